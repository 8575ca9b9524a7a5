"""Checkpoints of an FSDP2 model's optimizer in the layout every topology shares.

A checkpoint holds the flat space a one-rank engine lays out for the whole model
(runtime.flat.FlatParams over the model's trainable parameters, in the order and the
param groups the built-in path gives them, at the same parameter alignment), cut
into the files of the ranks that saved it (optimizer_server.reshard).  An FSDP2 rank
holds rows [r0, r1) of every parameter (torch.chunk on dim 0): a contiguous range of
that parameter, so a contiguous range of the flat space.  Its engine, a one-rank
engine over its proxies (runtime.fsdp2), lays those out in its own local flat space;
FlatMap says where each local piece lies in the shared one.

save (every rank of FSDP2's group calls it):
  1. each rank's server writes its master and moments straight into the step
     directory's one-rank shard file (shard-r0-of-1.bin: the whole flat space), at the
     places FSDP2's rows have there (SAVE.pieces, optimizer_server.piece_map): the
     first server to open the file makes it at its full size, zeros where no parameter
     lies; each rank's worker does the same with its device weights (device16-r0-of-1.bin,
     pending16 under DPU);
  2. each writer keeps the CRC of the file as if only its bytes were in it; rank 0
     joins every rank's into the files' checksums (ckpt_io.combine_disjoint: nobody
     reads the files back), writes the manifests, and the directory is published as
     any checkpoint is (optimizer_server.checkpoint.CheckpointDir).
background=True: the server's save is a snapshot (ckpt_io.SaveJob) and the worker's
weights are copied before the next step changes them, so save_checkpoint returns
at once and step 2 runs at the first step() that finds every rank's server done (a
collective), or at wait_checkpoint().
The result is an ordinary checkpoint: the built-in path loads it on any number of
ranks, and so does FSDP2 on any number of ranks.

load (every rank calls it): the checkpoint's checksums are verified with the reading
shared (each rank 1/world of every file, the CRCs combined); then each rank's server
reads its rows out of any checkpoint (saved by FSDP2 or by the built-in path, at any
world size: LOAD.pieces), and its worker its device weights, with every check a
load makes.

Cost: what the built-in path writes and reads, and no private copy: the file is
written once, by the servers, and read twice by a load (the shared verification, then
each rank's rows; the second read usually from the page cache).  int8 state is
refused: its scale per 256 elements does not follow FSDP2's rows, so moving it between
topologies would re-quantise it.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from zero_offload.server import checkpoint as C
from zero_offload.server.atomic import atomic_write_bytes
from zero_offload.server.ckpt_io import combine_disjoint, combine_pieces, range_crc
from zero_offload.server.errors import OptimizerServerDeadError, OptimizerServerError
from zero_offload.server.piece_map import PieceMap
from zero_offload.server.protocol import E_CHECKPOINT
from zero_offload.server.reshard import read_range
from zero_offload.server.state import INT8_CODES, ShardStateArrays

from . import fsdp2
from .checkpoint import InFlight, _EngineFiles
from .flat import FlatParams

log = logging.getLogger("zero_offload")
ONE = 1          # the shared files are a one-rank checkpoint's
SEEN = "seen"    # each rank's empty mark in the step directory (seen-rK-of-W.txt): one filesystem for all
INT8_REFUSED = ("an FSDP2 checkpoint with int8 state: its scale per 256 elements does not follow FSDP2's rows, "
                "so it cannot move between topologies bitwise; use state_dtype='bf16' or 'fp32' (or save each "
                "rank's opt.state_dict() with torch.save)")


@dataclass
class FlatMap:
    """Where this rank's local flat space lies in the shared one."""
    numel: int                               # the shared flat space (one rank: no padding)
    pieces: list[tuple[int, int, int]]       # (local_lo, flat_lo, n), by local_lo
    span_of_local: list[int]                 # local span j -> its parameter's span in the shared layout
    n_params: int                            # the shared layout's parameters (a step count each)
    params: list[dict]                       # the checkpoint's "params": each one's offset, shape, names


