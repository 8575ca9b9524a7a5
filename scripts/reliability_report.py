"""Run the fault suite (tests/faults) and write its measured outcomes into BENCHMARKS.md.

    python scripts/reliability_report.py
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_md import machine_line, update_section  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        rec = Path(d) / "reliability.json"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "tests/faults"], cwd=ROOT,
                           env=dict(os.environ, ZERO_OFFLOAD_RECORD=str(rec)))
        data = json.loads(rec.read_text()) if rec.exists() else {}
    lines = [f"## Reliability (scripts/reliability_report.py: tests/faults)\n\n{machine_line()}; suite exit code "
             f"{r.returncode}.\n", "| check | outcome |", "|---|---|"]
    for k, v in sorted(data.items()):
        if k.startswith("server_sigkill"):
            lines.append(f"| {k.replace('_', ' ')} | {v['trials']} trials at random steps; named error after "
                         f"{v['mean_detect_s'] * 1e3:.0f} ms mean, {v['max_detect_s'] * 1e3:.0f} ms max (bound 5 s); "
                         f"no segment left |")
        elif k.startswith("restart_"):
            lines.append(f"| zero-offload-launch --max-restarts, the {k[8:]} SIGKILLed after step "
                         f"{v['killed_after_step']} | restarted; resumed from the step-{v['resumed_from']} checkpoint, "
                         f"first new step {v['back_after_s']:.1f} s after the kill; final master, m, v and weights "
                         f"bitwise those of an uninterrupted run |")
        elif k == "fuzz":
            lines.append(f"| fuzzing the control socket | {v['messages']} messages (seed {v['seed']}), "
                         f"{v['error_replies']} error replies, {v.get('speculate_hints', 0)} SPECULATE hints (never "
                         f"answered), server alive, shard state bitwise unchanged |")
        elif k == "soak":
            a, b = v["after_warmup"], v["end"]
            lines.append(f"| soak, {v['steps']} DPU steps in {v['seconds']:.1f} s | worker RSS {a['worker_rss_kb']} -> "
                         f"{b['worker_rss_kb']} KiB, server RSS {a['server_rss_kb']} -> {b['server_rss_kb']} KiB, "
                         f"fds {a['worker_fds']}/{a['server_fds']} -> {b['worker_fds']}/{b['server_fds']}, "
                         f"segments {a['shm']} -> {b['shm']} |")
    update_section("reliability", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
