"""Where a training step is between the engine's calls (what were seven booleans).

Phases (StepPhase) and the events that move between them (next_phase):

    from                 event                                     to
    IDLE, ACCUMULATING   backward: engine.backward(loss) returned  GRADS_READY (the step's last micro-batch)
                                                                   ACCUMULATING (an earlier one)
    IDLE, ACCUMULATING   pass_begins: the first gradient hook of   IN_BACKWARD
                           a loss.backward() (backward_mode hooks)
    IN_BACKWARD          pass_ends: autograd's end-of-backward     GRADS_READY (the last micro-batch)
                           callback                                ACCUMULATING (an earlier one)
    GRADS_READY          step: engine.step()                       IDLE
    IDLE, ACCUMULATING   restore: load_checkpoint set the count    IDLE (a whole number of steps)
                           of micro-batches                        ACCUMULATING (some of one)
    any                  close                                     CLOSED

Anything else is a caller's error, which the engine reports before asking (a second
backward before step(), step() before backward(), ...); next_phase raises
AssertionError for it, naming the phase and the event.  A backward that raises
midway leaves the phase where it was: the next one starts the micro-batch again.
"""
from __future__ import annotations

import enum


class StepPhase(enum.Enum):
    IDLE = "idle"                  # between steps: no micro-batch of the coming step has run
    ACCUMULATING = "accumulating"  # earlier micro-batches' gradients sum in .grad; the last one is to come
    IN_BACKWARD = "in_backward"    # backward_mode "hooks": a loss.backward() is running
    GRADS_READY = "grads_ready"    # the last micro-batch's gradients are on their way down: step() may run
    CLOSED = "closed"


_OPEN = (StepPhase.IDLE, StepPhase.ACCUMULATING)
# (phase, event) -> (to on the step's last micro-batch, to on an earlier one)
TRANSITIONS: dict[tuple[StepPhase, str], tuple[StepPhase, StepPhase]] = {
    **{(p, "backward"): (StepPhase.GRADS_READY, StepPhase.ACCUMULATING) for p in _OPEN},
    **{(p, "pass_begins"): (StepPhase.IN_BACKWARD, StepPhase.IN_BACKWARD) for p in _OPEN},
    (StepPhase.IN_BACKWARD, "pass_ends"): (StepPhase.GRADS_READY, StepPhase.ACCUMULATING),
    (StepPhase.GRADS_READY, "step"): (StepPhase.IDLE, StepPhase.IDLE),
    **{(p, "restore"): (StepPhase.IDLE, StepPhase.ACCUMULATING) for p in _OPEN},
    **{(p, "close"): (StepPhase.CLOSED, StepPhase.CLOSED) for p in StepPhase},
}


def next_phase(phase: StepPhase, event: str, final: bool = True) -> StepPhase:
    """The phase after `event` (final: it concerns the step's last micro-batch)."""
    to = TRANSITIONS.get((phase, event))
    assert to is not None, f"step state: {event!r} in phase {phase.value!r}"
    return to[0] if final else to[1]
