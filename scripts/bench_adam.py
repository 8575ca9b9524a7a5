"""CPU optimizer step: our one-pass kernel vs torch's fused AdamW pipeline vs the bound.

    python scripts/bench_adam.py                 # N in 4M, 32M, 128M; 1 and 2 threads
    python scripts/bench_adam.py --sizes 4M --reps 3 --no-write

For each N and thread count, interleaved and with a 256 MiB cache flush before
every timed step (the real offload state lives in DRAM, not cache):
  ours   cython_ext adam_step: fp16 grad in, fp32 p/m/v in place, fp16 weights out
  torch  torch.optim.AdamW(fused=True) on fp32, plus the casts offload needs
         (fp16 grad -> fp32 before, fp32 -> fp16 weights after)
  ds     DeepSpeedCPUAdam with the same casts, when deepspeed is importable
  bound  28 B/param at the bandwidth of a loop with Adam's access pattern and
         trivial arithmetic (cython_ext stream_probe) on the same buffers, in the same run
Writes the table into BENCHMARKS.md (section "bench_adam").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_md import machine_line, update_section  # noqa: E402

from cython_ext import cpu_adam  # noqa: E402

BYTES_PER_PARAM = 28
FLUSH = np.ones(64 * 1024 * 1024, np.float32)  # 256 MiB, larger than any LLC here


def flush_cache() -> None:
    FLUSH[::16] += 1.0  # one write per 64 B line touches every line


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMG" else s) * mult)


def size_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def make_state(n: int, rng: np.random.Generator):
    p = rng.standard_normal(n, dtype=np.float32)
    m = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
    v = np.abs(rng.standard_normal(n, dtype=np.float32)) * np.float32(1e-6)
    g = rng.standard_normal(n, dtype=np.float32).astype(np.float16)
    return p, m, v, g, np.empty(n, np.float16)


def try_deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        return DeepSpeedCPUAdam
    except Exception:
        return None


def bench(n: int, threads: int, reps: int, rng) -> dict[str, float]:
    torch.set_num_threads(threads)
    p, m, v, g, out = make_state(n, rng)
    # torch pipeline state: its own fp32 copies so both start from the same data
    tp = torch.from_numpy(p.copy()).requires_grad_(True)
    tg16 = torch.from_numpy(g)
    tout = torch.empty(n, dtype=torch.float16)
    tp.grad = torch.empty(n, dtype=torch.float32)
    topt = torch.optim.AdamW([tp], lr=1e-4, weight_decay=0.01, fused=True)
    ds_cls = try_deepspeed()
    dsopt = None
    if ds_cls is not None:
        dp = torch.from_numpy(p.copy()).requires_grad_(True)
        dp.grad = torch.empty(n, dtype=torch.float32)
        dsopt = ds_cls([dp], lr=1e-4, weight_decay=0.01, adamw_mode=True)

    def run_ours(step):
        cpu_adam.adam_step(p, m, v, g, out, step=step, lr=1e-4, weight_decay=0.01, num_threads=threads)

    def run_torch(step):
        with torch.no_grad():
            tp.grad.copy_(tg16)   # pass 1: fp16 -> fp32 gradient
            topt.step()           # pass 2: fused AdamW on fp32
            tout.copy_(tp)        # pass 3: fp32 -> fp16 weights

    def run_ds(step):
        with torch.no_grad():
            dp.grad.copy_(tg16)
            dsopt.step()
            tout.copy_(dp)

    def run_bound(step):
        # on the very buffers of our kernel: same pages, same placement, same TLB reach
        cpu_adam.stream_probe(p, m, v, g, out, num_threads=threads)

    runs = {"ours": run_ours, "torch": run_torch, "bound": run_bound}
    if dsopt is not None:
        runs["ds"] = run_ds
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(1, reps + 2):
        for name, fn in runs.items():  # interleaved: drift hits all alike
            flush_cache()
            t0 = time.perf_counter()
            fn(step)
            dt = time.perf_counter() - t0
            if step > 1:  # first call warms page tables and thread pools
                times[name].append(dt)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4M,32M,128M", help="comma-separated element counts (K/M/G suffixes)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per configuration (median reported)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)
    print(f"simd={cpu_adam.simd_level()} openmp={cpu_adam.openmp_enabled()} deepspeed={'yes' if try_deepspeed() else 'no'}")
    head = ("| N | threads | bound ms | ours ms | torch fused+casts ms | ds+casts ms "
            "| ours GB/s | ours % of bound | ours speed-up vs torch |")
    rows = [head, "|" + "---|" * 9]
    for n in sizes:
        for t in threads:
            r = bench(n, t, args.reps, rng)
            gbs = BYTES_PER_PARAM * n / (r["ours"] * 1e-3) / 1e9
            row = (f"| {size_label(n)} | {t} | {r['bound']:.1f} | {r['ours']:.1f} | {r['torch']:.1f} | "
                   f"{r.get('ds', float('nan')):.1f} | {gbs:.1f} | {100 * r['bound'] / r['ours']:.0f}% | "
                   f"{r['torch'] / r['ours']:.2f}x |")
            print(row, flush=True)
            rows.append(row)
    body = (f"## CPU Adam step (scripts/bench_adam.py)\n\n{machine_line()}; simd={cpu_adam.simd_level()}, "
            f"openmp={cpu_adam.openmp_enabled()}; median of {args.reps} steps, 256 MiB cache flush before each, "
            f"all variants interleaved in one run.\n\n" + "\n".join(rows) + "\n")
    if not args.no_write:
        update_section("bench_adam", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
