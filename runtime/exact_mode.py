"""mode="exact": the engine picks how to hide the CPU update, by measuring it.

Every strategy gives the bits of the synchronous engine (the server runs the same
update on the same gradients; only when it starts and how its weights reach the
device differ), so the engine may change strategy between any two steps:

    sync                         step() waits for the update and copies the weights up
    overlap_update               the update runs during the next forward (runtime.overlap);
                                 one rank: with several, the all-gather lands it in step()
    speculation                  it starts during backward, undo-logged (runtime.speculation);
                                 host RAM: the state's twin (12 B/param with fp32 state)
    overlap_update+speculation   both

Which is fastest depends on the model, and guessing goes wrong: on a model that is
mostly one embedding table, whose gradient (nearly all of the model) arrives last in
backward, speculation has almost nothing to start early while its twin slows every
update (1.5x slower than sync on this repository's AVX2 machine, BENCHMARKS.md); on a
model whose update outlasts its forward, overlap hides most of it.  So the engine runs
each candidate for a few steps and keeps the fastest.

What a step's time is: from one step() to the next.  That interval holds step k's own
work (sync: the wait), the next forward (overlap: its waits) and the next backward
(speculation: what it starts), so it belongs to one strategy only when steps k and
k+1 used the same one; intervals that straddle a change, or follow a skipped step (no
update), are not counted.  `per_candidate` steps per candidate give per_candidate - 1
intervals; the median of them is the candidate's time.

Phases (PickPhase) and what moves between them (step_ends(), which every rank calls at
the same iterations, so ranks agree; their medians are combined by `agree`, the
largest of each: a step is as slow as its slowest rank):

    from     event                                                      to
    WARMUP   iteration `warmup` ends                                    TRIAL (the first candidate)
    TRIAL    a candidate's per_candidate steps end, candidates left     TRIAL (the next one)
    TRIAL    the last candidate's steps end                             PICKED (decide(): the fastest)
    PICKED   a check (every check_every steps) finds the recent median  TRIAL (the first candidate)
               more than DRIFT away from the pick's trial median
    PICKED   (not speculation while it is a candidate: the engine gives   PICKED (speculation no
               the twin's RAM back, drop_speculation)                       candidate any more)
    FIXED    (one candidate: forced, or nothing to choose from)         FIXED
"""
from __future__ import annotations

import enum
import logging
import statistics
from collections import deque
from typing import Callable

log = logging.getLogger("zero_offload")

SYNC = "sync"
OVERLAP = "overlap_update"
SPECULATION = "speculation"
OVERLAP_SPECULATION = "overlap_update+speculation"
STRATEGIES = (SYNC, OVERLAP, SPECULATION, OVERLAP_SPECULATION)  # simplest first

# Candidates within this fraction of the fastest count as as fast: the simplest of them
# is kept (less host RAM, fewer moving parts).  Step times on a quiet machine vary by a
# few percent from one step to the next.
TIE = 0.03
# A step time this far (relative) from the pick's trial median sends the engine back to
# the trial: the model, the batch or the machine changed under it.
DRIFT = 0.3


def strategy_of(overlap: bool, speculate: bool) -> str:
    """The strategy that overlaps and/or speculates as asked (neither: sync)."""
    return {(False, False): SYNC, (True, False): OVERLAP, (False, True): SPECULATION,
            (True, True): OVERLAP_SPECULATION}[(bool(overlap), bool(speculate))]


def overlaps(strategy: str) -> bool:
    return strategy.startswith(OVERLAP)


def speculates(strategy: str) -> bool:
    return strategy.endswith(SPECULATION)


def candidates(*, world_size: int, overlap_ok: bool, speculation_ok: bool) -> list[str]:
    """What "auto" chooses among, simplest first.  overlap_update only on one rank (with
    several it overlaps nothing) and where the model's own forward runs its hooks;
    speculation only where its host RAM was granted."""
    out = [SYNC]
    overlap = world_size == 1 and overlap_ok
    if overlap:
        out.append(OVERLAP)
    if speculation_ok:
        out.append(OVERLAP_SPECULATION if overlap else SPECULATION)
    return out


def decide(medians: dict[str, float], order: list[str], tie: float = TIE) -> tuple[str, str]:
    """The strategy to keep and why: the simplest (first in `order`) whose median step
    time is within `tie` of the fastest's."""
    best = min(medians.values())
    pick = next(s for s in order if s in medians and medians[s] <= best * (1.0 + tie))
    times = ", ".join(f"{s} {medians[s] * 1e3:.1f} ms" for s in order if s in medians)
    fastest = min(medians, key=medians.get)
    why = (f"median step time {times}: {pick} is the fastest" if pick == fastest else
           f"median step time {times}: {pick} is within {tie:.0%} of the fastest ({fastest}) and simpler")
    return pick, why


class PickPhase(enum.Enum):
    WARMUP = "warmup"  # the first steps (first touch of the state, the allocator) are not measured
    TRIAL = "trial"    # each candidate in turn
    PICKED = "picked"  # the fastest, checked every check_every steps
    FIXED = "fixed"    # one strategy, never changed


