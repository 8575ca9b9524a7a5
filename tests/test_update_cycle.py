"""runtime.update_cycle on its own, against a fake client: the phase table, the copy up
of published ranges, the zero-copy swap, and a timed-out wait that can be retried."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from zero_offload.server.errors import OptimizerServerError, OptimizerServerTimeoutError
from zero_offload.server.protocol import Done
from zero_offload.server.tracing import Tracer
from zero_offload.flat import FlatParams
from zero_offload.stats import Counters
from zero_offload.update_cycle import CyclePhase, UpdateCycle

pytestmark = pytest.mark.timeout(60)
N = 64


class FakeClient:
    """The client interface UpdateCycle uses.  The test plays the server: it writes
    the incoming weights slot, publishes progress and lets DONE arrive."""

    request_timeout_s = 5.0

    def __init__(self, weights_slots: int):
        self.weights16_slots = [np.zeros(N, np.uint16) for _ in range(weights_slots)]
        self.sent = []
        self.progress = 0
        self.done = False
        self.timeouts = 0  # the next wait_done calls that time out
        self.refuse = ""   # the next wait_done reads this ERROR (the server refused the STEP)

    def step_async(self, step, slot, lr, grad_scale, hparams, predict=0.0, weights_slot=0):
        self.sent.append((step, weights_slot))
        self.progress, self.done = 0, False

    def published(self, step):
        return self.progress if self.sent and self.sent[-1][0] == step else 0

    def reply_ready(self, timeout_s):
        return self.done or bool(self.refuse)

    def wait_done(self, timeout_s=None):
        if self.timeouts:
            self.timeouts -= 1
            raise OptimizerServerTimeoutError("no DONE yet")
        if self.refuse:
            why, self.refuse = self.refuse, ""
            raise OptimizerServerError(why)
        assert self.done, "wait_done before the fake server finished"
        return Done(step=self.sent[-1][0], update_s=0.5)

    def finish(self, value: float, slot: int):
        w = torch.full((N,), value, dtype=torch.bfloat16)
        self.weights16_slots[slot][:] = w.view(torch.int16).numpy().view(np.uint16)
        self.progress, self.done = N, True


def make(zero_copy: bool, overlap: bool = True):
    params = [torch.nn.Parameter(torch.zeros(N // 2)), torch.nn.Parameter(torch.zeros(N // 2))]
    flat = FlatParams(params, bucket_numel=1024, world_size=1)
    client = FakeClient(2 if zero_copy else 1)
    c = UpdateCycle(client, flat, dtype=torch.bfloat16, device=torch.device("cpu"), shard_lo=0,
                    zero_copy=zero_copy, overlap_weights_up=overlap, tracer=Tracer(), counters=Counters())
    flat.cast_and_bind(c.flat16)
    return c, client, params


def send(c, k):
    c.send(k, grad_slot=0, lr=1e-3, grad_scale=1.0, hparams={}, predict=0.0)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_phase_table(zero_copy):
    c, client, params = make(zero_copy)
    assert c.phase is CyclePhase.IDLE and c.in_flight is None
    send(c, 1)
    assert c.phase is CyclePhase.IN_FLIGHT and c.in_flight == 1 and not c.landed
    assert client.sent == [(1, 1 if zero_copy else 0)]  # zero-copy: the slot the model is not on
    with pytest.raises(AssertionError, match="send in phase in_flight"):
        send(c, 2)  # one update in flight at a time
    with pytest.raises(AssertionError, match="reset in phase in_flight"):
        c.reset()
    client.finish(1.5, client.sent[-1][1])
    c.land(copy=False)  # a checkpoint: DONE read, the device keeps its weights
    assert c.phase is CyclePhase.LANDED and c.landed and c.in_flight is None
    assert all(float(p.detach().float().sum()) == 0.0 for p in params)
    c.land(copy=True)
    assert c.phase is CyclePhase.ON_DEVICE
    assert all(torch.equal(p.detach().float(), torch.full((N // 2,), 1.5)) for p in params)
    assert c.counters.wait_s > 0 and c.counters.update_s == 0.5
    assert c.counters.bytes_to_device == (0 if zero_copy else 2 * N)
    send(c, 2)  # ON_DEVICE -> IN_FLIGHT
    client.finish(2.5, client.sent[-1][1])
    c.land(copy=False)
    c.restore(2)  # as load_checkpoint does with a saved pending update
    assert c.phase is CyclePhase.LANDED
    c.reset()
    assert c.phase is CyclePhase.IDLE
    c.release()


def test_zero_copy_swaps_slots_and_copies_nothing():
    c, client, params = make(True)
    slots = []
    for k in range(1, 5):
        slots.append(c.model_slot)
        send(c, k)
        client.finish(float(k), client.sent[-1][1])
        c.land(copy=True)
        assert params[0].data_ptr() == c.flat16.data_ptr() + 2 * (N // 2) or params[1].data_ptr() == c.flat16.data_ptr()
    assert slots == [0, 1, 0, 1] and c.counters.bytes_to_device == 0
    c.release()
    assert float(params[0].detach().float()[0]) == 4.0  # private memory after release, same values


def test_pump_copies_only_what_is_published_and_free():
    c, client, params = make(False)
    send(c, 1)
    client.weights16_slots[0][:] = torch.ones(N, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    client.progress = 40
    assert c.pump(free=16) == 16  # backward still reads the rest
    assert c.pump(free=N) == 40   # the server has published only 40
    assert c.counters.bytes_to_device_early == 2 * 40
    flat = c.flat16.float()
    assert flat[:40].eq(1).all() and flat[40:].eq(0).all()
    client.done, client.progress = True, N
    c.land(copy=True)
    assert c.flat16.float().eq(1).all() and c.counters.bytes_to_device == 2 * N
    c.release()


def test_overlap_off_copies_everything_after_done():
    c, client, _ = make(False, overlap=False)
    send(c, 1)
    client.progress = N
    assert c.pump(free=N) == 0
    client.finish(3.0, 0)
    c.land(copy=True)
    assert c.counters.bytes_to_device == 2 * N and c.counters.bytes_to_device_early == 0
    c.release()


def test_a_timed_out_wait_leaves_the_update_in_flight_for_a_retry():
    c, client, _ = make(True)
    send(c, 1)
    client.timeouts = 1
    with pytest.raises(OptimizerServerTimeoutError, match="no DONE yet"):
        c.land(copy=True)
    assert c.phase is CyclePhase.IN_FLIGHT and c.in_flight == 1  # nothing lost
    client.finish(7.0, client.sent[-1][1])
    c.land(copy=True)
    assert c.phase is CyclePhase.ON_DEVICE and float(c.flat16.float()[0]) == 7.0
    c.release()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_a_refused_update_goes_back_to_idle_and_is_not_waited_for_again(zero_copy):
    """IN_FLIGHT -> IDLE when land() reads the server's ERROR: raised once, and a later
    land() (close()) returns at once instead of waiting request_timeout_s for a DONE
    that never comes; the device keeps its weights.  (Mutation: leaving the phase
    IN_FLIGHT makes the second land() wait and then fail.)"""
    c, client, _ = make(zero_copy)
    before = c.flat16.clone()
    send(c, 1)
    client.refuse = "STEP 1 refused"
    with pytest.raises(OptimizerServerError, match="STEP 1 refused"):
        c.land(copy=True)
    assert c.phase is CyclePhase.IDLE and c.in_flight is None
    c.land(copy=True)  # nothing in flight: returns
    assert torch.equal(c.flat16, before)
    send(c, 2)  # and the cycle takes the next STEP
    assert c.in_flight == 2
