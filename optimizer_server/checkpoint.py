"""The checkpoint format: file names for both sides, checksums, versions, and the
directory protocol (temporary directory, agreement across ranks, rename, `latest`,
retention).  Importable without torch; docs/checkpoint.md describes the format.

    ROOT/
      latest                       the name of the newest complete step directory
      step-00000100/               one complete checkpoint
        shard-r{k}-of-{W}.bin      server: master, then each state array (fp32, shard k)
        shard-r{k}-of-{W}.json     server: its manifest (format, layout, hparams, checksum)
        engine-r{k}-of-{W}.json    engine: counters, loss scale, lr state, checksums
        device16-r{k}-of-{W}.bin   engine: the device's 16-bit weights of shard k
        pending16-r{k}-of-{W}.bin  engine, DPU only: a landed update not yet on the device
      tmp-step-00000200/           a save in progress (or one a crash left: swept by the next)

Who writes what: the engine of rank k makes nothing but its own files; the server
writes the shard files into the directory the engine names (so every rank, and
the server, must see one filesystem: commit checks it); rank 0 alone sweeps,
renames, points `latest` and prunes.  Each .bin file's CRC-32 is in the JSON
beside it and is verified before anything is read into memory that matters.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import zlib
from pathlib import Path
from typing import Callable

from .atomic import atomic_write_bytes, fsync_dir
from .ckpt_io import file_crc, lower_this_threads_priority

log = logging.getLogger("zero_offload")  # the pruner runs in the worker (the engine's CheckpointDir)

LATEST = "latest"
STEP_PREFIX = "step-"
TMP_PREFIX = "tmp-"
# what the directory protocol may remove: its own step and temporary directories, by
# their exact shape (a user's "step-best" or another tool's "tmp-x" beside them stays)
STEP_DIR = re.compile(r"step-\d{8,}$")
TMP_STEP_DIR = re.compile(r"tmp-step-\d{8,}$")
SHARD_FORMAT = 2     # shard-*.json "format": the server's files
# 2: int8 arrays hold float-like codes (e4m3 m, e5m3 v; cython_ext/_kernels_int8.h);
# 1: int8 arrays hold the power-law codes of before (m = scale (q/127)^4, v = scale
#    (q/255)^8), read as the legacy array dtype "int8-pow" and re-encoded on load.
SHARD_FORMATS_READ = (1, 2)
LEGACY_INT8 = "int8-pow"
ENGINE_VERSION = 1   # engine-*.json "version": the engine's files
# Roles of the per-rank files (the prefix of their names).
SHARD, ENGINE, DEVICE16, PENDING16 = "shard", "engine", "device16", "pending16"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded as asked; the message names the fix."""


def rank_file(directory: Path, prefix: str, rank: int, world: int, suffix: str) -> Path:
    """The file of one rank in a checkpoint: ``{prefix}-r{rank}-of-{world}{suffix}``
    (the one place that spells the name; saved_world_sizes parses it)."""
    return Path(directory) / f"{prefix}-r{rank}-of-{world}{suffix}"


def step_name(iteration: int) -> str:
    return f"{STEP_PREFIX}{iteration:08d}"


def saved_world_sizes(directory: Path, prefix: str) -> list[int]:
    """The world sizes W for which directory holds ``{prefix}-r0-of-{W}.json``.  A W out of
    [1, MAX_WORLD_SIZE] is refused here, naming the file, before anything is built from
    it (a crafted ``shard-r0-of-999999999999.json`` made every reader list that many
    paths and run out of memory)."""
    directory = Path(directory)
    pat = re.compile(rf"{re.escape(prefix)}-r0-of-(\d+)\.json$")
    found = [(p.name, pat.match(p.name)) for p in directory.glob(f"{prefix}-r0-of-*.json")] if directory.is_dir() else []
    out = []
    for name, m in found:
        if not m:
            continue
        digits = m.group(1)
        if len(digits) > len(str(MAX_WORLD_SIZE)) or not 1 <= int(digits) <= MAX_WORLD_SIZE:
            raise CheckpointError(f"{directory / name} names world size {digits[:20]}"
                                  f"{'...' if len(digits) > 20 else ''}, not in [1, {MAX_WORLD_SIZE}]: it is not a "
                                  f"checkpoint file of ours; remove it, or load another checkpoint")
        out.append(int(digits))
    return sorted(out)


