"""The shard's speculation (Shard inherits it): SPECULATE, following the ready word,
the undo log or the twin, and settling at the STEP.

Speculation (SPECULATE, protocol v10): the worker says the gradients of [0, upto)
are final and sends the STEP it expects, assuming no clipping and no overflow.  The
update thread saves what an update of the next piece writes in the undo log
(optimizer_server.undo), then updates it with the assumed values; it stops where
the log is full.  The STEP settles it (``_settle``): if its values over the
speculated prefix equal the assumed ones (the same grad_scale, slots, prediction and
per-range hyper-parameters and step counts), the prefix is kept and only the rest is
updated; otherwise the log is restored and the whole STEP runs.  Either way the
bytes are those of a STEP alone: the update is elementwise (int8: blockwise, and the
speculated prefix ends on a block), so splitting it changes nothing.  After the
step's first SPECULATE the update thread follows the worker's ready word (``follow``,
protocol v11) and speculates each piece as its gradients land, until the STEP.

The twin (Adam/AdamW with fp32 state or bf16 state and the exact master, and
undo_log_bytes for the whole update): the
pieces write the new state out of place into a twin of the state and the log saves
only the out weights slot.  A kept STEP updates the rest into the twin as well and
flips (the twin becomes the state); a rolled-back one restores the weights slot and
updates in place, since the state itself was never written.  Saving the state into
the log had cost more than the update of those elements (BENCHMARKS.md).
"""
from __future__ import annotations

import time

from zero_offload.kernels import cpu_adam

from . import protocol as P
from .shard_phase import ShardPhase
from .undo import UndoLog


class SpeculativeUpdate:
    """What the shard speculated for one step: the assumed STEP's values, how far
    pieces were queued (socket thread) and done (update thread)."""

    def __init__(self, msg: P.Speculate, key: tuple):
        self.msg = msg
        self.key = key      # Shard._step_key of the assumption (its step number first)
        self.queued = 0     # [0, queued) handed to the update thread
        self.done = 0       # [0, done) updated, its old bytes in the undo log
        self.full = False   # the undo log could not take the next piece: no more this step
        self.closed = False  # the STEP came: pieces not yet started are left to it (set by the socket thread)


# A speculative piece is saved and updated in sub-pieces of this many elements (whole
# int8 blocks): 3.5 MiB of fp32 state's writes, well inside a last-level cache.
SPEC_SUBPIECE = 1 << 18
assert SPEC_SUBPIECE % P.QBLOCK == 0

# follow()'s longest sleep between looks at the ready word: a bucket of a large model's
# CPU backward can take seconds, and a look every 0.1 ms through it would wake the
# server's core ten thousand times a second for nothing
MAX_READY_POLL_S = 0.001


