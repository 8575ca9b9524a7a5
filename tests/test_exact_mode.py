"""mode="exact" (runtime/exact_mode.py): the picker's phases on their own, fed step
times; and the engine under it, against the synchronous engine bit for bit.

Which strategy wins on a real model is a matter of time, so no test here asserts it
(BENCHMARKS.md, bench_exact_mode, measures it); what is asserted is what the picker
does with given times, that every strategy it may pick gives the bits of sync, and
what it may pick (no speculation without its RAM, no overlap without a forward)."""
from __future__ import annotations

import copy

import pytest
import torch

from zero_offload import OffloadAdamW, OffloadConfig, OffloadEngine
from zero_offload import exact_mode as X
from tests.helpers.models import flat_master, gpt, gpt_batch, train_engine

pytestmark = pytest.mark.timeout(300)

ONE_RANK = [X.SYNC, X.OVERLAP, X.OVERLAP_SPECULATION]


def drive(picker, times: dict, steps: int, skipped=()):
    """Run `steps` steps where a step under strategy s takes times[s] seconds (a step's
    time is charged to the interval that starts at it); returns the strategy of each."""
    t, used = 0.0, []
    for it in range(1, steps + 1):
        picker.step_begins(t)
        used.append(picker.current)
        t += times[picker.current]
        picker.step_ends(it, skipped=it in skipped)
    return used


# ----------------------------------------------------------------------------- the picker alone
def test_candidates_by_world_size_forward_and_ram():
    assert X.candidates(world_size=1, overlap_ok=True, speculation_ok=True) == ONE_RANK
    assert X.candidates(world_size=2, overlap_ok=True, speculation_ok=True) == [X.SYNC, X.SPECULATION]
    assert X.candidates(world_size=1, overlap_ok=False, speculation_ok=True) == [X.SYNC, X.SPECULATION]
    assert X.candidates(world_size=1, overlap_ok=True, speculation_ok=False) == [X.SYNC, X.OVERLAP]
    assert X.candidates(world_size=4, overlap_ok=True, speculation_ok=False) == [X.SYNC]


def test_trial_runs_each_candidate_in_turn_then_keeps_the_fastest():
    """Phases WARMUP -> TRIAL (each candidate per_candidate steps) -> PICKED; a candidate's
    samples are only intervals between two of its own steps.  (Mutation: attributing the
    interval that straddles a switch gives overlap 4 samples and makes the counts fail.)"""
    p = X.ExactModePicker(ONE_RANK, warmup=2, per_candidate=4)
    assert p.phase is X.PickPhase.WARMUP
    used = drive(p, {X.SYNC: 0.30, X.OVERLAP: 0.20, X.OVERLAP_SPECULATION: 0.25}, 14)
    assert used == [X.SYNC] * 6 + [X.OVERLAP] * 4 + [X.OVERLAP_SPECULATION] * 4
    assert p.phase is X.PickPhase.PICKED and p.current == X.OVERLAP
    assert [len(p.samples[s]) for s in ONE_RANK] == [4, 3, 3]
    assert p.medians == pytest.approx({X.SYNC: 0.30, X.OVERLAP: 0.20, X.OVERLAP_SPECULATION: 0.25})
    assert "overlap_update is the fastest" in p.why and "steps 3-14" in p.why
    assert drive(p, {X.SYNC: 0.30, X.OVERLAP: 0.20, X.OVERLAP_SPECULATION: 0.25}, 5)[-1] == X.OVERLAP


def test_embedding_dominated_numbers_do_not_pick_speculation():
    """The numbers the issue measured on a 134M embedding table (sync 330-365 ms,
    overlap_update 329-333, overlap with speculation 508-518): not speculation; and a
    tie within TIE keeps the simpler strategy."""
    pick, why = X.decide({X.SYNC: 0.345, X.OVERLAP: 0.331, X.OVERLAP_SPECULATION: 0.513}, ONE_RANK)
    assert pick == X.OVERLAP
    pick, why = X.decide({X.SYNC: 0.335, X.OVERLAP: 0.331, X.OVERLAP_SPECULATION: 0.513}, ONE_RANK)
    assert pick == X.SYNC and "within 3%" in why
    pick, _ = X.decide({X.SYNC: 0.60, X.OVERLAP: 0.45, X.OVERLAP_SPECULATION: 0.30}, ONE_RANK)
    assert pick == X.OVERLAP_SPECULATION  # an update that outlasts the forward


def test_skipped_steps_are_not_samples():
    """A skipped step (an overflow: no update) is fast; the interval after it is not counted."""
    p = X.ExactModePicker([X.SYNC, X.OVERLAP], warmup=1, per_candidate=4)
    drive(p, {X.SYNC: 0.3, X.OVERLAP: 0.2}, 9, skipped={2, 3})
    assert len(p.samples[X.SYNC]) == 2 and len(p.samples[X.OVERLAP]) == 3


