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

import errno
import fcntl
import hmac
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import zmq

from . import ipc
from . import protocol as P
from .config import ServerConfig
from .procs import pid_alive
from .shard import Shard, state_bytes_per_param
from .shm import Segment, ShardLayout
from .shm import unlink as shm_unlink
from .spawn import SPAWN_DIR_PREFIX
from .tracing import Tracer

log = logging.getLogger("optimizer_server")

POLL_INTERVAL_MS = 50            # how often the loop looks at signals and heartbeats
SHUTDOWN_UPDATE_WAIT_S = 30.0    # bound on finishing the update in flight at exit
TOKEN_ENV = "ZERO_OFFLOAD_TOKEN"


def shm_prefix() -> str:
    """Segment name prefix; ZERO_OFFLOAD_SHM_PREFIX lets a test suite tell its own apart."""
    p = os.environ.get("ZERO_OFFLOAD_SHM_PREFIX", "zo-")
    if not p or len(p) > 40 or not all(ch.isalnum() or ch in "-_." for ch in p):
        raise ValueError(f"ZERO_OFFLOAD_SHM_PREFIX must be 1-40 of [A-Za-z0-9._-], got {p!r}")
    return p


def read_mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
        self.had_clients = False
        self.private_dir: str | None = None
        self.ipc_path: str | None = None
        self.lock_fd: int | None = None
        self.address = ""
        self.ctx = zmq.Context()
        self.sock = None
        self.n_seg = 0
        self.owns_files = False  # set once bound: a refused server must not remove the live one's files
        self.tracer = Tracer(cfg.trace_dir, "server", 0)
        self.shm_prefix = shm_prefix()

    # ------------------------------------------------------------------ set-up
    def _registry_path(self) -> Path | None:
        return Path(self.cfg.address_file + ".segments") if self.cfg.address_file else None

    def _write_registry(self) -> None:
        reg = self._registry_path()
        if reg is None:
            return
        names = [s.segment.name for s in self.shards.values()]
        tmp = reg.with_name(reg.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "segments": names, "private_dir": self.private_dir or ""}))
        os.replace(tmp, reg)

    def _sweep_leftovers(self) -> None:
        """Unlink segments a killed server left behind under the same address file."""
        reg = self._registry_path()
        if reg is None or not reg.exists():
            return
        try:
            data = json.loads(reg.read_text())
        except (OSError, ValueError):
            reg.unlink(missing_ok=True)
            return
        if pid_alive(int(data.get("pid", 0))) and int(data.get("pid", 0)) != os.getpid():
            return  # its owner still runs; the lock check will refuse us anyway
        n = sum(shm_unlink(name) for name in data.get("segments", []) if isinstance(name, str))
        if n:
            log.warning("swept %d shared segment(s) left by dead server pid %s", n, data.get("pid"))
        d = data.get("private_dir")
        if isinstance(d, str) and os.path.basename(d).startswith(ipc.PRIVATE_PREFIX):
            ipc.remove_socket_files(os.path.join(d, ipc.SOCKET_NAME))
        reg.unlink(missing_ok=True)

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

    def _take_ipc_lock(self, path: str) -> None:
        fd = os.open(ipc.lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                other = os.read(fd, 32).decode().strip() or "?"
            finally:
                os.close(fd)
            raise RuntimeError(f"another optimizer server (pid {other}) is already serving at ipc://{path}; "
                               f"stop it or pass a different --address") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.lock_fd = fd
        if os.path.exists(path):  # a stale socket file of a dead server
            os.unlink(path)

    def bind(self) -> str:
        self._sweep_leftovers()
        addr = self._resolve_address()
        if addr.startswith("ipc://"):
            self.ipc_path = addr[len("ipc://"):]
            os.makedirs(os.path.dirname(self.ipc_path) or ".", exist_ok=True)
            self._take_ipc_lock(self.ipc_path)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # hard cap well above any control message; larger ones get the peer disconnected
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * P.MAX_MESSAGE_BYTES)
        try:
            sock.bind(addr)
        except zmq.ZMQError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise RuntimeError(f"address {addr} is already in use (another optimizer server?); "
                                   f"stop it or pass a different --address") from None
            raise RuntimeError(f"cannot bind {addr}: {e}") from None
        self.owns_files = True
        if self.ipc_path:
            os.chmod(self.ipc_path, 0o600)
        self.sock = sock
        self.address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if self.cfg.address_file:
            af = Path(self.cfg.address_file)
            tok = Path(self.cfg.address_file + ".token")
            fd = os.open(str(tok) + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token)
            os.replace(str(tok) + ".tmp", tok)
            self._write_registry()  # before the address: a kill from here on is swept by the next server
            tmp = af.with_name(af.name + ".tmp")
            tmp.write_text(self.address + "\n")
            os.replace(tmp, af)  # atomic: a reader sees nothing or the whole address
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
                with self.tracer.span("request"):
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
        if isinstance(msg, P.Heartbeat):
            return P.HeartbeatOk(server_pid=os.getpid()).encode()
        if isinstance(msg, P.Stats):
            return shard.stats().encode()
        if shard.busy:
            return P.error(P.E_ORDER, f"{msg.TYPE} while step {shard.steps + 1} is still updating; "
                                      f"wait for its DONE first")
        if isinstance(msg, P.Bye):
            self._drop(session, "said BYE", logging.INFO)
            return P.Ok().encode()
        if isinstance(msg, P.Init):
            try:
                shard.init_chunk(msg.offset, msg.count)
            except ValueError as e:
                return P.error(P.E_ORDER, str(e))
            return P.Ok().encode()
        if isinstance(msg, P.Load):
            try:
                with self.tracer.span("checkpoint_load", rank=shard.rank):
                    info = shard.load(msg.dir)
            except (OSError, ValueError) as e:
                return P.error(P.E_CHECKPOINT, str(e))
            return P.Ok(info=info).encode()
        if not shard.initialized:
            return P.error(P.E_ORDER, f"{msg.TYPE} before INIT: write the initial weights to staging "
                                      f"and send INIT (or LOAD a checkpoint) first")
        if isinstance(msg, P.Step):
            if msg.step != shard.steps + 1:
                return P.error(P.E_ORDER, f"STEP {msg.step} out of order: the shard has done {shard.steps} "
                                          f"update(s), so the next is {shard.steps + 1}")
            if msg.slot >= len(shard.grads):
                return P.error(P.E_DECODE, f"gradient slot {msg.slot} but HELLO asked for {len(shard.grads)} "
                                           f"slot(s): send slot 0, or register with grad_slots=2")
            if msg.out_slot >= len(shard.weights16_slots):
                return P.error(P.E_DECODE, f"out_slot {msg.out_slot} but HELLO asked for "
                                           f"{len(shard.weights16_slots)} weight slot(s): send out_slot 0, or "
                                           f"register with weight_slots=2")
            if msg.predict and shard.optimizer not in ("adamw", "adam"):
                return P.error(P.E_DECODE, f"predict is implemented for adam/adamw, not {shard.optimizer}")
            shard.busy = True
            fut = self.executors[session].submit(self._traced_step, shard, msg)
            self.pending[session] = fut
            fut.add_done_callback(lambda f, i=identity, s=session, st=msg.step: self._on_done(i, s, st, f))
            return None
        if isinstance(msg, P.Skip):
            if msg.step != shard.steps + 1:
                return P.error(P.E_ORDER, f"SKIP {msg.step} out of order: next step is {shard.steps + 1}")
            shard.skipped += 1
            return P.Ok(info={"steps": shard.steps}).encode()
        if isinstance(msg, P.GetMaster):
            try:
                shard.master_to_staging(msg.offset, msg.count)
            except ValueError as e:
                return P.error(P.E_ORDER, str(e))
            return P.Ok().encode()
        if isinstance(msg, P.Save):
            try:
                t0 = time.perf_counter()
                with self.tracer.span("checkpoint_save", rank=shard.rank):
                    info = shard.save(msg.dir)
                info["seconds"] = time.perf_counter() - t0
            except OSError as e:
                return P.error(P.E_CHECKPOINT, f"saving to {msg.dir} failed: {e.strerror or e} "
                                               f"(errno {e.errno}); the previous checkpoint there is intact")
            return P.Ok(info=info).encode()
        return P.error(P.E_DECODE, f"{msg.TYPE} is not a request")

    def _hello(self, msg: P.Hello) -> bytes:
        # order matters: version, then token, then resources; nothing is allocated
        # for a client that fails any check
        if msg.version != P.PROTOCOL_VERSION:
            return P.error(P.E_VERSION, f"protocol version mismatch: client {msg.version}, "
                                        f"server {P.PROTOCOL_VERSION}; install the same zero-offload on both")
        if not hmac.compare_digest(msg.token.encode(), self.token.encode()):
            return P.error(P.E_AUTH, "wrong or missing token: pass the token the server wrote next to its "
                                     "address file (ZERO_OFFLOAD_TOKEN)")
        layout = ShardLayout(msg.numel, msg.weight_slots, msg.grad_slots, msg.staging_numel)
        need = msg.numel * state_bytes_per_param(msg.optimizer) + layout.total_bytes
        avail = read_mem_available()
        if self.cfg.max_ram_fraction and need > avail * self.cfg.max_ram_fraction:
            return P.error(P.E_RESOURCE, f"shard of {msg.numel} params needs {need / 2**30:.2f} GiB of host RAM "
                                         f"({need} bytes) but {avail / 2**30:.2f} GiB ({avail} bytes) is available; "
                                         f"use more ranks/nodes or a smaller model (where RAM grows as it is "
                                         f"used, as in some VMs, ZERO_OFFLOAD_MAX_RAM_FRACTION=0 turns this "
                                         f"check off)")
        try:
            st = os.statvfs("/dev/shm")
            shm_free = st.f_bavail * st.f_frsize
            if layout.total_bytes > shm_free:
                return P.error(P.E_RESOURCE, f"shard segment needs {layout.total_bytes} bytes but /dev/shm has "
                                             f"{shm_free} free; enlarge /dev/shm (docker: --shm-size)")
        except OSError:
            pass
        session = secrets.token_hex(8)
        self.n_seg += 1
        name = f"{self.shm_prefix}{self.instance}-r{msg.rank}-{self.n_seg}"
        try:
            seg = Segment.create(name, layout.total_bytes)
        except OSError as e:
            return P.error(P.E_RESOURCE, f"cannot create shared segment {name}: {e}")
        try:
            shard = Shard(session, msg, seg, self.cfg.threads)
        except MemoryError:
            seg.close()
            seg.unlink()
            return P.error(P.E_RESOURCE, f"out of memory allocating a shard of {msg.numel} params")
        self.shards[session] = shard
        self.executors[session] = ThreadPoolExecutor(1, thread_name_prefix=f"update-r{msg.rank}")
        self.had_clients = True
        self._write_registry()
        log.info("rank %d/%d registered: %d params %s %s, segment %s", msg.rank, msg.world_size, msg.numel,
                 msg.dtype, msg.optimizer, name)
        return P.HelloOk(session=session, segment=name, segment_bytes=layout.total_bytes, numel=msg.numel,
                         grad_offsets=list(layout.grad_offsets), weights_offsets=list(layout.weights_offsets),
                         staging_offset=layout.staging_offset, staging_numel=layout.staging_numel,
                         progress_offset=layout.progress_offset,
                         server_pid=os.getpid()).encode()

    # ------------------------------------------------------------------ updates
    def _traced_step(self, shard: Shard, msg: P.Step) -> float:
        with self.tracer.span("update", rank=shard.rank, step=msg.step, bytes=shard.bytes_per_update,
                              threads=shard.threads):
            return shard.step(msg)

    def _on_done(self, identity: bytes, session: str, step: int, fut: Future) -> None:
        # runs on the update thread: queue the reply, wake the socket thread
        exc = fut.exception()
        if exc is None:
            reply = P.Done(step=step, update_s=fut.result()).encode()
        else:
            reply = P.error(P.E_INTERNAL, f"update of step {step} failed: {type(exc).__name__}: {exc}")
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
                shard.busy = False
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
        shard = self.shards.pop(session, None)
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
        deadline = time.monotonic() + SHUTDOWN_UPDATE_WAIT_S
        for fut in list(self.pending.values()):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
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
        if self.lock_fd is not None:  # held only by a server that got this ipc path
            ipc.remove_socket_files(self.ipc_path)
            os.close(self.lock_fd)
            self.lock_fd = None
        if not self.owns_files:
            return
        if self.cfg.address_file:
            for suffix in ("", ".token", ".segments"):
                Path(self.cfg.address_file + suffix).unlink(missing_ok=True)
            # spawn() made the address file's private directory and removes it at its
            # exit; when that parent was killed first, the server is the last one who
            # knows it.  rmdir only ever removes an empty directory.
            if self.cfg.parent_pid and not pid_alive(self.cfg.parent_pid):
                d = Path(self.cfg.address_file).parent
                if d.name.startswith(SPAWN_DIR_PREFIX):
                    try:
                        d.rmdir()
                    except OSError:
                        pass


def run(cfg: ServerConfig) -> int:
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="%(asctime)s optimizer_server[%(process)d] %(levelname)s %(message)s")
    server = OptimizerServer(cfg)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    try:
        server.bind()
    except RuntimeError as e:
        print(f"zero-offload-server: {e}", file=sys.stderr, flush=True)
        server.shutdown()
        return 2
    return server.serve()
