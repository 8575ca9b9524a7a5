"""Training runs that must be bitwise alike: overlap_update and speculation against the
synchronous engine (tests/test_overlap.py, tests/test_speculation.py)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from zero_offload import OffloadEngine

from .config import offload_config

STEPS = 40
# The synchronous reference runs, by configuration: test_overlap and test_speculation compare
# against the same ones (the gradient buckets' size changes no byte on the CPU device).
_SYNC: dict = {}


def run(tmp, make, batch, dtype, overlap, accum=1, groups=None, slow_forward=False, inject_at=None, before_step=None,
        **cfg):
    """STEPS steps; returns (losses, device weights, checkpoint bytes, grad norms, stats).
    before_step(engine, t): called between step t's backward and its step()."""
    key = None
    if not overlap and not cfg.get("undo_log_bytes") and not slow_forward:
        key = (make.__module__, make.__qualname__, batch.__qualname__, dtype, accum, groups and groups.__qualname__,
               inject_at, before_step and before_step.__qualname__, os.environ.get("ZERO_OFFLOAD_SIMD"), STEPS,
               tuple(sorted((k, v) for k, v in cfg.items() if k != "bucket_numel")))
        if key in _SYNC:
            return _SYNC[key]
    out = _run(tmp, make, batch, dtype, overlap, accum, groups, slow_forward, inject_at, before_step, **cfg)
    if key is not None:
        _SYNC[key] = out
    return out


def _run(tmp, make, batch, dtype, overlap, accum, groups, slow_forward, inject_at, before_step, **cfg):
    model = make()
    kw = dict(lr=3e-3, dtype=dtype, server_threads=1, grad_accumulation_steps=accum, progress_block_numel=256,
              overlap_update=overlap)
    kw.update(cfg)
    norms = []
    hooks = []
    if slow_forward:  # a slower device: each module's forward takes a little longer
        hooks = [m.register_forward_pre_hook(lambda m, a: time.sleep(0.0005)) for m in model.modules()]
    eng = OffloadEngine(model, offload_config(**kw), param_groups=groups(model) if groups else None)
    with eng:
        losses = []
        for t in range(1, STEPS + 1):
            h = None
            if inject_at == t:  # an fp16 overflow on this step: skipped, the scale halves
                p = next(model.parameters())
                h = p.register_hook(lambda g: torch.full_like(g, float("inf")))
            for mi in range(accum):
                loss = batch(t, dtype, mi)(eng.model)
                eng.backward(loss)
            losses.append(float(loss.detach()))
            if before_step is not None:
                before_step(eng, t)
            eng.step()
            norms.append(eng.last_grad_norm)
            if h is not None:
                h.remove()
        d = eng.save_checkpoint(str(tmp / f"ck-{overlap}-{cfg.get('undo_log_bytes', 0)}"))
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        stats = eng.stats()
    state = b"".join(p.read_bytes() for p in sorted(Path(d).glob("*.bin")))  # master, m, v of every shard
    for h in hooks:
        h.remove()
    return losses, weights, state, norms, stats


def two_groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 1e-3}]




def assert_ran(stats: dict, strategy: str) -> None:
    """The strategy a run was given ran: bitwise-equal-to-sync is true of sync itself.
    overlap_update: every update after the first went on into the next forward, whose
    pre-hooks made the parameters current (those of every step after the first and
    before the last: at least one per update); sync: none did."""
    overlaps = "overlap" in strategy
    assert stats.get("exact_strategy", strategy) == strategy, stats.get("exact_strategy")
    if overlaps:
        assert stats["overlap_steps"] == stats["updates"], (stats["overlap_steps"], stats["updates"])
        assert stats["overlap_forward_params"] >= stats["updates"] - 1, stats["overlap_forward_params"]
    else:
        assert stats["overlap_steps"] == 0 and stats["overlap_forward_params"] == 0


def assert_bitwise(over, sync, kw: dict) -> None:
    """Losses, master, m, v (the checkpoint's bytes) and the device weights equal; the clip
    fired on some steps and not on others, and an injected overflow was skipped; and the
    strategy `over` was given ran, and sync's overlapped nothing (assert_ran)."""
    assert_ran(over[4], over[4]["exact_strategy"])
    assert_ran(sync[4], "sync")
    assert over[0] == sync[0], "losses"
    assert over[2] == sync[2], "master, m, v"
    for k in sync[1]:
        assert torch.equal(over[1][k], sync[1][k]), k
    if "clip_grad_norm" in kw:  # the clip fired on some steps and not on others
        assert min(sync[3]) < kw["clip_grad_norm"] < max(sync[3]), sync[3]
    if "inject_at" in kw:
        assert over[4]["skipped_steps"] == sync[4]["skipped_steps"] == 1
    assert over[4]["updates"] == sync[4]["updates"]