def pick_world_size(directory: Path, prefix: str, mine: int) -> int:
    """The world size to load from: ours if saved, else the only one there is."""
    directory = Path(directory)
    worlds = saved_world_sizes(directory, prefix)
    if mine in worlds:
        return mine
    if len(worlds) == 1:
        return worlds[0]
    have = sorted(p.name for p in directory.glob(f"{prefix}-*.json")) if directory.is_dir() else []
    raise CheckpointError(f"no checkpoint to load in {directory}: expected {prefix}-r0-of-W.json files of one "
                          f"world size W; found {have or 'nothing'}")


# ----------------------------------------------------------------------------- checksums

def crc32_update(crc: int, data) -> int:
    """Fold bytes (anything with the buffer protocol) into a running CRC-32."""
    return zlib.crc32(memoryview(data).cast("B"), crc)


def checksum_str(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def file_checksum(path: Path) -> str:
    """The whole file's CRC-32, read in large pieces on several threads (ckpt_io)."""
    return checksum_str(file_crc(path)[0])


def verify(path: Path, expected: str | None) -> None:
    """Raise CheckpointError naming the file unless its checksum is `expected`."""
    if not expected:
        raise CheckpointError(f"checkpoint file {path} has no checksum in its manifest (written by an older "
                              f"version?); load a checkpoint this version wrote")
    got = file_checksum(path)
    if got != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its checksum is {got}, the manifest says "
                              f"{expected}; load another checkpoint (an earlier step-N beside it)")


def check_version(path: Path, key: str, found, expected) -> None:
    if found != expected:
        raise CheckpointError(f"checkpoint file {path} has {key}={found!r} but this version reads {key}={expected!r}; "
                              f"load it with the zero-offload that wrote it")


def saved_array_dtypes(manifest: dict) -> dict:
    """A shard manifest's array dtypes ("array_dtypes"; absent: every array fp32), with
    format 1's int8 arrays named by their legacy code."""
    dtypes = dict(manifest.get("array_dtypes", {}))
    if manifest.get("format") == 1:
        dtypes = {k: LEGACY_INT8 if v == "int8" else v for k, v in dtypes.items()}
    return dtypes


# ----------------------------------------------------------------------------- directory protocol

def has_checkpoint(root: str | Path) -> bool:
    """True once a save into root has completed (its `latest` pointer exists)."""
    return (Path(root) / LATEST).exists()


STEP_DIR = re.compile(rf"{STEP_PREFIX}\d{{8}}")
MAX_WORLD_SIZE = 1 << 16   # a manifest's world size beyond this is not a checkpoint of ours
MAX_LATEST_BYTES = 64


def resolve(root: str | Path) -> Path:
    """root/latest's target, or root itself if it holds the files (a step directory).
    `latest` must name a step directory (step-NNNNNNNN) inside root: anything else (a
    path, '..', a link out of root) is refused naming the fix."""
    d = Path(root)
    latest = d / LATEST
    if not latest.exists():
        return d
    with open(latest, "rb") as f:
        name = f.read(MAX_LATEST_BYTES + 1).decode(errors="replace").strip()
    target = d / name
    if (not STEP_DIR.fullmatch(name) or target.is_symlink() or not target.is_dir()):
        raise CheckpointError(f"{latest} names {name[:MAX_LATEST_BYTES]!r}, not a step-NNNNNNNN directory inside "
                              f"{d}; load a step directory by its path, or rewrite {LATEST}")
    return target


def manifest_updates(man: dict) -> int:
    """The updates a shard manifest says its state has had ("updates"; manifests written
    before protocol 14 call them "steps")."""
    return int(man.get("updates", man.get("steps", 0)))


