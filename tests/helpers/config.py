"""OffloadConfig from the tests' flat keywords.

Test helpers pass settings through several layers as one flat dict (`run(...,
bucket_numel=1024, undo_log_bytes=BIG)`); this sorts them into OffloadConfig's groups
by the groups' own field names, so no test leans on the deprecated flat names (whose
mapping tests/test_units.py tests on its own).  Besides the groups' fields it takes
the tests' switches: dpu (bool: mode="dpu"), overlap_update (bool) and
undo_log_bytes > 0, which name the exact strategy as the old switches did (explicit
overlap_update=False without an undo log: "sync").
"""
from __future__ import annotations

from dataclasses import fields

from zero_offload.config import ExpertConfig, LossScaling, OffloadConfig, ServerConnection

_GROUP_OF = {**{f"server_{f.name}" if f.name != "request_timeout_s" else f.name: ("server", f.name)
                for f in fields(ServerConnection)},
             **{"loss_scale" if f.name == "scale" else f.name: ("loss_scaling", f.name) for f in fields(LossScaling)},
             **{f.name: ("expert", f.name) for f in fields(ExpertConfig)}}


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
        name = "+".join(filter(None, ["overlap_update" if overlap else "", "speculation" if undo else ""]))
        groups.setdefault("expert", {})["exact_strategy"] = name or "sync"
    return OffloadConfig(**kw, **groups)