def test_drift_measures_again():
    """PICKED -> TRIAL when the recent median moves more than DRIFT from the pick's."""
    p = X.ExactModePicker([X.SYNC, X.OVERLAP], warmup=1, per_candidate=3, check_every=5)
    drive(p, {X.SYNC: 0.3, X.OVERLAP: 0.2}, 7)
    assert p.phase is X.PickPhase.PICKED and p.current == X.OVERLAP and p.trials == 1
    drive(p, {X.SYNC: 0.3, X.OVERLAP: 0.21}, 5)  # within DRIFT: stays
    assert p.phase is X.PickPhase.PICKED
    p2 = X.ExactModePicker([X.SYNC, X.OVERLAP], warmup=1, per_candidate=3, check_every=5)
    t = drive(p2, {X.SYNC: 0.3, X.OVERLAP: 0.2}, 7)
    times = {X.SYNC: 0.5, X.OVERLAP: 0.6}  # the model or the batch changed
    it, tt = 7, 0.0
    for _ in range(5):
        it += 1
        p2.step_begins(100.0 + tt)
        tt += times[p2.current]
        p2.step_ends(it)
    assert p2.phase is X.PickPhase.TRIAL and p2.current == X.SYNC
    for _ in range(6):
        it += 1
        p2.step_begins(100.0 + tt)
        tt += times[p2.current]
        p2.step_ends(it)
    assert p2.phase is X.PickPhase.PICKED and p2.current == X.SYNC and p2.trials == 2
    del t


def test_forced_and_single_candidate_are_fixed():
    p = X.ExactModePicker(ONE_RANK, forced=X.OVERLAP)
    assert p.phase is X.PickPhase.FIXED and drive(p, {X.OVERLAP: 0.1}, 20) == [X.OVERLAP] * 20
    assert "forced" in p.why
    q = X.ExactModePicker([X.SYNC])
    assert q.phase is X.PickPhase.FIXED and q.current == X.SYNC
    with pytest.raises(ValueError, match="unknown strategy"):
        X.ExactModePicker(ONE_RANK, forced="fastest")


def test_ranks_agree_on_the_largest_median():
    """Several ranks: each median is the largest over the ranks (agree), so every rank
    keeps the same strategy even where its own times say otherwise."""
    other = {X.SYNC: 0.2, X.SPECULATION: 0.9}  # the other rank's medians
    p = X.ExactModePicker([X.SYNC, X.SPECULATION], warmup=1, per_candidate=3,
                          agree=lambda v: [max(a, b) for a, b in zip(v, other.values())])
    drive(p, {X.SYNC: 0.3, X.SPECULATION: 0.25}, 7)
    assert p.current == X.SYNC and p.medians[X.SPECULATION] == 0.9


# ----------------------------------------------------------------------------- the engine under it
def _train(cfg: OffloadConfig, steps: int = 24):
    torch.manual_seed(0)
    model = gpt()
    with OffloadEngine(copy.deepcopy(model), cfg) as eng:
        losses = train_engine(eng, gpt_batch, steps, cfg.dtype)
        eng.synchronize(copy_weights=True)
        weights = [p.detach().clone() for p in eng.model.parameters()]
        return losses, flat_master(eng), weights, eng.stats()


def _cfg(**expert):
    return OffloadConfig(lr=3e-3, weight_decay=0.1, dtype="bf16", clip_grad_norm=1.2, server={"threads": 1},
                         expert={"progress_block_numel": 256, "bucket_numel": 4096, **expert})


def test_auto_tries_every_candidate_and_is_bitwise_sync():
    """24 steps under "auto": the trial runs sync, overlap_update and overlap with
    speculation (steps 3-14), then keeps one; losses, master and device weights are
    bitwise the synchronous engine's.  (Mutation: landing an overlapped update after the
    next forward's first module, or speculating with a stale lr, breaks the equality.)"""
    sync = _train(_cfg(exact_strategy="sync"))
    auto = _train(_cfg())
    st = auto[3]
    assert st["mode"] == "exact" and st["exact_phase"] == "picked", st
    assert set(st["exact_medians_ms"]) == set(ONE_RANK), st
    assert st["exact_strategy"] in ONE_RANK and st["exact_strategy_why"].startswith("trial 1")
    assert st["spec_steps"] > 0  # the speculation candidate ran
    assert auto[0] == sync[0]
    assert torch.equal(auto[1], sync[1])
    assert all(torch.equal(a, b) for a, b in zip(auto[2], sync[2]))


def test_auto_without_ram_for_the_twin_never_speculates(monkeypatch):
    """Where a whole update's undo log (the twin) does not fit in half the available host
    RAM, speculation is no candidate: no undo log is asked for and no step speculates.
    The host's answer is faked; undo_log_bytes=0 says the same outright."""
    import zero_offload.wiring as W
    monkeypatch.setattr(W, "read_mem_available", lambda: 1 << 20)
    st = _train(_cfg(), steps=12)[3]
    assert set(st["exact_medians_ms"]) == {X.SYNC, X.OVERLAP} and st["spec_steps"] == 0, st
    monkeypatch.undo()
    st = _train(_cfg(undo_log_bytes=0), steps=12)[3]
    assert set(st["exact_medians_ms"]) == {X.SYNC, X.OVERLAP} and st["spec_steps"] == 0, st


