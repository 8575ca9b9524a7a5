"""scripts/train_gpt.py end to end: a few steps, a checkpoint, a resume, and its errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
