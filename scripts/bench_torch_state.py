"""Moving a torch AdamW run onto offload at a user's size: OffloadAdamW.load_state_dict of
torch.optim.AdamW's state dict (runtime.torch_state), against the same engine's own
blocking save_checkpoint + load_checkpoint in the same run (the round trip the load
makes, without its rewrite of the moments).

Per size: a model that is mostly one embedding table (bench_scale's), one torch AdamW
step in fp32 to give it a state, then OffloadAdamW built on the model and the dict
loaded.  Reports the load's time and its ratio to the round trip, the worker's peak
RSS and the lowest MemAvailable seen, and checks the loaded m and v (fp32 state:
bitwise, at a few slices of the file the next save writes).

    python scripts/bench_torch_state.py --runs 0.5e9:fp32 1e9:bf16 --write
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from zero_offload import OffloadAdamW  # noqa: E402
from zero_offload.kernels import cpu_adam  # noqa: E402
from zero_offload.server.admission import read_mem_available  # noqa: E402
from bench_md import machine_line, update_section  # noqa: E402
from bench_scale import Tables, peak_rss  # noqa: E402

SEED = 0
GIB = 1 << 30


class LowestAvailable:
    """The lowest MemAvailable seen, sampled every 50 ms on a thread."""

    def __init__(self):
        self.low, self._stop = read_mem_available(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.low = min(self.low, read_mem_available())

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.low


def check_moments(step_dir: str, sd: dict, rows: int) -> int:
    """fp32 state: compare the checkpoint's exp_avg and exp_avg_sq of the table with the
    dict's at three slices (the file memory-mapped: nothing read but those).  The elements checked."""
    man = json.load(open(os.path.join(step_dir, "shard-r0-of-1.json")))
    n = man["numel"]
    f = np.memmap(os.path.join(step_dir, "shard-r0-of-1.bin"), dtype=np.float32, mode="r")
    params = json.load(open(os.path.join(step_dir, "engine-r0-of-1.json")))["params"]
    off = next(p["offset"] for p in params if p["names"][0] == "emb.weight")
    table = 0  # the table's index in torch's state: its first parameter
    done = 0
    for at in (0, rows * 64 // 2, rows * 64 - 4096):
        for k, name in ((1, "exp_avg"), (2, "exp_avg_sq")):
            got = np.asarray(f[k * n + off + at:k * n + off + at + 4096])
            want = sd["state"][table][name].reshape(-1)[at:at + 4096].numpy()
            if not np.array_equal(got, want):
                raise SystemExit(f"{name} at {at}: the loaded moments are not the dict's")
            done += got.size
    return done


def one(size: float, state_dtype: str, threads: int, tmp: str) -> dict:
    torch.manual_seed(SEED)
    rows = int(size) // 64
    model = Tables(rows)
    idx = torch.randint(0, rows, (4096,), generator=torch.Generator().manual_seed(SEED))
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    model(idx).backward()
    ref.step()
    t_torch = time.perf_counter() - t0
    sd = ref.state_dict()
    del ref
    model.zero_grad(set_to_none=True)
    low = LowestAvailable()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, state_dtype=state_dtype,
                       server={"threads": threads})
    try:
        # the baseline before and after the load: this disk writes its first pass over
        # fresh blocks slower than a later one (BENCHMARKS.md, bench_scale), so whichever
        # runs first pays it; both are reported
        t_before, _ = round_trip(opt, tmp)
        t0 = time.perf_counter()
        opt.load_state_dict(sd)
        t_load = time.perf_counter() - t0
        t_after, checked = round_trip(opt, tmp, lambda d: check_moments(d, sd, rows)
                                      if state_dtype == "fp32" else 0)
        n = opt.engine.flat.numel
    finally:
        opt.close()
    return {"numel": n, "torch_step_s": t_torch, "load_s": t_load, "round_s": (t_before, t_after),
            "worker_peak": peak_rss(), "low_avail": low.stop(), "checked": checked}


def round_trip(opt, tmp: str, check=None) -> tuple[float, int]:
    """A blocking save_checkpoint and load_checkpoint of the engine's state: (seconds,
    check(step directory)'s answer)."""
    d = tempfile.mkdtemp(prefix="zo-bench-torch-state-", dir=tmp)
    try:
        t0 = time.perf_counter()
        step_dir = opt.save_checkpoint(d, keep=1)
        opt.load_checkpoint(step_dir)
        seconds = time.perf_counter() - t0
        return seconds, (check(step_dir) if check is not None else 0)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=["0.5e9:fp32"],
                    help="SIZE:STATE_DTYPE each (state dtype fp32, bf16 or int8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the round trip's checkpoint goes (the "
                    "load's own temporary checkpoint goes to TMPDIR)")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, its result as JSON
    a = ap.parse_args()
    if a.one:
        size, _, dt = a.runs[0].partition(":")
        print("RESULT " + json.dumps(one(float(size), dt, a.threads, a.dir)), flush=True)
        return
    runs = []
    for r in a.runs:
        size, _, dt = r.partition(":")
        if dt not in ("fp32", "bf16", "int8"):
            ap.error(f"--runs {r!r}: SIZE:STATE_DTYPE with a state dtype of fp32, bf16 or int8")
        runs.append((float(size), dt))
    simd = cpu_adam.simd_level()
    lines = [f"Machine: {machine_line()}, SIMD {simd}; `python scripts/bench_torch_state.py --runs "
             f"{' '.join(a.runs)} --threads {a.threads}` (seed {SEED}; TMPDIR and --dir on the same disk).", "",
             "| params | state | torch AdamW step s | load_state_dict s | save + load s before, after (baseline) "
             "| ratio to the faster | worker peak GiB | lowest MemAvailable GiB | m, v checked |",
             "|" + "---|" * 9]
    for (size, state_dtype), spec in zip(runs, a.runs):
        # each run in a process of its own: a finished run's heap would lower the next one's
        # MemAvailable, and admission would refuse a size that fits
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "--runs", spec, "--threads",
                            str(a.threads), "--dir", a.dir], capture_output=True, text=True)
        got = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not got:
            raise SystemExit(f"run {spec} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        r = json.loads(got[-1][len("RESULT "):])
        b, f = r["round_s"]
        lines.append(f"| {r['numel'] / 1e9:.2f}e9 | {state_dtype} | {r['torch_step_s']:.1f} | {r['load_s']:.1f} "
                     f"| {b:.1f}, {f:.1f} | {r['load_s'] / min(b, f):.2f}x | {r['worker_peak'] / GIB:.1f} "
                     f"| {r['low_avail'] / GIB:.1f} | {r['checked'] if r['checked'] else 'n/a'} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if a.write:
        update_section("bench_torch_state", table)


if __name__ == "__main__":
    main()