def test_offload_adamw_without_model_does_not_overlap():
    """OffloadAdamW without model= has no forward to hook: overlap_update is no candidate,
    and forcing it is refused naming model=."""
    model = gpt()
    with OffloadAdamW(model.parameters(), lr=1e-3, server={"threads": 1}) as opt:
        assert X.OVERLAP not in opt.engine.picker.order and opt.engine.pipeline is None
    with pytest.raises(ValueError, match="model=model"):
        OffloadAdamW(gpt().parameters(), lr=1e-3, server={"threads": 1}, expert={"exact_strategy": "overlap_update"})


def test_dpu_mode_has_no_picker():
    model = gpt()
    with OffloadEngine(model, OffloadConfig(dtype="bf16", mode="dpu", server={"threads": 1})) as eng:
        st = eng.stats()
        assert eng.picker is None and st["mode"] == "dpu" and "exact_strategy" not in st


# ----------------------------------------------------------------------------- the step's phases (runtime/step_state.py)
def test_step_phases_follow_the_table():
    """The engine's step lifecycle on its own: each documented transition, and anything
    else refused naming the phase.  (Mutation: letting "step" leave from IDLE, which is
    step() before backward(), fails the refusal below.)"""
    from zero_offload.step_state import StepPhase as S, next_phase
    assert next_phase(S.IDLE, "backward", final=False) is S.ACCUMULATING
    assert next_phase(S.ACCUMULATING, "backward", final=True) is S.GRADS_READY
    assert next_phase(S.IDLE, "pass_begins") is S.IN_BACKWARD
    assert next_phase(S.IN_BACKWARD, "pass_ends", final=False) is S.ACCUMULATING
    assert next_phase(S.IN_BACKWARD, "pass_ends", final=True) is S.GRADS_READY
    assert next_phase(S.GRADS_READY, "step") is S.IDLE
    assert next_phase(S.ACCUMULATING, "restore", final=True) is S.IDLE
    assert all(next_phase(p, "close") is S.CLOSED for p in S)
    for phase, event in [(S.IDLE, "step"), (S.GRADS_READY, "backward"), (S.GRADS_READY, "pass_begins"),
                         (S.IN_BACKWARD, "step"), (S.CLOSED, "backward"), (S.IDLE, "pass_ends")]:
        with pytest.raises(AssertionError, match=f"{event!r} in phase {phase.value!r}"):
            next_phase(phase, event)


def test_engine_walks_the_step_phases():
    """The engine's phase through accumulation, step() and close(), and the user-facing
    refusals that keep it on the table."""
    from zero_offload.step_state import StepPhase as S
    model = gpt()
    with OffloadEngine(model, OffloadConfig(dtype="bf16", grad_accumulation_steps=2, server={"threads": 1})) as eng:
        assert eng.phase is S.IDLE
        with pytest.raises(RuntimeError, match="step\\(\\) before backward"):
            eng.step()
        eng.backward(gpt_batch(1, "bf16")(model))
        assert eng.phase is S.ACCUMULATING
        eng.backward(gpt_batch(1, "bf16", 1)(model))
        assert eng.phase is S.GRADS_READY
        with pytest.raises(RuntimeError, match="backward\\(\\) called twice"):
            eng.backward(gpt_batch(1, "bf16")(model))
        eng.step()
        assert eng.phase is S.IDLE
    assert eng.phase is S.CLOSED and eng.closed


def test_a_pick_without_speculation_gives_the_twin_back(monkeypatch):
    """When the trial keeps a strategy without speculation, the engine sends RELEASE_TWIN
    before the next backward: the server frees the twin and the undo log, no later step
    speculates, re-trials leave speculation out, and the bits stay sync's.  The pick is
    forced to sync (decide patched), so the test does not depend on this machine's speed.
    (Mutation: not dropping speculation from the candidates makes a re-trial speculate
    on a shard with no undo log; not sending RELEASE_TWIN keeps exact_twin_released False.)"""
    monkeypatch.setattr(X, "decide", lambda medians, order, tie=X.TIE: (X.SYNC, "patched"))
    sync = _train(_cfg(exact_strategy="sync"))
    auto = _train(_cfg())
    st = auto[3]
    assert st["exact_strategy"] == X.SYNC and st["exact_twin_released"], st
    assert st["spec_steps"] <= 4  # the trial's four speculation steps, none after
    assert auto[0] == sync[0] and torch.equal(auto[1], sync[1])


def test_release_twin_frees_the_shard_s_twin_and_undo_log():
    """RELEASE_TWIN on the server: the bytes of the twin (fp32 state: 12 B/param) and the
    undo log come back, and a second one releases nothing."""
    import numpy as np

    from zero_offload.server.client import ShardClient
    from zero_offload.server.spawn import spawn
    n = 1 << 16
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, undo_log_bytes=16 * n)
        try:
            c.init_weights(np.zeros(n, np.float32))
            freed = c.release_twin()
            assert freed >= 12 * n, freed
            assert c.release_twin() == 0
        finally:
            c.close()
