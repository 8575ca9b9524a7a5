"""The optimizer server in a subprocess, driven by a minimal client written here.

The client below speaks the protocol with a raw DEALER socket and maps the
segment itself (no optimizer_server.client), and the expected weights come from
torch.optim.AdamW in float64.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import zmq

from zero_offload.server import protocol as P
from zero_offload.server import spawn
from tests.conftest import our_segments
from tests.helpers import seeded_rng

pytestmark = pytest.mark.timeout(120)


class MiniClient:
    def __init__(self, address: str, token: str, numel: int, rank: int = 0, world_size: int = 1, pid: int = 0,
                 progress_block: int = 0, staging_numel: int = 0, grad_slots: int = 2, **hp):
        self.ctx = zmq.Context()
        self.s = self.ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(address)
        self.numel = numel
        hello = P.Hello(version=P.PROTOCOL_VERSION, token=token, rank=rank, world_size=world_size, numel=numel,
                        dtype="fp16", optimizer="adamw", hparams=hp, pid=pid, progress_block=progress_block,
                        staging_numel=staging_numel, grad_slots=grad_slots)
        ok = self.req(hello)
        assert isinstance(ok, P.HelloOk), ok
        self.session, self.seg = ok.session, ok.segment
        fd = os.open(f"/dev/shm/{ok.segment}", os.O_RDWR)
        self.mm = mmap.mmap(fd, ok.segment_bytes)
        os.close(fd)
        self.grad = [np.frombuffer(self.mm, np.float16, numel, off) for off in ok.grad_offsets]
        self.w16 = np.frombuffer(self.mm, np.float16, numel, ok.weights_offsets[0])
        self.staging = np.frombuffer(self.mm, np.float32, ok.staging_numel, ok.staging_offset)
        self.progress = np.frombuffer(self.mm, np.uint64, 1, ok.progress_offset)

    def init(self, p0: np.ndarray) -> None:
        """INIT through the staging window, chunk by chunk."""
        w = max(1, self.staging.size)
        for lo in range(0, max(self.numel, 1), w):
            hi = min(lo + w, self.numel)
            self.staging[:hi - lo] = p0[lo:hi]
            r = self.req(P.Init(session=self.session, offset=lo, count=hi - lo))
            assert isinstance(r, P.Ok), r

    def master(self) -> np.ndarray:
        out = np.empty(self.numel, np.float32)
        w = max(1, self.staging.size)
        for lo in range(0, self.numel, w):
            hi = min(lo + w, self.numel)
            r = self.req(P.GetMaster(session=self.session, offset=lo, count=hi - lo))
            assert isinstance(r, P.Ok), r
            out[lo:hi] = self.staging[:hi - lo]
        return out

    def send_raw(self, data: bytes, timeout_s: float = 10.0) -> P.Message:
        self.s.send(data)
        assert self.s.poll(int(timeout_s * 1000)), "no reply"
        return P.decode(self.s.recv())

    def req(self, msg: P.Message, timeout_s: float = 30.0) -> P.Message:
        return self.send_raw(msg.encode(), timeout_s)

    def close(self, bye: bool = True):
        if bye:
            assert isinstance(self.req(P.Bye(session=self.session)), P.Ok)
        del self.grad, self.w16, self.staging, self.progress
        self.mm.close()
        self.s.close(linger=0)
        self.ctx.term()


def hello_error(address, **over):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    kw = dict(version=P.PROTOCOL_VERSION, token="", rank=0, world_size=1, numel=16, dtype="fp16", optimizer="adamw")
    kw.update(over)
    s.send(P.Hello(**kw).encode())
    assert s.poll(10000)
    r = P.decode(s.recv())
    s.close()
    ctx.term()
    return r


def test_steps_match_float64_adamw_and_skip_get_master(server):
    n = 10_001
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    # torch.optim's first step imports lazily (2.4 s measured, run alone), longer than this
    # fixture's heartbeat timeout for a client that sends no heartbeats: take it first
    warm = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    warm.grad = torch.zeros(1, dtype=torch.float64)
    torch.optim.AdamW([warm]).step()
    c = MiniClient(server.address, server.token, n, staging_numel=3000, **hp)  # 4 chunks, the last short
    try:
        assert c.staging.size == 3000
        c.init(p0)
        np.testing.assert_array_equal(c.w16, p0.astype(np.float16))
        ref = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
        for t in range(1, 11):
            g = rng.standard_normal(n).astype(np.float16)
            c.grad[t % 2][:] = g
            done = c.req(P.Step(session=c.session, step=t, grad_slot=t % 2, lr=1e-2, grad_scale=0.5))
            assert isinstance(done, P.Done) and done.step == t
            ref.grad = torch.tensor(g.astype(np.float64) * 0.5)
            opt.step()
        r = ref.detach().numpy()
        err = np.abs(c.w16.astype(np.float64) - r).max()
        assert err <= np.abs(r).max() * 2 ** -10  # fp16 rounding of the fp32 result
        # SKIP leaves the state as it is
        before_w = c.w16.copy()
        m1 = c.master()
        upd = np.linalg.norm(m1.astype(np.float64) - p0)
        assert np.linalg.norm(m1 - r) / upd < 1e-4  # update's relative error
        c.grad[1][:] = np.float16(np.inf)
        assert isinstance(c.req(P.Skip(session=c.session, step=11)), P.Ok)
        np.testing.assert_array_equal(c.master(), m1)
        np.testing.assert_array_equal(c.w16, before_w)
        st = c.req(P.Stats(session=c.session))
        assert st.updates == 10 and st.skipped == 1
        # out-of-order step is refused and changes nothing
        e = c.req(P.Step(session=c.session, step=13, grad_slot=0, lr=1e-2))
        assert isinstance(e, P.Error) and e.code == P.E_ORDER
    finally:
        c.close()


def wait_speculated(client, n: int, timeout_s: float = 30.0) -> None:
    """Until the server's speculation of the coming step has updated n elements."""
    deadline = time.monotonic() + timeout_s
    while client.stats().speculated < n:
        assert time.monotonic() < deadline, "speculation did not progress"
        time.sleep(0.002)


