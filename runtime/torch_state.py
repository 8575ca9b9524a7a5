"""Moving a run onto offload and off it: torch optimizer state dicts in and out.

A run that trained with torch.optim.AdamW (or Adam with decoupled weight decay) has
its m, v and step counts in `opt.state_dict()` (or a transformers.Trainer
checkpoint's optimizer.pt).  OffloadAdamW.load_state_dict takes that dict as torch's
own optimizers would, so the run goes on with its moments instead of restarting them.

    model.load_state_dict(weights)            # fp32, as the torch run saved them
    opt = OffloadAdamW(groups, lr=..., model=model)
    opt.load_state_dict(torch.load("optimizer.pt"))

What is taken from where:
- m and v (exp_avg, exp_avg_sq; Lion's exp_avg): from the dict, per parameter, in
  the order of the param groups (torch's own matching: the i-th state entry is the
  i-th parameter over the groups in order).  A parameter the dict has no state for
  (it never had a gradient) starts at zero, as it would in torch; a frozen one in the
  groups (requires_grad=False, which the engine does not train) has none either.
- step counts: from each parameter's `step` (Adam's bias correction is per parameter
  here as in torch), so the update continues as the torch run's would.
- the master: the model's weights when the optimizer was built.  torch's optimizer
  holds no master (its parameters are the master), so load the fp32 weights into
  the model before building the optimizer; bf16 weights give a bf16-valued master.
- the groups' lr, betas, eps, weight_decay (and a scheduler's keys): as torch's
  load_state_dict copies them.

The way off (load_into_torch_optimizer, at the end): a checkpoint's moments and step
counts into a torch optimizer's state, each parameter by its name in the model.

How the way on works: the engine writes an ordinary checkpoint of its state into a
private temporary directory (TMPDIR, or state_dir; 12-16 B/param of disk for a moment:
the load takes about twice a save's time, BENCHMARKS.md), this module replaces its
moment arrays and step counts there (the master stays where it is in the file: it
comes first in every state dtype's layout, so the file is cut after it and the moments
written as fp32), and the engine loads it with every check a load makes; loading
converts the fp32 moments to the state dtype (bf16 rounds to nearest even, int8
encodes to the nearest code). Worker memory: one parameter's moments at a time.

Several ranks (ZeRO-2, each rank passing the same dict): the temporary checkpoint
goes into a directory every rank sees (OffloadAdamW's state_dir, OffloadTrainer's
output_dir), each rank writes its shard's range of the moments, and the ranks agree
at each point, so a refusal or a failed write raises on every rank and loads
nothing.  Each rank of an FSDP2 model (a one-rank engine over its local shards)
loads its own dict: its DTensor moments' local shards, which are its proxies' rows.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from zero_offload.server import checkpoint as C
from zero_offload.server.atomic import atomic_write_bytes
from zero_offload.server.piece_map import PieceMap
from zero_offload.server.state import ShardStateArrays

from . import scratch

# torch.optim.Adam/AdamW options this server's update does not implement: a dict saved
# with any other value is refused (its moments would mean something else here)
_REFUSED = {"amsgrad": False, "maximize": False}
_GROUP_KEYS_IGNORED = ("params", "foreach", "fused", "capturable", "differentiable", "amsgrad", "maximize",
                       "decoupled_weight_decay")
CHUNK = 1 << 22  # elements written at a time: 16 MiB of fp32, whatever the parameter's size
TMP_PREFIX = "zero-offload-torch-state-"


def is_torch_state_dict(state_dict) -> bool:
    """A torch.optim optimizer's state_dict(): "state" and "param_groups", nothing of ours."""
    return (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list))


