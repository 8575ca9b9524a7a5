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

Others on the machine: each file is written through a random temporary name opened
O_EXCL|O_NOFOLLOW, then renamed (optimizer_server.atomic), so nobody can read the
token through a file made in advance or make the server overwrite a file through a
symbolic link; a directory that other users may write is refused unless it has the
sticky bit (/tmp), where those writes are still safe; the lock file is opened
O_NOFOLLOW and must be ours.  The registry is trusted only if it is a regular
file of ours with mode 0600 and every name in it looks like a segment of ours.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import stat
from pathlib import Path

from . import ipc
from .atomic import atomic_write_bytes
from .procs import pid_alive
from .shm import unlink as shm_unlink
from .spawn import SPAWN_DIR_PREFIX

log = logging.getLogger("optimizer_server")
TOKEN_SUFFIX, REGISTRY_SUFFIX = ".token", ".segments"


SEGMENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,40}[0-9a-f]{8}-r\d{1,6}-[0-9a-f]{16}")  # server.Server._hello


def _replace(path: Path, data: str, mode: int = 0o600) -> None:
    """Write data to path atomically (random tmp + rename); a vanished directory is no error."""
    try:
        atomic_write_bytes(path, data.encode(), mode, fsync=False)
    except FileNotFoundError:
        if path.parent.exists():
            raise
        log.debug("not writing %s: its directory is gone (the parent exited)", path)


def check_private_dir(d: str | Path, what: str) -> None:
    """Refuse (RuntimeError naming the fix) a directory other users may write, unless
    it is sticky (like /tmp: others can add files there but not replace ours)."""
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return  # made by us, later
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if (shared or st.st_uid != os.geteuid()) and not st.st_mode & stat.S_ISVTX:
        raise RuntimeError(f"the {what}'s directory {d} is writable by other users (mode "
                           f"{stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): one of them could replace the "
                           f"files there; use a directory of your own (mkdir -m 700) or a sticky one such as /tmp")


def _ours(path: Path, mode_mask: int = 0o077) -> bool:
    """A regular file (not a link) owned by this user with none of mode_mask's bits."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & mode_mask


def read_token_file(path: str) -> str:
    """The token in `path`: a regular file of this user that no one else can read
    (0600), one line; ValueError naming the fix otherwise."""
    if not _ours(Path(path)):
        raise ValueError(f"--token-file {path} must be a regular file of yours that others cannot read or write "
                         f"(chmod 600), not a link")
    token = Path(path).read_text().strip()
    if not token or len(token) > 4096 or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {path} must hold one token (no spaces, at most 4096 characters)")
    return token


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
        """Unlink segments a killed server left behind under the same address file, if the
        registry is one of ours (regular, our uid, 0600) and each name one of our segments."""
        if self.address_file is not None:
            check_private_dir(self.address_file.parent or ".", "address file")
            os.makedirs(self.address_file.parent or ".", mode=0o700, exist_ok=True)
        reg = self._sibling(REGISTRY_SUFFIX)
        if reg is None or not os.path.lexists(reg):
            return
        if not _ours(reg):
            log.warning("not trusting %s: not a regular file of this user with mode 0600; nothing swept", reg)
            return
        try:
            data = json.loads(reg.read_text())
            pid = int(data.get("pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            reg.unlink(missing_ok=True)
            return
        if pid_alive(pid) and pid != os.getpid():
            return  # its owner still runs; the lock check will refuse us anyway
        names = [n for n in data.get("segments", []) if isinstance(n, str) and SEGMENT_NAME.fullmatch(n)]
        n = sum(shm_unlink(name) for name in names if _ours(Path("/dev/shm") / name))
        if n:
            log.warning("swept %d shared segment(s) left by dead server pid %s", n, pid)
        d = data.get("private_dir")
        if (isinstance(d, str) and os.path.basename(d).startswith(ipc.PRIVATE_PREFIX)
                and os.path.isdir(d) and not os.path.islink(d) and os.stat(d).st_uid == os.geteuid()):
            ipc.remove_dead_server_files(os.path.join(d, ipc.SOCKET_NAME), pid)
        reg.unlink(missing_ok=True)

    def take_ipc_lock(self, path: str) -> None:
        check_private_dir(os.path.dirname(path) or ".", "ipc socket")
        lock = ipc.lock_path(path)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o600)
        except OSError as e:
            raise RuntimeError(f"cannot open the lock file {lock} ({e.strerror}; a symbolic link is refused): "
                               f"remove it or pass a different --address") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise RuntimeError(f"the lock file {lock} is not a regular file of this user; remove it or pass a "
                               f"different --address")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                other = os.read(fd, 32).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise RuntimeError(f"another optimizer server (pid {other}) is already serving at ipc://{path}; "
                               f"stop it or pass a different --address") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.ipc_path, self.lock_fd = path, fd
        if os.path.lexists(path):  # a stale socket file of a dead server
            os.unlink(path)

    # -- once bound ----------------------------------------------------------
    def publish(self, address: str, token: str, segments: list[str], private_dir: str) -> None:
        """Token, registry, then the address (what readers wait for) last."""
        self.owns = True
        if self.address_file is None:
            return
        _replace(self._sibling(TOKEN_SUFFIX), token, 0o600)
        self.write_registry(segments, private_dir)  # before the address: a kill from here on is swept
        _replace(self.address_file, address + "\n", 0o644)  # not a secret: the token is apart

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
