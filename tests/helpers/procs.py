"""Which processes a test left or started: read from /proc (no pgrep needed on the machine)."""
from __future__ import annotations

import os


def argv(pid) -> list[str]:
    """A process's command line as its arguments ([] once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def matching(text: str) -> list[str]:
    """Command lines of the live processes (not this one) that contain text."""
    me = str(os.getpid())
    return [c for p in _pids() if p != me and text in (c := " ".join(argv(p)))]


def children(parent: int, text: str) -> list[int]:
    """Pids of parent's children whose command line contains text."""
    return [int(p) for p in _pids() if _ppid(p) == parent and text in " ".join(argv(p))]


def servers_for(pid: int) -> list[int]:
    """The optimizer servers spawned for worker `pid` (their --parent-pid)."""
    out = []
    for p in _pids():
        a = argv(p)
        if "zero_offload.server" in a and "--parent-pid" in a[:-1] and a[a.index("--parent-pid") + 1] == str(pid):
            out.append(int(p))
    return out
