"""Which processes a test left: read from /proc (no pgrep needed on the machine)."""
from __future__ import annotations

import os


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def matching(text: str) -> list[str]:
    """Command lines of the live processes (not this one) that contain text."""
    me = str(os.getpid())
    return [c for p in os.listdir("/proc") if p.isdigit() and p != me and text in (c := _cmdline(p))]


def children(parent: int, text: str) -> list[int]:
    """Pids of parent's children whose command line contains text."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == parent and text in _cmdline(p)]