def check_groups(saved: list, optimizer: str) -> None:
    """Refuse a dict whose options change what its moments mean, naming the fix."""
    for gi, g in enumerate(saved):
        for k, ok in _REFUSED.items():
            if g.get(k, ok) != ok:
                raise ValueError(f"the state dict's param group {gi} has {k}={g[k]!r}: the offloaded update does "
                                 f"not implement it, so its state cannot continue here; train with {k}={ok}")
        if optimizer == "adamw" and g.get("decoupled_weight_decay") is False and g.get("weight_decay", 0):
            raise ValueError(f"the state dict's param group {gi} is torch.optim.Adam's with weight_decay="
                             f"{g['weight_decay']} (L2, added to the gradient), and OffloadAdamW's weight decay is "
                             f"decoupled (AdamW's): the run would change; use OffloadEngine with "
                             f"OffloadConfig(optimizer='adam'), or load it with weight_decay set to 0 in the dict")


def group_values(g: dict) -> dict:
    """What of a saved group goes into ours (the optimizer's values and a scheduler's keys)."""
    return {k: v for k, v in g.items() if k not in _GROUP_KEYS_IGNORED}


def _step_count(st: dict, where: str) -> int:
    step = st.get("step", 0)
    step = float(step.item() if isinstance(step, torch.Tensor) else step)
    if not (math.isfinite(step) and step >= 0 and step == int(step)):
        raise ValueError(f"{where}'s step is {step}: a step count is a whole number >= 0")
    return int(step)


