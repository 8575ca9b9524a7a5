"""scripts/train_gpt.py end to end: a few steps, a checkpoint, a resume, its errors, Ctrl-C, and
two ranks under the launcher."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=240):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "train_gpt.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_train_checkpoint_and_resume(tmp_path):
    common = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-every", "3", "--dpu-warmup", "2",
              "--no-progress", "--ckpt-dir", str(tmp_path / "ck")]
    r = run("--steps", "6", "--log-json", str(tmp_path / "a.jsonl"), *common)
    assert r.returncode == 0, r.stderr
    assert "done:" in r.stdout and "val loss" in r.stdout
    recs = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == list(range(1, 7))
    assert {"loss", "tokens_per_s", "step_s", "wait_s"} <= set(recs[0]) and "val_loss" in recs[2]
    r = run("--steps", "9", "--resume", "--log-json", str(tmp_path / "b.jsonl"), *common)
    assert r.returncode == 0, r.stderr
    assert [json.loads(line)["step"] for line in (tmp_path / "b.jsonl").read_text().splitlines()] == [7, 8, 9]


def test_no_offload_baseline_runs():
    r = run("--steps", "3", "--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--no-offload",
            "--no-progress", "--eval-every", "0")
    assert r.returncode == 0, r.stderr


def test_bad_flags_are_explained():
    r = run("--steps", "0")
    assert r.returncode == 2 and "steps must be >= 1" in r.stderr
    r = run("--model", "huge")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    if not torch.cuda.is_available():
        r = run("--device", "cuda", "--steps", "1")
        assert r.returncode == 2 and "CUDA" in r.stderr


TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--eval-every", "0", "--no-progress"]


def test_ctrl_c_ends_quietly_and_cleanly(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) during training: exit 130 with
    one line, no traceback from the private server, nothing left behind."""
    from tests.conftest import our_segments
    before = our_segments()
    log = tmp_path / "steps.jsonl"
    p = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_gpt.py"), "--steps", "100000",
                          "--log-json", str(log), *TINY], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 3):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)
        # 150 s: in two full CI runs of the eighth session the exit outlasted 60 s (alone it takes ~1 s);
        # the cause is not found yet, and exit 130 with one line and nothing left behind is still asserted
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err, err
    assert our_segments() == before


def test_under_the_launcher_it_trains_one_job_of_two_ranks(tmp_path):
    """`zero-offload-launch --nproc-per-node 2 scripts/train_gpt.py`: one job (world
    size 2, each rank half the shard), every process traced into the launcher's
    --trace-dir, and the report has the server's figures."""
    tr = tmp_path / "trace"
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", "--trace-dir", str(tr),
           str(ROOT / "scripts" / "train_gpt.py"), "--steps", "12", *TINY]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["stats"]["world_size"] == 2
    assert summary["stats"]["shard_numel"] * 2 >= summary["params"] > summary["stats"]["shard_numel"]
    roles = sorted(f.name.rsplit("-", 1)[0] for f in tr.glob("*.json"))
    assert roles == ["server-0", "worker-0", "worker-1"], roles
    rep = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_report.py"), str(tr)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "nan" not in rep.stdout and "server update at" in rep.stdout, rep.stdout


def test_an_engine_where_the_launcher_started_ranks_but_no_group_exists(tmp_path):
    code = ("import torch; from zero_offload import OffloadEngine\n"
            "try:\n    OffloadEngine(torch.nn.Linear(4, 4))\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), WORLD_SIZE="2", RANK="0"))
    assert "refused: WORLD_SIZE is 2 but torch.distributed is not initialised" in r.stdout, r.stdout + r.stderr
    assert "init_process_group" in r.stdout