def flat_map(engine, shards, order: list, group_of: dict, rank: int, world: int, names: dict) -> FlatMap:
    """order: the model's trainable FSDP2 parameters in the order the built-in path lays
    them out (the model's, or the optimizer's without model=); group_of: id -> group;
    names: id -> the parameter's state_dict names."""
    stand = [torch.empty(p.shape, device="meta") for p in order]
    shared = FlatParams(stand, bucket_numel=1 << 62, world_size=1, groups=[group_of[id(p)] for p in order],
                        align=engine.param_align)
    span_index = {id(s.param): j for j, s in enumerate(shared.spans)}
    where = {id(p): shared.spans[span_index[id(t)]] for p, t in zip(order, stand)}
    index = {id(p): span_index[id(t)] for p, t in zip(order, stand)}
    proxy_of = {id(q): p for p, q in zip(shards.params, shards.proxies)}
    pieces, span_of_local = [], []
    for s in engine.flat.spans:
        p = proxy_of[id(s.param)]
        rows = p.shape[0] if p.dim() else 1
        cols = p.numel() // rows if rows else 0
        r0, r1 = fsdp2.chunk_rows(rows, world, rank)
        if (r1 - r0) * cols != s.numel:
            raise ValueError(f"a local shard of {s.numel} elements where FSDP2's rows {r0}:{r1} of a "
                             f"{tuple(p.shape)} parameter hold {(r1 - r0) * cols}: this sharding is not "
                             f"torch.chunk on dim 0, so its place in a checkpoint is unknown")
        if s.numel:
            pieces.append((s.offset, where[id(p)].offset + r0 * cols, s.numel))
        span_of_local.append(index[id(p)])
    table = sorted(({"offset": where[id(p)].offset, "shape": list(p.shape), "names": list(names[id(p)])} for p in order),
                   key=lambda r: r["offset"])
    return FlatMap(shared.numel, pieces, span_of_local, len(shared.spans), table)


