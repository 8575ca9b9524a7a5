"""One worker's shard on the server: fp32 master, optimizer state, its segment.

The master weights and m/v live in the server's private memory; only the
gradients and the 16-bit weights are shared (optimizer_server.shm).  The update
runs on a thread of its own (the kernel releases the GIL), so the methods that
touch state are called either from that thread (step) or from the socket
thread while the shard is READY (init, get_master, save, load): the state is
the lock.

States (ShardState) and what moves between them:

    from            event                                  to
    UNINITIALIZED   INIT's last chunk, or a LOAD that reads  READY
    READY           an INIT chunk that is not the last       UNINITIALIZED (a partial master)
    READY           a LOAD that fails midway                 UNINITIALIZED (a mixed master)
    READY           accept_step (STEP in order)              UPDATING
    UPDATING        finish_update (the thread is done)       READY
    READY           skip (SKIP in order)                     READY (skipped + 1)

Only READY takes STEP, SKIP, GET_MASTER and SAVE; UPDATING takes nothing but
HEARTBEAT and STATS (the server answers the rest with E_ORDER).
"""
from __future__ import annotations

import enum
import json
import logging
import time
from pathlib import Path

import numpy as np

from cython_ext import cpu_adam

from . import checkpoint as C
from . import protocol as P
from .atomic import atomic_write, atomic_write_bytes, fsync_dir
from .shm import Segment, ShardLayout
from .state import ShardStateArrays

log = logging.getLogger("optimizer_server")


class ShardState(enum.Enum):
    UNINITIALIZED = "uninitialized"  # no complete master: STEP is refused
    READY = "ready"                  # idle, state complete
    UPDATING = "updating"            # a STEP runs on the shard's thread


DEFAULT_HPARAMS = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    "adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
    "adagrad": dict(lr=1e-2, beta1=0.0, beta2=0.0, eps=1e-10, weight_decay=0.0),
    "lion": dict(lr=1e-4, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0),
}


