"""Where an ipc:// server socket lives, and how its files go away.

    /tmp/zero-offload-XXXXXXXX/      the default: a private directory, mode 0700
        server.sock                  the ZeroMQ ipc endpoint
        server.sock.lock             flock held by the serving process (its pid inside)

The server removes these on every exit it controls; after a SIGKILL the worker
that notices (client) or the next server with the same address file does, through
``remove_dead_server_files``: only while no process holds the lock, and only the files
whose lock names the dead server's pid (a supervisor may have restarted a server at
the same path meanwhile: its socket and lock are not the dead one's to remove).
"""
from __future__ import annotations

import fcntl
import os
import tempfile
import time

PRIVATE_PREFIX = "zero-offload-"
DEAD_LOCK_WAIT_S = 2.0  # how long a dead server's threads may still hold its lock
SOCKET_NAME = "server.sock"


def make_private_dir() -> str:
    d = tempfile.mkdtemp(prefix=PRIVATE_PREFIX)
    os.chmod(d, 0o700)
    return d


def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"


def remove_dead_server_files(socket_path: str, server_pid: int = 0) -> bool:
    """A dead server's socket and lock (remove_socket_files), if they are still its: the
    lock is held by nobody (flock: a live server holds it for as long as it serves) and,
    given server_pid, names that pid.  True if removed."""
    lock = lock_path(socket_path)
    try:
        fd = os.open(lock, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        fd = None  # no lock: no server binds there (one takes the lock first); a socket may be left
    except OSError:
        return False
    try:
        if fd is not None:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if server_pid and owner and owner != str(server_pid):
                return False  # another server's lock (its own leftovers are for whoever saw it die)
            # a killed server's lock goes when its last thread has exited, a moment after its
            # pid shows it dead; a live server (one restarted here) holds it for good
            deadline = time.monotonic() + DEAD_LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.01)
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()  # ours now: the last word
            if server_pid and owner and owner != str(server_pid):
                return False
        remove_socket_files(socket_path)
        return True
    finally:
        if fd is not None:
            os.close(fd)  # (releases the flock: the files are gone by then)


def remove_socket_files(socket_path: str) -> None:
    """Remove the socket and its lock file, and the directory holding them if it is a
    private one (left alone unless empty).  The lock's holder, or remove_dead_server_files."""
    for p in (socket_path, lock_path(socket_path)):
        try:
            os.unlink(p)
        except OSError:
            pass
    d = os.path.dirname(socket_path)
    if os.path.basename(d).startswith(PRIVATE_PREFIX):
        try:
            os.rmdir(d)
        except OSError:
            pass
