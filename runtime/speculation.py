"""Speculation during backward (the exact strategies with "speculation"; expert.undo_log_bytes).

As backward completes gradient buckets front to back, the prefix of the shard whose
gradients are final in the host slot grows.  The first time it does, the engine sends
SPECULATE: the STEP it will send if no clip fires and nothing overflows, and how
far the gradients are final; after that it only stores how far in the shared ready
word (optimizer_server.shm), which the server follows: a message a bucket had cost
the worker's core a wake of ZeroMQ's I/O thread each (BENCHMARKS.md) and
the server's core a request.  The server updates that prefix at once, undo-logged
(optimizer_server.shard: SpeculativeUpdate), so the update runs inside backward.  step()
sends the real STEP as always; the server keeps the speculated part when the values
match and otherwise restores it and runs the whole update, so the result is bitwise
the synchronous one in every case, and this object only decides when to try.

Phases of one step (SpeculatorPhase):

    from      event                                          to
    any       begin(): the step's last backward starts       ARMED     (or IDLE: backing off; from
                                                                        ARMED/SENT: a step() that failed)
    ARMED     ready(upto): a first SPECULATE goes out        SENT
    SENT      ready(upto): the prefix grew, the ready word    SENT
                says so
    ARMED,    end(): the step was sent or skipped            IDLE
      SENT

Backing off: a rollback (the STEP did not match: a clip fired, an lr changed after
backward) or a skipped step (overflow) costs the speculated update, so after one the
next `backoff` steps do not speculate, doubling up to MAX_BACKOFF with every
rollback in a row and back to 0 after a step whose speculation was kept.  With
clip_grad_norm firing on every step this speculates on one step in MAX_BACKOFF + 1.
"""
from __future__ import annotations

import enum
import weakref
from typing import Callable

from .parts import SpeculationCycle, Tracing
from .stats import Counters

MAX_BACKOFF = 32  # steps without speculation after a run of rollbacks


def weak_method(method: Callable[[int], dict | None]) -> Callable[[int], dict | None]:
    """method (bound) without a strong reference to its object: None once the object is
    gone, which Speculator reads as "cannot be said".  The engine owns its speculator, so
    a bound method of the engine here would be a reference cycle, and the engine, with
    the user's model and its weights, would outlive its last reference until Python's
    cyclic collector happened to run (gigabytes at a billion parameters)."""
    ref = weakref.WeakMethod(method)

    def call(slot: int) -> dict | None:
        m = ref()
        return None if m is None else m(slot)
    return call


class SpeculatorPhase(enum.Enum):
    IDLE = "idle"
    ARMED = "armed"  # this step speculates once gradients land
    SENT = "sent"    # SPECULATE went out for [0, sent)


class Speculator:
    """expected(slot): the keyword arguments UpdateCycle.send would get for the coming
    step if no clip fires and nothing overflows (or None when that cannot be said);
    cycle: the update cycle (speculate)."""

    def __init__(self, cycle: SpeculationCycle, expected: Callable[[int], dict | None], *, tracer: Tracing,
                 counters: Counters):
        self.cycle, self.expected, self.tracer, self.counters = cycle, expected, tracer, counters
        self.phase = SpeculatorPhase.IDLE
        self.k = 0              # the update this step's STEP will carry
        self.slot = 0
        self.sent = 0           # SPECULATE said [0, sent) is final
        self._args: dict | None = None
        self.backoff = 0        # how many steps to skip after the last rollback
        self._skip_left = 0
        self._seen = (0, 0)     # (kept, rolled back) steps counted at the last begin()

    def begin(self, k: int, slot: int) -> None:
        """The last micro-batch's backward of update k starts; its gradients go to `slot`."""
        self.phase = SpeculatorPhase.IDLE
        c = self.counters
        kept, rolled = c.spec_kept_steps - self._seen[0], c.spec_rollback_steps - self._seen[1]
        self._seen = (c.spec_kept_steps, c.spec_rollback_steps)
        if rolled:  # the last speculation was undone (its DONE, or a SKIP, came since)
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self._skip_left = self.backoff
        elif kept:
            self.backoff = self._skip_left = 0
        self.k, self.slot, self.sent, self._args = k, slot, 0, None
        if self._skip_left > 0:
            self._skip_left -= 1
            return
        if self.cycle.can_speculate:
            self.phase = SpeculatorPhase.ARMED

    def ready(self, upto: int) -> None:
        """The gradients of shard elements [0, upto) are final in the slot."""
        if self.phase is SpeculatorPhase.IDLE or upto <= self.sent:
            return
        if self._args is None:
            self._args = self.expected(self.slot)
            if self._args is None:
                self.phase = SpeculatorPhase.IDLE
                return
            self.counters.spec_steps += 1
        if self.phase is SpeculatorPhase.SENT:
            self.cycle.announce(self.k, upto)
        else:
            with self.tracer.span("speculate_signal", step=self.k, upto=upto):
                self.cycle.speculate(self.k, upto=upto, **self._args)
        self.sent = upto
        self.phase = SpeculatorPhase.SENT

    def end(self, skipped: bool = False) -> None:
        """step() sent STEP k (the server settles the speculation), or skipped it (an
        overflow: SKIP rolled it back)."""
        if skipped and self.phase is SpeculatorPhase.SENT:
            self.counters.spec_rollback_steps += 1
        self.phase = SpeculatorPhase.IDLE