class Shard:
    """State of one registered worker.  Created on HELLO, freed on BYE or drop."""

    def __init__(self, session: str, hello: P.Hello, segment: Segment, layout: ShardLayout, threads: int):
        self.session = session
        self.rank = hello.rank
        self.world_size = hello.world_size
        self.numel = hello.numel
        self.dtype = hello.dtype
        self.optimizer = hello.optimizer
        self.pid = hello.pid
        self.hparams = dict(DEFAULT_HPARAMS[hello.optimizer])
        self.hparams.update(hello.hparams)
        self.threads = threads
        self.segment = segment
        self.layout = layout  # admission computed it for the segment's size
        n = self.numel
        self.index_base = self.rank * n  # the shard's first element in the whole model (stochastic rounding)
        self.arrays = ShardStateArrays(self.optimizer, n, state_dtype=hello.state_dtype,
                                       exact_master=hello.exact_master)
        self.grads = [segment.array(np.uint16, off, n) for off in self.layout.grad_offsets]
        self.weights16_slots = [segment.array(np.uint16, off, n) for off in self.layout.weights_offsets]
        self.weights16 = self.weights16_slots[0]  # INIT and LOAD write this one
        self.staging = segment.array(np.float32, self.layout.staging_offset, self.layout.staging_numel)
        self.progress = segment.array(np.uint64, self.layout.progress_offset, 1)
        self.progress_block = hello.progress_block or P.DEFAULT_PROGRESS_BLOCK
        self.steps = 0
        self.skipped = 0
        self.phase = ShardState.UNINITIALIZED
        self._state_dirty = False  # m/v hold something other than zeros (a step or LOAD ran)
        self._init_next = 0        # INIT chunks arrive in order: the offset the next must have
        self.last_groups: list = []  # the param groups of the last STEP (saved in the manifest)
        self.drop_reason: str | None = None  # set when its worker died mid-update
        self.last_seen = time.monotonic()
        self.update_times: list[float] = []
        self.bytes_read = 0
        self.bytes_written = 0

    # -- helpers ---------------------------------------------------------------
    def _write_weights16(self, slot: int = 0) -> None:
        self.arrays.write_weights(self.weights16_slots, self.dtype, self.threads, slot)

    def close(self) -> None:
        """Drop views, unmap and unlink the segment (the server created it)."""
        self.grads = []
        self.weights16 = self.staging = self.progress = None
        self.weights16_slots = []
        self.segment.close()
        self.segment.unlink()
        self.arrays = None

    # -- requests ------------------------------------------------------------
    def _check_chunk(self, what: str, offset: int, count: int) -> None:
        """A user mistake in an INIT/GET_MASTER chunk: ValueError naming the fix."""
        if count > self.layout.staging_numel or offset + count > self.numel:
            raise ValueError(f"{what} chunk [{offset}, {offset + count}) does not fit: the shard has "
                             f"{self.numel} elements and the staging window {self.layout.staging_numel}; send "
                             f"chunks of at most staging_numel (HELLO_OK) within the shard")

    def init_chunk(self, offset: int, count: int) -> None:
        """master[offset:offset+count] = staging[:count]; chunks come in order from 0,
        and the one that reaches numel finishes INIT (state reset, weights16 cast)."""
        self._check_chunk("INIT", offset, count)
        if offset not in (0, self._init_next):
            raise ValueError(f"INIT chunks must come in order: expected offset {self._init_next} "
                             f"(or 0 to start over), got {offset}")
        # a partial master must never be stepped on: until the last chunk, STEP is refused
        self.phase = ShardState.UNINITIALIZED
        self.arrays.set_master(offset, self.staging[:count], self.weights16_slots, self.threads)
        self._init_next = offset + count
        if self._init_next < self.numel:
            return
        if self._state_dirty:
            self.arrays.clear_moments()
        # else np.zeros' pages are still untouched: the first update commits them,
        # after the worker has let go of its fp32 copy of the model
        self._state_dirty = False
        self._init_next = 0
        self.steps = 0
        self._write_weights16()
        self.progress[0] = 0  # step numbers restart: no old tag may match the next STEP
        self.phase = ShardState.READY

    @property
    def busy(self) -> bool:
        return self.phase is ShardState.UPDATING

    @property
    def initialized(self) -> bool:
        return self.phase is not ShardState.UNINITIALIZED

    def refusal(self, what: str) -> str | None:
        """Why the request `what` cannot run now (None: it can), for an E_ORDER reply."""
        if self.phase is ShardState.UPDATING:
            return f"{what} while step {self.steps + 1} is still updating; wait for its DONE first"
        if self.phase is ShardState.UNINITIALIZED:
            return (f"{what} before INIT: write the initial weights to staging and send INIT (or LOAD a "
                    f"checkpoint) first")
        return None

    def accept_step(self, msg: P.Step) -> tuple[str, str] | None:
        """Check a STEP against this shard; (error code, message) to refuse it, else
        None and the shard is UPDATING until finish_update."""
        if msg.step != self.steps + 1:
            return P.E_ORDER, (f"STEP {msg.step} out of order: the shard has done {self.steps} update(s), so "
                               f"the next is {self.steps + 1}")
        if msg.slot >= len(self.grads):
            return P.E_INVALID, (f"gradient slot {msg.slot} but HELLO asked for {len(self.grads)} slot(s): send "
                                 f"slot 0, or register with grad_slots=2")
        if msg.out_slot >= len(self.weights16_slots):
            return P.E_INVALID, (f"out_slot {msg.out_slot} but HELLO asked for {len(self.weights16_slots)} weight "
                                 f"slot(s): send out_slot 0, or register with weight_slots=2")
        if msg.predict and self.optimizer not in ("adamw", "adam"):
            return P.E_INVALID, f"predict is implemented for adam/adamw, not {self.optimizer}"
        if msg.predict and self.arrays.exact_master:
            return P.E_INVALID, ("predict with the exact master: the weights slot must hold the master's high "
                                 "half; register with exact_master=False to predict")
        if msg.groups and msg.groups[-1][0] + msg.groups[-1][1] != self.numel:
            return P.E_INVALID, (f"STEP's groups cover [0, {msg.groups[-1][0] + msg.groups[-1][1]}) but the shard has "
                                 f"{self.numel} elements: the groups' ranges must cover it")
        self.phase = ShardState.UPDATING
        return None

    def finish_update(self) -> None:
        assert self.phase is ShardState.UPDATING
        self.phase = ShardState.READY

    def skip(self, step: int) -> str | None:
        """SKIP: the step's gradients overflowed on some rank; the state stays as it
        is and only the count moves.  Returns why it is refused, or None."""
        if step != self.steps + 1:
            return f"SKIP {step} out of order: next step is {self.steps + 1}"
        self.skipped += 1
        return None

    def step(self, msg: P.Step) -> float:
        """Run one update from gradient slot msg.slot; returns seconds spent.  With param
        groups, one kernel call per group's range, front to back, each publishing its
        progress in shard coordinates (progress_base)."""
        self.hparams.update(msg.hparams)
        self.hparams["lr"] = msg.lr
        ranges = [(0, self.numel, self.hparams, msg.step)]
        if msg.groups:
            keys = P.GROUP_FIELDS[2:7]
            ranges = [(int(g[0]), int(g[0]) + int(g[1]), dict(zip(keys, g[2:7])), int(g[7])) for g in msg.groups]
            self.last_groups = msg.groups
        # the shared buffers are raw 16-bit words; the dtype keywords say fp16 or bf16
        gin, out = self.grads[msg.slot], self.weights16_slots[msg.out_slot]
        self._state_dirty = True
        t0 = time.perf_counter()
        if self.arrays.state_dtype == "int8":
            self._step_blocks(msg, ranges, gin)
        elif msg.reverse:
            # back to front, one progress block per call, each published as "done from the
            # end"; an elementwise update gives the same bytes in any order and split
            B = self.progress_block
            for lo, hi, h, updates in reversed(ranges):
                for b in range(hi, lo, -B):
                    a = max(lo, b - B)
                    self._update_range(msg, a, b, h, updates, gin, out, progress=False)
                    cpu_adam.store_progress(self.progress, tag=msg.step, done=self.numel - a)
        else:
            for lo, hi, h, updates in ranges:
                self._update_range(msg, lo, hi, h, updates, gin, out, progress=True)
        self.arrays.finish_step(msg.out_slot)
        dt = time.perf_counter() - t0
        self.steps = msg.step
        self.update_times.append(dt)
        if len(self.update_times) > 1024:
            del self.update_times[:512]
        self.bytes_read += self.bytes_per_update // 2    # 16-bit grad + fp32 state
        self.bytes_written += self.bytes_per_update // 2  # fp32 state + 16-bit weights
        return dt

    def _step_blocks(self, msg: P.Step, ranges: list, gin) -> None:
        """The int8 update: whole blocks, one kernel call for the shard (front to back,
        the kernel publishing its progress) or, reversed, one per progress block from
        the end; each call gets every range's hyper-parameters (None: kept)."""
        segs = [(lo, hi, None if updates == 0 else dict(h, updates=updates)) for lo, hi, h, updates in ranges]
        kw = dict(grad_dtype=self.dtype, out_dtype=self.dtype, grad_scale=msg.grad_scale, num_threads=self.threads,
                  predict=msg.predict)
        run = dict(step=msg.step, gin=gin, slots=self.weights16_slots, out_slot=msg.out_slot,
                   index_base=self.index_base)
        if not msg.reverse:
            kw.update(progress=self.progress, progress_tag=msg.step, progress_block=self.progress_block)
            self.arrays.update_blocks(0, self.numel, segs, kw=kw, **run)
            return
        B = -(-self.progress_block // P.QBLOCK)  # blocks per publication
        for k in range(-(-self.numel // P.QBLOCK), 0, -B):
            a, b = max(0, k - B) * P.QBLOCK, min(self.numel, k * P.QBLOCK)
            self.arrays.update_blocks(a, b, segs, kw=kw, **run)
            cpu_adam.store_progress(self.progress, tag=msg.step, done=self.numel - a)

    def _update_range(self, msg: P.Step, lo: int, hi: int, h: dict, updates: int, gin, out, *,
                      progress: bool) -> None:
        """Update shard elements [lo, hi) with hyper-parameters h at Adam step `updates`
        (0: no gradient, the range stays as it is); progress: the kernel publishes its
        blocks (front to back, in shard coordinates)."""
        if updates == 0:
            # no gradient this step (torch.optim skips a parameter whose .grad is None):
            # master and state stay as they are; the out slot may hold older weights
            # (two slots alternate), so it gets the master's 16 bits, then the progress
            self.arrays.keep_range(lo, hi, self.weights16_slots, msg.out_slot, self.dtype, self.threads)
            if progress:
                cpu_adam.store_progress(self.progress, tag=msg.step, done=hi)
            return
        # progress: weights16 is final block by block, front first; the worker copies
        # each block up as soon as it is published (and, with DPU, free on the device)
        kw = dict(grad_dtype=self.dtype, out_dtype=self.dtype, grad_scale=msg.grad_scale, num_threads=self.threads)
        if progress:
            kw.update(progress=self.progress, progress_tag=msg.step, progress_block=self.progress_block,
                      progress_base=lo)
        if msg.predict:  # the server refused it for optimizers other than adam/adamw
            kw["predict"] = msg.predict
        self.arrays.update_range(lo, hi, h, updates, step=msg.step, gin=gin, slots=self.weights16_slots,
                                 out_slot=msg.out_slot, index_base=self.index_base, kw=kw)

    @property
    def bytes_per_update(self) -> int:
        """Memory traffic of one update: 28 B/param for Adam, 20 for Adagrad and Lion (fp32
        state); 18 or 20 for Adam with bf16 state (optimizer_server.state)."""
        return self.arrays.bytes_per_update

    def master_to_staging(self, offset: int, count: int) -> None:
        self._check_chunk("GET_MASTER", offset, count)
        self.arrays.get_master(offset, self.staging[:count], self.weights16_slots)

    def stats(self) -> P.StatsOk:
        ut = self.update_times
        return P.StatsOk(steps=self.steps, skipped=self.skipped, last_update_s=ut[-1] if ut else 0.0,
                         mean_update_s=float(np.mean(ut)) if ut else 0.0, bytes_read=self.bytes_read,
                         bytes_written=self.bytes_written, threads=self.threads, simd=cpu_adam.simd_level())

    # -- checkpoints -----------------------------------------------------------
    def _paths(self, d: Path) -> tuple[Path, Path]:
        return (C.rank_file(d, C.SHARD, self.rank, self.world_size, ".bin"),
                C.rank_file(d, C.SHARD, self.rank, self.world_size, ".json"))

    def manifest(self) -> dict:
        return {"format": C.SHARD_FORMAT, "protocol_version": P.PROTOCOL_VERSION,
                "rank": self.rank, "world_size": self.world_size, "numel": self.numel,
                "dtype": self.dtype, "optimizer": self.optimizer, "hparams": self.hparams,
                "steps": self.steps, "skipped": self.skipped, "groups": self.last_groups,
                "arrays": self.arrays.names, "array_dtypes": self.arrays.dtypes}

    def save(self, directory: str) -> dict:
        """Write master + state atomically: tmp file, fsync, rename; the manifest,
        with the file's checksum (taken while writing), last."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        bin_path, man_path = self._paths(d)
        crc = 0

        def write(f):
            nonlocal crc
            crc = self.arrays.write_to(f, C.crc32_update, 0, self.weights16_slots)
        atomic_write(bin_path, write)
        man = dict(self.manifest(), checksum=C.checksum_str(crc))
        atomic_write_bytes(man_path, json.dumps(man, indent=1).encode())  # the manifest is last
        fsync_dir(d)
        return {"path": str(bin_path), "bytes": self.arrays.saved_bytes(), "steps": self.steps}

    def load(self, directory: str, out_slot: int = 0) -> dict:
        """Read this shard's range of a checkpoint, saved with this world size or
        another (optimizer_server.reshard): every rank's manifest must agree, and
        every file read must match its checksum, before any state is touched."""
        d = Path(directory)
        src = C.pick_world_size(d, C.SHARD, self.world_size)
        man_paths = [C.rank_file(d, C.SHARD, k, src, ".json") for k in range(src)]
        mans = []
        for path in man_paths:
            if not path.exists():
                raise ValueError(f"checkpoint {d} is incomplete: {path.name} is missing; load another "
                                 f"checkpoint (an earlier step-N beside it)")
            mans.append(json.loads(path.read_text()))
        mine = self.manifest()
        keys = ("format", "dtype", "optimizer", "arrays") + (("numel",) if src == self.world_size else ())
        for k, man in enumerate(mans):
            diff = {key: (man.get(key), mine[key]) for key in keys if man.get(key) != mine[key]}
            if man.get("numel") != mans[0].get("numel") or man.get("steps") != mans[0].get("steps"):
                diff["numel/steps across ranks"] = ((man.get("numel"), man.get("steps")),
                                                    (mans[0].get("numel"), mans[0].get("steps")))
            if diff:
                desc = ", ".join(f"{key}: checkpoint {a!r} vs this run {b!r}" for key, (a, b) in diff.items())
                raise ValueError(f"checkpoint {man_paths[k]} does not match this shard's layout ({desc})")
        per_file = int(mans[0]["numel"])
        saved_dtypes = mans[0].get("array_dtypes", {})  # absent: every array fp32 (older checkpoints)
        expect = ShardStateArrays.file_bytes(self.arrays.names, saved_dtypes, per_file)
        bins = [C.rank_file(d, C.SHARD, k, src, ".bin") for k in range(src)]
        lo = self.rank * self.numel
        if not 0 <= out_slot < len(self.weights16_slots):
            raise ValueError(f"LOAD's out_slot {out_slot} but the shard has {len(self.weights16_slots)} weights slot(s)")
        for k, path in enumerate(bins):
            size = path.stat().st_size if path.exists() else -1
            if size != expect:
                raise ValueError(f"checkpoint {path} has {size} bytes, expected {expect} (truncated?)")
            if k * per_file < lo + self.numel and lo < (k + 1) * per_file:  # a file this shard reads from
                C.verify(path, mans[k].get("checksum"))
        man = mans[0]
        # Straight into the state arrays: temporaries would double the server's
        # memory (12 B/param) exactly when resuming, the moment a job that fits
        # would OOM.  A read that fails midway leaves a mix, so the shard is marked
        # uninitialized and refuses STEP until a LOAD or INIT succeeds.
        self.phase = ShardState.UNINITIALIZED
        self._state_dirty = True
        try:
            self.arrays.read_from(bins, per_file, saved_dtypes, lo, self.weights16_slots, out_slot, self.threads)
        except OSError as e:
            raise OSError(f"reading checkpoint {d} failed ({e}); this shard's state is now partly "
                          f"overwritten: LOAD a good checkpoint (or INIT) before the next step") from e
        self.steps = int(man["steps"])
        self.skipped = int(man.get("skipped", 0))
        self.hparams.update(man.get("hparams", {}))
        self._init_next = 0
        self._write_weights16(out_slot)
        self.progress[0] = 0  # steps may repeat after a rollback: no old tag may match
        self.phase = ShardState.READY
        return {"steps": self.steps}
