"""One worker's shard on the server: fp32 master, optimizer state, its segment.

The master weights and m/v live in the server's private memory; only the
gradients and the 16-bit weights are shared (optimizer_server.shm).  The update
runs on a thread of its own (the kernel releases the GIL), so the methods that
touch state are called either from that thread (step, speculate, rollback) or
from the socket thread while the shard is READY (init, get_master, save, load):
the state is the lock.

Its phases (ShardPhase) and what moves between them: optimizer_server.shard_phase.

Only READY takes STEP, SKIP, GET_MASTER and SAVE (SPECULATING too, settled first);
UPDATING takes nothing but HEARTBEAT and STATS (the server answers the rest with
E_ORDER, and drops a SPECULATE).  INIT, LOAD, GET_MASTER and SAVE also run on the
update thread (``working`` names the one running; the shard is busy meanwhile), so
the socket thread answers heartbeats and other workers however long they take.

Saving and loading: optimizer_server.shard_checkpoint; speculation and its twin:
optimizer_server.shard_speculation (the Shard inherits both).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from zero_offload.kernels import cpu_adam

from . import protocol as P
from .ckpt_io import SAVE_CHUNK, BufferPool, SaveJob
from .shm import Segment, ShardLayout
from .shard_checkpoint import ShardCheckpoint
from .shard_phase import ShardPhase
from .shard_speculation import ShardSpeculation, SpeculativeUpdate
from .state import ShardStateArrays
from .undo import UndoLog

log = logging.getLogger("optimizer_server")


DEFAULT_HPARAMS = {
    "adamw": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
    "adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
    "adagrad": dict(lr=1e-2, beta1=0.0, beta2=0.0, eps=1e-10, weight_decay=0.0),
    "lion": dict(lr=1e-4, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0),
}


def _chunk_starts(lo: int, hi: int) -> list[int]:
    """Where [lo, hi) is cut on the save's chunk grid (ckpt_io.SAVE_CHUNK)."""
    return [lo] + list(range(_chunk_end(lo), hi, SAVE_CHUNK))


