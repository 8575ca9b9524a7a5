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
  1. each rank's engine writes an ordinary one-rank checkpoint of its local flat
     space into a private temporary directory;
  2. rank 0 creates the step directory's one-rank files at their full size
     (shard-r0-of-1.bin: master and moments of the whole flat space;
     device16-r0-of-1.bin; pending16 under DPU), zeros where no parameter lies;
  3. each rank copies its pieces of each array into them (pread/pwrite, bounded
     chunks), taking each piece's CRC-32 as it writes it;
  4. rank 0 combines every rank's CRCs into the files' checksums (the holes are
     zeros; nobody reads the files back), writes the manifests, and the directory is
     published as any checkpoint is (optimizer_server.checkpoint.CheckpointDir).
The result is an ordinary checkpoint: the built-in path loads it on any number of
ranks, and so does FSDP2 on any number of ranks.

load (every rank calls it): the checkpoint's checksums are verified with the reading
shared (each rank 1/world of every file, the CRCs combined); each rank reads its
pieces out of any checkpoint (saved by FSDP2 or by the built-in path, at any world
size: read_range), writes them as a one-rank checkpoint of its local flat space into
a private temporary directory (in TMPDIR: point it at a disk with room), and its
engine loads that (with every check a load makes).  A save's own temporary directory
is beside the checkpoints.

Cost: each rank writes, reads and copies its local state once more through a
temporary directory (12 B/param/world with fp32 state, plus 2-4 of weights).  int8
state is refused: its scale per 256 elements does not follow FSDP2's rows, so moving
it between topologies would re-quantise it.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from zero_offload.server import checkpoint as C
from zero_offload.server.atomic import atomic_write_bytes
from zero_offload.server.ckpt_io import combine_pieces, range_crc
from zero_offload.server.errors import OptimizerServerError
from zero_offload.server.protocol import E_CHECKPOINT
from zero_offload.server.reshard import read_range
from zero_offload.server.state import INT8_CODES, ITEM_BYTES, ShardStateArrays

from . import scratch
from .flat import FlatParams

