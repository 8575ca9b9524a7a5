"""The scripts in scripts/ run end to end at tiny sizes (so they do not rot between benchmark runs)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parent.parent


def run(script, *args, timeout=240):
    cmd = ["bash", str(ROOT / "scripts" / script)] if script.endswith(".sh") else \
        [sys.executable, str(ROOT / "scripts" / script)]
    r = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_bench_adam_tiny():
    out = run("bench_adam.py", "--sizes", "64K", "--threads", "1", "--reps", "1", "--no-write")
    row = next(line for line in out.splitlines() if line.startswith("| 64K | 1 |"))
    assert row.count("|") == 10 and "% |" in row


def test_bench_adam_state_dtypes_tiny():
    out = run("bench_adam.py", "--state-dtypes", "--sizes", "64K", "--threads", "1", "--reps", "1", "--no-write")
    for state in ("fp32", "bf16", "bf16-exact", "int8", "int8-exact"):
        assert any(line.startswith(f"| 64K | 1 | {state} |") for line in out.splitlines()), state


def test_bench_adam_progress_tiny():
    """--progress: the update in 1M progress blocks against one call (2M elements: two blocks)."""
    out = run("bench_adam.py", "--progress", "--sizes", "2M", "--threads", "1,2", "--reps", "1", "--no-write")
    for t in (1, 2):
        row = next(line for line in out.splitlines() if line.startswith(f"| 2M | {t} |"))
        assert row.count("|") == 6 and row.rstrip().endswith("x |"), row


def test_bench_transport_tiny():
    out = run("bench_transport.py", "--n", "50", "--numel", "64K", "--no-write")
    assert "bare ZeroMQ echo" in out and "round trip STEP" in out


def test_bench_spec_piece_tiny():
    out = run("bench_spec_piece.py", "--numel", "64K", "--reps", "1", "--no-write")
    rows = [line for line in out.splitlines() if line.startswith("| 64K |")]
    kinds = ["plain update", "speculated, undo log", "speculated, twin", "speculated, twin, two weights slots"]
    assert [(r.split("|")[2].strip(), r.split("|")[3].strip()) for r in rows] == \
        [(st, k) for st in ("fp32", "bf16") for k in kinds]
    assert all(r.count("|") == 7 for r in rows)


def test_bench_pipeline_tiny():
    out = run("bench_pipeline.py", "--settings", "tiny:1x8", "--steps", "2", "--passes", "1", "--warm", "3",
              "--no-write")
    assert "| tiny 1x8 |" in out
    out = run("bench_pipeline.py", "--state-dtypes", "--settings", "tiny:1x8", "--steps", "2", "--passes", "1",
              "--warm", "3", "--no-write")
    for mode in ("sync", "dpu", "overlap"):
        row = next(line for line in out.splitlines() if line.startswith(f"| tiny 1x8 | {mode} |"))
        assert row.count("|") == 8
    out = run("bench_pipeline.py", "--speculation", "--settings", "tiny:1x8", "--steps", "2", "--passes", "1",
              "--warm", "2", "--spec-states", "int8", "--no-write")
    rows = [line for line in out.splitlines() if line.startswith("| tiny 1x8 |")]
    assert len(rows) == 2 and all(r.count("|") == 16 for r in rows), rows
    assert "| int8 | none |" in out and " / 0% / " in rows[0], rows  # no clip: nothing rolled back


def test_bench_memory_tiny():
    # one variant per layout, mode and state dtype (each starts its own processes: ~6 s a variant)
    variants = ("baseline", "offload-sync", "offload-dpu-copy", "offload-sync-copy-bf16state",
                "offload-dpu-copy-int8state")
    out = run("bench_memory.py", "--layers", "1", "--d-model", "64", "--steps", "2", "--no-write",
              "--variants", ",".join(variants))
    for variant in variants:
        assert f"| {variant} |" in out
    capacity = out.split("params on a 24 GiB host")
    assert len(capacity) == 2 and "| offload-dpu-copy-int8state | " in capacity[1]


def test_bench_scale_tiny(tmp_path):
    """bench_scale's whole path at 1e6 parameters (its rows are 0.5e9 and up: BENCHMARKS.md),
    without dropping the machine's page cache: one row of 13 columns, the engine's save
    rate against the write bound, master_state_dict timed (RAM is plenty), the export's row;
    under fp32 compute (what an AVX2 host gets), which the machine line names."""
    out = run("bench_scale.py", "--sizes", "1e6", "--repro", "0", "--warm", "--dir", str(tmp_path),
              "--compute-dtype", "fp32")
    assert "--compute-dtype fp32`; compute dtype float32." in out, out[-2000:]
    rows = [line for line in out.splitlines() if line.startswith("| 0.00e9 | bf16 |")]
    assert len(rows) == 1 and rows[0].count("|") == 14, out[-2000:]
    assert "\n|" + "---|" * 13 + "\n" in out  # the delimiter row has the header's 13 cells (or it renders as text)
    cols = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert re.fullmatch(r"[\d.]+ \([\d.]+, \d+%\)", cols[5]), cols  # save s (GB/s, % of the write bound)
    assert re.fullmatch(r"[\d.]+", cols[10]), cols  # master_state_dict s: not skipped
    assert "may hit the page cache" in out
    ex = [line for line in out.splitlines() if line.startswith("| 0.00e9 |") and line.count("|") == 7]
    assert len(ex) == 1 and re.fullmatch(r"\| 0\.00e9 \| [\d.]+ \| [\d.]+ \+ 0\.00 \| [\d.]+ \| \d+% \| [\d.]+ \|",
                                         ex[0]), out[-2000:]  # the export's row


def test_bench_torch_state_tiny(tmp_path):
    """bench_torch_state's whole path at 1e6 parameters (its rows are 0.5e9 and up:
    BENCHMARKS.md): one row, the moments checked bitwise at its three slices."""
    out = run("bench_torch_state.py", "--runs", "1e6:fp32", "--dir", str(tmp_path))
    rows = [line for line in out.splitlines() if line.startswith("| 0.00e9 | fp32 |")]
    assert len(rows) >= 1 and rows[-1].count("|") == 10, out[-2000:]
    assert rows[-1].split("|")[-2].strip() == "24576", rows[-1]  # 3 slices x 4096 x (m, v)
    assert "SIMD" in out


def test_convergence_tiny():
    out = run("convergence.py", "--model", "tiny", "--steps", "4", "--eval-every", "2", "--dpu-warmup", "2",
              "--seq-len", "16", "--batch-size", "2", "--no-write")
    assert "dpu-sim" in out and "| default | tiny |" in out
    assert "sync-bf16state vs sync: validation gap" in out
    assert "sync-int8state vs sync: validation gap" in out
    assert "overlap vs sync: validation losses identical at every evaluation" in out
    assert "overlap-spec vs sync: validation losses identical at every evaluation" in out


def test_trace_tools(tmp_path):
    tr = tmp_path / "tr"
    run("train_gpt.py", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "8", "--dpu-warmup",
        "3", "--eval-every", "0", "--no-progress", "--trace-dir", str(tr))
    names = sorted(p.name.split("-")[0] for p in tr.glob("*.json"))
    assert names == ["server", "worker"]  # one file per process
    run("trace_merge.py", str(tr), "-o", str(tmp_path / "run.json"))
    merged = json.loads((tmp_path / "run.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {int(p.stem.split("-")[2]) for p in tr.glob("*.json")}
    out = run("trace_report.py", str(tr), "--png", str(tmp_path / "tl.png"))
    assert "server update" in out and "hidden behind forward/backward" in out
    assert (tmp_path / "tl.png").stat().st_size > 1000


def test_trace_report_shows_speculation(tmp_path):
    """overlap_update with speculation and no clipping: the server's pieces inside backward,
    and steps that kept them."""
    tr = tmp_path / "tr"
    run("train_gpt.py", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "8", "--no-dpu",
        "--overlap-update", "--undo-log-bytes", str(1 << 24), "--clip", "0", "--eval-every", "0", "--no-progress",
        "--trace-dir", str(tr))
    out = run("trace_report.py", str(tr))
    assert "server speculate" in out and "speculation:" in out and "0 rollbacks" in out, out
    assert "so 8 steps kept" in out, out


def test_gpu_scripts_without_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_check.sh is run on its own there")
    assert run("gpu_check.sh").strip() == "no CUDA device; skipped"
    out = run("gpu_bench.py", "--dry-run")
    for variant in ("baseline", "sync", "dpu"):
        assert f"| 2x32 | {variant} |" in out


def _gpu_check(tmp_path, **env):
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), PYTHON=sys.executable, **env))


def test_gpu_check_dry_run(tmp_path):
    """gpu_check.sh --dry-run: every step of the prepared GPU run (machine facts, imports,
    build, the cuda tests, which skip, the benchmark at tiny sizes with a variant that
    raises, the JSON, the summary table) on the CPU.  The largest batch first, its
    variants in the order users ask about (GPU-only, DPU with bf16 state, with fp32
    state, sync, DeepSpeed: a row that says it was skipped without CUDA)."""
    r = _gpu_check(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "/dev/shm" in r.stdout and "cuda tests rc=0, bench rc=0" in r.stdout, r.stdout[-3000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    assert {"sync_b2", "dpu_b4", "dpu:bf16_b4", "dpu-after_b2"} <= set(res)
    order = [k for k in res if k.endswith("_b4")]
    assert order[:6] == ["baseline_b4", "broken_b4", "dpu:bf16_b4", "dpu_b4", "sync_b4", "deepspeed_b4"], order
    assert "injected failure" in res["broken_b4"]["error"]          # one variant failed ...
    summary = r.stdout.split("== summary", 1)[1]
    assert "| 4 | broken | FAILED: RuntimeError: injected failure" in summary  # ... and said so
    assert "| 4 | deepspeed | skipped: DeepSpeed's ZeRO-Offload needs a CUDA device" in summary
    assert "| 2x32 | dpu-after |" in summary                        # the rest ran on


def test_gpu_check_big_dry_run(tmp_path):
    """gpu_check.sh --big --dry-run: the second call's path (the model sized by host RAM,
    built in bf16 on the device, DPU with bf16 state, activation checkpointing) on a tiny
    model on the CPU: it trains (the loss falls) and prints its table line and JSON.
    (Mutation: the engine's step left out of run_big: the engine refuses the second
    backward, the line says FAILED and the rc is 1.)"""
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--big", "--dry-run"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OUT=str(tmp_path), PYTHON=sys.executable))
    assert r.returncode == 0 and "big rc=0" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert "| dpu, bf16 state, activation checkpointing |" in r.stdout
    big = json.loads((tmp_path / "gpu_big.json").read_text())["big"]
    assert big["losses"][-1] < big["losses"][0], big["losses"]
    from scripts.gpu_bench import big_config
    mc, why = big_config(128 << 30, dry=False)  # the lent machine's host: about 10e9 parameters
    assert 9e9 < 12 * mc.n_layer * mc.d_model ** 2 < 11e9 and "128 GiB" in why


def test_gpu_check_prints_the_table_when_the_bench_is_killed(tmp_path):
    """The measurements cut short by their bound (SIGTERM mid-way, in a variant that hangs
    after the first baseline, so the cut does not depend on this machine's speed): the
    summary table of what finished still prints."""
    r = _gpu_check(tmp_path, GPU_CHECK_BENCH_S="12", GPU_CHECK_INJECT_HANG="1")
    summary = r.stdout.split("== summary", 1)[1]
    assert "| batch | variant |" in summary and "| 4x32 | baseline |" in summary, r.stdout[-3000:]
    res = json.loads((tmp_path / "gpu_results.json").read_text())
    assert "dpu-after_b2" not in res  # it was stopped before the end
    assert "bench rc=124" in r.stdout or res.get("stopped"), r.stdout[-2000:]