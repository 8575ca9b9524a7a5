"""Real processes, real signals: a server or worker killed mid-training, and resume."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import seed_for_test
import torch

from zero_offload.server import spawn
from tests.conftest import our_segments

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def record(key: str, value) -> None:
    """Measured outcomes for BENCHMARKS.md: kept only when scripts/reliability_report.py
    runs the suite (it sets ZERO_OFFLOAD_RECORD to a JSON file)."""
    path = os.environ.get("ZERO_OFFLOAD_RECORD")
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data[key] = value
    p.write_text(json.dumps(data, indent=1))


def worker(mode, ckpt, steps, env=None, private=False):
    cmd = [sys.executable, str(ROOT / "tests" / "helpers" / "fault_worker.py"), mode, str(ckpt), str(steps)]
    if private:
        cmd.append("--private")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


def read_until_step(p, step: int, timeout_s: float = 60.0) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith("STEP") and int(line.split()[1]) >= step:
            return lines
    raise AssertionError(f"worker never reached step {step}: {lines} {p.stderr.read() if p.poll() else ''}")


@pytest.mark.parametrize("mode", ["sync", "dpu"])
@pytest.mark.parametrize("private", [False, True], ids=["launcher-server", "private-server"])
def test_server_sigkill_surfaces_as_named_error(tmp_path, mode, private):
    before = our_segments()
    rng = random.Random(seed_for_test())
    detections = []
    for trial in range(3):
        kill_at = rng.randint(2, 12)
        srv = None if private else spawn(threads=1)
        env = {} if private else {"ZERO_OFFLOAD_ADDRESS": srv.address, "ZERO_OFFLOAD_TOKEN": srv.token}
        p = worker(mode, tmp_path / f"ck{trial}", 100000, env, private)
        try:
            lines = read_until_step(p, kill_at)
            if private:
                _, pid, address = next(ln for ln in lines if ln.startswith("SERVER")).split()
                pid = int(pid)
            else:
                pid, address = srv.pid, srv.address
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            if srv is not None:
                srv.proc.wait(5)  # the launcher would reap it
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
            if srv is not None:
                srv.stop()
        dead = [ln for ln in out.splitlines() if ln.startswith("DEAD")]
        assert p.returncode == 3 and dead, (out, err)
        t_dead = float(dead[0].split()[1])
        assert t_dead - t_kill < 5.0
        msg = dead[0]
        assert "pid" in msg and ("SIGKILL" in msg if private else "no longer running" in msg)
        if not private:
            assert srv.address in msg
        detections.append(t_dead - t_kill)
        assert not os.path.exists(address[len("ipc://"):])  # the worker removed the dead server's socket
    assert our_segments() == before  # the worker unlinked the dead server's segments
    record(f"server_sigkill_{mode}_{'private' if private else 'launcher'}",
           {"trials": len(detections), "max_detect_s": max(detections), "mean_detect_s": sum(detections) / 3})


def test_a_dead_unreaped_server_is_dead_to_its_worker(tmp_path):
    """The server is SIGKILLed and its parent (this test, as a launcher would be while it
    is busy elsewhere) does not reap it: it stays a zombie, its pid still in /proc.  The
    worker talking to it must still raise the named dead-server error within the usual
    bound, not wait out request_timeout_s for a process that will never answer.
    (Mutation: procs.pid_alive counting state Z as alive makes the worker wait: no DEAD
    line within 30 s.)"""
    srv = spawn(threads=1)
    env = {"ZERO_OFFLOAD_ADDRESS": srv.address, "ZERO_OFFLOAD_TOKEN": srv.token,
           "ZERO_OFFLOAD_REQUEST_TIMEOUT_S": "120"}
    p = worker("sync", tmp_path / "ck", 100000, env)
    try:
        read_until_step(p, 3)
        t_kill = time.monotonic()
        os.kill(srv.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        state = ""
        while time.monotonic() < deadline:  # the kernel makes it a zombie; nobody reaps it
            with open(f"/proc/{srv.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.01)
        assert state == "Z", state
        out, err = p.communicate(timeout=30)
        with open(f"/proc/{srv.pid}/stat") as f:  # still unreaped while the worker decided
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        p.kill()
        srv.stop()  # reaps it
    dead = [ln for ln in out.splitlines() if ln.startswith("DEAD")]
    assert p.returncode == 3 and dead, (out, err)
    assert float(dead[0].split()[1]) - t_kill < 5.0
    assert "no longer running" in dead[0] and srv.address in dead[0]


def test_resume_after_server_crash_is_bitwise(tmp_path):
    ck = tmp_path / "ck"
    with spawn(threads=1) as srv:
        env = {"ZERO_OFFLOAD_ADDRESS": srv.address, "ZERO_OFFLOAD_TOKEN": srv.token}
        p = worker("dpu", ck, 100000, env)
        read_until_step(p, 12)
        os.kill(srv.pid, signal.SIGKILL)
        srv.proc.wait(5)
        p.communicate(timeout=30)
        assert p.returncode == 3
    saved = int((ck / "latest").read_text().split("-")[1])
    assert saved >= 10
    with spawn(threads=1) as srv:  # a new server, from the last checkpoint
        env = {"ZERO_OFFLOAD_ADDRESS": srv.address, "ZERO_OFFLOAD_TOKEN": srv.token}
        q = worker("resume", ck, 7, env)
        out, err = q.communicate(timeout=120)
        assert q.returncode == 0, err
    # the same run, never interrupted, to the same step
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    q = worker("full", full_dir, saved + 7, {})
    out, err = q.communicate(timeout=120)
    assert q.returncode == 0, err
    resumed = torch.load(next(ck.glob("resume-*.pt")))
    full = torch.load(next(full_dir.glob("full-*.pt")))
    for part in ("master", "w16"):
        for k in full[part]:
            assert torch.equal(resumed[part][k], full[part][k]), (part, k)


def test_killed_parent_leaves_no_spawn_directory():
    """spawn()'s private directory goes at the parent's exit; when the parent is
    SIGKILLed instead, the server (which exits with it) removes it."""
    from zero_offload.server.procs import pid_alive
    code = ("import time\nfrom optimizer_server import spawn\ns = spawn(threads=1)\n"
            "print(s.address_file, s.pid, flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        address_file, server_pid = p.stdout.readline().split()
        d = Path(address_file).parent
        assert d.is_dir() and d.name.startswith("zero-offload-spawn-")
    finally:
        p.kill()
        p.wait(10)
        p.stdout.close()
    deadline = time.monotonic() + 20
    while pid_alive(int(server_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(int(server_pid)), "the server outlived its killed parent"
    assert not d.exists(), f"{d} was left behind"


@pytest.mark.parametrize("dpu", [False, True], ids=["sync", "dpu"])
def test_server_killed_before_a_checkpoint_is_the_named_error(tmp_path, dpu):
    """A save that finds the server dead raises OptimizerServerDeadError itself, not
    a checkpoint error wrapping it (what a trainer catches to restart), and leaves
    no partial checkpoint."""
    from zero_offload.server import OptimizerServerDeadError
    from zero_offload import OffloadConfig, OffloadEngine
    from tests.helpers.dist_worker import global_batch, make_model
    model = make_model()
    eng = OffloadEngine(model, OffloadConfig(lr=1e-3, dtype="bf16", mode="dpu" if dpu else "exact",
                                             server={"threads": 1}, expert={"dpu_warmup_steps": 1}))
    try:
        for t in range(1, 4):
            x, y = global_batch(t)
            eng.backward(torch.nn.functional.mse_loss(model(x.to(eng.compute_dtype)).float(), y))
            eng.step()
        eng._server.proc.kill()
        eng._server.proc.wait(10)
        with pytest.raises(OptimizerServerDeadError, match="SIGKILL"):
            eng.save_checkpoint(str(tmp_path))
        assert not OffloadEngine.has_checkpoint(str(tmp_path))
    finally:
        eng.close()
