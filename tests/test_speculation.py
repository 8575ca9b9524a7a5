"""Speculation during backward (OffloadConfig.undo_log_bytes; runtime/speculation.py,
optimizer_server/shard_speculation.py): the server updates each bucket's range as soon as its
gradients land, and a STEP whose values differ (a clip that fires, an overflow, an lr
changed after backward) rolls it back from the undo log.  The reference is the
synchronous engine without speculation: losses, master, m, v (checkpoint bytes) and
device weights bitwise, on steps that kept the speculation and on steps that rolled
it back.  The models and batches are seeded (tests/helpers/models.py)."""
from __future__ import annotations

import pytest

from zero_offload import OffloadConfig
from zero_offload.speculation import MAX_BACKOFF, SpeculatorPhase, Speculator
from zero_offload.stats import Counters
from tests.helpers.models import gpt, gpt_batch, mlp, mlp_batch
from tests.helpers.overlap_runs import STEPS, assert_bitwise, run, two_groups

pytestmark = pytest.mark.timeout(300)

BIG = 1 << 26  # an undo log that holds the whole test model's state
SMALL = 100_000  # about a fourth of the test transformer's fp32 state (34K params, 12 B each)

# bucket_numel 1024: about 34 buckets, so speculation runs piece by piece inside backward
CASES = {
    # clip 1.2 fires on some steps only: those roll back, the others keep their speculation
    "overlap-clip": (gpt, gpt_batch, "bf16", True, dict(clip_grad_norm=1.2, weight_decay=0.1)),
    "sync-clip": (gpt, gpt_batch, "bf16", False, dict(clip_grad_norm=1.2)),
    # an fp16 overflow on step 5 (SKIP rolls back), accumulation over 2 micro-batches
    "fp16-overflow-accum2": (mlp, mlp_batch, "fp16", True, dict(accum=2, inject_at=5)),
    "groups": (gpt, gpt_batch, "bf16", True, dict(groups=two_groups, clip_grad_norm=1.2)),
    "small-undo-log": (gpt, gpt_batch, "bf16", True, dict(clip_grad_norm=1.2, undo_log_bytes=SMALL)),
    # the exact master with one weights slot: the out slot holds the master's high halves,
    # so a rollback must restore it too
    "bf16-state-copy": (gpt, gpt_batch, "bf16", True, dict(state_dtype="bf16", cpu_zero_copy=False,
                                                            clip_grad_norm=1.2)),
    "int8-state-groups": (gpt, gpt_batch, "bf16", True, dict(state_dtype="int8", groups=two_groups,
                                                              clip_grad_norm=1.2)),
    "lion": (mlp, mlp_batch, "bf16", True, dict(optimizer="lion", lr=1e-4, clip_grad_norm=0.22)),
    # Lion's one int8 moment: the undo log saves its codes and scales
    "lion-int8-state": (mlp, mlp_batch, "bf16", True, dict(optimizer="lion", lr=1e-4, state_dtype="int8",
                                                            clip_grad_norm=0.22)),
    # a slower device: each module's forward takes a little longer (the ordering makes it exact)
    "slow-forward": (gpt, gpt_batch, "bf16", True, dict(slow_forward=True, clip_grad_norm=1.2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_is_bitwise_sync(tmp_path, case):
    make, batch, dtype, overlap, kw = CASES[case]
    kw = dict(kw, bucket_numel=1024)
    undo = kw.pop("undo_log_bytes", BIG)
    sync = run(tmp_path, make, batch, dtype, False, **kw)
    spec = run(tmp_path, make, batch, dtype, overlap, undo_log_bytes=undo, **kw)
    assert_bitwise(spec, sync, kw)
    st = spec[4]
    assert st["spec_kept_steps"] > 0 and st["spec_kept_numel"] > 0, st  # some steps kept what backward did
    if "clip_grad_norm" in kw or "inject_at" in kw:
        assert st["spec_rollback_steps"] > 0, st  # and some were undone
    # a STEP takes over the pieces not yet started, so a step keeps at most the shard
    assert st["spec_kept_numel"] <= st["spec_kept_steps"] * st["shard_numel"], st
    if undo == SMALL:  # the log filled: each step speculated only part of the shard
        assert 0 < st["spec_kept_numel"] / st["spec_kept_steps"] < st["shard_numel"] / 2, st


def test_lr_changed_after_backward_rolls_back_bitwise(tmp_path):
    """The lr of every third step changes between backward and step(): the assumption was
    wrong, the server must notice and redo the update with the lr step() sent."""
    def bump(eng, t):
        if t % 3 == 0:
            for g in eng.optimizer.param_groups:
                g["lr"] *= 0.9
    kw = dict(bucket_numel=1024, before_step=bump)
    sync = run(tmp_path, gpt, gpt_batch, "bf16", False, **kw)
    spec = run(tmp_path, gpt, gpt_batch, "bf16", True, undo_log_bytes=BIG, **kw)
    assert_bitwise(spec, sync, {})
    st = spec[4]
    assert st["spec_rollback_steps"] > 0 and st["spec_kept_steps"] > 0, st


def test_slowed_server_speculation_is_bitwise_sync(tmp_path, monkeypatch):
    """The scalar kernel: the speculative pieces queue up behind backward, the STEP waits
    for them; only the timing moves."""
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", "scalar")
    kw = dict(bucket_numel=1024, clip_grad_norm=1.2)
    sync = run(tmp_path, gpt, gpt_batch, "bf16", False, **kw)
    spec = run(tmp_path, gpt, gpt_batch, "bf16", True, undo_log_bytes=BIG, **kw)
    assert_bitwise(spec, sync, kw)


def test_undo_log_bytes_refusals():
    with pytest.raises(ValueError, match="undo_log_bytes"):
        OffloadConfig(expert={"exact_strategy": "speculation", "undo_log_bytes": -1})
    with pytest.raises(ValueError, match="choose mode='dpu'"):
        OffloadConfig(mode="dpu", expert={"undo_log_bytes": 1 << 20})
    with pytest.raises(ValueError, match="needs an undo log"):
        OffloadConfig(expert={"exact_strategy": "speculation", "undo_log_bytes": 0})


class _Cycle:
    """The update cycle's side of speculation, recorded (the state machine alone)."""
    can_speculate = True

    def __init__(self):
        self.sent = []       # SPECULATE messages
        self.announced = []  # ready-word stores after them

    def speculate(self, k, *, upto, **args):
        self.sent.append((k, upto))

    def announce(self, k, upto):
        self.announced.append((k, upto))


class _Tracer:
    def span(self, *a, **kw):
        import contextlib
        return contextlib.nullcontext()


def test_speculator_phases_and_backoff():
    c = Counters()
    cyc = _Cycle()
    sp = Speculator(cyc, lambda slot: {"grad_slot": slot}, tracer=_Tracer(), counters=c)
    assert sp.phase is SpeculatorPhase.IDLE
    sp.ready(10)  # outside a step: nothing
    assert cyc.sent == []
    sp.begin(1, 0)
    assert sp.phase is SpeculatorPhase.ARMED
    sp.ready(10)
    sp.ready(10)  # no growth: nothing new
    sp.ready(30)
    sp.ready(40)
    # one message a step; the prefix's growth after it goes through the ready word
    assert sp.phase is SpeculatorPhase.SENT and cyc.sent == [(1, 10)] and cyc.announced == [(1, 30), (1, 40)]
    assert c.spec_steps == 1
    sp.end()
    assert sp.phase is SpeculatorPhase.IDLE
    # rollbacks in a row: 1, 2, 4, ... steps without speculation, up to MAX_BACKOFF
    speculated = []
    for k in range(2, 200):
        if speculated and speculated[-1] == k - 1:
            c.spec_rollback_steps += 1  # the last step's DONE said: rolled back
        sp.begin(k, 0)
        sp.ready(5)
        if sp.phase is SpeculatorPhase.SENT:
            speculated.append(k)
        sp.end()
    gaps = [b - a - 1 for a, b in zip(speculated, speculated[1:])]
    assert gaps[:6] == [1, 2, 4, 8, 16, 32] and max(gaps) == MAX_BACKOFF, gaps
    # a kept speculation resets the back-off
    c.spec_kept_steps += 1
    sp.begin(300, 0)
    assert sp.backoff == 0 and sp.phase is SpeculatorPhase.ARMED
    # a skipped step (overflow: SKIP rolled it back) counts as a rollback
    sp.ready(5)
    before = c.spec_rollback_steps
    sp.end(skipped=True)
    assert c.spec_rollback_steps == before + 1
    sp.begin(301, 0)
    assert sp.phase is SpeculatorPhase.IDLE and sp.backoff == 1
    # a cycle that holds a restored checkpoint's update does not speculate
    cyc.can_speculate = False
    for k in range(302, 302 + MAX_BACKOFF + 2):
        sp.begin(k, 0)
        assert sp.phase is SpeculatorPhase.IDLE


def test_step_count_is_unchanged_by_speculation(tmp_path):
    """STEPS steps, each with one STEP: speculation adds no update of its own."""
    spec = run(tmp_path, gpt, gpt_batch, "bf16", True, undo_log_bytes=BIG, bucket_numel=1024)
    assert spec[4]["updates"] == STEPS and spec[4]["spec_steps"] == STEPS
