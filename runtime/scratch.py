"""Private scratch directories for the temporary checkpoints some calls write (a torch
state dict through the checkpoint path, an FSDP2 rank's own checkpoint, state_dict()
without state_dir), and the sweep of those a killed process left.

A scratch directory is named ``{prefix}{host}-{pid}-{random}``: made 0700 by
tempfile.mkdtemp (a fresh, unguessable name) and removed by its caller whatever
happens, except when the process is killed.  So each ``make`` first sweeps the
directories beside it with the same prefix that were made on this host by a process
that is no longer running, are this user's, and are directories, not links: a crash
leaves at most one behind, until the next call of the same kind.  What another host
made (a shared disk) is left to that host.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path

from zero_offload.server.procs import pid_alive


def _host() -> str:
    # a name that cannot hold the separator or a path: what the sweep parses back
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def make(prefix: str, parent: str | Path | None = None) -> Path:
    """A fresh scratch directory under `parent` (None: TMPDIR), after a sweep there."""
    where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    sweep(prefix, where)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{_host()}-{os.getpid()}-", dir=where))


def sweep(prefix: str, parent: str | Path) -> list[str]:
    """Remove `prefix` scratch directories under `parent` whose process (on this host) is
    gone; returns their names."""
    pat = re.compile(rf"{re.escape(prefix)}{re.escape(_host())}-(\d+)-[^/]+$")
    gone = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return gone
    for e in entries:
        m = pat.match(e.name)
        if not m or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            st = os.lstat(e.path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(e.name)
    return gone
