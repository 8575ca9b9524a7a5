"""Shared fixtures: every test must leave no /dev/shm segment and no child behind."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

SHM = "/dev/shm"
# every server this test session starts (children inherit the environment) names
# its segments with this prefix, so other runs on the machine do not confuse the checks
PREFIX = f"zo-t{os.getpid()}-"
os.environ["ZERO_OFFLOAD_SHM_PREFIX"] = PREFIX


def our_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = our_segments()
    yield
    # a dropped worker's segment is unlinked by the server within its heartbeat check
    deadline = time.monotonic() + 3.0
    while our_segments() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = our_segments() - before
    assert not left, f"test left shared segments behind: {sorted(left)}"


@pytest.fixture
def server():
    from zero_offload.server import spawn
    srv = spawn(threads=1, heartbeat_timeout_s=2.0)
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def run_py(code: str, timeout_s: float = 60.0, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, **kw)
