"""The engine's side of a checkpoint: its files, and the save and load sequences
around the server's (the format and the directory protocol are
optimizer_server.checkpoint's; docs/checkpoint.md describes both).

The engine writes, per rank: engine-r{k}-of-{W}.json (counters, loss scale,
lr state, and the checksums of the two files below), device16-r{k}-of-{W}.bin
(the device's 16-bit weights of its shard as they are: under DPU one update
behind) and, when an update has landed that the device does not have yet,
pending16-r{k}-of-{W}.bin (with dpu_predict it is not simply RNE(master), so it
is saved as it is).
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from zero_offload.server import checkpoint as C
from zero_offload.server.atomic import atomic_write_bytes
from zero_offload.server.ckpt_io import chunk_buffer, lend_back, lower_this_threads_priority, write_file
from zero_offload.server.errors import OptimizerServerDeadError, OptimizerServerError
from zero_offload.server.protocol import E_CHECKPOINT
from zero_offload.server.reshard import read_range

log = logging.getLogger("zero_offload")


@dataclass
class InFlight:
    """A background save whose server file is still being written: the thread writing
    the engine's files, the collective that says every rank's server is done, and what
    publishes it (ok, the error if not, the server's last save status) -> its path."""
    writer: "_EngineFiles"
    agree: Callable[[bool], bool]
    publish: Callable[[bool, BaseException | None, dict], str]


def _write_engine_files(tmp: Path, k: int, W: int, device16: np.ndarray, pending16: np.ndarray | None,
                        meta: dict) -> None:
    """device16 (and pending16) with their checksums in engine-r{k}-of-{W}.json."""
    sums = {}
    for prefix, arr in ((C.DEVICE16, device16), (C.PENDING16, pending16)):
        if arr is not None:
            data = np.ascontiguousarray(arr)
            write_file(C.rank_file(tmp, prefix, k, W, ".bin"), data)
            sums[prefix] = C.checksum_str(C.crc32_update(0, data))
    meta = dict(meta, checksums=sums)
    atomic_write_bytes(C.rank_file(tmp, C.ENGINE, k, W, ".json"), json.dumps(meta, indent=1).encode())


class _EngineFiles(threading.Thread):
    """The engine's files of a background save, on their own thread: first a snapshot of
    the live device16 / pending16 (``copied`` is set then: the engine may change them
    from that moment), then the files."""

    MIN_BYTES_PER_S = 10e6  # wait() gives up past this slow a disk or copy (plus a minute)

    def __init__(self, tmp: Path, k: int, W: int, device16, pending16, meta: dict, snapshot):
        super().__init__(name="zo-ckpt-engine", daemon=True)
        self.tmp, self.k, self.W, self.meta = tmp, k, W, meta
        self.live = (device16, pending16)
        self.snapshot = snapshot
        self.nbytes = device16.nbytes + (0 if pending16 is None else pending16.nbytes)
        self.bound_s = 60.0 + self.nbytes / self.MIN_BYTES_PER_S  # each wait below
        self.copied = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            try:
                dev, pend = (None if a is None else self.snapshot(i, a) for i, a in enumerate(self.live))
            finally:
                self.live = None
                self.copied.set()
            lower_this_threads_priority(idle=True)  # the write uses idle CPU, not the training's
            self.write(dev, pend)
            for a in (dev, pend):  # kept for the next save, counted as free until then
                if a is not None:
                    lend_back(a)
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self.error = e

    def write(self, dev: np.ndarray, pend: np.ndarray | None) -> None:
        """The files, from the snapshot."""
        _write_engine_files(self.tmp, self.k, self.W, dev, pend, self.meta)

    def wait_copied(self) -> None:
        if not self.copied.wait(self.bound_s):
            raise OSError(f"snapshotting the device weights for a checkpoint took over {self.bound_s:.0f} s")

    def wait(self) -> None:
        self.join(self.bound_s)
        if self.is_alive():
            raise OSError(f"writing the engine's checkpoint files took over {self.bound_s:.0f} s")
        if self.error is not None:
            raise self.error


class EngineCheckpoint:
    """Save and load of one rank's engine files, with the server's shard beside them.

    agree(ok) and barrier() are the collectives of CheckpointDir (trivial on one rank).
    """

    def __init__(self, *, rank: int, world_size: int, numel: int, shard_numel: int, agree, barrier, tracer):
        self.rank, self.world_size = rank, world_size
        self.numel, self.shard_numel = numel, shard_numel
        self.shard_lo, self.shard_hi = rank * shard_numel, (rank + 1) * shard_numel
        self._agree, self._barrier = agree, barrier
        self.tracer = tracer
        self.in_flight: InFlight | None = None  # a background save not yet published
        self._snaps: dict[int, np.ndarray] = {}  # the device weights' snapshots (_snapshot)
        self._preparing: threading.Thread | None = None  # making them ahead of a background save
        self._prepare_bound_s = 0.0
        # superseded step directories go on a thread of theirs (C.Pruner): only a save
        # published between steps (poll) returns before they are gone
        self.pruner = C.Pruner()

    def _expected(self, k: int, pending: bool) -> list[Path]:
        W = self.world_size
        names = [C.rank_file(Path("."), p, k, W, s) for p, s in
                 ((C.SHARD, ".bin"), (C.SHARD, ".json"), (C.ENGINE, ".json"), (C.DEVICE16, ".bin"))]
        if pending:
            names.append(C.rank_file(Path("."), C.PENDING16, k, W, ".bin"))
        return names

    def save(self, root: str, iteration: int, keep: int, *, client, device16: np.ndarray,
             pending16: np.ndarray | None, meta: dict, background: bool = False) -> str:
        """Write everything under root/step-N and point root/latest at it.

        Everything goes to root/tmp-step-N first and is renamed into place only
        when every rank has finished and rank 0 sees every rank's files; then
        `latest` is replaced atomically: a failed save (full or read-only disk,
        a directory not every rank sees) raises and leaves the previous checkpoint
        intact and current.  The newest `keep` are kept.

        background: the server writes its (large) shard file while training goes on;
        this returns the step directory it will become, and ``poll`` / ``finish``
        publish it once the server is done (the engine's files are written here)."""
        if self.in_flight is not None:
            self.finish(client)  # one save at a time: the previous one is published (or fails) first
        d = C.CheckpointDir(root, rank=self.rank, world_size=self.world_size, agree=self._agree,
                            barrier=self._barrier, keep=keep, pruner=self.pruner)
        name = C.step_name(iteration)
        err: BaseException | None = None
        with self.tracer.span("save_checkpoint", background=background):
            tmp = d.begin(iteration)
            W, k = self.world_size, self.rank
            meta = dict(meta, version=C.ENGINE_VERSION, world_size=W, rank=k, numel=self.numel,
                        stale=pending16 is not None)
            try:
                info = client.save(str(tmp), background=background)
                if background and not info.get("snapshot", True):
                    # said once per save: the steps while it writes wait for the disk
                    log.warning("%s", info.get("note") or "a background save took no snapshot")
                if background:
                    # the device weights change with the next backward or step: a thread of
                    # ours snapshots them (the engine waits for that copy, wait_snapshot(),
                    # before anything can change them), then writes them with the checksums
                    writer = _EngineFiles(tmp, k, W, device16, pending16, meta, self._snapshot)
                    writer.start()
                else:
                    _write_engine_files(tmp, k, W, device16, pending16, meta)
                ok = True
            except (OSError, OptimizerServerError) as e:
                ok, err = False, e
            if background and self._agree(ok):
                pending = pending16 is not None
                self.in_flight = InFlight(writer, self._agree, lambda ok_, err_, _st: self._commit(
                    d, tmp, ok_, err_, root, name, pending))
                return str(tmp.with_name(name))
            try:
                return self._commit(d, tmp, ok, err, root, name, pending16 is not None)
            finally:
                self.after_blocking_save(device16, pending16)

    def wait_snapshot(self) -> None:
        """Before the device weights can change (a backward, a step): a background save
        in flight has copied them."""
        if self.in_flight is not None:
            self.in_flight.writer.wait_copied()

    def _snapshot(self, i: int, src: np.ndarray) -> np.ndarray:
        """src copied into snapshot buffer i, kept from one background save to the next
        (2 B/param of worker RAM, lent back to the kernel between saves: ckpt_io.lend_back):
        a fresh array's first touch costs ~2 s per GB in page faults here, a memcpy into a
        touched one ~0.1.  On the writer thread, before the next backward or step."""
        self._wait_prepared()
        if not self._has_snapshot_buffer(i, src):
            # page-aligned, so that its file is written with O_DIRECT (ckpt_io.write_file)
            self._snaps[i] = chunk_buffer(src.nbytes).view(src.dtype).reshape(src.shape)
        buf = self._snaps[i]
        np.copyto(buf, src)
        return buf

    def _has_snapshot_buffer(self, i: int, like: np.ndarray) -> bool:
        buf = self._snaps.get(i)
        return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype

    def after_blocking_save(self, device16: np.ndarray, pending16: np.ndarray | None) -> None:
        """What a blocking save (this engine's or FSDP2's) does before it returns: the
        superseded checkpoints gone, the next background save's buffers on their way."""
        self.pruner.wait()
        self.prepare_snapshots(device16, pending16)

    def prepare_snapshots(self, device16: np.ndarray, pending16: np.ndarray | None) -> None:
        """After a save: the snapshot buffers a background save of these arrays will
        need, made and touched on a lowest-priority thread and lent back, so that the
        first background save's copy runs at memory speed (the step after it waits for
        that copy).  Nothing if they exist already."""
        want = [(i, a) for i, a in enumerate((device16, pending16))
                if a is not None and not self._has_snapshot_buffer(i, a)]
        if not want or self._preparing is not None:
            return
        made = {i: (a.shape, a.dtype, a.nbytes) for i, a in want}
        # a first touch runs at 0.5-3 GB/s on a VM; past this slow (plus a minute) the save gives up
        self._prepare_bound_s = 60.0 + sum(n for _, _, n in made.values()) / _EngineFiles.MIN_BYTES_PER_S

        def run() -> None:
            lower_this_threads_priority(idle=True)
            for i, (shape, dtype, nbytes) in made.items():
                buf = chunk_buffer(nbytes, touch=True)
                lend_back(buf)
                self._snaps[i] = buf.view(dtype).reshape(shape)
        self._preparing = threading.Thread(target=run, name="zo-ckpt-prepare", daemon=True)
        self._preparing.start()

    def _wait_prepared(self) -> None:
        t, self._preparing = self._preparing, None
        if t is not None:
            t.join(self._prepare_bound_s)
            if t.is_alive():
                raise OSError(f"making the snapshot buffers for a checkpoint took over {self._prepare_bound_s:.0f} s")

    def _commit(self, d: "C.CheckpointDir", tmp: Path, ok: bool, err: BaseException | None, root: str, name: str,
                pending: bool) -> str:
        done, where = d.commit(tmp, ok, lambda r: self._expected(r, pending))
        if done:
            return where
        if isinstance(err, OptimizerServerDeadError):
            raise err  # a dead server is the one named error, whatever it interrupted
        if err is not None:
            raise OptimizerServerError(f"saving checkpoint {name} in {root} failed ({err}); the previous "
                                       f"checkpoint is intact", code=E_CHECKPOINT) from err
        if where:
            raise OptimizerServerError(f"saving checkpoint {name} failed: {where}; the previous checkpoint is "
                                       f"intact", code=E_CHECKPOINT)
        raise OptimizerServerError(f"saving checkpoint {name} failed on another rank; the previous "
                                   f"checkpoint is intact", code=E_CHECKPOINT)

    def poll(self, client) -> str | None:
        """Between steps, while a background save is in flight: publish it if every rank's
        server is done and so is every rank's own writer of its files (a collective with
        several ranks; no round trip to the server: the heartbeat's word; the writer runs
        on idle CPU, and a step that waited for it would stop training that long).  Its
        path once published, else None."""
        if self.in_flight is None:
            return None
        state = client.save_status()["state"]
        if not self.in_flight.agree(state != "writing" and not self.in_flight.writer.is_alive()):
            return None
        return self.finish(client, prune_later=True)

    def finish(self, client, prune_later: bool = False) -> str | None:
        """Wait for the background save in flight (bounded by its progress) and publish
        it: its step directory, or OptimizerServerError naming why it failed (the
        previous checkpoint stays `latest`).  None if no save is in flight.
        prune_later: the superseded directories may still be going when this returns
        (published between steps); otherwise they are gone."""
        f, self.in_flight = self.in_flight, None
        if f is None:
            self.pruner.wait()
            return None
        try:
            return self._finish(client, f)
        finally:
            if not prune_later:
                self.pruner.wait()

    def _finish(self, client, f: InFlight) -> str:
        err, st = None, {}
        try:
            f.writer.wait()
            st = client.wait_save()
            ok = st["state"] == "done"
            if not ok:
                err = OSError(st.get("error") or f"the server's save ended {st['state']}")
        except (OSError, OptimizerServerError) as e:
            ok, err = False, e
        with self.tracer.span("checkpoint_publish"):
            return f.publish(ok, err, st)

    def read_meta(self, directory: str, expect: dict) -> tuple[Path, int, dict, list[dict]]:
        """(step directory, world size saved, this rank's meta, every saved rank's meta)."""
        d = C.resolve(directory)
        src = C.pick_world_size(d, C.ENGINE, self.world_size)
        metas = []
        for k in range(src):
            path = C.rank_file(d, C.ENGINE, k, src, ".json")
            if not path.exists():
                raise C.CheckpointError(f"checkpoint {d} is incomplete: {path.name} is missing; load another "
                                        f"checkpoint (an earlier step-N beside it)")
            m = json.loads(path.read_text())
            C.check_version(path, "version", m.get("version"), C.ENGINE_VERSION)
            metas.append(m)
        meta = metas[self.rank if src == self.world_size else 0]
        saved_align = meta.get("param_align", 1)  # before it was recorded, every layout was packed
        if "param_align" in expect and saved_align != expect["param_align"]:
            raise C.CheckpointError(
                f"checkpoint {d} lays each parameter out at a multiple of {saved_align} elements and this engine at "
                f"{expect['param_align']} (the default is 128 on a GPU, 1 on the CPU): build the engine with "
                f"OffloadConfig(expert={{'param_align_numel': {saved_align}}}) to load it")
        for key, mine in expect.items():
            if key == "param_align":
                continue
            if meta.get(key) != mine:
                raise C.CheckpointError(f"checkpoint {d} has {key}={meta.get(key)!r} but this engine has {mine!r}")
        return d, src, meta, metas

    def read_shard(self, d: Path, prefix: str, src: int, metas: list[dict], out: np.ndarray | None = None):
        """This rank's shard of the 16-bit files {prefix}-r*-of-{src}.bin, each verified first."""
        files = [C.rank_file(d, prefix, k, src, ".bin") for k in range(src)]
        sizes = {f.stat().st_size if f.exists() else -1 for f in files}
        per_file = sizes.pop() // 2 if len(sizes) == 1 else -1
        if per_file < 0 or per_file * src < self.numel:
            raise C.CheckpointError(f"checkpoint {d}: {prefix} files of {src} rank(s) are missing or of unequal or "
                                    f"too small sizes ({sorted(f.name for f in files if f.exists())}); load "
                                    f"another checkpoint (an earlier step-N beside it)")
        for k, f in enumerate(files):
            if k * per_file < self.shard_hi and self.shard_lo < (k + 1) * per_file:  # a file this rank reads
                C.verify(f, metas[k].get("checksums", {}).get(prefix))
        if out is None:
            out = np.empty(self.shard_numel, np.int16)
        read_range(files, per_file, 0, self.shard_lo, self.shard_hi, out)
        return out