class Group:
    """FSDP2's process group (a LocalShards' group, rank and world size), as CheckpointDir's
    agree and barrier."""

    def __init__(self, shards):
        self.group, self.rank, self.world = shards.group, shards.rank, shards.world
        self.device = shards.coll_device  # where the group's collectives take tensors

    def agree(self, ok: bool) -> bool:
        """True on every rank if ok is True on every rank."""
        return self._reduce(ok, dist.ReduceOp.MIN)

    def any(self, flag: bool) -> bool:
        return self._reduce(flag, dist.ReduceOp.MAX)

    def _reduce(self, flag: bool, op) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=op, group=self.group)
        fsdp2.released_by_collective_threads(t)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def all_rows(self, rows: list[tuple[int, ...]], width: int) -> list[tuple[int, ...]]:
        """Every rank's rows of `width` int64s, on every rank (two all_gathers: the
        counts, then the rows padded to the longest)."""
        if self.world == 1:
            return list(rows)
        n = torch.tensor([len(rows)], dtype=torch.int64, device=self.device)
        counts = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(counts, n, group=self.group)
        fsdp2.released_by_collective_threads(n, *counts)
        counts = [int(c.item()) for c in counts]
        if max(counts) == 0:
            return []
        mine = torch.zeros((max(counts), width), dtype=torch.int64)
        if rows:
            mine[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        mine = mine.to(self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        fsdp2.released_by_collective_threads(mine, *parts)
        return [tuple(r) for part, k in zip(parts, counts) for r in part[:k].cpu().tolist()]


def _arrays(man: dict) -> tuple[list, dict]:
    names, dtypes = list(man["arrays"]), C.saved_array_dtypes(man)
    bad = [n for n in names if dtypes.get(n, "fp32") in INT8_CODES or dtypes.get(n, "fp32") == C.LEGACY_INT8]
    if bad:
        raise ValueError(INT8_REFUSED)
    return names, dtypes


class _PlacedWeights(_EngineFiles):
    """This rank's device weights (and the update's still to go up) written into the
    shared one-rank files at the rank's pieces, each file's masked CRC kept (``crcs``):
    on its own thread for a background save (a snapshot first, as _EngineFiles), or
    called at once (``write``) for a blocking one."""

    def __init__(self, tmp: Path, flat_numel: int, pieces: PieceMap, device16, pending16, snapshot):
        super().__init__(tmp, 0, ONE, device16, pending16, {}, snapshot)
        self.flat_numel, self.pieces = flat_numel, pieces
        self.crcs: dict[str, int] = {}

    def write(self, dev: np.ndarray, pend: np.ndarray | None) -> None:
        size = 2 * self.flat_numel
        for role, arr in ((C.DEVICE16, dev), (C.PENDING16, pend)):
            if arr is None:
                continue
            path = C.rank_file(self.tmp, role, 0, ONE, ".bin")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                have = os.fstat(fd).st_size
                if have not in (0, size):
                    raise OSError(f"checkpoint file {path} has {have} bytes, the shared layout {size}")
                if have == 0:  # whichever rank comes first (the same size again changes nothing)
                    os.ftruncate(fd, size)
                words = np.ascontiguousarray(arr).view(np.uint8)
                crcs = [_pwrite_piece(fd, words[2 * a:2 * (a + n)], 2 * b, path) for a, b, n in self.pieces.pieces]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.crcs[role] = combine_pieces(crcs, size)


def _pwrite_piece(fd: int, data, at: int, name) -> tuple[int, int, int]:
    """data written at byte `at` (OSError on a short write); its (offset, length, CRC-32),
    for the file's checksum (ckpt_io.combine_pieces)."""
    if os.pwrite(fd, data, at) != len(data):
        raise OSError(f"short write of {name} at byte {at}")
    return at, len(data), zlib.crc32(data)


def save(engine, fmap: FlatMap, shards, directory: str, keep: int, background: bool = False) -> str:
    """Every rank of FSDP2's group (shards: the LocalShards whose group it is): the
    optimizer's state into directory/step-N in the shared layout (module docstring).
    Returns the step directory (background: the one it becomes once published, at a
    step() that finds every rank's server done, or at wait_checkpoint())."""
    if engine.cfg.state_dtype == "int8":  # before anything is written
        raise ValueError(INT8_REFUSED)
    g = Group(shards)
    engine.wait_checkpoint()  # one save at a time: the previous one is published (or fails) first
    try:
        engine._check_between_steps("save_checkpoint()")
        dev, pending, meta = engine._checkpoint_parts()
        err = None
    except (RuntimeError, OptimizerServerError) as e:  # (a dead server's error is one of them)
        err = e
    if not g.agree(err is None):  # no rank goes on into the save's collectives alone
        raise err or OptimizerServerError("saving the FSDP2 checkpoint was refused on another rank (its error says "
                                          "why); nothing was written", code=E_CHECKPOINT)
    stale = pending is not None
    if g.any(stale) != g.agree(stale):  # one DPU schedule: every rank alike
        raise OptimizerServerError("saving the FSDP2 checkpoint failed (the ranks disagree on whether an update "
                                   "is pending); the previous checkpoint is intact", code=E_CHECKPOINT)
    N = fmap.numel
    pieces = PieceMap.build(fmap.pieces, engine.flat.shard_numel, N)
    counts = [0] * fmap.n_params
    for j, c in zip(fmap.span_of_local, meta["param_updates"]):
        counts[j] = c
    meta = dict(meta, version=C.ENGINE_VERSION, world_size=ONE, rank=0, numel=N, stale=stale, param_updates=counts)
    d = C.CheckpointDir(directory, rank=g.rank, world_size=g.world, agree=g.agree, barrier=g.barrier, keep=keep,
                        pruner=engine.checkpoints.pruner)
    tmp = d.begin(engine.iteration)
    writer = _PlacedWeights(tmp, N, pieces, dev, pending, engine.checkpoints._snapshot)
    info: dict = {}
    with engine.tracer.span("save_checkpoint", background=background, fsdp2=True):
        try:
            info = engine.client.save(str(tmp), background=background, pieces=pieces)
            if background and not info.get("snapshot", True):
                log.warning("%s", info.get("note") or "a background save took no snapshot")
            if background:
                writer.start()
            else:
                writer.write(dev, pending)
            ok = True
        except (OSError, OptimizerServerError) as e:
            ok, err = False, e

        def publish(ok_: bool, err_, st: dict) -> str:
            return _publish(g, d, tmp, info, meta, fmap.params, writer, N, ok_, err_, st)
        if background:
            if g.agree(ok):
                engine.checkpoints.in_flight = InFlight(writer, g.agree, publish)
                return str(tmp.with_name(C.step_name(engine.iteration)))
            if writer.is_alive():
                writer.join(writer.bound_s)
            if ok:  # another rank failed: this rank's server finishes its (discarded) write before the next SAVE
                try:
                    engine.client.wait_save()
                except OptimizerServerError:
                    pass
            return publish(False, err, {})  # the error is this rank's, or "on another rank"
        try:
            return publish(ok, err, {"state": "done", "crc": info.get("crc", -1)})
        finally:
            engine.checkpoints.after_blocking_save(dev, pending)


def _publish(g: Group, d: "C.CheckpointDir", tmp: Path, info: dict, meta: dict, params: list,
             writer: _PlacedWeights, N: int, ok: bool, err, st: dict) -> str:
    """Every rank: the CRCs joined on rank 0, which writes the manifests; then the
    directory is published as any checkpoint is (CheckpointDir.commit)."""
    roles = [C.DEVICE16] + ([C.PENDING16] if meta["stale"] else [])
    crc = int(st.get("crc", -1)) if ok else -1
    if ok and crc < 0:
        ok, err = False, err or OSError("the server gave no checksum for its part of the file")
    row = (1 if ok else 0, crc, *(writer.crcs.get(r, -1) for r in (C.DEVICE16, C.PENDING16)))
    every = g.all_rows([row], 4)
    if ok and all(r[0] for r in every) and g.rank == 0:
        try:
            man = info["manifest"]
            names, dtypes = _arrays(man)
            sizes = {C.SHARD: ShardStateArrays.file_bytes(names, dtypes, N), C.DEVICE16: 2 * N, C.PENDING16: 2 * N}
            col = {C.SHARD: 1, C.DEVICE16: 2, C.PENDING16: 3}
            sums = {role: C.checksum_str(combine_disjoint([r[col[role]] for r in every], sizes[role]))
                    for role in [C.SHARD] + roles}
            shard_man = dict(man, rank=0, world_size=ONE, numel=N, groups=[], checksum=sums.pop(C.SHARD))
            atomic_write_bytes(C.rank_file(tmp, C.SHARD, 0, ONE, ".json"), json.dumps(shard_man, indent=1).encode())
            atomic_write_bytes(C.rank_file(tmp, C.ENGINE, 0, ONE, ".json"),
                               json.dumps(dict(meta, checksums=sums, params=params), indent=1).encode())
        except (OSError, ValueError, KeyError) as e:
            ok, err = False, e
    # each rank's mark beside the shared files, which every rank wrote its rows into: rank
    # 0 must see every rank's (one filesystem; on node-local disks each would publish a
    # file of holes beside its own rows)
    if ok:
        try:
            atomic_write_bytes(C.rank_file(tmp, SEEN, g.rank, g.world, ".txt"), b"")
        except OSError as e:
            ok, err = False, e
    expected = [C.rank_file(Path("."), p, 0, ONE, s) for p, s in
                ((C.SHARD, ".bin"), (C.SHARD, ".json"), (C.ENGINE, ".json"), (C.DEVICE16, ".bin"))]
    done, where = d.commit(tmp, ok, lambda k: (expected if k == 0 else [])
                           + [C.rank_file(Path("."), SEEN, k, g.world, ".txt")])
    if done:
        return where
    if isinstance(err, OptimizerServerDeadError):
        raise err
    why = err or where or "on another rank"
    raise OptimizerServerError(f"saving the FSDP2 checkpoint in {d.root} failed ({why}); the previous "
                               f"checkpoint is intact", code=E_CHECKPOINT)


@dataclass
class _Source:
    """What a load reads: the checkpoint's shard and weights files and their manifests."""
    mans: list
    metas: list
    names: list
    dtypes: dict
    per_file: int
    bins: list
    w16: dict


def _source(engine, fmap: FlatMap, directory: str) -> _Source:
    """The checkpoint's manifests read and checked against this model (CheckpointError
    naming the fix otherwise); nothing is read into the state."""
    d = C.resolve(directory)
    src = C.pick_world_size(d, C.SHARD, ONE)
    mans, metas = [], []
    for k in range(src):
        mp, ep = C.rank_file(d, C.SHARD, k, src, ".json"), C.rank_file(d, C.ENGINE, k, src, ".json")
        for path in (mp, ep):
            if not path.exists():
                raise C.CheckpointError(f"checkpoint {d} is incomplete: {path.name} is missing; load another "
                                        f"checkpoint (an earlier step-N beside it)")
        man = json.loads(mp.read_text())
        C.check_shard_manifest(mp, man)
        mans.append(man)
        meta = json.loads(ep.read_text())
        C.check_version(ep, "version", meta.get("version"), C.ENGINE_VERSION)
        metas.append(meta)
    man, meta = mans[0], metas[0]
    names, dtypes = _arrays(man)
    per_file = int(man["numel"])
    if any(int(m["numel"]) != per_file for m in mans):
        raise C.CheckpointError(f"checkpoint {d}: its shard files hold different numbers of elements")
    if meta.get("param_align", 1) != engine.param_align or meta.get("numel") != fmap.numel:
        raise C.CheckpointError(
            f"checkpoint {d} lays out {meta.get('numel')} elements at an alignment of {meta.get('param_align', 1)}, "
            f"this model's one-rank layout {fmap.numel} at {engine.param_align}: load it into the model it was "
            f"saved from, with the same param groups (and expert={{'param_align_numel': "
            f"{meta.get('param_align', 1)}}} if only the alignment differs)")
    for key, mine in (("dtype", engine.cfg.dtype), ("optimizer", engine.cfg.optimizer)):
        if meta.get(key) != mine:
            raise C.CheckpointError(f"checkpoint {d} has {key}={meta.get(key)!r} but this engine has {mine!r}")
    if len(meta.get("param_updates", [])) != fmap.n_params:
        raise C.CheckpointError(f"checkpoint {d} counts steps for {len(meta.get('param_updates', []))} parameters, "
                                f"this model has {fmap.n_params} trainable ones: load it into the model it was "
                                f"saved from")
    bins = [C.rank_file(d, C.SHARD, k, src, ".bin") for k in range(src)]
    expect = ShardStateArrays.file_bytes(names, dtypes, per_file)
    for k, path in enumerate(bins):
        size = path.stat().st_size if path.exists() else -1
        if size != expect:
            raise C.CheckpointError(f"checkpoint {path} has {size} bytes, expected {expect} (truncated?)")
    roles = [C.DEVICE16] + ([C.PENDING16] if meta["stale"] else [])
    w16 = {role: [C.rank_file(d, role, k, src, ".bin") for k in range(src)] for role in roles}
    return _Source(mans, metas, names, dtypes, per_file, bins, w16)


def load(engine, fmap: FlatMap, directory: str, shards) -> None:
    """Every rank of FSDP2's group (shards: the LocalShards whose group it is): its
    pieces out of any checkpoint (module docstring), loaded by its engine.  The ranks
    agree after the checks and after the load, so a refusal on one rank is an error on
    every rank (none waits in a collective for a rank that gave up)."""
    g = Group(shards)
    engine.wait_checkpoint()  # a background save of ours is published (or fails) first
    try:
        engine._check_between_steps("load_checkpoint()")
        source, err = _source(engine, fmap, directory), None
    except (OSError, ValueError, RuntimeError, OptimizerServerError) as e:
        source, err = None, e
    if not g.agree(err is None):
        raise err if err is not None else C.CheckpointError(
            f"checkpoint {directory} was refused on another rank (its error says why); nothing was loaded")
    bins, w16, mans, metas = source.bins, source.w16, source.mans, source.metas
    meta = metas[0]
    _verify_together(g, [(path, mans[k].get("checksum")) for k, path in enumerate(bins)]
                     + [(f, metas[k].get("checksums", {}).get(role)) for role, fs in w16.items()
                        for k, f in enumerate(fs)])
    err = None
    try:
        d = bins[0].parent
        engine.optimizer.check_state_dict_small(meta.get("optimizer_proxy"), where=f"checkpoint {d}")
        pieces = PieceMap.build(fmap.pieces, engine.flat.shard_numel, fmap.numel)
        words = {}
        for role, fs in w16.items():  # this rank's words, zeros in its alignment padding
            per16 = fs[0].stat().st_size // 2
            words[role] = out = np.zeros(engine.flat.shard_numel, np.int16)
            for a, b, n in pieces.pieces:
                read_range(fs, per16, 0, b, b + n, out[a:a + n])
        counts = [meta["param_updates"][j] for j in fmap.span_of_local]
        with engine.tracer.span("load_checkpoint", world_size_saved=len(bins), fsdp2=True):
            # the server reads its rows straight out of the shared files, which the
            # ranks have just verified together
            engine._restore(meta, counts, words[C.DEVICE16], words.get(C.PENDING16),
                            lambda slot: engine.client.load(str(d), weights_slot=slot, pieces=pieces, verified=True))
    except (OSError, ValueError, OptimizerServerError) as e:
        err = e
    if not g.agree(err is None):
        if err is not None:
            raise err
        raise OptimizerServerError(f"loading checkpoint {directory} failed on another rank (its error says why); "
                                   f"this rank loaded it, so the ranks now differ: load a checkpoint again on "
                                   f"every rank", code=E_CHECKPOINT)


def _verify_together(g: Group, checks: list[tuple[Path, str | None]]) -> None:
    """C.verify for each (file, expected checksum), the reading shared: each rank checks
    its 1/world of every file's bytes and the ranks' CRCs are combined, so the group
    reads the checkpoint once instead of once per rank.  Every rank raises the same
    CheckpointError (a read that fails on one rank fails the check on all)."""
    for path, expected in checks:  # what every rank finds alike, before any reading
        if not path.exists():
            raise C.CheckpointError(f"checkpoint {path.parent} is incomplete: {path.name} is missing; load "
                                    f"another checkpoint (an earlier step-N beside it)")
        if not expected:
            C.verify(path, expected)  # raises, naming the file
    rows = []  # (file index, offset, length, crc); offset -1: this rank could not read it
    for i, (path, _) in enumerate(checks):
        size = path.stat().st_size
        lo, hi = size * g.rank // g.world, size * (g.rank + 1) // g.world
        try:
            rows.append((i, lo, hi - lo, range_crc(path, lo, hi)[0]))
        except OSError:
            rows.append((i, -1, 0, 0))
    every = g.all_rows(rows, 4)
    for i, (path, expected) in enumerate(checks):
        mine = [r[1:] for r in every if r[0] == i]
        if any(off < 0 for off, _, _ in mine):
            raise C.CheckpointError(f"checkpoint file {path} could not be read on every rank; load another "
                                    f"checkpoint (an earlier step-N beside it)")
        got = C.checksum_str(combine_pieces(mine, path.stat().st_size))
        if got != expected:
            raise C.CheckpointError(f"checkpoint file {path} is corrupt: its checksum is {got}, the manifest says "
                                    f"{expected}; load another checkpoint (an earlier step-N beside it)")