class ExactModePicker:
    """The strategy of each step under mode="exact".

    order: the candidates, simplest first (candidates()); forced: expert.exact_strategy
    when it is not "auto"; agree(values): the largest of each value over all ranks
    (identity on one rank).  The engine calls step_begins(t) when step() starts and
    step_ends(iteration, skipped) when it ends; `current` is the strategy of the coming
    step (its backward's speculation, its step's overlap)."""

    def __init__(self, order: list[str], *, forced: str | None = None, warmup: int = 2, per_candidate: int = 4,
                 check_every: int = 50, agree: Callable[[list[float]], list[float]] | None = None):
        if forced is not None and forced not in STRATEGIES:
            raise ValueError(f"unknown strategy {forced!r}; one of {STRATEGIES}")
        assert per_candidate >= 2, "a candidate needs two steps in a row for one interval"
        self.order = [forced] if forced is not None else list(order)
        self.warmup, self.per_candidate, self.check_every = warmup, per_candidate, check_every
        self.agree = agree or (lambda values: values)
        self.samples: dict[str, list[float]] = {s: [] for s in self.order}
        self.medians: dict[str, float] = {}
        self.recent: deque[float] = deque(maxlen=check_every)
        self.trials = 0          # trials completed
        self.released = False    # speculation dropped, its twin given back
        self._t: float | None = None
        self._last: str | None = None  # the strategy of the step that began at _t
        self._skipped = False
        self._trial_at = 0       # the iteration the current trial started after
        self._picked_at = 0
        if len(self.order) == 1:
            self.phase, self.current = PickPhase.FIXED, self.order[0]
            self.why = (f"forced (expert.exact_strategy={forced!r})" if forced is not None
                        else "the only candidate (one rank needs a model forward for overlap_update; speculation "
                             "needs its host RAM)" if self.order[0] == SYNC else "the only candidate")
        else:
            self.phase, self.current = PickPhase.WARMUP, self.order[0]
            self.why = f"measuring: {', '.join(self.order)} for {per_candidate} steps each after {warmup} steps"

    # ------------------------------------------------------------------ the engine's calls
    def step_begins(self, t: float) -> None:
        """step() starts at time t: the interval since the last one is a sample of the
        current strategy if the last step used it too and was not skipped."""
        if self._t is not None and self._last == self.current and not self._skipped:
            dt = t - self._t
            if self.phase is PickPhase.TRIAL:
                self.samples[self.current].append(dt)
            elif self.phase is PickPhase.PICKED:
                self.recent.append(dt)
        self._t, self._last = t, self.current

    def step_ends(self, iteration: int, skipped: bool = False) -> None:
        """step() of `iteration` (1-based, skipped ones included) ends: the phase may move,
        and `current` becomes the next step's strategy."""
        self._skipped = skipped
        if self.phase is PickPhase.WARMUP:
            if iteration >= self.warmup:
                self._start_trial(iteration)
        elif self.phase is PickPhase.TRIAL:
            done = iteration - self._trial_at
            if done % self.per_candidate == 0:
                i = done // self.per_candidate
                if i < len(self.order):
                    self.current = self.order[i]
                else:
                    self._pick(iteration)
        elif self.phase is PickPhase.PICKED:
            if (iteration - self._picked_at) % self.check_every == 0:
                self._check(iteration)

    # ------------------------------------------------------------------ transitions
    def _start_trial(self, iteration: int) -> None:
        self.phase = PickPhase.TRIAL
        self._trial_at = iteration
        self.samples = {s: [] for s in self.order}
        self.current = self.order[0]

    def _pick(self, iteration: int) -> None:
        local = [statistics.median(self.samples[s]) if self.samples[s] else -1.0 for s in self.order]
        agreed = self.agree(local)
        self.medians = {s: m for s, m in zip(self.order, agreed) if m >= 0}
        self.trials += 1
        if not self.medians:  # every interval straddled a skip: measure again
            self._start_trial(iteration)
            return
        self.current, why = decide(self.medians, self.order)
        self.why = f"trial {self.trials} (steps {self._trial_at + 1}-{iteration}): {why}"
        log.info("mode='exact' keeps %s: %s", self.current, self.why)
        self.phase = PickPhase.PICKED
        self._picked_at = iteration
        self.recent.clear()

    def _check(self, iteration: int) -> None:
        local = statistics.median(self.recent) if self.recent else -1.0
        now = self.agree([local])[0]
        ref = self.medians.get(self.current)
        if now < 0 or ref is None:
            return
        if abs(now / ref - 1.0) > DRIFT:
            log.info("mode='exact': the step time moved from %.1f to %.1f ms under %s; measuring the strategies "
                     "again", ref * 1e3, now * 1e3, self.current)
            self._start_trial(iteration)

    @property
    def speculation_unused(self) -> bool:
        """A strategy without speculation was kept while speculation is still a candidate:
        the engine gives its twin back (RELEASE_TWIN) and drops it (drop_speculation)."""
        return (self.phase is PickPhase.PICKED and not speculates(self.current)
                and any(map(speculates, self.order)))

    def drop_speculation(self) -> None:
        """Speculation is no candidate any more (its RAM was given back): later trials
        measure the others."""
        self.order = [s for s in self.order if not speculates(s)]
        self.released = True

    def report(self) -> dict:
        """What stats() says of it."""
        return {"exact_strategy": self.current, "exact_strategy_why": self.why, "exact_phase": self.phase.value,
                "exact_medians_ms": {s: round(m * 1e3, 3) for s, m in self.medians.items()},
                "exact_twin_released": self.released}