def _chunk_end(a: int) -> int:
    return (a // SAVE_CHUNK + 1) * SAVE_CHUNK


class Shard(ShardSpeculation, ShardCheckpoint):
    """State of one registered worker.  Created on HELLO, freed on BYE or drop."""

    def __init__(self, session: str, hello: P.Hello, segment: Segment, layout: ShardLayout, threads: int, *,
                 save_max_bytes_per_s: float = 0.0):
        self.session = session
        self.save_max_bytes_per_s = save_max_bytes_per_s  # ServerConfig's cap on a save's writes
        self.save_pool = BufferPool()  # the save jobs' chunk buffers, kept between saves (ckpt_io)
        self.save_note = ""  # why the newest background save took no snapshot ("" if it did)
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
        self.ready = segment.array(np.uint64, self.layout.ready_offset, 1)  # the worker writes it
        self.progress_block = hello.progress_block or P.DEFAULT_PROGRESS_BLOCK
        self.updates = 0
        self.skipped = 0
        self.phase = ShardPhase.UNINITIALIZED
        self.working: str | None = None  # INIT/LOAD/GET_MASTER/SAVE running on the update thread
        self.save_job: SaveJob | None = None  # the newest save (maybe still being written)
        self.save_seq = 0          # saves started (HEARTBEAT_OK.save_seq)
        self._io_done = 0          # bytes of earlier save jobs (work_done's past)
        self._load_bytes = 0       # bytes LOAD has read
        self._state_dirty = False  # m/v hold something other than zeros (a step or LOAD ran)
        self._init_next = 0        # INIT chunks arrive in order: the offset the next must have
        self.last_groups: list = []  # the param groups of the last STEP (saved in the manifest)
        self.drop_reason: str | None = None  # set when its worker died mid-update
        self.last_seen = time.monotonic()
        self.update_times: list[float] = []
        self.bytes_read = 0
        self.bytes_written = 0
        # a step saves each element once at most: a log larger than what one whole update
        # overwrites would only hold pages nothing uses (the update of a STEP that writes the
        # slot the worker does not compute with: the other one of two)
        out = 1 if len(self.weights16_slots) > 1 else 0
        whole = UndoLog.nbytes(self.arrays.update_writes(0, n, self.weights16_slots, out))
        if hello.undo_log_bytes >= whole and self.arrays.can_twin:
            # room for all of it, and a kernel that updates out of place: speculation writes
            # the new state into a twin of it (12 B/param with fp32 state, 6 with bf16): a
            # rollback restores no state, and a piece moves about the bytes of a plain update
            # (saving the state into the log had cost more than updating it).  The log keeps
            # the weights slot (2) only where there is one (update_writes)
            self.arrays.make_twin()
            whole = UndoLog.nbytes(self.arrays.update_writes(0, n, self.weights16_slots, out))
        self.undo = UndoLog(min(hello.undo_log_bytes, whole)) if hello.undo_log_bytes else None
        self.speculative: SpeculativeUpdate | None = None
        self.speculate_dropped = 0
        self.last_drop_reason = ""
        self.last_speculated = 0   # the last STEP's: elements kept from speculation
        self.last_rolled_back = 0  # ... and elements restored and redone
        self.last_rollback_ns = (0, 0)  # when the last STEP's restore ran (perf_counter_ns), for the trace

    # -- helpers ---------------------------------------------------------------
    def _write_weights16(self, slot: int = 0) -> None:
        self.arrays.write_weights(self.weights16_slots, self.dtype, self.threads, slot)

    def close(self) -> None:
        """Drop views, unmap and unlink the segment (the server created it); a save still
        being written is cancelled first (its writers read the segment)."""
        if self.save_job is not None and not self.save_job.done:
            self.save_job.cancel()
        self.save_pool.clear()
        self.grads = []
        self.weights16 = self.staging = self.progress = self.ready = None
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
        self._await_save()
        if offset not in (0, self._init_next):
            raise ValueError(f"INIT chunks must come in order: expected offset {self._init_next} "
                             f"(or 0 to start over), got {offset}")
        # a partial master must never be stepped on: until the last chunk, STEP is refused
        self.phase = ShardPhase.UNINITIALIZED
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
        self.updates = 0
        self._write_weights16()
        self.progress[0] = 0  # step numbers restart: no old tag may match the next STEP
        self.phase = ShardPhase.READY

    def release_twin(self) -> int:
        """RELEASE_TWIN (nothing in flight, no speculation open: the server checked): drop
        the twin and the undo log; later SPECULATEs are dropped (no undo log).  Returns
        the bytes let go of (pages never touched count too: they were granted)."""
        n = 0
        if self.arrays.twin is not None:
            n += sum(a.nbytes for a in self.arrays.twin.values())
            self.arrays.twin = None
        if self.undo is not None:
            n += self.undo.capacity
            self.undo = None
        return n

    @property
    def busy(self) -> bool:
        return self.phase is ShardPhase.UPDATING or self.working is not None

    @property
    def work_done(self) -> int:
        """A count that grows while this shard's long requests move data: checkpoint
        bytes written and updates done (HEARTBEAT_OK.work: a waiting client's sign of
        progress)."""
        job = self.save_job
        return self._io_done + (job.bytes_done if job is not None else 0) + self.updates + self._load_bytes

    @property
    def initialized(self) -> bool:
        return self.phase is not ShardPhase.UNINITIALIZED

    def refusal(self, what: str) -> str | None:
        """Why the request `what` cannot run now (None: it can), for an E_ORDER reply."""
        if self.phase is ShardPhase.UPDATING:
            return f"{what} while step {self.updates + 1} is still updating; wait for its DONE first"
        if self.working is not None:
            return f"{what} while {self.working} is still running; wait for its reply first"
        if self.phase is ShardPhase.UNINITIALIZED:
            return (f"{what} before INIT: write the initial weights to staging and send INIT (or LOAD a "
                    f"checkpoint) first")
        return None

    @property
    def speculating(self) -> bool:
        return self.phase is ShardPhase.SPECULATING

    def accept_step(self, msg: P.Step) -> tuple[str, str] | None:
        """Check a STEP against this shard; (error code, message) to refuse it, else
        None and the shard is UPDATING until finish_update."""
        refused = self._step_refusal(msg)
        if refused is not None:
            return refused
        if self.speculative is not None:
            # speculative pieces still queued would only delay the STEP's own update, which
            # publishes its progress as it goes (the pieces do not): they are left to it
            self.speculative.closed = True
        self.phase = ShardPhase.UPDATING
        return None

    def _step_refusal(self, msg: P.Step) -> tuple[str, str] | None:
        if msg.step != self.updates + 1:
            return P.E_ORDER, (f"STEP {msg.step} out of order: the shard has done {self.updates} update(s), so "
                               f"the next is {self.updates + 1}")
        if msg.grad_slot >= len(self.grads):
            return P.E_INVALID, (f"gradient slot {msg.grad_slot} but HELLO asked for {len(self.grads)} slot(s): send "
                                 f"slot 0, or register with grad_slots=2")
        if msg.weights_slot >= len(self.weights16_slots):
            return P.E_INVALID, (f"weights_slot {msg.weights_slot} but HELLO asked for {len(self.weights16_slots)} weight "
                                 f"slot(s): send weights_slot 0, or register with weights_slots=2")
        if msg.predict and self.optimizer not in ("adamw", "adam"):
            return P.E_INVALID, f"predict is implemented for adam/adamw, not {self.optimizer}"
        if msg.predict and self.arrays.exact_master:
            return P.E_INVALID, ("predict with the exact master: the weights slot must hold the master's high "
                                 "half; register with exact_master=False to predict")
        if msg.groups and msg.groups[-1][0] + msg.groups[-1][1] != self.numel:
            return P.E_INVALID, (f"STEP's groups cover [0, {msg.groups[-1][0] + msg.groups[-1][1]}) but the shard has "
                                 f"{self.numel} elements: the groups' ranges must cover it")
        return None

    def finish_update(self) -> None:
        assert self.phase is ShardPhase.UPDATING
        self.phase = ShardPhase.READY

    def skip(self, step: int) -> str | None:
        """SKIP: the step's gradients overflowed on some rank; the state stays as it
        is and only the count moves.  Returns why it is refused, or None."""
        if step != self.updates + 1:
            return f"SKIP {step} out of order: next step is {self.updates + 1}"
        self.skipped += 1
        return None

    def _ranges(self, msg: P.Step, *, persist: bool) -> list:
        """(lo, hi, hparams, updates) per range of the shard.  persist: the STEP's values
        become the shard's (saved in the manifest); a speculation leaves them alone."""
        h = dict(self.hparams)
        h.update(msg.hparams)
        h["lr"] = msg.lr
        if persist:
            self.hparams = h
        if not msg.groups:
            return [(0, self.numel, h, msg.step)]
        if persist:
            self.last_groups = msg.groups
        keys = P.GROUP_FIELDS[2:7]
        return [(int(g[0]), int(g[0]) + int(g[1]), dict(zip(keys, g[2:7])), int(g[7])) for g in msg.groups]

    def step(self, msg: P.Step) -> float:
        """Run one update from gradient slot msg.grad_slot; returns seconds spent.  With param
        groups, one kernel call per group's range, front to back, each publishing its
        progress in shard coordinates (progress_base).  What a speculation already did
        for this STEP is kept (``_settle``)."""
        ranges = self._ranges(msg, persist=True)
        self._state_dirty = True
        t0 = time.perf_counter()
        start = self._settle(msg)
        # with the twin, a kept speculation's prefix is in the twin: the rest goes there too,
        # then the twin becomes the state (rolled back, the state was never touched)
        twin = start > 0 and self.arrays.twin is not None
        self._run(msg, ranges, start, self.numel, progress=True, twin=twin)
        if twin:
            self.arrays.flip()
        self.arrays.finish_step(msg.weights_slot)
        dt = time.perf_counter() - t0
        self.updates = msg.step
        self.update_times.append(dt)
        if len(self.update_times) > 1024:
            del self.update_times[:512]
        self.bytes_read += self.bytes_per_update // 2    # 16-bit grad + fp32 state
        self.bytes_written += self.bytes_per_update // 2  # fp32 state + 16-bit weights
        return dt

    def _run(self, msg: P.Step, ranges: list, lo: int, hi: int, *, progress: bool, twin: bool = False) -> None:
        """Update shard elements [lo, hi) (the whole shard, the part a speculation left, or a
        speculative piece).  progress: publish as the STEP's order says; a reversed STEP
        that starts past 0 publishes the speculated prefix with its last block.  twin: the
        new state goes into the state's twin (ShardStateArrays.make_twin)."""
        ranges = [(max(a, lo), min(b, hi), h, u) for a, b, h, u in ranges if a < hi and b > lo]
        # the shared buffers are raw 16-bit words; the dtype keywords say fp16 or bf16
        gin, out = self.grads[msg.grad_slot], self.weights16_slots[msg.weights_slot]
        if self.arrays.state_dtype == "int8":
            assert not twin, "int8 state has no twin (can_twin)"
            self._step_blocks(msg, ranges, gin, lo, hi, progress)
        elif msg.reverse and progress:
            # back to front, one progress block per call, each published as "done from the
            # end"; an elementwise update gives the same bytes in any order and split
            B = self.progress_block
            for a0, b0, h, updates in reversed(ranges):
                for b in range(b0, a0, -B):
                    a = max(a0, b - B)
                    self._update_range(msg, a, b, h, updates, gin, out, progress=False, twin=twin)
                    cpu_adam.store_progress(self.progress, tag=msg.step, done=self.numel - a)
        else:
            for a, b, h, updates in ranges:
                self._update_range(msg, a, b, h, updates, gin, out, progress=progress, twin=twin)
        if progress and msg.reverse and lo > 0:
            cpu_adam.store_progress(self.progress, tag=msg.step, done=self.numel)
        elif progress and not msg.reverse and lo > 0 and lo == hi:
            cpu_adam.store_progress(self.progress, tag=msg.step, done=hi)  # all of it was speculated

    def _step_blocks(self, msg: P.Step, ranges: list, gin, lo: int, hi: int, progress: bool) -> None:
        """The int8 update of whole blocks [lo, hi): one kernel call (front to back, the
        kernel publishing its progress) or, reversed, one per progress block from the
        end; each call gets every range's hyper-parameters (None: kept)."""
        groups = [(a, b, None if updates == 0 else dict(h, updates=updates)) for a, b, h, updates in ranges]
        kw = dict(grad_dtype=self.dtype, out_dtype=self.dtype, grad_scale=msg.grad_scale, num_threads=self.threads)
        if msg.predict:  # the server refused it for optimizers other than adam/adamw
            kw["predict"] = msg.predict
        run = dict(step=msg.step, gin=gin, slots=self.weights16_slots, weights_slot=msg.weights_slot,
                   index_base=self.index_base)
        if hi <= lo:
            return
        if not (msg.reverse and progress):
            # one kernel call, or one per save chunk while a save is being written (the guard);
            # the cut is decided once: a save that ends midway must not change the pieces
            saving = self.saving
            for a in (_chunk_starts(lo, hi) if saving else [lo]):
                b = min(hi, _chunk_end(a)) if saving else hi
                self._guard(a, b)
                if progress:
                    kw.update(progress=self.progress, progress_tag=msg.step, progress_block=self.progress_block,
                              progress_base=a)
                self.arrays.update_blocks(a, b, groups, kw=kw, **run)
            return
        B = -(-self.progress_block // P.QBLOCK)  # blocks per publication
        first = lo // P.QBLOCK
        for k in range(-(-hi // P.QBLOCK), first, -B):
            a, b = max(first, k - B) * P.QBLOCK, min(hi, k * P.QBLOCK)
            self._guard(a, b)
            self.arrays.update_blocks(a, b, groups, kw=kw, **run)
            cpu_adam.store_progress(self.progress, tag=msg.step, done=self.numel - a)

    def _update_range(self, msg: P.Step, lo: int, hi: int, h: dict, updates: int, gin, out, *,
                      progress: bool, twin: bool = False) -> None:
        """Update shard elements [lo, hi) with hyper-parameters h at Adam step `updates`
        (0: no gradient, the range stays as it is); progress: the kernel publishes its
        blocks (front to back, in shard coordinates)."""
        if self.saving and hi - lo > SAVE_CHUNK:
            # a save is being written: go a save chunk at a time, so the update waits for
            # (or writes) only the chunk it is about to overwrite, and chases the writers
            for a in _chunk_starts(lo, hi):
                self._update_range(msg, a, min(hi, _chunk_end(a)), h, updates, gin, out, progress=progress,
                                   twin=twin)
            return
        self._guard(lo, hi)
        if updates == 0:
            # no gradient this step (torch.optim skips a parameter whose .grad is None):
            # master and state stay as they are; the out slot may hold older weights
            # (two slots alternate), so it gets the master's 16 bits, then the progress
            self.arrays.keep_range(lo, hi, self.weights16_slots, msg.weights_slot, self.dtype, self.threads, twin=twin)
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
                                 weights_slot=msg.weights_slot, index_base=self.index_base, kw=kw, twin=twin)

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
        return P.StatsOk(updates=self.updates, skipped=self.skipped, last_update_s=ut[-1] if ut else 0.0,
                         mean_update_s=float(np.mean(ut)) if ut else 0.0, bytes_read=self.bytes_read,
                         bytes_written=self.bytes_written, threads=self.threads, simd=cpu_adam.simd_level(),
                         speculate_dropped=self.speculate_dropped, last_drop_reason=self.last_drop_reason,
                         speculated=self.speculative.done if self.speculative is not None else 0,
                         state_dtype=self.arrays.state_dtype, state_bytes=self.arrays.state_bytes)
