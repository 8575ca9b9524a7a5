"""Start an optimizer server as a child process and wait until it is ready.

    with optimizer_server.spawn(threads=1) as srv:
        client = ShardClient(srv.address, srv.token, ...)
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from .config import TOKEN_ENV
from .procs import describe_exit

READY_TIMEOUT_S = 60.0
SPAWN_DIR_PREFIX = "zero-offload-spawn-"  # the server removes such a directory if its parent was killed
STOP_TIMEOUT_S = 10.0


class ServerHandle:
    """A running server child: .address, .token, .pid, .stop(); a context manager."""

    def __init__(self, proc: subprocess.Popen, address: str, token: str, address_file: str, tmpdir: str | None):
        self.proc = proc
        self.address = address
        self.token = token
        self.address_file = address_file
        # the address/token directory goes even when the parent exits without stop()
        # (an uncaught OptimizerServerDeadError, say): at interpreter exit at the latest
        self._cleanup = weakref.finalize(self, shutil.rmtree, tmpdir, True) if tmpdir else None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait (bounded), SIGKILL if needed; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        if self.proc.returncode is not None and self.proc.returncode < 0:
            # killed: its segments stay in /dev/shm unless each worker saw the death before it
            # was stopped itself (torchrun stops the other ranks when one raises); the parent
            # that saw it die sweeps what its registry names, as the next server would
            from .files import ServerFiles
            try:
                ServerFiles(self.address_file).sweep_leftovers()
            except (OSError, RuntimeError, ValueError):
                pass  # nothing of ours to sweep there
        if self._cleanup is not None:
            self._cleanup()
            self._cleanup = None
        return self.proc.returncode

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _identity(path: str):
    try:
        st = os.stat(path)
        return (st.st_ino, st.st_mtime_ns)
    except FileNotFoundError:
        return None


def spawn(*, threads: int = 0, address: str = "", address_file: str = "", token: str = "",
          heartbeat_timeout_s: float | None = None, exit_when_idle: bool = False, log_level: str = "WARNING",
          ready_timeout_s: float = READY_TIMEOUT_S, env: dict | None = None, stdout=None, stderr=None,
          extra_args: list[str] | None = None, trace_dir: str = "") -> ServerHandle:
    """Start `python -m zero_offload.server` as a child and return once its address is
    written (within ready_timeout_s), or raise saying why it did not come up."""
    tmpdir = None
    if not address_file:
        tmpdir = tempfile.mkdtemp(prefix=SPAWN_DIR_PREFIX)
        address_file = os.path.join(tmpdir, "server.addr")
    token = token or secrets.token_hex(16)
    cmd = [sys.executable, "-m", "zero_offload.server", "--address-file", address_file, "--threads", str(threads),
           "--log-level", log_level, "--parent-pid", str(os.getpid())]
    if address:
        cmd += ["--address", address]
    if heartbeat_timeout_s is not None:
        cmd += ["--heartbeat-timeout", str(heartbeat_timeout_s)]
    if exit_when_idle:
        cmd.append("--exit-when-idle")
    if trace_dir:
        cmd += ["--trace-dir", trace_dir]
    cmd += extra_args or []
    child_env = dict(os.environ if env is None else env)
    child_env[TOKEN_ENV] = token  # via the environment, not argv (visible in ps)
    if threads > 0:
        child_env["OMP_NUM_THREADS"] = str(threads)
    before = _identity(address_file)  # a stale file from an earlier server is not "ready"
    # A session of its own: Ctrl-C at the terminal reaches the parent alone, which
    # stops the server itself (close, or the finalizer at exit); a parent killed
    # outright is noticed through --parent-pid.  In the parent's process group the
    # server would get the SIGINT too and race the parent's own clean-up.
    proc = subprocess.Popen(cmd, env=child_env, stdout=stdout if stdout is not None else subprocess.DEVNULL,
                            stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            said = proc.stderr.read().strip() if proc.stderr is not None else "(its output is above)"
            raise RuntimeError(f"optimizer server {describe_exit(rc)} before it was ready: {said}")
        ident = _identity(address_file)
        if ident is not None and ident != before:
            addr = Path(address_file).read_text().strip()
            if addr:
                return ServerHandle(proc, addr, token, address_file, tmpdir)
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise TimeoutError(f"optimizer server not ready after {ready_timeout_s:.0f} s; command: {' '.join(cmd)}")
        time.sleep(0.01)