def check_shard_manifest(path: Path, man: dict) -> None:
    """A shard manifest's values in range before anything is read on their word: known
    keys, a world size and rank in bounds, counts >= 0, hyper-parameters as HELLO would
    accept them.  CheckpointError naming the file and the key."""
    from .protocol import GROUP_FIELDS, MAX_NUMEL, ProtocolError, validate_hparams
    known = {"format", "protocol_version", "rank", "world_size", "numel", "dtype", "optimizer", "hparams", "updates",
             "steps", "skipped", "groups", "arrays", "array_dtypes", "checksum"}
    bad = sorted(set(man) - known) if isinstance(man, dict) else ["(not a map)"]

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise CheckpointError(f"checkpoint manifest {path} is not valid: {what}; load another checkpoint (an "
                                  f"earlier step-N beside it)")
    need(not bad, f"unknown keys {bad}")

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)
    w = man.get("world_size")
    need(is_int(w) and 1 <= w <= MAX_WORLD_SIZE, f"world_size {w!r} is not in [1, {MAX_WORLD_SIZE}]")
    need(is_int(man.get("rank")) and 0 <= man["rank"] < w, f"rank {man.get('rank')!r} is not in [0, {w})")
    need(is_int(man.get("numel")) and 0 <= man["numel"] <= MAX_NUMEL, f"numel {man.get('numel')!r} is out of range")
    for k in ("updates", "steps", "skipped"):
        need(is_int(man.get(k, 0)) and man.get(k, 0) >= 0, f"{k} {man.get(k)!r} is not a count")
    h = man.get("hparams", {})
    need(isinstance(h, dict), "hparams is not a map")
    try:
        validate_hparams(h)
    except ProtocolError as e:
        need(False, f"hparams: {e}")
    groups = man.get("groups", [])
    need(isinstance(groups, list) and all(isinstance(g, list) and len(g) == len(GROUP_FIELDS) for g in groups),
         "groups is not a list of ranges")
    for g in groups:
        try:
            validate_hparams(dict(zip(GROUP_FIELDS[2:7], g[2:7])))
        except ProtocolError as e:
            need(False, f"a group's hparams: {e}")


def _size_of(dirs: list[Path]) -> int:
    """The bytes of the files directly in dirs (a step directory is flat); 0 for what is gone."""
    n = 0
    for d in dirs:
        try:
            n += sum(f.lstat().st_size for f in d.iterdir())
        except OSError:
            pass
    return n


