"""Where an ipc:// server socket lives, and how its files go away.

    /tmp/zero-offload-XXXXXXXX/      the default: a private directory, mode 0700
        server.sock                  the ZeroMQ ipc endpoint
        server.sock.lock             flock held by the serving process (its pid inside)

The server removes these on every exit it controls; after a SIGKILL the worker
that notices (client) or the next server with the same address file does.
"""
from __future__ import annotations

import os
import tempfile

PRIVATE_PREFIX = "zero-offload-"
SOCKET_NAME = "server.sock"


def make_private_dir() -> str:
    d = tempfile.mkdtemp(prefix=PRIVATE_PREFIX)
    os.chmod(d, 0o700)
    return d


def lock_path(socket_path: str) -> str:
    return socket_path + ".lock"


def remove_socket_files(socket_path: str) -> None:
    """Remove the socket and its lock file, and the directory holding them if it is a
    private one (left alone unless empty)."""
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