class ShardSpeculation:
    """accept_speculation / follow / speculate / rollback / _settle of Shard."""

    def accept_speculation(self, msg: P.Speculate) -> list[tuple[int, int]] | str | None:
        """Socket thread: the range [a, b) of a usable SPECULATE to hand to the update
        thread, as one item: [(a, b)] (the update thread walks it a speculation_piece at
        a time, so that a STEP waits for one piece at most; a list of pieces made here
        cost the socket thread a tuple and a future per piece: with a tiny progress block
        one SPECULATE stalled every other client), None if it adds nothing, or why it is
        dropped."""
        if self.undo is None:
            return "this shard has no undo log (HELLO.undo_log_bytes = 0)"
        if self.phase not in (ShardPhase.READY, ShardPhase.SPECULATING):
            return f"SPECULATE while the shard is {self.phase.value}"
        refused = self._step_refusal(msg)
        if refused is not None:
            return refused[1]
        key = self._step_key(msg)
        if self.speculative is None:
            self.speculative = SpeculativeUpdate(msg, key)
            self.phase = ShardPhase.SPECULATING
        elif self.speculative.key != key:
            return "SPECULATE's assumption differs from the one this step already speculated on"
        b = self._block_floor(min(msg.upto, self.numel))
        a = self.speculative.queued
        if b <= a or self.speculative.full:
            return None
        self.speculative.queued = b
        return [(a, b)]

    def speculate_range(self, a: int, b: int, run=None) -> None:
        """Update thread: [a, b) a speculation_piece at a time, until a piece does not
        advance (the STEP came, another request closed it, or the undo log is full).
        run(a, b): speculate one piece (default: ``speculate``; the server traces it)."""
        run = run or self.speculate
        piece = self.speculation_piece
        for x in range(a, b, piece):
            run(x, min(b, x + piece))  # (it returns at once where the speculation is over)
            sp = self.speculative
            if sp is None or sp.done != min(b, x + piece):
                return

    @property
    def speculation_piece(self) -> int:
        """A speculative piece's length: a progress block (int8: whole blocks)."""
        if self.arrays.state_dtype == "int8":
            return max(P.QBLOCK, self._block_floor(self.progress_block))
        return self.progress_block

    def follow(self, step: int, *, poll_s: float, idle_s: float, run=None) -> None:
        """Update thread, queued after the pieces of a step's first SPECULATE: speculate
        on as the worker's ready word says more gradients are final (tag `step`), a piece
        at a time, until the STEP or any other request closes the speculation, the undo
        log is full, the shard is done, or idle_s pass with nothing new (the worker
        stopped short: its STEP does the rest).  Sleeps poll_s between looks, doubling
        up to MAX_READY_POLL_S while nothing new comes (a long backward polls less).
        run(a, b): speculate one piece (default: ``speculate``; the server traces it)."""
        run = run or self.speculate
        sp = self.speculative
        last = time.monotonic()
        delay = poll_s
        while sp is self.speculative and sp is not None and not (sp.closed or sp.full) and sp.done < self.numel:
            said = self._block_floor(min(self.numel, cpu_adam.load_progress(self.ready, tag=step)))
            upto = max(said, sp.queued)  # a later SPECULATE still counts
            if upto > sp.done:
                a = sp.done
                run(a, min(upto, a + self.speculation_piece))
                if sp.done == a:  # it did not fit the log (full) or was closed meanwhile
                    return
                last, delay = time.monotonic(), poll_s
            elif time.monotonic() - last > idle_s:
                return
            else:
                time.sleep(delay)
                delay = min(2 * delay, max(poll_s, MAX_READY_POLL_S))

    def _block_floor(self, b: int) -> int:
        """int8: b rounded down to a whole block (a block's scale depends on all of it),
        unless it is the shard's end; other state dtypes: b."""
        if self.arrays.state_dtype == "int8" and b < self.numel:
            return b - b % P.QBLOCK
        return b

    def stop_following(self) -> None:
        """Socket thread: a request other than SPECULATE came (or the worker is gone), so
        ``follow`` returns after its piece and queued pieces do nothing."""
        if self.speculative is not None:
            self.speculative.closed = True

    def drop_speculation(self, why: str) -> None:
        self.speculate_dropped += 1
        self.last_drop_reason = why

    def speculate(self, a: int, b: int) -> None:
        """Update thread: update [a, b) with the assumed values, its old bytes saved first;
        as much of it as the undo log holds (whole blocks with int8)."""
        sp = self.speculative
        if sp is None or sp.full or sp.closed or a != sp.done:
            return  # settled meanwhile, the STEP is here, or an earlier piece did not fit
        per = UndoLog.nbytes(self.arrays.update_writes(a, b, self.weights16_slots, sp.msg.weights_slot)) / (b - a)
        room = int((self.undo.capacity - self.undo.used) / per) if per else b - a
        if room < b - a:  # as much as the log holds, and no more pieces this step
            sp.full = True
            b = self._block_floor(a + room)
            if b <= a:
                return
        writes = self.arrays.update_writes(a, b, self.weights16_slots, sp.msg.weights_slot)
        if not self.undo.fits(writes):
            sp.full = True  # the int8 scales' rounding: the cut piece's bytes did not fit after all
            return
        self.undo.prefault()
        self.arrays.prefault_twin()
        self._state_dirty = True
        ranges = self._ranges(sp.msg, persist=False)
        twin = self.arrays.twin is not None
        # saved and updated a sub-piece at a time: the save reads what the update reads
        # next, so a sub-piece that fits the last-level cache is read from memory once
        # (with nothing to save, the twin with two weights slots, one kernel call)
        sub = SPEC_SUBPIECE if writes else b - a
        for x in range(a, b, sub):
            y = min(b, x + sub)
            saved = self.undo.save(self.arrays.update_writes(x, y, self.weights16_slots, sp.msg.weights_slot))
            assert saved, "the piece's bytes fit, so each of its sub-pieces does"
            self._run(sp.msg, ranges, x, y, progress=False, twin=twin)
        sp.done = b

    def rollback(self) -> int:
        """Update thread: undo what was speculated (before a request that reads or replaces
        the state); returns the elements restored."""
        sp, self.speculative = self.speculative, None
        if self.phase is ShardPhase.SPECULATING:
            self.phase = ShardPhase.READY
        if sp is None:
            return 0
        self.undo.restore()
        return sp.done

    def _settle(self, msg: P.Step) -> int:
        """Update thread, at a STEP: elements [0, start) already hold its result (kept from
        speculation), or the speculation is rolled back and start is 0."""
        sp, self.speculative = self.speculative, None
        self.last_speculated = self.last_rolled_back = 0
        if sp is None or sp.done == 0:
            if sp is not None:
                self.undo.clear()
            return 0
        if self._clipped_key(sp.key, sp.done) == self._clipped_key(self._step_key(msg), sp.done):
            self.undo.clear()
            self.last_speculated = sp.done
            return sp.done
        t0 = time.perf_counter_ns()
        self.undo.restore()
        self.last_rollback_ns = (t0, time.perf_counter_ns())
        self.last_rolled_back = sp.done
        return 0

    def _step_key(self, msg: P.Step) -> tuple:
        """Everything of a STEP that decides the bytes an update writes, per range."""
        return (msg.step, msg.grad_slot, msg.weights_slot, msg.grad_scale, msg.predict,
                tuple((lo, hi, tuple(sorted(h.items())), updates) for lo, hi, h, updates in self._ranges(msg, persist=False)))

    @staticmethod
    def _clipped_key(key: tuple, n: int) -> tuple:
        """The key over elements [0, n) only (what was speculated)."""
        return key[:5] + (tuple((lo, min(hi, n), h, u) for lo, hi, h, u in key[5] if lo < n),)
