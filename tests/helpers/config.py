"""OffloadConfig from the tests' flat keywords.

Test helpers pass settings through several layers as one flat dict (`run(...,
bucket_numel=1024, undo_log_bytes=BIG)`); this sorts them into OffloadConfig's groups
with the config's own table of flat names (DEPRECATED, plus every expert field), so no
test passes a deprecated name to OffloadConfig (tests/test_units.py tests those on
their own).  Besides the groups' fields it takes
the tests' switches: dpu (bool: mode="dpu"), overlap_update (bool) and
undo_log_bytes > 0, which name the exact strategy as the old switches did (explicit
overlap_update=False without an undo log: "sync").
"""
from __future__ import annotations

from dataclasses import fields

from zero_offload.config import DEPRECATED, ExpertConfig, OffloadConfig
from zero_offload.exact_mode import strategy_of

_GROUP_OF = {**{f.name: ("expert", f.name) for f in fields(ExpertConfig)}, **DEPRECATED}


def offload_config(**flat) -> OffloadConfig:
    dpu = flat.pop("dpu", None)
    overlap = flat.pop("overlap_update", None)
    kw: dict = {}
    groups: dict[str, dict] = {}
    for k, v in flat.items():
        if k in _GROUP_OF:
            g, f = _GROUP_OF[k]
            groups.setdefault(g, {})[f] = v
        else:
            kw[k] = v
    if dpu is not None:
        kw["mode"] = "dpu" if dpu else "exact"
    undo = groups.get("expert", {}).get("undo_log_bytes")
    if kw.get("mode") != "dpu" and (overlap is not None or undo is not None) and "exact_strategy" not in groups.get(
            "expert", {}):
        groups.setdefault("expert", {})["exact_strategy"] = strategy_of(overlap, undo)
    return OffloadConfig(**kw, **groups)
