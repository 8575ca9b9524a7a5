"""overlap_update (runtime/overlap.py): bitwise the synchronous engine — losses, fp32
master, m, v (the server's checkpoint bytes) and the device's weights — while the
update runs during the next forward; a slowed server or a slowed forward changes
the timing, never a bit."""
from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from zero_offload import OffloadConfig
from zero_offload.demo.gpt import GPT, GPTConfig
from tests.helpers.models import gpt, gpt_batch, mlp, mlp_batch
from tests.helpers.overlap_runs import assert_bitwise, assert_ran, run, two_groups

pytestmark = pytest.mark.timeout(300)


CASES = {
    # clip_grad_norm 1.2: the norm starts above it and falls below, so it fires on some steps only
    "adamw-clip": (gpt, gpt_batch, "bf16", dict(clip_grad_norm=1.2, weight_decay=0.1)),
    "fp16-overflow-accum2": (mlp, mlp_batch, "fp16", dict(accum=2, inject_at=5)),
    "groups": (gpt, gpt_batch, "bf16", dict(groups=two_groups, clip_grad_norm=1.2)),
    "copy-path": (gpt, gpt_batch, "bf16", dict(cpu_zero_copy=False, clip_grad_norm=1.2)),
    "lion": (mlp, mlp_batch, "bf16", dict(optimizer="lion", lr=1e-4, clip_grad_norm=0.22)),
    "adagrad": (mlp, mlp_batch, "bf16", dict(optimizer="adagrad")),
    "slow-forward": (gpt, gpt_batch, "bf16", dict(slow_forward=True, clip_grad_norm=1.2)),
    # bf16 moments and the exact master: the reversed update writes the same bytes
    "bf16-state": (gpt, gpt_batch, "bf16", dict(state_dtype="bf16", clip_grad_norm=1.2)),
    "bf16-state-copy": (gpt, gpt_batch, "bf16", dict(state_dtype="bf16", cpu_zero_copy=False, clip_grad_norm=1.2)),
    # int8 moments: the reversed update runs whole blocks, one call per published block
    "int8-state-groups": (gpt, gpt_batch, "bf16", dict(state_dtype="int8", clip_grad_norm=1.2, groups=two_groups)),
    "int8-state-fp16": (mlp, mlp_batch, "fp16", dict(state_dtype="int8", accum=2, inject_at=5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_is_bitwise_sync(tmp_path, case):
    make, batch, dtype, kw = CASES[case]
    sync = run(tmp_path, make, batch, dtype, False, **kw)
    over = run(tmp_path, make, batch, dtype, True, **kw)
    assert_bitwise(over, sync, kw)


def wide_gpt():
    """The test transformer 8x wider (1.6M parameters): its scalar update takes ~10 ms,
    far longer than the worker's gap between one step() and the next forward, so the
    forward catches up with the update whatever else the machine is doing (with the
    40K-parameter one, a loaded machine's gap outlasted the whole update)."""
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=256, seq_len=16))


def _hold_server(eng, t):
    """Before every third step(): the server is held stopped for 0.2 s, so that the STEP
    waits in its socket and the next forward's hooks wait for their weights on any
    machine (the race is made, not hoped for)."""
    if t % 3 == 0:
        pid = eng._server.pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(0.2, os.kill, (pid, signal.SIGCONT)).start()


def test_slowed_server_is_bitwise_sync_and_the_forward_waited(tmp_path, monkeypatch):
    """The scalar kernel (several times slower) and a server held stopped now and then:
    the forward's hooks must wait for their weights, and the result is still sync's."""
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", "scalar")
    sync = run(tmp_path, wide_gpt, gpt_batch, "bf16", False, clip_grad_norm=1.2)
    over = run(tmp_path, wide_gpt, gpt_batch, "bf16", True, clip_grad_norm=1.2, before_step=_hold_server)
    assert over[0] == sync[0] and over[2] == sync[2]
    assert_ran(over[4], "overlap_update")
    assert over[4]["overlap_wait_s"] > 0


def test_overlap_with_dpu_is_refused():
    with pytest.raises(ValueError, match="exact_strategy.*is for mode='exact'"):
        OffloadConfig(mode="dpu", expert={"exact_strategy": "overlap_update"})
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="choose one"):
        OffloadConfig(overlap_update=True, dpu=True)  # the old names: the old words


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "copy"])
def test_offload_adamw_with_overlap_is_bitwise_sync(zero_copy):
    """A plain torch loop (loss.backward(): the update lands in the first gradient hook)."""
    from zero_offload import OffloadAdamW
    out = []
    for overlap in (False, True):
        model = gpt()
        with OffloadAdamW(model.parameters(), lr=3e-3, model=model, server={"threads": 1},
                          expert={"exact_strategy": "overlap_update" if overlap else "sync",
                                  "cpu_zero_copy": zero_copy, "progress_block_numel": 256,
                                  "compute_dtype": "bf16"}) as opt:  # zero-copy: 16-bit compute
            losses = []
            for t in range(1, 16):
                loss = gpt_batch(t, "bf16")(model)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.2)
                opt.step()
                losses.append(float(loss.detach()))
            master = opt.master_state_dict()
            assert_ran(opt.stats(), "overlap_update" if overlap else "sync")  # the loop's own hooks did it
        out.append((losses, master, {k: v.clone() for k, v in model.state_dict().items()}))
    assert out[0][0] == out[1][0]
    with pytest.raises(ValueError, match="model=model"):
        OffloadAdamW(gpt().parameters(), expert={"exact_strategy": "overlap_update"})
    for k in out[0][1]:
        assert torch.equal(out[0][1][k], out[1][1][k]) and torch.equal(out[0][2][k], out[1][2][k]), k