CHUNK = 1 << 24  # elements copied at a time: 64 MiB of fp32 in the worker, whatever the model's size
ONE = 1          # the shared files are a one-rank checkpoint's
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
        chunk = -(-rows // world)
        r0, r1 = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
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


class _Group:
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
        counts = [int(c.item()) for c in counts]
        if max(counts) == 0:
            return []
        mine = torch.zeros((max(counts), width), dtype=torch.int64)
        if rows:
            mine[:len(rows)] = torch.tensor(rows, dtype=torch.int64)
        mine = mine.to(self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=self.group)
        return [tuple(r) for part, k in zip(parts, counts) for r in part[:k].cpu().tolist()]


def _arrays(man: dict) -> tuple[list, dict]:
    names, dtypes = list(man["arrays"]), C.saved_array_dtypes(man)
    bad = [n for n in names if dtypes.get(n, "fp32") in INT8_CODES or dtypes.get(n, "fp32") == C.LEGACY_INT8]
    if bad:
        raise ValueError(INT8_REFUSED)
    return names, dtypes


def _copy_pieces(src_fd: int, dst_fd: int, pieces, src_base: int, dst_base: int, item: int) -> list:
    """Each piece's elements from the local file into the shared one, CHUNK at a time;
    returns (byte offset, length, CRC-32) of what it wrote, for the file's checksum."""
    crcs = []
    for a, b, n in pieces:  # (local_lo, flat_lo, n)
        for off in range(0, n, CHUNK):
            m = min(CHUNK, n - off)
            data = os.pread(src_fd, m * item, src_base + (a + off) * item)
            if len(data) != m * item:
                raise OSError(f"short read of a checkpoint file ({len(data)} of {m * item} bytes)")
            crcs.append(_pwrite_piece(dst_fd, data, dst_base + (b + off) * item, "a checkpoint file"))
    return crcs


def _pwrite_piece(fd: int, data, at: int, name) -> tuple[int, int, int]:
    """data written at byte `at` (OSError on a short write); its (offset, length, CRC-32),
    for the file's checksum (ckpt_io.combine_pieces)."""
    if os.pwrite(fd, data, at) != len(data):
        raise OSError(f"short write of {name} at byte {at}")
    return at, len(data), zlib.crc32(data)


def _create(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def save(engine, fmap: FlatMap, shards, directory: str, keep: int) -> str:
    """Every rank of FSDP2's group (shards: the LocalShards whose group it is): the
    optimizer's state into directory/step-N in the shared layout (module docstring).
    Returns the step directory."""
    if engine.cfg.state_dtype == "int8":  # before anything is written
        raise ValueError(INT8_REFUSED)
    g = _Group(shards)
    d = C.CheckpointDir(directory, rank=g.rank, world_size=g.world, agree=g.agree, barrier=g.barrier, keep=keep)
    tmp = d.begin(engine.iteration)
    # beside the checkpoints (the disk chosen for their size), where the directory
    # protocol's sweep of tmp-* does not look; removed below whatever happens
    local_root = scratch.make(f".local-r{g.rank}-", directory)
    err: BaseException | None = None
    files = {}
    try:
        # 1. this rank's own one-rank checkpoint
        try:
            local = Path(engine.save_checkpoint(str(local_root), keep=1))
            man = json.loads(C.rank_file(local, C.SHARD, 0, ONE, ".json").read_text())
            meta = json.loads(C.rank_file(local, C.ENGINE, 0, ONE, ".json").read_text())
            names, dtypes = _arrays(man)
            ok = True
        except (OSError, ValueError, OptimizerServerError) as e:
            ok, err = False, e
        if not g.agree(ok):
            return _fail(tmp, err)
        # every rank's stale flag is the same (one DPU schedule)
        stale = bool(meta["stale"])
        if g.any(stale) != g.agree(stale):
            return _fail(tmp, RuntimeError("the ranks disagree on whether an update is pending"))
        N = fmap.numel
        shard_bytes = ShardStateArrays.file_bytes(names, dtypes, N)
        files = {C.SHARD: C.rank_file(tmp, C.SHARD, 0, ONE, ".bin"),
                 C.DEVICE16: C.rank_file(tmp, C.DEVICE16, 0, ONE, ".bin")}
        if stale:
            files[C.PENDING16] = C.rank_file(tmp, C.PENDING16, 0, ONE, ".bin")
        # 2. rank 0 makes the shared files at their full size (zeros where no parameter lies)
        ok = True
        if g.rank == 0:
            try:
                _create(files[C.SHARD], shard_bytes)
                for k in (C.DEVICE16, C.PENDING16):
                    if k in files:
                        _create(files[k], 2 * N)
            except OSError as e:
                ok, err = False, e
        if not g.agree(ok):
            return _fail(tmp, err)
        # 3. each rank its pieces, and the CRC of each piece as it is written (the shared
        # files' checksums are combined from them: nobody reads the files back)
        crcs: list[tuple[int, int, int, int]] = []  # (role index, offset, length, crc)
        try:
            n_local = int(man["numel"])
            lbase, _ = ShardStateArrays.file_layout(names, dtypes, n_local)
            gbase, _ = ShardStateArrays.file_layout(names, dtypes, N)
            for r, (role, path) in enumerate(files.items()):
                src = C.rank_file(local, role, 0, ONE, ".bin")
                sfd, dfd = os.open(src, os.O_RDONLY), os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
                try:
                    if role == C.SHARD:
                        for name in names:
                            item = ITEM_BYTES[dtypes.get(name, "fp32")]
                            crcs += [(r, *c) for c in _copy_pieces(sfd, dfd, fmap.pieces, lbase[name],
                                                                   gbase[name], item)]
                    else:
                        crcs += [(r, *c) for c in _copy_pieces(sfd, dfd, fmap.pieces, 0, 0, 2)]
                    os.fsync(dfd)
                finally:
                    os.close(sfd)
                    os.close(dfd)
        except OSError as e:
            ok, err = False, e
        if not g.agree(ok):
            return _fail(tmp, err)
        every = g.all_rows(crcs, 4)
        # 4. rank 0: the manifests, with the shared files' checksums
        if g.rank == 0:
            try:
                sizes = {C.SHARD: shard_bytes, C.DEVICE16: 2 * N, C.PENDING16: 2 * N}
                sums = {role: C.checksum_str(combine_pieces([c[1:] for c in every if c[0] == r], sizes[role]))
                        for r, role in enumerate(files)}
                shard_man = dict(man, rank=0, world_size=ONE, numel=N, groups=[], checksum=sums.pop(C.SHARD))
                atomic_write_bytes(C.rank_file(tmp, C.SHARD, 0, ONE, ".json"),
                                   json.dumps(shard_man, indent=1).encode())
                counts = [0] * fmap.n_params
                for j, c in zip(fmap.span_of_local, meta["param_updates"]):
                    counts[j] = c
                eng = dict(meta, rank=0, world_size=ONE, numel=N, param_updates=counts, checksums=sums,
                           params=fmap.params)
                atomic_write_bytes(C.rank_file(tmp, C.ENGINE, 0, ONE, ".json"), json.dumps(eng, indent=1).encode())
            except (OSError, ValueError) as e:
                ok, err = False, e
        expected = [C.rank_file(Path("."), p, 0, ONE, s) for p, s in
                    ((C.SHARD, ".bin"), (C.SHARD, ".json"), (C.ENGINE, ".json"), (C.DEVICE16, ".bin"))]
        done, where = d.commit(tmp, ok, lambda k: expected if k == 0 else [])
        if done:
            return where
        why = err or where or "on another rank"
        raise OptimizerServerError(f"saving the FSDP2 checkpoint in {directory} failed ({why}); the previous "
                                   f"checkpoint is intact", code=E_CHECKPOINT)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)


def _fail(tmp: Path, err) -> NoReturn:
    shutil.rmtree(tmp, ignore_errors=True)
    raise OptimizerServerError(f"saving the FSDP2 checkpoint failed ({err or 'on another rank'}); the previous "
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
    g = _Group(shards)
    try:
        source, err = _source(engine, fmap, directory), None
    except (OSError, ValueError) as e:
        source, err = None, e
    if not g.agree(err is None):
        raise err if err is not None else C.CheckpointError(
            f"checkpoint {directory} was refused on another rank (its error says why); nothing was loaded")
    bins, w16, mans, metas = source.bins, source.w16, source.mans, source.metas
    names, dtypes, per_file, meta, man = source.names, source.dtypes, source.per_file, metas[0], mans[0]
    _verify_together(g, [(path, mans[k].get("checksum")) for k, path in enumerate(bins)]
                     + [(f, metas[k].get("checksums", {}).get(role)) for role, fs in w16.items()
                        for k, f in enumerate(fs)])
    n_local = engine.flat.shard_numel
    local_root = None
    try:
        try:
            local_root = scratch.make("zero-offload-fsdp2-")
            local = local_root / "state"
            local.mkdir(mode=0o700)
            lbase, lsize = ShardStateArrays.file_layout(names, dtypes, n_local)
            gbase, _ = ShardStateArrays.file_layout(names, dtypes, per_file)
            out = C.rank_file(local, C.SHARD, 0, ONE, ".bin")
            _create(out, lsize)
            arrays = [(lbase[n], gbase[n], ITEM_BYTES[dtypes.get(n, "fp32")]) for n in names]
            shard_crc = combine_pieces(_gather(bins, per_file, out, arrays, fmap.pieces), lsize)
            sums = {}
            for role, fs in w16.items():
                per16 = fs[0].stat().st_size // 2
                out16 = C.rank_file(local, role, 0, ONE, ".bin")
                _create(out16, 2 * n_local)
                crcs = _gather(fs, per16, out16, [(0, 0, 2)], fmap.pieces)
                sums[role] = C.checksum_str(combine_pieces(crcs, 2 * n_local))
            atomic_write_bytes(C.rank_file(local, C.SHARD, 0, ONE, ".json"), json.dumps(dict(
                man, rank=0, world_size=ONE, numel=n_local, groups=[], checksum=C.checksum_str(shard_crc))).encode())
            counts = [meta["param_updates"][j] for j in fmap.span_of_local]
            atomic_write_bytes(C.rank_file(local, C.ENGINE, 0, ONE, ".json"), json.dumps(
                dict({k: v for k, v in meta.items() if k != "params"},  # the shared layout's, not the local one's
                     rank=0, world_size=ONE, numel=engine.flat.numel, param_updates=counts, checksums=sums)).encode())
            engine.load_checkpoint(str(local))
        except (OSError, ValueError, OptimizerServerError) as e:
            err = e
    finally:
        if local_root is not None:
            shutil.rmtree(local_root, ignore_errors=True)
    if not g.agree(err is None):
        if err is not None:
            raise err
        raise OptimizerServerError(f"loading checkpoint {directory} failed on another rank (its error says why); "
                                   f"this rank loaded it, so the ranks now differ: load a checkpoint again on "
                                   f"every rank", code=E_CHECKPOINT)


def _gather(files: list[Path], per_file: int, out: Path, arrays: list[tuple[int, int, int]], pieces) -> list:
    """Into the local file `out`: each array's pieces (arrays: (local base, shared base,
    item bytes)) read out of the shared flat space of `files` (read_range); returns
    (byte offset, length, CRC-32) of what it wrote, for the local file's checksum."""
    fd = os.open(out, os.O_WRONLY | os.O_NOFOLLOW)
    crcs = []
    try:
        for lbase, gbase, item in arrays:
            dt = {1: np.uint8, 2: np.uint16, 4: np.uint32}[item]
            for lo, flat_lo, n in pieces:
                for off in range(0, n, CHUNK):
                    m = min(CHUNK, n - off)
                    buf = np.empty(m, dt)
                    read_range(files, per_file, gbase, flat_lo + off, flat_lo + off + m, buf)
                    crcs.append(_pwrite_piece(fd, memoryview(buf).cast("B"), lbase + (lo + off) * item, out))
        os.fsync(fd)
    finally:
        os.close(fd)
    return crcs


def _verify_together(g: _Group, checks: list[tuple[Path, str | None]]) -> None:
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
