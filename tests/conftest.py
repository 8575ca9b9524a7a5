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
# One intra-op thread per process (before torch is imported; children inherit it): the
# suite runs two pytest-xdist workers, each with its servers and launched ranks, on as
# many cores as there are workers.  With torch's default of a thread per core, each op's
# parallel region waits for a thread that shares its core with another process:
# tests/test_overlap.py took 67 s beside one busy core instead of 23 s with one thread
# (18 s on an idle machine either way).  A test that wants more threads says so
# (num_threads=, server threads, the launcher's split).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def our_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}
    except FileNotFoundError:
        return set()


# Tests that one pytest-xdist worker runs one after another (nodeid prefix -> group):
# - a module fixture's tests, so its launch happens once;
# - what holds GBs of host RAM or reads MemAvailable, so none sees another's memory.
# Every other test is its own unit.  (A table here, not xdist_group markers: with
# pytest 9.2, pytest-xdist 3.8's loadgroup no longer tags the items, so the markers
# were ignored.)
XDIST_GROUPS = (
    ("tests/test_distributed.py::test_two_ranks_match_one_rank", "two_rank_runs"),
    ("tests/test_distributed.py::test_overlap_update_on_two_ranks_is_bitwise_sync", "two_rank_runs"),
    ("tests/test_distributed.py::test_overflow_on_one_rank_skips_everywhere", "two_rank_runs"),
    ("tests/test_distributed.py::test_ranks_agree_on_the_undo_log_when_their_ram_differs", "two_rank_runs"),
    ("tests/test_distributed.py::test_ranks_agree_on_the_compute_dtype_when_their_cpus_differ", "two_rank_runs"),
    ("tests/test_distributed.py::test_a_shard_refused_on_one_rank_raises_on_every_rank", "two_rank_runs"),
    ("tests/faults/test_restart.py", "restart"),
    # the FSDP2 module fixture's one launch of 8 runs
    ("tests/test_fsdp2.py::test_offload_adamw_on_fsdp2", "fsdp2_two_ranks"),
    ("tests/test_fsdp2.py::test_torch_save_of_each_ranks", "fsdp2_two_ranks"),
    ("tests/test_fsdp2.py::test_the_device_holds", "fsdp2_two_ranks"),
    ("tests/test_fsdp2.py::test_mode_exact_on_fsdp2", "fsdp2_two_ranks"),
    ("tests/test_fsdp2_checkpoint.py", "fsdp2_checkpoint_chain"),
    ("tests/test_checkpoint_scale.py", "memory"),
    ("tests/test_memory.py", "memory"),
    ("tests/test_export.py::test_a_0_3e9", "memory"),
    ("tests/test_scripts.py::test_bench_memory_tiny", "memory"),
    ("tests/faults/test_hardening.py::test_admission_adds_up_the_sessions_it_admitted", "memory"),
    # a variant's bf16 and int8 cases share its fp32-state run (cached per process); dpu-predict
    # before dpu: the first prefix that matches wins
    *((f"tests/test_state_dtype.py::test_compact_state_trains_close_to_fp32_state[{v}-", f"compact_{v}")
      for v in ("sync", "dpu-predict", "dpu", "copy-path", "fp16")),
)


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (the GPU image) it is not called
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Grouped(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            for prefix, group in XDIST_GROUPS:
                if nodeid.startswith(prefix):
                    return group
            return nodeid

    return Grouped(config, log)


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