class Pruner:
    """Removes the step directories a newer checkpoint superseded, on a thread of its own.

    Unlinking a checkpoint's files is the file system's work in proportion to their size
    (ext4 frees every extent: about 1 s for a 7.5 GB file here), and a background save
    is published between two steps: removing the old one there would stop training for
    that long.  The removal runs on a lowest-priority thread instead; ``wait`` joins it.
    A blocking save, ``wait_checkpoint``, a load and close wait for it (what the caller
    sees afterwards is the pruned directory), and the next prune waits for the last one
    first.  A crash midway leaves part of a superseded step-N; the next commit removes
    the rest (it is still older than ``latest``)."""

    MIN_BYTES_PER_S = 50e6  # wait() goes on past this slow a removal (plus a minute), saying so

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._bound_s = 0.0

    def prune(self, dirs: list[Path]) -> None:
        self.wait()
        if dirs:
            self._bound_s = 60.0 + _size_of(dirs) / self.MIN_BYTES_PER_S
            self._thread = threading.Thread(target=self._remove, args=(list(dirs),), name="ckpt-prune", daemon=True)
            self._thread.start()

    @staticmethod
    def _remove(dirs: list[Path]) -> None:
        lower_this_threads_priority()
        for p in dirs:
            shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Until the removal is done, at most its bound: past it the caller goes on (the
        log says so; a file system that slow is not a reason to stop training), and the
        next wait waits again."""
        t = self._thread
        if t is None:
            return
        t.join(self._bound_s)
        if t.is_alive():
            log.warning("removing superseded checkpoints is still running after %.0f s; going on without it",
                        self._bound_s)
        else:
            self._thread = None


class CheckpointDir:
    """One save's way through ROOT: ``begin`` -> every rank writes -> ``commit``.

    agree(ok) must return True only if every rank passed True (a collective), and
    barrier() must return once every rank called it; one rank passes trivial ones.

    begin:  rank 0 removes tmp-* directories that crashed saves left; all ranks
            meet; each makes ROOT/tmp-step-N.
    commit: the ranks agree that each one's writes succeeded; rank 0 checks that
            it sees every rank's files (ROOT is one filesystem for all, and for
            the server); it renames tmp-step-N to step-N, replaces `latest`
            atomically and keeps the newest `keep` (the older ones removed by
            ``pruner``, on its thread: the caller waits for it where it must);
            all ranks meet again.
    A failure anywhere removes tmp-step-N and leaves the previous checkpoint current.
    """

    def __init__(self, root: str | Path, *, rank: int, world_size: int, agree: Callable[[bool], bool],
                 barrier: Callable[[], None], keep: int = 2, pruner: Pruner | None = None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (how many checkpoints stay), got {keep!r}")
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self._agree = agree
        self._barrier = barrier
        self.keep = keep
        self.pruner = pruner

    def begin(self, iteration: int) -> Path:
        name = step_name(iteration)
        tmp = self.root / (TMP_PREFIX + name)
        if self.rank == 0:
            if self.pruner is not None:
                self.pruner.wait()  # the last save's superseded directories are gone first
            try:
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
                for stale in self.root.glob(TMP_PREFIX + STEP_PREFIX + "*"):
                    if TMP_STEP_DIR.match(stale.name) and stale.is_dir() and not stale.is_symlink():
                        shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                pass  # the write that follows fails and says why
        self._barrier()
        try:
            tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            pass  # the write into it fails and says why
        return tmp

    def missing(self, tmp: Path, expected: list[Path]) -> list[str]:
        return sorted(p.name for p in expected if not (tmp / p.name).exists())

    def commit(self, tmp: Path, ok: bool, expected: Callable[[int], list[Path]]) -> tuple[bool, str]:
        """Agree and publish.  expected(k): the files rank k must have written into tmp.
        Returns (True, step path), or (False, why) on every rank alike, why "" when a
        rank's write failed (that rank raises its own error)."""
        if not self._agree(ok):
            shutil.rmtree(tmp, ignore_errors=True)
            return False, ""
        why = ""
        fix = ("Pass a directory every rank and the optimizer server can see (a shared mount), not a "
               "node-local path")
        if self.rank == 0:
            lost = {k: self.missing(tmp, expected(k)) for k in range(self.world_size)}
            lost = {k: v for k, v in lost.items() if v}
            if lost:
                why = (f"checkpoint directory {self.root} is not one filesystem for every rank: rank 0 does not see "
                       + "; ".join(f"rank {k}'s {', '.join(v)}" for k, v in lost.items()) + ". " + fix)
        if not self._agree(not why):
            shutil.rmtree(tmp, ignore_errors=True)  # every rank its own (one and the same if shared)
            return False, why or (f"checkpoint directory {self.root} is not one filesystem for every rank: rank 0 "
                                  f"does not see every rank's files. " + fix)
        final = tmp.with_name(tmp.name[len(TMP_PREFIX):])
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            atomic_write_bytes(self.root / LATEST, final.name.encode())  # 0600, like every file here
            old = sorted((p for p in self.root.glob(STEP_PREFIX + "*")
                          if STEP_DIR.match(p.name) and p.is_dir() and not p.is_symlink() and p.name != final.name),
                         key=lambda p: int(p.name[len(STEP_PREFIX):]))
            stale = old[:max(0, len(old) - (self.keep - 1))]
            if self.pruner is None:  # here and now
                for p in stale:
                    shutil.rmtree(p, ignore_errors=True)
            else:
                self.pruner.prune(stale)
        self._barrier()
        return True, str(final)
