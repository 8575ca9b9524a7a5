"""Process liveness and exit descriptions, shared by server, client and launcher."""
from __future__ import annotations

import os
import signal


def pid_alive(pid: int) -> bool:
    """True if pid runs and is not a zombie (a killed child not yet reaped is dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exited (status unknown: not our child)"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
