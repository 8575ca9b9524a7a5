"""zero-offload-launch --max-restarts: a killed server or worker costs a restart, not the run.

The real launcher, server and train_gpt.py; the victim is SIGKILLed mid-run.  The
restarted workers resume from the last checkpoint (--auto-resume), and the run
must end exactly where an uninterrupted run ends: the final master, m, v and
device weights bitwise equal, and every step logged after the restart with the
uninterrupted run's loss.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import our_segments
from tests.faults.test_crashes import record

pytestmark = pytest.mark.timeout(240)  # one xdist worker runs this module (tests/conftest.py XDIST_GROUPS)
ROOT = Path(__file__).resolve().parents[2]
STEPS, CKPT_EVERY, KILL_AFTER = 100, 10, 25
COMMON = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--dpu-warmup", "3",
          "--no-progress", "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--auto-resume"]


def launch(tmp: Path, name: str, max_restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zero_offload.launch", "--max-restarts", str(max_restarts),
           str(ROOT / "scripts" / "train_gpt.py"), *COMMON, "--ckpt-dir", str(tmp / f"{name}-ck"),
           "--log-json", str(tmp / f"{name}.jsonl")]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def find_pid(*needles: str, exclude: tuple[str, ...] = ()) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if all(n in cmd for n in needles) and not any(x in cmd for x in exclude):
            return int(d.name)
    raise AssertionError(f"no process with {needles} in its command line")


def final_files(ck: Path) -> dict[str, bytes]:
    d = ck / (ck / "latest").read_text().strip()
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.bin"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    p = launch(tmp, "ref", 0)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out
    return {r["step"]: r["loss"] for r in records(tmp / "ref.jsonl")}, final_files(tmp / "ref-ck")


@pytest.mark.parametrize("victim", ["server", "worker"])
def test_restart_ends_where_an_uninterrupted_run_ends(tmp_path, uninterrupted, victim):
    ref_loss, ref_files = uninterrupted
    p = launch(tmp_path, "crash", 2)
    log = tmp_path / "crash.jsonl"
    try:
        deadline = time.monotonic() + 120
        while len(records(log)) < KILL_AFTER:
            assert p.poll() is None, p.communicate()[0]
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.005)
        if victim == "server":
            pid = find_pid("zero_offload.server", f"--parent-pid {p.pid}")
        else:
            pid = find_pid("train_gpt.py", str(log), exclude=("zero_offload.launch", "torch.distributed.run"))
        killed_at = len(records(log))
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        assert killed_at < STEPS, "the run ended before the kill; make it longer"
        lines_at_kill = len(records(log))
        while len(records(log)) <= lines_at_kill and p.poll() is None and time.monotonic() < t_kill + 120:
            time.sleep(0.01)
        back_after_s = time.monotonic() - t_kill  # detection, fresh server, engine set-up, load, one step
        out, _ = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out
    assert "restart 1 of 2" in out and "restart 2" not in out, out
    m = re.search(r"resumed from \S+ at step (\d+)", out)
    assert m, out
    n = int(m.group(1))
    assert n > 0 and n % CKPT_EVERY == 0, n  # the last checkpoint, not a fresh start
    recs = records(log)
    after = recs[len(recs) - (STEPS - n):]
    before = recs[:len(recs) - len(after)]
    assert [r["step"] for r in after] == list(range(n + 1, STEPS + 1))
    assert [r["step"] for r in before] == list(range(1, len(before) + 1)) and len(before) >= n
    for r in after:
        assert r["loss"] == ref_loss[r["step"]], r  # bitwise the same trajectory
    assert final_files(tmp_path / "crash-ck") == ref_files  # master, m, v, device weights
    assert not our_segments()
    record(f"restart_{victim}", {"killed_after_step": killed_at, "resumed_from": n, "back_after_s": back_after_s})