def _local(t):
    """A DTensor's local shard (an FSDP2 model's moments), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def load(engine, pairs: list, moments: tuple[str, ...], directory: str | None = None,
         agree: Callable[[bool], bool] | None = None) -> None:
    """Load the moments and step counts of `pairs` [(the engine's parameter, its torch
    state dict entry or None, a name for errors)] into the engine (module docstring).
    With several ranks (each passing the same dict) `directory` is one every rank sees:
    the temporary checkpoint goes there; with one, None means TMPDIR.  `agree`: for
    one-rank engines that train together (FSDP2's ranks, each its own local shards and a
    private temporary checkpoint), True on every rank iff its argument is True on every
    rank: a refusal, or a failed write or load, on one rank raises on all of them."""
    several = engine.world_size > 1
    if several and directory is None:
        raise ValueError("with several ranks a torch optimizer's state dict loads through a checkpoint in a "
                         "directory every rank sees: build the optimizer with state_dir='...'")
    if several:
        agree = engine.coll.all_ok
    try:
        counts, checked = _check(engine, pairs, moments)
        err = None
    except ValueError as e:
        err = e
    if agree is not None and not agree(err is None):  # every rank refuses, none is left in a collective
        raise err or ValueError("another rank refused its torch state dict (its error says why)")
    if err is not None:
        raise err
    if several:  # one name for every rank, drawn on rank 0
        token = engine.coll.all_reduce_max([float(secrets.randbits(48)) if engine.rank == 0 else 0.0])[0]
        tmp = Path(directory) / f"{TMP_PREFIX}{int(token):012x}"
    else:  # one rank, or FSDP2's one-rank engines: a private one each
        if directory is not None:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = scratch.make(TMP_PREFIX, directory)
    try:
        d = Path(engine.save_own_checkpoint(str(tmp), keep=1))
        write_err = None
        try:
            _rewrite(d, engine.rank, engine.world_size, checked, moments, counts)
        except OSError as e:
            if agree is None:
                raise
            write_err = e  # raised below on every rank, with its cause on this one
        if agree is not None and not agree(write_err is None):
            raise OSError(f"a rank could not write its part of the temporary checkpoint in {tmp} (disk full?): "
                          f"nothing was loaded") from write_err
        if several or agree is None:
            engine.load_own_checkpoint(str(d))  # the built-in path's LOAD fails on every rank together itself
        else:
            _load_together(engine, d, agree)
    finally:
        if several:
            engine.coll.barrier()  # every rank has read its files
        if engine.rank == 0 or not several:
            shutil.rmtree(tmp, ignore_errors=True)


def _load_together(engine, d: Path, agree: Callable[[bool], bool]) -> None:
    """FSDP2's one-rank engines load their private checkpoints, and agree that every
    rank did, so no rank trains on while another has raised."""
    try:
        engine.load_own_checkpoint(str(d))
    except Exception:
        agree(False)
        raise
    if not agree(True):
        raise RuntimeError("another rank could not load its part of the torch state dict (its error says why): "
                           "this rank holds the loaded state, that one its old one; load again")


def _check(engine, pairs: list, moments: tuple[str, ...]) -> tuple[np.ndarray, list]:
    """Every entry checked before anything is written: (the step counts by span, [(span,
    entry)])."""
    flat = engine.flat
    span_index = {id(s.param): i for i, s in enumerate(flat.spans)}
    counts = engine.param_updates.copy()
    checked = []
    for p, st, where in pairs:
        span = flat.by_param.get(id(p))
        if span is None:  # in the groups but frozen (requires_grad=False): torch kept no state for it either
            if st:
                raise ValueError(f"{where} has state, but the parameter is frozen here (requires_grad=False): "
                                 f"build the optimizer over the model as it was trained")
            continue
        if st is None:
            st = {}
        if not isinstance(st, dict):
            raise ValueError(f"{where}'s state is a {type(st).__name__}, not a dict: not a torch optimizer's state; "
                             f"pass what the torch optimizer's state_dict() returned")
        extra = sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.numel() > 1
                       and k not in moments)
        if extra:
            raise ValueError(f"{where}'s state has {extra}, which this optimizer does not keep (amsgrad's "
                             f"max_exp_avg_sq?): its state cannot continue here")
        missing = [k for k in moments if k not in st]
        if st and missing:
            raise ValueError(f"{where}'s state has no {missing} (keys: {sorted(st)}): it is not the state of "
                             f"the optimizer this is ({', '.join(moments)})")
        for k in moments if st else ():
            t = _local(st[k])
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"{where}'s {k} is not a floating tensor: not a torch optimizer's state as "
                                 f"state_dict() saved it; pass that dict unchanged")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{where}'s {k} has shape {tuple(t.shape)}, the parameter {tuple(p.shape)}: "
                                 f"build the optimizer over the model the state dict was saved with, in the "
                                 f"same order")
        counts[span_index[id(p)]] = _step_count(st, where) if st else 0
        checked.append((span, st))
    return counts, checked


def _rewrite(d: Path, rank: int, world: int, checked: list, moments: tuple[str, ...], counts: np.ndarray) -> None:
    """This rank's files of the checkpoint in d with fp32 moments from `checked` (its
    shard's range of each) and `counts` as the step counts; the master (first in the
    file) stays as the engine saved it."""
    man_path = C.rank_file(d, C.SHARD, rank, world, ".json")
    bin_path = C.rank_file(d, C.SHARD, rank, world, ".bin")
    man = json.loads(man_path.read_text())
    names = list(man["arrays"])
    if names != ["master", *moments]:
        raise ValueError(f"the optimizer server keeps {names}, the state dict {['master', *moments]}: "
                         f"load it into the optimizer it was saved from")
    n = int(man["numel"])
    dtypes = {k: "fp32" for k in names}
    bases, total = ShardStateArrays.file_layout(names, dtypes, n)
    # no fsync here or below: the directory is private and read back at once, so the
    # page cache is all it needs (the server's save fsync'd what it wrote)
    with open(bin_path, "r+b") as f:
        fd = f.fileno()
        keep = bases["master"] + 4 * n
        os.truncate(fd, keep)   # the master stays; the old moments go
        os.truncate(fd, total)  # zeros: the padding, and the moments of parameters without state
        if total > keep:  # the blocks in one allocation, not one per write into a hole
            os.posix_fallocate(fd, keep, total - keep)
        shard_lo = rank * n  # the file holds the flat space's [rank n, (rank + 1) n)
        for span, st in checked:
            a, b = max(span.offset, shard_lo), min(span.offset + span.numel, shard_lo + n)
            for k in moments if st and a < b else ():
                src = _local(st[k]).detach().reshape(-1)
                for lo in range(a, b, CHUNK):
                    hi = min(lo + CHUNK, b)
                    piece = src[lo - span.offset:hi - span.offset].to("cpu", torch.float32).contiguous().numpy()
                    os.pwrite(fd, memoryview(piece).cast("B"), bases[k] + 4 * (lo - shard_lo))
    # the update counter runs at least as far as the furthest parameter's step count
    # (STEP carries both, and the server refuses a count past the update's): a torch
    # run at step N goes on at update N + 1, and its checkpoints are named by its steps
    eng_path = C.rank_file(d, C.ENGINE, rank, world, ".json")
    meta = json.loads(eng_path.read_text())
    ahead = max(0, int(counts.max(initial=0)) - int(meta["updates"]))
    meta["updates"] += ahead
    meta["iteration"] += ahead
    meta["param_updates"] = [int(c) for c in counts]
    man["updates"] = C.manifest_updates(man) + ahead
    man["array_dtypes"] = dtypes
    man["checksum"] = C.file_checksum(bin_path)
    atomic_write_bytes(man_path, json.dumps(man, indent=1).encode(), fsync=False)
    atomic_write_bytes(eng_path, json.dumps(meta, indent=1).encode(), fsync=False)


# ---------------------------------------------------------------- and back out
def load_into_torch_optimizer(checkpoint, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """A checkpoint's moments and step counts into a torch optimizer's state: leaving
    offload (the way back of OffloadAdamW.load_state_dict's torch dicts).

        model.load_state_dict(master_state_dict_from_checkpoint("ckpt"))   # zero_offload.export
        opt = torch.optim.AdamW(groups, ...)
        load_into_torch_optimizer("ckpt", opt, model)

    Each parameter of the optimizer's groups is found in the checkpoint by its name in
    `model` (the checkpoint's parameter table: any topology, any world size saved it);
    its state becomes exp_avg and exp_avg_sq (Lion: exp_avg) in the parameter's dtype and
    device, decoded to fp32 first whatever the state dtype (int8: its codes' values), and
    `step` its own count, as torch keeps them.  A parameter the checkpoint does not train,
    or that never had an update, gets no state (as torch leaves it).  Every shard file's
    checksum is checked first; each parameter is read on its own (memory: the state
    torch will hold, plus one parameter's fp32 moment).  The groups' values stay the
    optimizer's own: set lr and the scheduler as the run had them."""
    from zero_offload.export import CheckpointMaster
    from zero_offload.server.state import QBLOCK, _Source
    src = CheckpointMaster(checkpoint)
    moments = [a for a in src.arrays if a != "master"]
    by_name = {n: (row, count) for row, count in zip(src.params, src.param_updates) for n in row.names}
    names = {id(p): n for n, p in model.named_parameters()}
    plan = []
    for g in optimizer.param_groups:  # every parameter checked before any state is set
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError("a parameter of the optimizer is not one of the model's: pass the model the "
                                 "optimizer was built over")
            if name not in by_name:
                continue  # frozen in the offloaded run: no state, as torch leaves it
            row, count = by_name[name]
            if tuple(p.shape) != row.shape:
                raise ValueError(f"{name} has shape {tuple(p.shape)}, the checkpoint's {row.shape}: load it into the "
                                 f"model it was saved from")
            plan.append((p, row, count))
    whole = src.per_file * len(src.files)
    flat = PieceMap.contiguous(0, whole, whole)  # read by flat index
    sources = {m: _Source(src.files, src.per_file, src.at[m], src.at.get(m + ".scale"), src.dtypes.get(m, "fp32"), m,
                          flat) for m in moments}
    for p, row, count in plan:
        if count == 0:
            continue
        st = {"step": torch.tensor(float(count))}
        lo = row.offset - row.offset % QBLOCK  # int8 arrays are read from the start of a block
        for m, source in sources.items():
            buf = np.empty(row.offset + row.numel - lo, np.float32)
            source.read_fp32(lo, row.offset + row.numel, buf)
            t = torch.from_numpy(buf[row.offset - lo:]).view(row.shape)
            st[m] = t.to(p.device, p.dtype)  # (up to 255 elements of the block before it stay in buf)
        optimizer.state[p] = st
