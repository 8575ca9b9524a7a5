"""The files a server leaves on disk, and how the next one sweeps a killed one's.

    ADDRESS_FILE            the bound address, one line, written atomically once ready
    ADDRESS_FILE.token      the token (mode 0600): what a worker must present in HELLO
    ADDRESS_FILE.segments   registry: {"pid", "segments": [names], "private_dir"}; the
                            next server with the same address file unlinks what a
                            killed one left (its pid gone) before it binds
    SOCKET.lock             ipc:// only: flock held by the serving process, pid inside
                            (optimizer_server.ipc: where the socket lives)

A server removes all of them on every exit it controls; a file whose directory
is gone (the spawning parent exited and removed it first) is no error: the
parent's exit is a normal end for a spawned server.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path

from . import ipc
from .procs import pid_alive
from .shm import unlink as shm_unlink
from .spawn import SPAWN_DIR_PREFIX

log = logging.getLogger("optimizer_server")
TOKEN_SUFFIX, REGISTRY_SUFFIX = ".token", ".segments"


def _replace(path: Path, data: str, mode: int = 0o644) -> None:
    """Write data to path atomically (tmp + rename); a vanished directory is no error."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except FileNotFoundError:
        if path.parent.exists():
            raise
        log.debug("not writing %s: its directory is gone (the parent exited)", path)


class ServerFiles:
    """The address file, token, segment registry and ipc lock of one server."""

    def __init__(self, address_file: str, parent_pid: int = 0):
        self.address_file = Path(address_file) if address_file else None
        self.parent_pid = parent_pid
        self.ipc_path: str | None = None
        self.lock_fd: int | None = None
        self.owns = False  # set once bound: a refused server must not remove the live one's files

    def _sibling(self, suffix: str) -> Path | None:
        return self.address_file.with_name(self.address_file.name + suffix) if self.address_file else None

    # -- before binding ------------------------------------------------------
    def sweep_leftovers(self) -> None:
        """Unlink segments a killed server left behind under the same address file."""
        reg = self._sibling(REGISTRY_SUFFIX)
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

    def take_ipc_lock(self, path: str) -> None:
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
        self.ipc_path, self.lock_fd = path, fd
        if os.path.exists(path):  # a stale socket file of a dead server
            os.unlink(path)

    # -- once bound ----------------------------------------------------------
    def publish(self, address: str, token: str, segments: list[str], private_dir: str) -> None:
        """Token, registry, then the address (what readers wait for) last."""
        self.owns = True
        if self.address_file is None:
            return
        _replace(self._sibling(TOKEN_SUFFIX), token, 0o600)
        self.write_registry(segments, private_dir)  # before the address: a kill from here on is swept
        _replace(self.address_file, address + "\n")

    def write_registry(self, segments: list[str], private_dir: str) -> None:
        reg = self._sibling(REGISTRY_SUFFIX)
        if reg is not None:
            _replace(reg, json.dumps({"pid": os.getpid(), "segments": segments, "private_dir": private_dir}))

    # -- exit ----------------------------------------------------------------
    def remove(self) -> None:
        if self.lock_fd is not None:  # held only by a server that got this ipc path
            ipc.remove_socket_files(self.ipc_path)
            os.close(self.lock_fd)
            self.lock_fd = None
        if not self.owns or self.address_file is None:
            return
        for suffix in ("", TOKEN_SUFFIX, REGISTRY_SUFFIX):
            Path(str(self.address_file) + suffix).unlink(missing_ok=True)
        # spawn() made the address file's private directory and removes it at its
        # exit; when that parent was killed first, the server is the last one who
        # knows it.  rmdir only ever removes an empty directory.
        if self.parent_pid and not pid_alive(self.parent_pid):
            d = self.address_file.parent
            if d.name.startswith(SPAWN_DIR_PREFIX):
                try:
                    d.rmdir()
                except OSError:
                    pass
