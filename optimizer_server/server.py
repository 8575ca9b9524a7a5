"""The optimizer server's event loop: one ROUTER socket, shards updated on threads.

The socket thread never runs an update: STEP is handed to the shard's own
single-thread executor (the kernel releases the GIL), whose completion wakes the
loop through a pipe so the DONE reply goes out from the socket thread (ZeroMQ
sockets are not thread-safe).  One worker's update therefore never delays another
worker's replies or heartbeats.

Exit paths it controls (BYE of the last worker with --exit-when-idle, SIGTERM,
SIGINT) finish the update in flight, unlink every segment, and remove the
socket, lock, token and address files.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from . import ipc
from . import protocol as P
from .admission import Refused, Reservations, admit, read_mem_available, shard_need
from .checkpoint import CheckpointError
from .config import TOKEN_ENV, ServerConfig
from .files import ServerFiles
from .piece_map import PieceMap
from .procs import pid_alive
from .shard import Shard
from .shm import Segment
from .tracing import Tracer

log = logging.getLogger("optimizer_server")

POLL_INTERVAL_MS = 50            # how often the loop looks at signals and heartbeats
SETTLE_TIMEOUT_S = 120.0         # bound on the speculative pieces queued before a rollback
# How long the update thread first sleeps between looks at a worker's ready word while
# it follows a speculation (Shard.follow): a piece of 2^20 elements takes about a
# millisecond, so a look every 0.1 ms delays it little, and the sleep leaves the core.
READY_POLL_S = 1e-4
SHUTDOWN_UPDATE_WAIT_S = 30.0    # bound on finishing the update in flight at exit


def shm_prefix() -> str:
    """Segment name prefix; ZERO_OFFLOAD_SHM_PREFIX lets a test suite tell its own apart."""
    p = os.environ.get("ZERO_OFFLOAD_SHM_PREFIX", "zo-")
    if not p or len(p) > 40 or not all(ch.isalnum() or ch in "-_." for ch in p):
        raise ValueError(f"ZERO_OFFLOAD_SHM_PREFIX must be 1-40 of [A-Za-z0-9._-], got {p!r}")
    return p


@dataclass
class _Result:
    identity: bytes
    session: str
    reply: bytes


class OptimizerServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.instance = secrets.token_hex(4)
        self.token = cfg.token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        self.shards: dict[str, Shard] = {}
        self.executors: dict[str, ThreadPoolExecutor] = {}
        self.pending: dict[str, Future] = {}
        self.results: list[_Result] = []
        self.results_lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.stop_requested = False
        self.abandoned = False  # an update thread never returned: the process must exit without joining it
        self.had_clients = False
        self.private_dir: str | None = None
        self.files = ServerFiles(cfg.address_file, cfg.parent_pid)
        self.address = ""
        self.ctx = zmq.Context()
        self.sock = None
        self.tracer = Tracer(cfg.trace_dir, "server", 0)
        self.shm_prefix = shm_prefix()
        self.reservations = Reservations()

    # ------------------------------------------------------------------ set-up
    def _write_registry(self) -> None:
        self.files.write_registry([sh.segment.name for sh in self.shards.values()], self.private_dir or "")

    def _resolve_address(self) -> str:
        addr = self.cfg.address
        if not addr:
            self.private_dir = ipc.make_private_dir()
            return f"ipc://{self.private_dir}/{ipc.SOCKET_NAME}"
        if addr.startswith("tcp://"):
            hostport = addr[len("tcp://"):]
            # no explicit host: loopback only, never every interface by accident
            if hostport.startswith(":"):
                addr = "tcp://127.0.0.1" + hostport
            elif hostport.isdigit():
                addr = "tcp://127.0.0.1:" + hostport
        return addr

    def bind(self) -> str:
        self.files.sweep_leftovers()
        addr = self._resolve_address()
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.files.take_ipc_lock(path)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # the control message cap plus ZeroMQ's framing: a larger one gets the peer disconnected
        # before a byte of it is buffered, so an unauthenticated peer cannot make us hold more
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES + 1024)
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(f"address {addr} is already in use (another optimizer server?); "
                                   f"stop it or pass a different --address") from None
            raise RuntimeError(f"cannot bind {addr}: {e}") from None
        if self.files.ipc_path:
            os.chmod(self.files.ipc_path, 0o600)
        self.sock = sock
        self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.files.publish(self.address, self.token, [], self.private_dir or "")
        return self.address

    # ------------------------------------------------------------------ loop
    def request_stop(self, *_args) -> None:
        self.stop_requested = True

    def serve(self) -> int:
        if self.sock is None:
            self.bind()
        print(f"zero-offload-server ready at {self.address} (pid {os.getpid()}, threads {self.cfg.threads})",
              flush=True)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        last_check = time.monotonic()
        try:
            while not self.stop_requested:
                try:
                    events = dict(poller.poll(POLL_INTERVAL_MS))
                except zmq.ZMQError as e:
                    if e.errno == errno.EINTR:
                        continue
                    raise
                if self.wake_r in events:
                    self._drain_results()
                if self.sock in events:
                    self._drain_socket()
                now = time.monotonic()
                if now - last_check >= 0.1:
                    last_check = now
                    self._check_workers(now)
                if self.cfg.exit_when_idle and self.had_clients and not self.shards:
                    log.info("last worker gone; exiting (--exit-when-idle)")
                    break
        finally:
            self.shutdown()
        return 0

    def _drain_socket(self) -> None:
        for _ in range(64):  # bounded batch; the loop comes back for more
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            if len(body) != 1:
                self._send(identity, P.error(P.E_DECODE, f"expected one frame, got {len(body)}"))
                continue
            try:
                reply = self._handle(identity, body[0])
            except Exception as e:  # a bug must not kill the server: answer it
                log.exception("internal error handling a request")
                reply = P.error(P.E_INTERNAL, f"{type(e).__name__}: {e}")
            if reply is not None:
                self._send(identity, reply)

    def _send(self, identity: bytes, reply: bytes) -> None:
        try:
            self.sock.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or its queue full: nothing to do
            log.debug("reply dropped: %s", e)

    # ------------------------------------------------------------------ requests
    def _handle(self, identity: bytes, data: bytes) -> bytes | None:
        try:
            msg = P.decode(data)
        except P.ProtocolError as e:
            return P.error(P.E_DECODE, str(e))
        if isinstance(msg, P.Hello):
            return self._hello(msg)
        session = getattr(msg, "session", None)
        if session is None:
            return P.error(P.E_DECODE, f"{msg.TYPE} is a reply type, not a request")
        shard = self.shards.get(session)
        if shard is None:
            return P.error(P.E_SESSION, f"unknown session {session!r}: send HELLO first (or the server "
                                        f"dropped this worker after a heartbeat timeout)")
        shard.last_seen = time.monotonic()
        # traced only now: a message that names no session of ours adds nothing to the trace
        with self.tracer.span("request"):
            return self._handle_session(identity, session, shard, msg)

    def _handle_session(self, identity: bytes, session: str, shard: Shard, msg: P.Message) -> bytes | None:
        if isinstance(msg, P.Heartbeat):
            sv = shard.save_status()
            return P.HeartbeatOk(server_pid=os.getpid(), work=shard.work_done, save_state=sv["state"],
                                 save_error=sv["error"][:2000], save_seq=shard.save_seq, save_crc=sv["crc"]).encode()
        if isinstance(msg, P.Stats):
            return self._stats(shard)
        if isinstance(msg, P.Speculate):  # before STEP's case: SPECULATE is a Step with `upto`
            self._speculate(session, shard, msg)
            return None  # a hint: never answered
        if shard.busy:
            return P.error(P.E_ORDER, shard.refusal(msg.TYPE))
        shard.stop_following()  # any request but SPECULATE ends the ready word's pieces
        if shard.speculating and not isinstance(msg, (P.Step, P.Bye)):
            # what the request reads or replaces must not hold speculated values
            why = self._settle(session, shard)
            if why is not None:
                return P.error(P.E_INTERNAL, why)
        if isinstance(msg, P.Bye):
            self._drop(session, "said BYE", logging.INFO)
            return P.Ok().encode()
        if isinstance(msg, P.Init):
            return self._on_thread(identity, session, shard, "INIT", lambda: shard.init_chunk(msg.offset, msg.count))
        if isinstance(msg, P.Load):
            def load():
                # a one-pass LOAD holds a second state until the file verifies: what
                # admission's rule admits beside the shards' reservations
                room = self._ram_room() if self.cfg.load_one_pass else 0
                pieces = PieceMap.from_bytes(msg.pieces, shard.numel, msg.flat_numel) if msg.flat_numel else None
                with self.tracer.span("checkpoint_load", rank=shard.rank):
                    return shard.load(msg.dir, msg.weights_slot, room=room, pieces=pieces, verified=msg.verified)
            return self._on_thread(identity, session, shard, "LOAD", load)
        if not shard.initialized:
            return P.error(P.E_ORDER, shard.refusal(msg.TYPE))
        if isinstance(msg, P.Step):
            refused = shard.accept_step(msg)
            if refused is not None:
                return P.error(*refused)
            fut = self.executors[session].submit(self._traced_step, shard, msg)
            self.pending[session] = fut
            fut.add_done_callback(lambda f, i=identity, s=session, st=msg.step: self._on_done(i, s, st, f))
            return None
        if isinstance(msg, P.Skip):
            why = shard.skip(msg.step)
            if why is not None:
                return P.error(P.E_ORDER, why)
            return P.Ok(info={"updates": shard.updates}).encode()
        if isinstance(msg, P.ReleaseTwin):
            return P.Ok(info={"released_bytes": shard.release_twin()}).encode()
        if isinstance(msg, P.GetMaster):
            return self._on_thread(identity, session, shard, "GET_MASTER",
                                   lambda: shard.master_to_staging(msg.offset, msg.count))
        if isinstance(msg, P.Save):
            if shard.saving:
                return P.error(P.E_ORDER, "SAVE while the previous save is still being written: wait for it "
                                          "(engine.wait_checkpoint) first")

            def save():
                pieces = PieceMap.from_bytes(msg.pieces, shard.numel, msg.flat_numel) if msg.flat_numel else None
                # placed: the workers' rank 0 writes the manifest (every rank's CRC joined)
                man = {"manifest": dict(shard.manifest(), groups=[])} if pieces else {}  # (groups: up to 512 ranges)
                try:
                    snapshot, on_done = self._snapshot_room(session, shard) if msg.background else (False, None)
                    # pool_room: after it, the next snapshot's buffers are made ready where admitted
                    job = shard.start_save(msg.dir, snapshot=snapshot, on_done=on_done, pieces=pieces,
                                           background=msg.background, pool_room=self._ram_room)
                    if msg.background:
                        return {"background": True, "bytes": job.total_bytes, "updates": shard.updates,
                                "seq": shard.save_seq, "snapshot": snapshot, "note": shard.save_note, **man}
                    with self.tracer.span("checkpoint_save", rank=shard.rank):
                        info = dict(job.wait(), **man)
                except OSError as e:
                    raise CheckpointError(f"saving to {msg.dir} failed: {e.strerror or e} (errno {e.errno}); the "
                                          f"previous checkpoint there is intact") from e
                return dict(info, seconds=job.seconds, seq=shard.save_seq)
            return self._on_thread(identity, session, shard, "SAVE", save)
        return P.error(P.E_DECODE, f"{msg.TYPE} is not a request")

    def _ram_room(self) -> int:
        """Host bytes admission's rule admits now beyond the admitted shards: MemAvailable
        less what they reserved and have not yet touched, times max_ram_fraction (where
        the check is on).  What a snapshot or a one-pass LOAD may take."""
        room = max(0, read_mem_available() - self.reservations.outstanding)
        return int(room * self.cfg.max_ram_fraction) if self.cfg.max_ram_fraction else room

    def _snapshot_room(self, session: str, shard: Shard) -> tuple[bool, object]:
        """A background save snapshots what the updates after it overwrite (ckpt_io): up to
        the file's size in host RAM.  Taken only if admission's rule admits it beside what
        admitted shards have reserved; reserved itself until the save ends, so a HELLO
        meanwhile counts it.  Otherwise the save writes before each update overwrites,
        as a blocking one would, and the log says why."""
        if not self.cfg.save_snapshot:
            shard.save_note = "a background save takes no snapshot (the server runs with --no-save-snapshot)"
            return False, None
        need, room = shard.snapshot_bytes(), self._ram_room()
        if self.cfg.max_ram_fraction and need > room:
            why = (f"a background save of rank {shard.rank} takes no snapshot: it needs {need / 2**30:.2f} GiB of host "
                   f"RAM and {room / 2**30:.2f} GiB is admissible beside the shards' reservations, so the "
                   f"updates while it writes wait for the disk (a smaller state_dtype makes the snapshot smaller: "
                   f"'bf16' 8, 'int8' 6 B/param against fp32's 12; or more host RAM)")
            log.warning("%s", why)
            shard.save_note = why
            return False, None
        key = f"{session}/snapshot"
        self.reservations.add(key, need)
        shard.save_note = ""
        return True, lambda: self.reservations.drop(key)

    def _stats(self, shard: Shard) -> bytes:
        sv = shard.save_status()
        return dataclasses.replace(shard.stats(), save_state=sv["state"], save_bytes_done=sv["bytes_done"],
                                   save_bytes_total=sv["bytes_total"], save_error=sv["error"],
                                   save_seconds=sv["seconds"], save_waited_s=sv["waited_s"],
                                   save_snapshot=sv["snapshot"], save_snapshot_peak=sv["snapshot_peak"],
                                   save_update_writes=sv["ensure_writes"], save_crc=sv["crc"]).encode()

    def _on_thread(self, identity: bytes, session: str, shard: Shard, what: str, fn) -> None:
        """Run a long request (INIT, LOAD, GET_MASTER, SAVE) on the shard's update thread,
        so this thread goes on answering heartbeats and other workers; its reply (OK with
        what fn returned, or the ERROR its exception names) goes out when it is done.
        The shard is busy meanwhile (Shard.working)."""
        shard.working = what

        def run():
            try:
                return P.Ok(info=fn() or {}).encode()
            except (OSError, ValueError) as e:  # SAVE/LOAD: the files; else a bad request or no room
                code = (P.E_CHECKPOINT if what in ("SAVE", "LOAD") else
                        P.E_INVALID if isinstance(e, ValueError) else P.E_RESOURCE)
                return P.error(code, str(e))
            except Exception as e:  # noqa: BLE001 - a bug must not kill the server: answer it
                log.exception("internal error in %s", what)
                return P.error(P.E_INTERNAL, f"{what} failed: {type(e).__name__}: {e}")
        fut = self.executors[session].submit(run)
        self.pending[session] = fut
        fut.add_done_callback(lambda f: self._queue_reply(identity, session, f.result()))
        return None

    def _hello(self, msg: P.Hello) -> bytes:
        try:
            layout = admit(msg, token=self.token, max_ram_fraction=self.cfg.max_ram_fraction,
                           reserved=self.reservations.outstanding, sessions=len(self.shards),
                           max_sessions=self.cfg.max_sessions)
        except Refused as e:
            return P.error(e.code, str(e))
        session = secrets.token_hex(8)
        # unpredictable: nobody can make it first, or guess it to attach (files.SEGMENT_NAME)
        name = f"{self.shm_prefix}{self.instance}-r{msg.rank}-{secrets.token_hex(8)}"
        try:
            seg = Segment.create(name, layout.total_bytes)
        except OSError as e:
            return P.error(P.E_RESOURCE, f"cannot create shared segment {name} of {layout.total_bytes} bytes: "
                                         f"{e.strerror or e}; free space in /dev/shm or enlarge it (docker: "
                                         f"--shm-size)")
        try:
            shard = Shard(session, msg, seg, layout, self.cfg.threads,
                          save_max_bytes_per_s=self.cfg.save_max_bytes_per_s)
        except MemoryError:
            seg.close()
            seg.unlink()
            return P.error(P.E_RESOURCE, f"out of memory allocating a shard of {msg.numel} params")
        self.shards[session] = shard
        # the segment's pages are committed already (Segment.create): the rest is reserved
        self.reservations.add(session, shard_need(msg, layout) - layout.total_bytes)
        self.executors[session] = ThreadPoolExecutor(1, thread_name_prefix=f"update-r{msg.rank}")
        self.had_clients = True
        self._write_registry()
        log.info("rank %d/%d registered: %d params %s %s, segment %s", msg.rank, msg.world_size, msg.numel,
                 msg.dtype, msg.optimizer, name)
        return P.HelloOk(session=session, segment=name, segment_bytes=layout.total_bytes, numel=msg.numel,
                         grad_offsets=list(layout.grad_offsets), weights_offsets=list(layout.weights_offsets),
                         staging_offset=layout.staging_offset, staging_numel=layout.staging_numel,
                         progress_offset=layout.progress_offset, ready_offset=layout.ready_offset,
                         server_pid=os.getpid()).encode()

    # ------------------------------------------------------------------ speculation
    def _speculate(self, session: str, shard: Shard, msg: P.Speculate) -> None:
        first = shard.speculative is None
        piece = shard.accept_speculation(msg)
        if isinstance(piece, str):
            shard.drop_speculation(piece)
            log.debug("rank %d: SPECULATE %d dropped: %s", shard.rank, msg.step, piece)
            return
        ex = self.executors[session]
        for a, b in piece or []:  # one range: one task walks it
            ex.submit(shard.speculate_range, a, b, lambda x, y: self._traced_speculate(shard, msg.step, x, y))
        if first and shard.speculative is not None:
            # the rest of the step comes through the ready word, not a message a bucket
            ex.submit(self._follow, shard, msg.step)

    def _follow(self, shard: Shard, step: int) -> None:
        shard.follow(step, poll_s=READY_POLL_S, idle_s=SETTLE_TIMEOUT_S,
                     run=lambda a, b: self._traced_speculate(shard, step, a, b))

    def _traced_speculate(self, shard: Shard, step: int, a: int, b: int) -> None:
        with self.tracer.span("speculate", rank=shard.rank, step=step, lo=a, hi=b):
            shard.speculate(a, b)

    def _settle(self, session: str, shard: Shard) -> str | None:
        """Roll a speculation back on the update thread (after its queued pieces) and wait
        for it; why it failed, or None."""
        def rollback():
            with self.tracer.span("rollback", rank=shard.rank):
                return shard.rollback()
        try:
            self.executors[session].submit(rollback).result(timeout=SETTLE_TIMEOUT_S)
        except Exception as e:  # the bound, or the update thread's own error
            return f"rolling back a speculation failed: {type(e).__name__}: {e}"
        return None

    # ------------------------------------------------------------------ updates
    def _traced_step(self, shard: Shard, msg: P.Step) -> float:
        with self.tracer.span("update", rank=shard.rank, step=msg.step, bytes=shard.bytes_per_update,
                              threads=shard.threads):
            dt = shard.step(msg)
        if shard.last_rolled_back:  # the STEP did not match what was speculated: its restore
            self.tracer.add("rollback", *shard.last_rollback_ns,
                            {"rank": shard.rank, "step": msg.step, "elements": shard.last_rolled_back})
        return dt

    def _on_done(self, identity: bytes, session: str, step: int, fut: Future) -> None:
        # runs on the update thread: queue the reply, wake the socket thread
        exc = fut.exception()
        if exc is None:
            shard = self.shards.get(session)
            spec = (shard.last_speculated, shard.last_rolled_back) if shard is not None else (0, 0)
            reply = P.Done(step=step, update_s=fut.result(), speculated=spec[0], rolled_back=spec[1]).encode()
        else:
            reply = P.error(P.E_INTERNAL, f"update of step {step} failed: {type(exc).__name__}: {exc}")
        self._queue_reply(identity, session, reply)

    def _queue_reply(self, identity: bytes, session: str, reply: bytes) -> None:
        with self.results_lock:
            self.results.append(_Result(identity, session, reply))
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def _drain_results(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self.results_lock:
            results, self.results = self.results, []
        for r in results:
            shard = self.shards.get(r.session)
            self.pending.pop(r.session, None)
            if shard is not None:
                if shard.working is not None:
                    shard.working = None
                else:
                    shard.finish_update()
                if shard.drop_reason:
                    self._drop(r.session, shard.drop_reason)
                    continue
            with self.tracer.span("reply"):
                self._send(r.identity, r.reply)

    # ------------------------------------------------------------------ workers
    def _check_workers(self, now: float) -> None:
        if self.cfg.parent_pid and not pid_alive(self.cfg.parent_pid):
            log.warning("parent process %d is gone; exiting", self.cfg.parent_pid)
            self.stop_requested = True
        ipc = self.address.startswith("ipc://")
        for session, shard in list(self.shards.items()):
            reason = None
            if ipc and shard.pid > 0 and not pid_alive(shard.pid):
                reason = f"worker pid {shard.pid} is gone"
            elif now - shard.last_seen > self.cfg.heartbeat_timeout_s:
                reason = f"no message for {now - shard.last_seen:.1f} s (heartbeat timeout)"
            if reason:
                if shard.busy:
                    shard.drop_reason = reason  # dropped when its update finishes
                else:
                    self._drop(session, reason)

    def _drop(self, session: str, reason: str, level: int = logging.WARNING) -> None:
        self.reservations.drop(session)
        shard = self.shards.pop(session, None)
        if shard is not None:
            shard.stop_following()
        ex = self.executors.pop(session, None)
        if ex is not None:
            ex.shutdown(wait=True)
        if shard is not None:
            log.log(level, "rank %d dropped (%s); freed %d params, unlinked %s", shard.rank, reason, shard.numel,
                    shard.segment.name)
            shard.close()
            self._write_registry()

    # ------------------------------------------------------------------ exit
    def shutdown(self) -> None:
        # The update in flight finishes (its worker may still read the weights) within
        # SHUTDOWN_UPDATE_WAIT_S; past that the server exits without it: an update
        # thread that does not return must not keep the process alive.
        deadline = time.monotonic() + SHUTDOWN_UPDATE_WAIT_S
        for session, fut in list(self.pending.items()):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # its own error, or the bound: either way it is abandoned
                if not fut.done():
                    log.warning("update of session %s still running after %.0f s; exiting without it",
                                session, SHUTDOWN_UPDATE_WAIT_S)
                    self._abandon(session)
                    self.abandoned = True
        for session in list(self.shards):
            self._drop(session, "server shutting down", logging.INFO)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.ctx.term()
        try:
            self.tracer.flush()
        except OSError as e:
            log.warning("could not write the trace: %s", e)
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.files.remove()

    def _abandon(self, session: str) -> None:
        """Forget a shard whose update never returned: its executor is not waited
        for (its thread is a daemon of the interpreter's exit), its segment unlinked."""
        ex = self.executors.pop(session, None)
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        shard = self.shards.pop(session, None)
        if shard is not None:
            shard.segment.unlink()  # the name goes now; the mapping with the process


def run(cfg: ServerConfig) -> int:
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="%(asctime)s optimizer_server[%(process)d] %(levelname)s %(message)s")
    server = OptimizerServer(cfg)
    # every ordinary way to stop a process ends the same way: segment, socket, token removed
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, server.request_stop)
    try:
        server.bind()
    except RuntimeError as e:
        print(f"zero-offload-server: {e}", file=sys.stderr, flush=True)
        server.shutdown()
        return 2
    rc = server.serve()
    if server.abandoned:
        # concurrent.futures joins its threads at interpreter exit; the abandoned
        # update would keep the process alive without bound
        logging.shutdown()
        sys.stdout.flush()
        os._exit(rc)
    return rc
