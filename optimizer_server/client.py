"""Worker-side client of the optimizer server (one shard per client).

Importable without torch: it exposes the shared segment as NumPy arrays, and the
runtime wraps those in tensors.  Every wait is bounded; while it waits the client
checks that the server process still lives, and declares it dead only on evidence:
a child's exit status, or (same node: an ipc:// or loopback address) its pid gone,
each within LIVENESS_POLL_S.  Only where neither can be seen (a tcp peer on another
node) does silence count: no heartbeat reply for HEARTBEAT_DEAD_AFTER_S.  So a dead
server surfaces as OptimizerServerDeadError instead of a hang, and a live one busy
with a long request is never declared dead, nor are its segment and socket removed.

Waits scale with the work: a request fails with OptimizerServerTimeoutError only
when request_timeout_s pass with no progress, where progress is the server's
HEARTBEAT_OK.work growing (checkpoint bytes moved, updates done) or the progress
word moving (a STEP publishing its blocks).  A 10B-parameter LOAD takes minutes and
is never cut short while its bytes flow.

Timeouts: a wait for DONE that times out leaves the step in flight, and
wait_done() may simply be called again (the reply is not lost; every other
request is refused until then, naming wait_done).  Any other request that times
out leaves a reply the client can no longer pair with its request, so the
client refuses further use with an error naming the fix (reconnect: a new
client, or restart and load_checkpoint).
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import zmq

from zero_offload.kernels.cpu_adam import load_progress, store_progress

from . import protocol as P
from .config import LOOPBACK_HOSTS, tcp_host
from .errors import OptimizerServerDeadError, OptimizerServerError, OptimizerServerTimeoutError
from .ipc import remove_dead_server_files
from .procs import describe_exit, pid_alive
from .shm import Segment
from .shm import unlink as shm_unlink

HEARTBEAT_INTERVAL_S = 1.0        # well under the server's default 5 s timeout
LIVENESS_POLL_S = 0.05            # how often a blocked wait checks the server
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # bound on a wait with no progress (see the module docstring)
HEARTBEAT_DEAD_AFTER_S = 10.0     # no heartbeat reply this long (tcp, other node only) = dead


class ShardClient:
    """Register one shard with a server and drive it.

    grads[slot], weights16 (uint16 words of fp16/bf16) and staging (float32) are
    NumPy views onto the shared segment; see optimizer_server.protocol for who
    writes what when.
    """

    def __init__(self, address: str, token: str, spec: P.ShardSpec | None = None, *,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, server_proc=None,
                 heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S, **spec_fields):
        """spec: the shard to register (protocol.ShardSpec), or its fields as keywords
        (numel=..., state_dtype=...: what scripts and tests write)."""
        if spec is None:
            spec = P.ShardSpec(**spec_fields)
        elif spec_fields:
            raise TypeError("pass either spec=ShardSpec(...) or its fields as keywords, not both")
        self.address = address
        self.token = token
        self.request_timeout_s = request_timeout_s
        self._proc = server_proc  # a Popen when we spawned the server: exact exit status
        self._ctx = zmq.Context()
        self._sock = self._new_socket()
        self._poller = zmq.Poller()  # one poller, reused: Socket.poll() would build one per call
        self._poller.register(self._sock, zmq.POLLIN)
        self._closed = False
        self._dead: OptimizerServerDeadError | None = None
        self._broken: str | None = None  # a request timed out: its late reply would answer the next one
        self.server_pid = 0
        self._hb_last_ok = time.monotonic()
        self._work = -1                        # the last HEARTBEAT_OK.work
        self._save_hint = ("idle", "", -1)     # the last HEARTBEAT_OK.save_state, save_error, save_crc
        self._save_seq = 0                     # the newest SAVE's seq (its OK)
        self._progress_seen = (-1, -1)         # (work, progress word) when last looked at
        self._progress_t = time.monotonic()    # when they last changed
        self.segment: Segment | None = None
        self.progress = None
        self._inflight: int | None = None  # step number of a STEP awaiting DONE
        hello = P.Hello(version=P.PROTOCOL_VERSION, token=token, pid=os.getpid(), **spec.spec_fields())
        try:
            ok = self._request(hello, P.HelloOk, timeout_s=30.0)
        except BaseException:
            self._close_sockets()
            raise
        self.session = ok.session
        self.server_pid = ok.server_pid
        self.numel = ok.numel
        self.segment_name = ok.segment
        self.segment = Segment.attach(ok.segment, ok.segment_bytes)
        n = ok.numel
        self.grads = [self.segment.array(np.uint16, off, n) for off in ok.grad_offsets]
        self.weights16_slots = [self.segment.array(np.uint16, off, n) for off in ok.weights_offsets]
        self.weights16 = self.weights16_slots[0]
        self.staging = self.segment.array(np.float32, ok.staging_offset, ok.staging_numel)
        self.progress = self.segment.array(np.uint64, ok.progress_offset, 1)
        self.ready = self.segment.array(np.uint64, ok.ready_offset, 1)  # this worker writes it
        self._hb_stop = threading.Event()
        self._hb_interval_s = heartbeat_interval_s
        self._hb = threading.Thread(target=self._heartbeat_loop, name="zo-heartbeat", daemon=True)
        self._hb.start()

    # ------------------------------------------------------------------ plumbing
    def _new_socket(self):
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.address)
        return s

    @property
    def same_node(self) -> bool:
        """The server runs on this node (ipc://, or tcp to a loopback address): its pid
        is evidence of its life."""
        if self.address.startswith("ipc://"):
            return True
        return tcp_host(self.address) in LOOPBACK_HOSTS

    @property
    def _sees_process(self) -> bool:
        """The server's process can be watched: our child, or its pid on this node."""
        return self._proc is not None or bool(self.server_pid) and self.same_node

    def _death_evidence(self) -> str | None:
        """How the server's process ended, where it can be seen (our child's exit status,
        or its pid on this node); None while it runs or where it cannot be seen."""
        if self._proc is not None:
            rc = self._proc.poll()
            return describe_exit(rc) if rc is not None else None
        if self._sees_process and not pid_alive(self.server_pid):
            return "is no longer running"
        return None

    def _server_gone(self) -> str | None:
        """Why the server is known to be dead, or None while it lives (or may)."""
        if self._sees_process:
            return self._death_evidence()
        # a peer on another node: silence is the only evidence there is
        if self.server_pid and time.monotonic() - self._hb_last_ok > HEARTBEAT_DEAD_AFTER_S:
            return f"has not answered heartbeats for {HEARTBEAT_DEAD_AFTER_S:.0f} s"
        return None

    def _raise_dead(self, why: str) -> None:
        # A dead server cannot clean up any more: the worker knows its segment's name
        # and socket path, and removes them so nothing stays in /dev/shm or /tmp.  Only
        # on evidence of its death: the creator alone unlinks a segment while it runs.
        if self._death_evidence() is not None:
            if self.segment is not None:
                shm_unlink(self.segment.name)
            if self.address.startswith("ipc://"):
                remove_dead_server_files(self.address[len("ipc://"):], self.server_pid)
        self._dead = OptimizerServerDeadError(
            f"optimizer server at {self.address} (pid {self.server_pid or '?'}) {why}; restart it and resume "
            f"from the last checkpoint (engine.load_checkpoint)")
        raise self._dead

    def _progressed(self) -> float:
        """When the server last showed progress (HEARTBEAT_OK.work or the progress word)."""
        word = int(self.progress[0]) if self.progress is not None else -1
        sig = (self._work, word)
        if sig != self._progress_seen:
            self._progress_seen, self._progress_t = sig, time.monotonic()
        return self._progress_t

    def _recv(self, expect: type, timeout_s: float):
        start = time.monotonic()
        while True:
            if self._poller.poll(int(LIVENESS_POLL_S * 1000)):
                msg = P.decode(self._sock.recv())
                if isinstance(msg, P.Error):
                    if msg.code == P.E_SESSION and (why := self._server_gone()):
                        # a server restarted at our address got the request our dead one
                        # never read (the socket reconnects by itself): the death is the error
                        self._raise_dead(why)
                    raise OptimizerServerError(f"optimizer server: {msg.message}", code=msg.code)
                if not isinstance(msg, expect):
                    raise OptimizerServerError(f"expected {expect.TYPE}, got {msg.TYPE} (a reply out of turn)",
                                               code=P.E_ORDER)
                return msg
            why = self._server_gone()
            if why:
                self._raise_dead(why)
            now = time.monotonic()
            if now - max(start, self._progressed()) > timeout_s:
                raise OptimizerServerTimeoutError(
                    f"optimizer server at {self.address} made no progress for {timeout_s:.0f} s (it is alive; "
                    f"raise request_timeout_s, the bound on a wait without progress, if it is this slow)")

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise OptimizerServerError("client is closed")
        if self._broken is not None:
            raise OptimizerServerError(f"this client is no longer usable: {self._broken}; close it and connect a new "
                                       f"one (or restart the server and load_checkpoint)", code=P.E_TIMEOUT)

    def _request(self, msg: P.Message, expect: type, timeout_s: float | None = None):
        self._check_usable()
        if self._inflight is not None:
            raise OptimizerServerError(f"{msg.TYPE} while step {self._inflight} is in flight: call wait_done() first",
                                       code=P.E_ORDER)
        self._sock.send(msg.encode())
        try:
            return self._recv(expect, self.request_timeout_s if timeout_s is None else timeout_s)
        except OptimizerServerTimeoutError:
            self._broken = f"{msg.TYPE} timed out and its reply may still come"
            raise

    def _heartbeat_loop(self) -> None:
        sock = self._new_socket()
        try:
            hb = P.Heartbeat(session=self.session).encode()
            while not self._hb_stop.wait(self._hb_interval_s):
                sock.send(hb)
                if sock.poll(int(self._hb_interval_s * 2000), zmq.POLLIN):
                    reply = P.decode(sock.recv())
                    self._hb_last_ok = time.monotonic()
                    if isinstance(reply, P.HeartbeatOk):
                        self._work = reply.work
                        if reply.save_seq >= self._save_seq:  # not a late word about an older save
                            self._save_hint = (reply.save_state, reply.save_error, reply.save_crc)
        except zmq.ZMQError:
            pass
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------ requests
    def init_chunks(self):
        """The (lo, hi) shard ranges, in order, in which the initial fp32 master goes
        through the staging window: write staging[:hi - lo], then init_chunk(lo, hi)."""
        w = max(1, self.staging.size)
        return [(lo, min(lo + w, self.numel)) for lo in range(0, max(self.numel, 1), w)]

    def init_chunk(self, lo: int, hi: int) -> None:
        """INIT: staging[:hi - lo] holds master[lo:hi]; the chunk reaching numel ends it."""
        self._request(P.Init(session=self.session, offset=lo, count=hi - lo), P.Ok)

    def init_weights(self, fp32: np.ndarray) -> None:
        """Send the whole initial fp32 master (numel elements), chunk by chunk."""
        src = np.asarray(fp32, np.float32).reshape(-1)
        if src.size != self.numel:
            raise ValueError(f"init_weights got {src.size} weights for a shard of {self.numel}")
        for lo, hi in self.init_chunks():
            np.copyto(self.staging[:hi - lo], src[lo:hi])
            self.init_chunk(lo, hi)

    def _send_step(self, cls, what: str, step: int, grad_slot: int, lr: float, grad_scale: float, hparams: dict | None,
                   predict: float, weights_slot: int, groups: list | None, reverse: bool, **extra) -> None:
        """STEP or SPECULATE (the same fields): out, with nothing in flight."""
        self._check_usable()
        if self._inflight is not None:
            raise OptimizerServerError(f"{what} sent while step {self._inflight} is in flight", code=P.E_ORDER)
        self._sock.send(cls(session=self.session, step=step, grad_slot=grad_slot, lr=float(lr), grad_scale=float(grad_scale),
                            hparams=dict(hparams or {}), predict=float(predict), weights_slot=weights_slot,
                            groups=list(groups or []), reverse=bool(reverse), **extra).encode())

    def step_async(self, step: int, grad_slot: int, lr: float, grad_scale: float = 1.0, hparams: dict | None = None,
                   predict: float = 0.0, weights_slot: int = 0, groups: list | None = None, reverse: bool = False):
        self._send_step(P.Step, f"step {step}", step, grad_slot, lr, grad_scale, hparams, predict, weights_slot, groups, reverse)
        self._inflight = step

    def speculate(self, step: int, grad_slot: int, lr: float, grad_scale: float, hparams: dict | None, *, upto: int,
                  predict: float = 0.0, weights_slot: int = 0, groups: list | None = None, reverse: bool = False) -> None:
        """SPECULATE (one-way, never answered): the gradients of [0, upto) are final in
        `grad_slot`, and these are the values step_async is expected to send."""
        self._send_step(P.Speculate, "SPECULATE", step, grad_slot, lr, grad_scale, hparams, predict, weights_slot, groups,
                        reverse, upto=int(upto))

    def announce(self, step: int, upto: int) -> None:
        """The gradients of [0, upto) are final in the slot of step's coming STEP: the
        ready word (optimizer_server.shm), which the server follows after step's first
        SPECULATE.  Call it before that SPECULATE too, so that it says this step."""
        self._check_usable()
        store_progress(self.ready, tag=step, done=int(upto))

    def wait_done(self, timeout_s: float | None = None) -> P.Done:
        self._check_usable()
        if self._inflight is None:
            raise OptimizerServerError("wait_done() with no step in flight", code=P.E_ORDER)
        try:
            done = self._recv(P.Done, self.request_timeout_s if timeout_s is None else timeout_s)
        except OptimizerServerTimeoutError:
            raise  # the step stays in flight: wait_done() again reads its DONE
        except OptimizerServerError:
            self._inflight = None  # the server answered (an ERROR): nothing is in flight any more
            raise
        assert done.step == self._inflight, (done.step, self._inflight)
        self._inflight = None
        return done

    @property
    def in_flight(self) -> int | None:
        return self._inflight

    def published(self, step: int) -> int:
        """Elements of weights16 that already hold step's new weights (it may still be
        running; see the progress word in optimizer_server.shm).  0 for another step's."""
        return load_progress(self.progress, tag=step)

    def reply_ready(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for a reply to arrive (it is not read); checks liveness."""
        self._check_usable()
        if self._poller.poll(max(0, int(timeout_s * 1000))):
            return True
        why = self._server_gone()
        if why:
            self._raise_dead(why)
        return False

    def step(self, step: int, grad_slot: int, lr: float, grad_scale: float = 1.0, hparams: dict | None = None) -> P.Done:
        self.step_async(step, grad_slot, lr, grad_scale, hparams)
        return self.wait_done()

    def skip(self, step: int) -> None:
        self._check_usable()
        self._request(P.Skip(session=self.session, step=step), P.Ok)

    def release_twin(self) -> int:
        """RELEASE_TWIN: this shard will not be speculated on again; the server frees the
        twin of the state and the undo log.  Returns the bytes it let go of."""
        self._check_usable()
        ok = self._request(P.ReleaseTwin(session=self.session), P.Ok)
        return int(ok.info.get("released_bytes", 0))

    def get_master(self) -> np.ndarray:
        """A copy of the fp32 master weights of this shard (fetched window by window)."""
        self._check_usable()
        out = np.empty(self.numel, np.float32)
        w = max(1, self.staging.size)
        for lo in range(0, self.numel, w):
            hi = min(lo + w, self.numel)
            self._request(P.GetMaster(session=self.session, offset=lo, count=hi - lo), P.Ok)
            out[lo:hi] = self.staging[:hi - lo]
        return out

    def save(self, directory: str, background: bool = False, pieces=None) -> dict:
        """SAVE this shard into directory (made absolute here: the server's cwd is not
        ours).  background: the reply comes once the save has started; save_status()
        says when it is done, and STEPs may run meanwhile.  pieces (a piece_map.PieceMap):
        into the shared one-rank file there, at the map's places (SAVE.pieces)."""
        self._check_usable()
        placed = {} if pieces is None else {"pieces": pieces.to_bytes(), "flat_numel": pieces.flat_numel}
        info = self._request(P.Save(session=self.session, dir=os.path.abspath(directory), background=background,
                                    **placed), P.Ok).info
        self._save_seq = int(info.get("seq", 0))
        self._save_hint = ("writing" if background else "done", "", int(info.get("crc", -1)))
        return info

    def save_status(self) -> dict:
        """The newest save's state: {"state": idle|writing|done|failed, "error", ...}: a
        STATS round trip, or, while a STEP is in flight (DPU), the last heartbeat's word
        (at most heartbeat_interval_s old)."""
        if self._inflight is not None:
            state, error, crc = self._save_hint
            return {"state": state, "error": error, "crc": crc}
        st = self.stats()
        self._save_hint = (st.save_state, st.save_error, st.save_crc)
        return {"state": st.save_state, "bytes_done": st.save_bytes_done, "bytes_total": st.save_bytes_total,
                "error": st.save_error, "seconds": st.save_seconds, "waited_s": st.save_waited_s,
                "snapshot": st.save_snapshot, "snapshot_peak": st.save_snapshot_peak,
                "update_writes": st.save_update_writes, "crc": st.save_crc}

    def wait_save(self, poll_s: float = 0.05) -> dict:
        """Block until the newest save is written (its status); fails only when the server
        shows no progress for request_timeout_s (HEARTBEAT_OK.work counts the save's bytes),
        or dies."""
        while True:
            st = self.save_status()
            if st["state"] != "writing":
                return st
            why = self._server_gone()
            if why:
                self._raise_dead(why)
            if time.monotonic() - self._progressed() > self.request_timeout_s:
                raise OptimizerServerTimeoutError(
                    f"the background save made no progress for {self.request_timeout_s:.0f} s; raise "
                    f"request_timeout_s if the disk is this slow")
            time.sleep(poll_s)

    def load(self, directory: str, weights_slot: int = 0, pieces=None, verified: bool = False) -> dict:
        """LOAD a checkpoint; weights_slot: the weights slot that gets its weights; pieces
        (a piece_map.PieceMap): where the shard's elements lie in its flat space
        (LOAD.pieces); verified: the caller checked the files' checksums."""
        self._check_usable()
        placed = {} if pieces is None else {"pieces": pieces.to_bytes(), "flat_numel": pieces.flat_numel}
        return self._request(P.Load(session=self.session, dir=os.path.abspath(directory), weights_slot=weights_slot,
                                    verified=verified, **placed), P.Ok).info

    def stats(self) -> P.StatsOk:
        self._check_usable()
        return self._request(P.Stats(session=self.session), P.StatsOk, timeout_s=30.0)

    # ------------------------------------------------------------------ teardown
    def _close_sockets(self) -> None:
        if getattr(self, "_hb", None) is not None:
            self._hb_stop.set()
            self._hb.join(5.0)
        self._sock.close(linger=0)
        self._ctx.term()

    def close(self, timeout_s: float = 10.0) -> None:
        """BYE (bounded; skipped if the server is dead), then detach."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._dead is None:
                if self._inflight is not None:
                    self._inflight = None
                    self._recv(P.Done, timeout_s)
                self._sock.send(P.Bye(session=self.session).encode())
                self._recv(P.Ok, timeout_s)
        except OptimizerServerError:
            pass
        finally:
            self.grads = []
            self.weights16 = self.staging = self.progress = self.ready = None
            self.weights16_slots = []
            if self.segment is not None:
                self.segment.close()
            self._close_sockets()

    def __enter__(self) -> "ShardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
