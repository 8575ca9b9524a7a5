"""ShardClient's waits: a timed-out wait for DONE can be retried, any other timed-out
request leaves the client refusing further use, naming the fix."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from optimizer_server import ShardClient, spawn
from optimizer_server.errors import OptimizerServerError, OptimizerServerTimeoutError

pytestmark = pytest.mark.timeout(120)


def test_wait_done_timeout_is_retryable_and_replies_stay_paired():
    # the server is stopped (SIGSTOP) while the step is in flight, so the short wait
    # times out whatever this machine's speed (an update of a few ms on a fast one did not)
    n = 1 << 16
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)
        c.init_weights(np.zeros(n, np.float32))
        c.grads[0].view(np.float16)[:] = 0.25
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            c.step_async(1, 0, 1e-3)
            with pytest.raises(OptimizerServerTimeoutError):
                c.wait_done(timeout_s=0.2)
            assert c.in_flight == 1  # still in flight: nothing was lost
            for _ in range(2):  # refused, and the reply to the refused request is not read by the next
                with pytest.raises(OptimizerServerError, match="in flight: call wait_done"):
                    c.skip(2)
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        done = c.wait_done()
        assert done.step == 1 and c.in_flight is None
        c.skip(2)                       # answered by its own OK
        assert c.stats().skipped == 1 and c.stats().steps == 1
        assert c.step(2, 0, 1e-3).step == 2
        c.close()


def test_a_request_that_times_out_leaves_the_client_refusing():
    with spawn(threads=1) as srv:
        c = ShardClient(srv.address, srv.token, numel=1000, server_proc=srv.proc)
        c.init_weights(np.ones(1000, np.float32))
        c.request_timeout_s = 0.3
        os.kill(srv.pid, signal.SIGSTOP)  # alive but silent
        try:
            with pytest.raises(OptimizerServerTimeoutError, match="made no progress"):
                c.get_master()
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        # the late reply would answer the next request: the client refuses instead
        with pytest.raises(OptimizerServerError, match="no longer usable.*GET_MASTER timed out.*connect a new one"):
            c.get_master()
        c.close()
        d = ShardClient(srv.address, srv.token, numel=10, server_proc=srv.proc)  # a new client works
        d.init_weights(np.ones(10, np.float32))
        np.testing.assert_array_equal(d.get_master(), np.ones(10, np.float32))
        d.close()