def test_speculation_kept_rolled_back_and_settled_bitwise(server):
    """SPECULATE against the same STEPs without it (a second shard), the rest of each
    step's gradients said final by the ready word: a matching STEP keeps the speculated
    prefix, a different grad_scale rolls it back, and SKIP and GET_MASTER settle a
    pending one first; the master and weights stay bitwise the reference's."""
    from zero_offload.server import ShardClient
    n = 5000
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    spec = ShardClient(server.address, server.token, numel=n, server_proc=server.proc, undo_log_bytes=1 << 20)
    ref = ShardClient(server.address, server.token, numel=n, server_proc=server.proc)
    try:
        for c in (spec, ref):
            c.init_weights(p0)
        for t in range(1, 7):
            g = rng.standard_normal(n).astype(np.float16)
            spec.grads[0].view(np.float16)[:] = g
            ref.grads[0].view(np.float16)[:] = g
            actual = 0.5 if t % 2 == 0 else 1.0  # even steps: "a clip fired", the assumption was wrong
            spec.announce(t, n // 3)
            spec.speculate(t, 0, 1e-2, 1.0, None, upto=n // 3)
            if t == 1:  # a second SPECULATE still counts
                spec.speculate(t, 0, 1e-2, 1.0, None, upto=n)
            else:       # the ready word, followed by the server's update thread
                spec.announce(t, n)
            wait_speculated(spec, n)  # else the STEP may come first and take the pieces over
            d = spec.step(t, 0, 1e-2, actual)
            ref.step(t, 0, 1e-2, actual)
            assert (d.speculated, d.rolled_back) == ((0, n) if t % 2 == 0 else (n, 0)), (t, d)
            np.testing.assert_array_equal(spec.weights16, ref.weights16)
        np.testing.assert_array_equal(spec.get_master(), ref.get_master())
        # a pending speculation: SKIP and GET_MASTER see the state as it was
        m0, w0 = ref.get_master(), ref.weights16.copy()
        spec.grads[0].view(np.float16)[:] = 1.0
        spec.speculate(7, 0, 1e-2, 1.0, None, upto=n)
        wait_speculated(spec, n)
        spec.skip(7)
        np.testing.assert_array_equal(spec.get_master(), m0)
        np.testing.assert_array_equal(spec.weights16, w0)
        spec.speculate(7, 0, 1e-2, 1.0, None, upto=n)
        wait_speculated(spec, n)
        np.testing.assert_array_equal(spec.get_master(), m0)
        # dropped, and counted: no undo log; an assumption that changes within a step
        ref.speculate(7, 0, 1e-2, 1.0, None, upto=n)
        spec.speculate(7, 0, 1e-2, 1.0, None, upto=n // 2)
        spec.speculate(7, 0, 2e-2, 1.0, None, upto=n)
        wait_speculated(spec, n // 2)
        st_ref, st_spec = ref.stats(), spec.stats()
        assert st_ref.speculate_dropped == 1 and "undo_log_bytes" in st_ref.last_drop_reason
        assert st_spec.speculate_dropped == 1 and "differs" in st_spec.last_drop_reason
        d = spec.step(7, 0, 2e-2)  # the first assumption (lr 1e-2) was wrong: rolled back
        assert (d.speculated, d.rolled_back) == (0, n // 2)
        ref.step(7, 0, 2e-2)
        np.testing.assert_array_equal(spec.get_master(), ref.get_master())
        np.testing.assert_array_equal(spec.weights16, ref.weights16)
    finally:
        spec.close()
        ref.close()


def test_handshake_refusals_allocate_nothing(server):
    segs = our_segments()
    r = hello_error(server.address, token="wrong")
    assert isinstance(r, P.Error) and r.code == P.E_AUTH
    r = hello_error(server.address, token=server.token, version=P.PROTOCOL_VERSION + 1)
    assert isinstance(r, P.Error) and r.code == P.E_VERSION and str(P.PROTOCOL_VERSION) in r.message
    r = hello_error(server.address, token=server.token, numel=1 << 39)
    assert isinstance(r, P.Error) and r.code == P.E_RESOURCE and "available" in r.message
    # the smaller state dtypes, with what each keeps per parameter (optimizer_server.state)
    assert "state_dtype='bf16' or 'int8' (6 or 4.03 B/param of optimizer state instead of 12" in r.message
    assert our_segments() == segs


def test_bad_messages_get_error_replies(server):
    c = MiniClient(server.address, server.token, 64)
    try:
        for data in [b"garbage", b"", msgpack_bytes({"t": "STEP"}), msgpack_bytes({"t": "X"}),
                     P.Step(session="nope", step=1, grad_slot=0, lr=0.1).encode(),
                     P.Step(session=c.session, step=1, grad_slot=0, lr=0.1).encode()]:  # before INIT
            r = c.send_raw(data)
            assert isinstance(r, P.Error), data
        c.s.send_multipart([b"a", b"b"])  # two frames
        assert c.s.poll(5000)
        assert isinstance(P.decode(c.s.recv()), P.Error)
    finally:
        c.close()


def msgpack_bytes(d):
    import msgpack
    return msgpack.packb(d)


CLIENT_SCRIPT = r"""
import sys, time, numpy as np
from zero_offload.server import ShardClient
c = ShardClient(sys.argv[1], sys.argv[2], numel=int(sys.argv[3]), rank=1, world_size=2)
c.init_weights(np.zeros(int(sys.argv[3]), np.float32))
print(c.segment_name, flush=True)
time.sleep(600)
"""


def test_two_clients_one_killed(server):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    victim = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, server.address, server.token, "5000"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        seg = victim.stdout.readline().strip()
        assert seg and os.path.exists(f"/dev/shm/{seg}")
        c = MiniClient(server.address, server.token, 3000, world_size=2)
        c.init(np.ones(3000, np.float32))
        victim.kill()
        victim.wait(10)
        t0 = time.monotonic()
        step = 0
        while os.path.exists(f"/dev/shm/{seg}"):
            step += 1
            c.grad[step % 2][:] = 1.0
            assert isinstance(c.req(P.Step(session=c.session, step=step, grad_slot=step % 2, lr=1e-3)), P.Done)
            assert time.monotonic() - t0 < 3.0, "dead worker's segment not freed within the heartbeat timeout"
        for _ in range(3):
            step += 1
            assert isinstance(c.req(P.Step(session=c.session, step=step, grad_slot=step % 2, lr=1e-3)), P.Done)
        c.close()
    finally:
        victim.kill()
        victim.wait(10)


def test_save_load_bitwise_equals_uninterrupted(tmp_path):
    n = 4099
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float16) for _ in range(15)]

    def run(c, steps):
        for t in steps:
            c.grad[t % 2][:] = grads[t - 1]
            assert isinstance(c.req(P.Step(session=c.session, step=t, grad_slot=t % 2, lr=3e-3)), P.Done)

    with spawn(threads=1) as srv:
        c = MiniClient(srv.address, srv.token, n)
        c.init(p0)
        run(c, range(1, 16))
        full = c.master()
        c.close()
    with spawn(threads=1) as srv:
        c = MiniClient(srv.address, srv.token, n)
        c.init(p0)
        run(c, range(1, 11))
        ok = c.req(P.Save(session=c.session, dir=str(tmp_path)))
        assert isinstance(ok, P.Ok), ok
        c.close()
    with spawn(threads=1) as srv:
        c = MiniClient(srv.address, srv.token, n)
        ok = c.req(P.Load(session=c.session, dir=str(tmp_path)))
        assert isinstance(ok, P.Ok) and ok.info["updates"] == 10
        run(c, range(11, 16))
        np.testing.assert_array_equal(c.master(), full)
        c.close()
        # a manifest from before protocol 14 says "steps" for the updates: it still loads
        mans = sorted(tmp_path.glob("shard-*.json"))
        assert mans
        for man in mans:
            d = json.loads(man.read_text())
            d["steps"] = d.pop("updates")
            man.write_text(json.dumps(d))
        c = MiniClient(srv.address, srv.token, n)
        ok = c.req(P.Load(session=c.session, dir=str(tmp_path)))
        assert isinstance(ok, P.Ok) and ok.info["updates"] == 10
        c.close()
        # a different layout is refused, naming both
        c = MiniClient(srv.address, srv.token, n + 1)
        e = c.req(P.Load(session=c.session, dir=str(tmp_path)))
        assert isinstance(e, P.Error) and e.code == P.E_CHECKPOINT and str(n) in e.message and str(n + 1) in e.message
        c.close()


def test_progress_word_tags_each_step_and_resets_on_init_and_load(server, tmp_path):
    """After STEP t's DONE the word reads (t << 40) | n; INIT and LOAD reset it, so a
    step number that repeats after a rollback cannot match a stale word."""
    n = 5000
    rng = seeded_rng()
    c = MiniClient(server.address, server.token, n, progress_block=512)
    try:
        c.progress[0] = 12345  # whatever was there: INIT clears it
        c.init(rng.standard_normal(n).astype(np.float32))
        assert int(c.progress[0]) == 0
        for t in range(1, 6):
            c.grad[t % 2][:] = rng.standard_normal(n).astype(np.float16)
            assert isinstance(c.req(P.Step(session=c.session, step=t, grad_slot=t % 2, lr=1e-3)), P.Done)
            assert int(c.progress[0]) == (t << 40) | n
            if t == 3:
                assert isinstance(c.req(P.Save(session=c.session, dir=str(tmp_path))), P.Ok)
        e = c.req(P.Step(session=c.session, step=6, grad_slot=0, lr=1e-3, weights_slot=1))  # HELLO asked for one slot
        assert isinstance(e, P.Error) and "weights_slot" in e.message
        assert isinstance(c.req(P.Skip(session=c.session, step=6)), P.Ok)
        assert int(c.progress[0]) == (5 << 40) | n  # a skip publishes nothing
        assert isinstance(c.req(P.Load(session=c.session, dir=str(tmp_path))), P.Ok)
        assert int(c.progress[0]) == 0
        c.grad[0][:] = rng.standard_normal(n).astype(np.float16)
        assert isinstance(c.req(P.Step(session=c.session, step=4, grad_slot=0, lr=1e-3)), P.Done)
        assert int(c.progress[0]) == (4 << 40) | n
        bad = c.req(P.Hello(version=P.PROTOCOL_VERSION, token=server.token, rank=0, world_size=1, numel=8,
                            dtype="fp16", optimizer="adamw", progress_block=-1))
        assert isinstance(bad, P.Error) and "progress_block" in bad.message
    finally:
        c.close()


def test_sigterm_cleans_up():
    srv = spawn(threads=1)
    c = MiniClient(srv.address, srv.token, 1000)
    seg = c.seg
    sock_path = srv.address[len("ipc://"):]
    assert os.path.exists(sock_path)
    assert os.stat(os.path.dirname(sock_path)).st_mode & 0o777 == 0o700
    assert os.stat(f"/dev/shm/{seg}").st_mode & 0o777 == 0o600
    c.close(bye=False)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(10) == 0
    assert not os.path.exists(sock_path)
    assert not os.path.exists(f"/dev/shm/{seg}")
    assert not os.path.exists(srv.address_file)
    srv.stop()


def test_second_server_on_same_address_refuses(tmp_path):
    addr = f"ipc://{tmp_path}/s.sock"
    with spawn(threads=1, address=addr) as a:
        with pytest.raises(RuntimeError, match="already serving"):
            spawn(threads=1, address=addr, log_level="INFO", stderr=subprocess.PIPE)
        # the first one still serves
        r = hello_error(a.address, token="x")
        assert isinstance(r, P.Error) and r.code == P.E_AUTH


def test_new_server_sweeps_a_killed_servers_segments(tmp_path):
    af = str(tmp_path / "srv.addr")
    srv = spawn(threads=1, address_file=af)
    c = MiniClient(srv.address, srv.token, 500)
    seg = c.seg
    c.close(bye=False)
    srv.proc.kill()
    srv.proc.wait(10)
    assert os.path.exists(f"/dev/shm/{seg}")  # nobody cleaned up after SIGKILL
    with spawn(threads=1, address_file=af) as srv2:
        assert not os.path.exists(f"/dev/shm/{seg}")
        assert not os.path.exists(srv.address[len("ipc://"):])  # and its socket directory
        assert srv2.address != srv.address
    srv.stop()


def test_staging_window_chunks_and_one_gradient_slot(server):
    """INIT and GET_MASTER through a window smaller than the shard: a chunk out of
    order, too long or past the end is refused naming the fix, and a partial INIT
    never lets a STEP through.  grad_slots=1 gives one gradient slot."""
    n = 2500
    rng = seeded_rng()
    p0 = rng.standard_normal(n).astype(np.float32)
    c = MiniClient(server.address, server.token, n, staging_numel=1000, grad_slots=1)
    try:
        assert len(c.grad) == 1 and c.staging.size == 1000
        c.staging[:] = p0[:1000]
        assert isinstance(c.req(P.Init(session=c.session, offset=0, count=1000)), P.Ok)
        for bad, match in [(P.Init(session=c.session, offset=2000, count=500), "expected offset 1000"),
                           (P.Init(session=c.session, offset=1000, count=1001), "does not fit"),
                           (P.Step(session=c.session, step=1, grad_slot=0, lr=1e-3), "before INIT")]:
            e = c.req(bad)
            assert isinstance(e, P.Error) and match in e.message, (bad, e)
        c.init(p0)  # from 0 again, all of it
        np.testing.assert_array_equal(c.master(), p0)
        np.testing.assert_array_equal(c.w16, p0.astype(np.float16))
        for bad, match in [(P.GetMaster(session=c.session, offset=2000, count=501), "does not fit"),
                           (P.Step(session=c.session, step=1, grad_slot=1, lr=1e-3), "grad_slots=2")]:
            e = c.req(bad)
            assert isinstance(e, P.Error) and match in e.message, (bad, e)
        c.grad[0][:] = rng.standard_normal(n).astype(np.float16)
        assert isinstance(c.req(P.Step(session=c.session, step=1, grad_slot=0, lr=1e-3)), P.Done)
        assert not np.array_equal(c.master(), p0)
    finally:
        c.close()


def test_segment_bytes_per_param():
    """Shared host RAM per parameter: one gradient slot + weights16 = 4 B (synchronous),
    6 with DPU's second gradient slot, 8 with the CPU worker's second weights slot."""
    from zero_offload.server.shm import ShardLayout
    n = 100_000_000
    for weights_slots, grad_slots, per_param in [(1, 1, 4), (1, 2, 6), (2, 2, 8), (2, 1, 6)]:
        assert ShardLayout(numel=n, weights_slots=weights_slots, grad_slots=grad_slots).total_bytes / n == pytest.approx(per_param, abs=1e-3)
    small = ShardLayout(numel=1000)  # the staging window (all 1000 fp32) is longer than the one slot
    assert small.weights_offsets[0] >= 4 * 1000 and small.staging_numel == 1000
    assert ShardLayout(numel=n, staging_numel=4096).staging_numel == 4096


# ----------------------------------------------------------------------------- parts of the server on their own
def _shard(numel=100, optimizer="adamw", dtype="fp16", **hello):
    from zero_offload.server import protocol as P
    from zero_offload.server.shard import Shard
    from zero_offload.server.shm import Segment, ShardLayout
    from tests.conftest import PREFIX
    msg = P.Hello(version=P.PROTOCOL_VERSION, token="t", rank=0, world_size=1, numel=numel, dtype=dtype,
                  optimizer=optimizer, **hello)
    layout = ShardLayout(numel=numel, weights_slots=msg.weights_slots, grad_slots=msg.grad_slots, staging_numel=40)
    seg = Segment.create(f"{PREFIX}unit-{os.getpid()}-{time.monotonic_ns()}", layout.total_bytes)
    return Shard("s", msg, seg, layout, 1)


def test_shard_state_table():
    from zero_offload.server import protocol as P
    from zero_offload.server.shard_phase import ShardPhase
    sh = _shard()
    try:
        step = lambda k, **kw: P.Step(session="s", step=k, grad_slot=kw.get("grad_slot", 0), lr=1e-3,  # noqa: E731
                                      weights_slot=kw.get("weights_slot", 0), predict=kw.get("predict", 0.0))
        assert sh.phase is ShardPhase.UNINITIALIZED and "before INIT" in sh.refusal("STEP")
        sh.staging[:40] = 1.0
        sh.init_chunk(0, 40)
        assert sh.phase is ShardPhase.UNINITIALIZED  # a partial master is never stepped on
        with pytest.raises(ValueError, match="in order"):
            sh.init_chunk(80, 20)
        sh.init_chunk(40, 40)
        sh.init_chunk(80, 20)
        assert sh.phase is ShardPhase.READY and sh.refusal("STEP") is None
        assert sh.accept_step(step(2))[0] == P.E_ORDER
        assert sh.accept_step(step(1, grad_slot=1))[0] == P.E_INVALID   # one gradient slot registered
        assert sh.accept_step(step(1, weights_slot=1))[0] == P.E_INVALID
        assert sh.phase is ShardPhase.READY  # refusals change nothing
        assert sh.accept_step(step(1)) is None and sh.phase is ShardPhase.UPDATING
        assert "still updating" in sh.refusal("GET_MASTER")
        sh.grads[0].view(np.float16)[:] = 0.5
        sh.step(step(1))
        sh.finish_update()
        assert sh.phase is ShardPhase.READY and sh.updates == 1
        assert "out of order" in sh.skip(3)
        assert sh.skip(2) is None and sh.skipped == 1 and sh.updates == 1  # SKIP moves only the count
        sh.staging[:40] = 2.0
        sh.init_chunk(0, 40)  # INIT again: partial again until its last chunk
        assert sh.phase is ShardPhase.UNINITIALIZED
    finally:
        sh.close()


def test_shard_speculation_states():
    """The SPECULATING rows of the shard's table, on the shard alone."""
    from zero_offload.server import protocol as P
    from zero_offload.server.shard_phase import ShardPhase
    sh = _shard(undo_log_bytes=1 << 16)
    try:
        spec = lambda k, upto, lr=1e-3: P.Speculate(session="s", step=k, grad_slot=0, lr=lr, upto=upto)  # noqa: E731
        assert isinstance(sh.accept_speculation(spec(1, 50)), str)  # before INIT: dropped
        sh.staging[:40] = 1.0
        for lo in (0, 40, 80):
            sh.init_chunk(lo, min(40, 100 - lo))
        assert "out of order" in sh.accept_speculation(spec(2, 50))
        assert sh.phase is ShardPhase.READY
        assert sh.accept_speculation(spec(1, 50)) == [(0, 50)] and sh.phase is ShardPhase.SPECULATING
        assert sh.accept_speculation(spec(1, 30)) is None       # nothing new
        assert "differs" in sh.accept_speculation(spec(1, 90, lr=2e-3))
        assert sh.accept_speculation(spec(1, 100)) == [(50, 100)]
        sh.grads[0].view(np.float16)[:] = 0.5
        m0 = sh.arrays.master.copy()
        assert sh.arrays.twin is not None  # a log for all of it: the new state goes to the twin
        sh.speculate(0, 50)
        t = sh.arrays.twin["master"]
        assert not np.array_equal(t[:50], m0[:50]) and np.array_equal(sh.arrays.master, m0)
        assert sh.rollback() == 50 and sh.phase is ShardPhase.READY   # SKIP, GET_MASTER, ...: settled
        np.testing.assert_array_equal(sh.arrays.master, m0)
        assert sh.accept_speculation(spec(1, 100)) == [(0, 100)]
        sh.speculate(0, 100)
        assert sh.accept_step(P.Step(session="s", step=1, grad_slot=0, lr=1e-3)) is None
        assert sh.phase is ShardPhase.UPDATING
        sh.step(P.Step(session="s", step=1, grad_slot=0, lr=1e-3))
        assert (sh.last_speculated, sh.last_rolled_back) == (100, 0) and sh.undo.empty
        sh.finish_update()
        assert sh.phase is ShardPhase.READY and sh.speculative is None
        # an undo log too small for the piece: as much as fits, then no more this step
        small = _shard(undo_log_bytes=14 * 30)  # fp32 master, m, v and the fp16 weights: 14 B/element
        try:
            small.staging[:40] = 1.0
            for lo in (0, 40, 80):
                small.init_chunk(lo, min(40, 100 - lo))
            assert small.accept_speculation(spec(1, 100)) == [(0, 100)]
            small.speculate(0, 100)
            assert small.speculative.done == 30 and small.speculative.full
            assert small.accept_speculation(spec(1, 100)) is None
        finally:
            small.close()
    finally:
        sh.close()



def _init_ones(sh) -> None:
    """INIT a unit shard (staging of 40) with a master of ones."""
    sh.staging[:40] = 1.0
    for lo in range(0, sh.numel, 40):
        sh.init_chunk(lo, min(40, sh.numel - lo))


def _speculating_pair(n: int, spec_hello: dict, **hello) -> list:
    """[a shard with an undo log for all of it (and spec_hello), its reference without],
    both INIT to ones, with the same seeded gradients in slot 0."""
    shards = [_shard(numel=n, undo_log_bytes=1 << 30, **spec_hello, **hello), _shard(numel=n, **hello)]
    try:
        g = (seeded_rng().standard_normal(n) * 0.1).astype(np.float16)
        for sh in shards:
            _init_ones(sh)
            sh.grads[0].view(np.float16)[:] = g
    except BaseException:
        for sh in shards:
            sh.close()
        raise
    return shards


def _master(sh) -> np.ndarray:
    """The shard's fp32 master (joined, for the exact master)."""
    out = np.empty(sh.numel, np.float32)
    sh.arrays.get_master(0, out, sh.weights16_slots)
    return out


def _step_both(shards, step) -> None:
    """The same STEP on a speculating shard and its reference: the same bytes after."""
    for sh in shards:
        assert sh.accept_step(step) is None
        sh.step(step)
        sh.finish_update()
    sp, ref = shards
    for a, b in [(_master(sp), _master(ref)), (sp.weights16, ref.weights16)] + \
            [(sp.arrays.moments[k], ref.arrays.moments[k]) for k in ref.arrays.moments]:
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), step.step


SUBPIECE_CASES = {  # HELLO of each: the twin, the undo log, the twin of bf16 state with the exact master
    "twin": dict(optimizer="adamw"),
    "undo-log": dict(optimizer="lion"),
    "twin-bf16-exact": dict(optimizer="adamw", dtype="bf16", state_dtype="bf16", exact_master=True),
    "twin-two-slots": dict(optimizer="adamw", weights_slots=2),  # the out slot is not the worker's: not logged
    "undo-log-two-slots": dict(optimizer="lion", weights_slots=2),  # master and m only
}


@pytest.mark.parametrize("case", list(SUBPIECE_CASES))
def test_speculation_in_sub_pieces_writes_the_bytes_of_one_update(monkeypatch, case):
    """A speculative piece saved and updated sub-piece by sub-piece (SPEC_SUBPIECE, here
    cut to 256 elements) leaves the bytes one update of the piece leaves, and a
    rollback restores every sub-piece; the undo log is capped at one whole update's
    writes and its pages are committed before the first piece, not during it.  AdamW
    with fp32 state writes the new state into the state's twin and logs only the
    weights slot (bf16 state with the exact master: its remainder and moments); Lion
    logs what it overwrites (master, m and the weights)."""
    import zero_offload.server.shard_speculation as S
    from zero_offload.server import protocol as P
    monkeypatch.setattr(S, "SPEC_SUBPIECE", 256)
    n = 1000
    hello = SUBPIECE_CASES[case]
    out = hello.get("weights_slots", 1) - 1  # of two slots, the one the worker does not compute with
    spec = P.Speculate(session="s", step=1, grad_slot=0, lr=1e-3, upto=n, weights_slot=out)
    shards = _speculating_pair(n, {}, **hello)
    try:
        sp, ref = shards
        twin = hello["optimizer"] == "adamw"
        logged = (0 if twin else 2) + (1 - out)  # arrays saved per sub-piece
        assert (sp.arrays.twin is not None) == twin
        # the twin's state is mirrored beside itself, not logged; Lion's fp32 master and m
        # are (8 B); the 16-bit weights (2 B) only when there is one slot
        assert sp.undo.capacity == ((0 if twin else 8) + 2 * (1 - out)) * n and not sp.undo.faulted
        m0 = _master(sp)
        assert sp.accept_speculation(spec) == [(0, n)]
        sp.speculate(0, n)  # four sub-pieces
        assert sp.undo.faulted and len(sp.undo._entries) == 4 * logged
        assert sp.rollback() == n
        np.testing.assert_array_equal(_master(sp), m0)
        assert sp.accept_speculation(spec) == [(0, n)]
        sp.speculate(0, n)
        _step_both(shards, P.Step(session="s", step=1, grad_slot=0, lr=1e-3, weights_slot=out))
        assert (sp.last_speculated, sp.last_rolled_back) == (n, 0)
        assert np.array_equal(sp.weights16_slots[out], ref.weights16_slots[out])
    finally:
        for sh in shards:
            sh.close()


def test_shard_follows_the_ready_word_of_its_step_only():
    """After a step's first SPECULATE the update thread speculates on as the worker's
    ready word grows (the tag names the step: another step's word counts for nothing),
    and stops when the word stops growing, when the STEP or any other request closes
    the speculation, or at the shard's end; the result is the bytes of a STEP alone."""
    from zero_offload.kernels import cpu_adam
    from zero_offload.server import protocol as P
    n = 1000
    spec = P.Speculate(session="s", step=1, grad_slot=0, lr=1e-3, upto=100)
    shards = _speculating_pair(n, dict(progress_block=128))
    try:
        sp = shards[0]
        ran = []

        def follow(step=1):
            sp.follow(step, poll_s=0.0, idle_s=0.05, run=lambda a, b: (ran.append((a, b)), sp.speculate(a, b)))
        cpu_adam.store_progress(sp.ready, tag=0, done=n)  # an older step's word: not this one's
        for a, b in sp.accept_speculation(spec):
            sp.speculate(a, b)
        follow()  # nothing new for step 1: returns after idle_s
        assert sp.speculative.done == 100 and ran == []
        cpu_adam.store_progress(sp.ready, tag=1, done=300)
        follow()  # a piece at most a progress block long
        assert sp.speculative.done == 300 and ran == [(100, 228), (228, 300)]
        cpu_adam.store_progress(sp.ready, tag=1, done=n)
        sp.stop_following()  # a request came: what the word says more is left to the STEP
        follow()
        assert sp.speculative.done == 300 and len(ran) == 2
        _step_both(shards, P.Step(session="s", step=1, grad_slot=0, lr=1e-3))
        assert sp.last_speculated == 300
        # step 2: the word grows to the end, and following stops there
        spec2 = P.Speculate(session="s", step=2, grad_slot=0, lr=1e-3, upto=0)
        assert sp.accept_speculation(spec2) is None and sp.speculative is not None  # nothing final yet
        cpu_adam.store_progress(sp.ready, tag=2, done=n)
        follow(2)
        assert sp.speculative.done == n
        _step_both(shards, P.Step(session="s", step=2, grad_slot=0, lr=1e-3))
        assert sp.last_speculated == n
    finally:
        for sh in shards:
            sh.close()

def test_shutdown_does_not_wait_for_a_stuck_update_without_bound(tmp_path, monkeypatch):
    """SHUTDOWN_UPDATE_WAIT_S bounds the wait for the update in flight: an update
    thread that never returns is abandoned (its segment unlinked), not joined."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import zero_offload.server.server as S
    from zero_offload.server.config import ServerConfig
    monkeypatch.setattr(S, "SHUTDOWN_UPDATE_WAIT_S", 0.3)
    srv = S.OptimizerServer(ServerConfig(address_file=str(tmp_path / "srv.addr"), log_level="ERROR"))
    srv.bind()
    sh = _shard()
    release = threading.Event()
    ex = ThreadPoolExecutor(1)
    srv.shards["s"], srv.executors["s"] = sh, ex
    sh.phase = sh.phase.__class__.UPDATING
    srv.pending["s"] = ex.submit(release.wait, 60)  # an update that does not come back
    t0 = time.monotonic()
    try:
        srv.shutdown()
        took = time.monotonic() - t0
    finally:
        release.set()
        ex.shutdown(wait=True)
    assert took < 5.0 and srv.abandoned, took
    assert not (tmp_path / "srv.addr").exists()  # the rest of the clean-up still ran


def test_server_files_survive_a_removed_directory(tmp_path):
    """The spawning parent removes the address file's directory at its exit; a
    server writing its registry then is at a normal end, not an error."""
    from zero_offload.server.files import ServerFiles
    d = tmp_path / "spawn"
    d.mkdir()
    f = ServerFiles(str(d / "server.addr"))
    f.publish("ipc:///x", "tok", [], "")
    assert (d / "server.addr.segments").exists() and oct((d / "server.addr.token").stat().st_mode)[-3:] == "600"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()
    f.write_registry(["zo-x"], "")  # no FileNotFoundError
    f.remove()


def test_a_spawned_server_has_a_session_of_its_own():
    """Ctrl-C at the terminal reaches the training process, which stops its server;
    the server does not get the SIGINT itself and race that clean-up."""
    with spawn(threads=1) as srv:
        assert os.getsid(srv.pid) != os.getsid(0) and os.getsid(srv.pid) == srv.pid


def test_twin_keeps_a_range_without_gradient_past_the_speculated_prefix():
    """With the twin, the STEP writes what speculation left into the twin too, and that
    includes ranges that got no gradient (copied, not updated): after the flip the
    state is byte for byte that of a STEP alone, master, moments and weights."""
    from zero_offload.server import protocol as P
    n, d = 1000, 500

    def groups(second):
        return [[0, d, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1], [d, n - d, 1e-3, 0.9, 0.999, 1e-8, 0.01, second]]
    shards = [_shard(numel=n, undo_log_bytes=1 << 30), _shard(numel=n)]
    try:
        rng = seeded_rng()
        for sh in shards:
            _init_ones(sh)
        for t in (1, 2):
            g = (rng.standard_normal(n) * 0.1).astype(np.float16)
            step = P.Step(session="s", step=t, grad_slot=0, lr=1e-3, groups=groups(0 if t == 2 else 1))
            for sh in shards:
                sh.grads[0].view(np.float16)[:] = g
            sp, ref = shards
            assert sp.arrays.twin is not None
            # speculated as if every parameter got a gradient; the STEP says the second
            # range got none (on step 2), which lies past the speculated prefix
            assert sp.accept_speculation(P.Speculate(session="s", step=t, grad_slot=0, lr=1e-3, upto=d,
                                                     groups=groups(1))) == [(0, d)]
            sp.speculate(0, d)
            _step_both(shards, step)
            assert (sp.last_speculated, sp.last_rolled_back) == (d, 0)
    finally:
        for sh in shards:
            sh.close()


def test_update_rules_cover_exactly_what_hello_accepts():
    """One update rule per optimizer x state dtype that HELLO admits, and none for the
    rest: a combination HELLO lets through always has its kernel.  (Mutation: dropping
    ("lion", "int8") from update_rules.RULES, or admitting adagrad with bf16 state in
    protocol.COMPACT_OPTIMIZERS, fails it.)"""
    from zero_offload.server import protocol as P
    from zero_offload.server.update_rules import RULES, rule_for
    admitted = set()
    for opt in P.OPTIMIZERS:
        for sd in P.STATE_DTYPES:
            hello = dict(version=P.PROTOCOL_VERSION, token="t", rank=0, world_size=1, numel=256, dtype="bf16",
                         optimizer=opt, state_dtype=sd)
            try:
                P.Hello(**hello).validate()
            except P.ProtocolError:
                continue
            admitted.add((opt, sd))
            assert rule_for(opt, sd).blockwise == (sd == "int8")
    assert set(RULES) == admitted
    with pytest.raises(ValueError, match="no update rule"):
        rule_for("adagrad", "bf16")


@pytest.mark.parametrize("hello", [dict(), dict(dtype="bf16", state_dtype="bf16", exact_master=True),
                                   dict(dtype="bf16", state_dtype="int8", exact_master=True)],
                         ids=["fp32-state", "bf16-exact", "int8-exact"])
def test_load_reads_its_file_once_and_a_corrupt_one_changes_nothing(tmp_path, monkeypatch, hello):
    """LOAD of the shard's own file (same world size, same state dtype) in one pass: read
    into a new state while its checksum is computed (the exact master split on the
    reading threads, its high halves staged), swapped in once it verifies (passes=1,
    bitwise the two-pass load, which it takes where the server admits no second state,
    room=0).  A flipped bit, in the moments or in the master, is refused naming the file,
    with the running master, moments and weights slot untouched.  Reads of 4 KiB, so the
    file comes in many pieces on several threads.  (Mutations: swapping the new state in
    before the checksum is compared: the corrupt file's bytes reach the state; the split
    writing the high halves straight into the weights slot: a corrupt master changes it.)"""
    from zero_offload.server import checkpoint as C
    from zero_offload.server import ckpt_io
    monkeypatch.setattr(ckpt_io, "IO_CHUNK_BYTES", 4096)
    n = 5000
    rng = seeded_rng()
    sh = _shard(numel=n, **hello)

    def step(scale: float = 0.1) -> None:  # one STEP on fresh seeded gradients
        g = (rng.standard_normal(n) * scale).astype(np.float32)
        sh.grads[0][:] = g.astype(np.float16).view(np.uint16) if sh.dtype == "fp16" else \
            (g.view(np.uint32) >> 16).astype(np.uint16)
        msg = P.Step(session="s", step=sh.updates + 1, grad_slot=0, lr=1e-2)
        assert sh.accept_step(msg) is None
        sh.step(msg)
        sh.finish_update()
    try:
        _init_ones(sh)
        step()
        step()
        sh.save(str(tmp_path / "ck"))
        saved = [_master(sh).copy()] + [a.copy() for a in sh.arrays.moments.values()]
        w_saved = sh.weights16.copy()
        step()  # away from the saved state
        moved = [_master(sh).copy()] + [a.copy() for a in sh.arrays.moments.values()]
        assert not np.array_equal(moved[0], saved[0])
        info = sh.load(str(tmp_path / "ck"), room=1 << 40)
        assert info["passes"] == 1
        got = [_master(sh)] + list(sh.arrays.moments.values())
        for a, b in zip(got, saved):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        assert np.array_equal(sh.weights16, w_saved)
        assert sh.load(str(tmp_path / "ck"), room=0)["passes"] == 2  # no room: verify, then read
        # room for a second state only: the exact master's staged high halves do not fit
        assert sh.load(str(tmp_path / "ck"), room=sh.arrays.state_bytes)["passes"] == (
            2 if sh.arrays.exact_master else 1)
        for a, b in zip([_master(sh)] + list(sh.arrays.moments.values()), saved):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        # a flipped bit in the moments, then in the master: refused, nothing changed
        step()
        before = [_master(sh).copy()] + [a.copy() for a in sh.arrays.moments.values()] + [sh.weights16.copy()]
        f = tmp_path / "ck" / "shard-r0-of-1.bin"
        good = f.read_bytes()
        for at in (len(good) * 2 // 3, 4 * (n // 2) + 3):  # a moment's byte; a master's high half
            data = bytearray(good)
            data[at] ^= 0x04
            f.write_bytes(bytes(data))
            with pytest.raises(C.CheckpointError, match="shard-r0-of-1.bin is corrupt"):
                sh.load(str(tmp_path / "ck"), room=1 << 40)
            after = [_master(sh)] + list(sh.arrays.moments.values()) + [sh.weights16]
            for a, b in zip(after, before):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    finally:
        sh.close()


def test_the_parent_of_a_killed_server_sweeps_its_segments():
    """A SIGKILLed server cannot unlink its segments; each worker does when it sees the
    death, but one that is stopped first (torchrun stops the other ranks when one raises)
    never sees it.  The handle that spawned the server sweeps what the dead server's
    registry names when it stops it.  (Mutation: ServerHandle.stop without the sweep: the
    segment stays.)"""
    from zero_offload.server.client import ShardClient
    before = set(our_segments())
    srv = spawn(threads=1)
    c = ShardClient(srv.address, srv.token, numel=4096, server_proc=srv.proc)
    made = set(our_segments()) - before
    assert len(made) == 1
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(30)
    srv.stop()  # (the client has made no request since: it has not looked)
    assert set(our_segments()) - before == set()
    c.close()
