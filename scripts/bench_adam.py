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
Writes the table into BENCHMARKS.md (section "bench_adam", "bench_adam_avx2" on an AVX2 host).

    python scripts/bench_adam.py --state-dtypes  # section "bench_adam_state"

compares the state dtypes instead, bf16 gradients and weights (what bf16 training
moves), each against the bound of its own access pattern in the same run:
  fp32        adam_step: fp32 master, m, v                      28 B/param
  bf16        adam_step_bf16: fp32 master, bf16 m, v            20 B/param
  bf16-exact  adam_step_bf16: the exact master (weights + rem)  18 B/param
  int8        adam_step_int8: fp32 master, int8 m, v            16 B/param
  int8-exact  adam_step_int8: the exact master                  14 B/param
(the int8 scales, 0.03 B/param read and written, are left out of the counts)
    python scripts/bench_adam.py --state-dtypes --lion  # section "bench_lion_state"
the same for Lion's one moment (fp32 20, bf16 16, bf16-exact 14, int8 14, int8-exact
12 B/param), each against fp32 state's Lion in the same run (no bound loops of its own)

    python scripts/bench_adam.py --progress --threads 14  # section "bench_adam_progress"

the fp32-state update (bf16 gradients and weights) as the server runs it, in progress
blocks of 1M elements published one after another (each block split among all threads),
against one call over the whole range: where a block does not split evenly among the
threads, the update runs below the kernel's speed (the ratio says by how much)
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

from zero_offload.kernels import cpu_adam  # noqa: E402

BYTES_PER_PARAM = 28
FLUSH = np.ones(64 * 1024 * 1024, np.float32)  # 256 MiB, larger than any LLC here


def section(name: str) -> str:
    """One section per SIMD level, so an AVX2 host's run does not replace an AVX-512
    host's (the AVX-512 sections keep their first names)."""
    level = cpu_adam.simd_level()
    return name if level == "avx512" else f"{name}_{level}"


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
    return interleaved(runs, reps)


STATE_BYTES = {"fp32": 28, "bf16": 20, "bf16-exact": 18, "int8": 16, "int8-exact": 14}


def bench_state(n: int, threads: int, reps: int, rng) -> dict[str, float]:
    """Median ms of each state dtype's update and of its own bound, interleaved."""
    p, m, v, _, _ = make_state(n, rng)
    g = cpu_adam_words(rng.standard_normal(n, dtype=np.float32))
    out = np.empty(n, np.uint16)
    m16, v16 = cpu_adam_words(m), cpu_adam_words(v)
    p2 = p.copy()
    hi, rem = np.empty(n, np.uint16), np.empty(n, np.uint16)
    cpu_adam.split_master(p, hi, rem)
    m16b, v16b = m16.copy(), v16.copy()
    kw = dict(lr=1e-4, weight_decay=0.01, num_threads=threads, grad_dtype="bf16", out_dtype="bf16")
    nb = (n + cpu_adam.QBLOCK - 1) // cpu_adam.QBLOCK
    m8, v8 = np.empty(n, np.uint8), np.empty(n, np.uint8)
    ms8, vs8 = np.empty(nb, np.float32), np.empty(nb, np.float32)
    cpu_adam.quantize_int8(m, m8, ms8, moment="exp_avg")
    cpu_adam.quantize_int8(v, v8, vs8, moment="exp_avg_sq")
    m8b, v8b, ms8b, vs8b = m8.copy(), v8.copy(), ms8.copy(), vs8.copy()
    p3, hi8, rem8 = p.copy(), hi.copy(), rem.copy()
    runs = {
        "fp32": lambda t: cpu_adam.adam_step(p, m, v, g, out, step=t, **kw),
        "fp32 bound": lambda t: cpu_adam.stream_probe(p, m, v, g.view(np.float16), out.view(np.float16),
                                                      num_threads=threads),
        "bf16": lambda t: cpu_adam.adam_step_bf16(p2, m16, v16, g, out, step=t, sr_key=t, **kw),
        "bf16 bound": lambda t: cpu_adam.stream_probe_bf16(p2, m16, v16, g, out, num_threads=threads),
        # one weights slot: hi is read and written in place, as the server does
        "bf16-exact": lambda t: cpu_adam.adam_step_bf16(rem, m16b, v16b, g, hi, master_hi=hi, step=t, sr_key=t,
                                                        **kw),
        "bf16-exact bound": lambda t: cpu_adam.stream_probe_bf16(rem, m16b, v16b, g, hi, master_hi=hi,
                                                                 num_threads=threads),
        "int8": lambda t: cpu_adam.adam_step_int8(p3, m8, v8, ms8, vs8, g, out, step=t, sr_key=t, **kw),
        "int8 bound": lambda t: cpu_adam.stream_probe_int8(p3, m8, v8, g, out, num_threads=threads),
        "int8-exact": lambda t: cpu_adam.adam_step_int8(rem8, m8b, v8b, ms8b, vs8b, g, hi8, master_hi=hi8, step=t,
                                                        sr_key=t, **kw),
        "int8-exact bound": lambda t: cpu_adam.stream_probe_int8(rem8, m8b, v8b, g, hi8, master_hi=hi8,
                                                                 num_threads=threads),
    }
    def reseat():  # the probes add to the state: re-seat the compact ones so the update never sees inf/NaN
        cpu_adam.split_master(p, hi, rem)
        cpu_adam.split_master(p, hi8, rem8)
        p3[:] = p
    return interleaved(runs, reps, after_step=reseat)


def interleaved(runs: dict, reps: int, after_step=None) -> dict[str, float]:
    """Median ms of each run (a function of the 1-based step), one after the other with a
    cache flush before each, reps + 1 rounds; after_step after each round."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(1, reps + 2):
        for name, fn in runs.items():  # interleaved: drift hits all alike
            flush_cache()
            t0 = time.perf_counter()
            fn(step)
            dt = time.perf_counter() - t0
            if step > 1:  # first call warms page tables and thread pools
                times[name].append(dt)
        if after_step is not None:
            after_step()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


LION_BYTES = {"fp32": 20, "bf16": 16, "bf16-exact": 14, "int8": 14, "int8-exact": 12}


def bench_lion_state(n: int, threads: int, reps: int, rng) -> dict[str, float]:
    """Median ms of Lion's update with each state dtype, interleaved."""
    p, m, _, _, _ = make_state(n, rng)
    g = cpu_adam_words(rng.standard_normal(n, dtype=np.float32))
    out = np.empty(n, np.uint16)
    hi, rem = np.empty(n, np.uint16), np.empty(n, np.uint16)
    cpu_adam.split_master(p, hi, rem)
    nb = (n + cpu_adam.QBLOCK - 1) // cpu_adam.QBLOCK
    m8, ms8 = np.empty(n, np.uint8), np.empty(nb, np.float32)
    cpu_adam.quantize_int8(m, m8, ms8, moment="exp_avg")
    st = {k: (p.copy(), rem.copy(), hi.copy()) for k in LION_BYTES}
    m16 = {k: cpu_adam_words(m) for k in ("bf16", "bf16-exact")}
    m8s = {k: (m8.copy(), ms8.copy()) for k in ("int8", "int8-exact")}
    kw = dict(lr=1e-4, weight_decay=0.1, num_threads=threads, grad_dtype="bf16", out_dtype="bf16")
    runs = {
        "fp32": lambda t: cpu_adam.lion_step(st["fp32"][0], m, g, out, **kw),
        "bf16": lambda t: cpu_adam.lion_step_bf16(st["bf16"][0], m16["bf16"], g, out, sr_key=t, **kw),
        # one weights slot: hi is read and written in place, as the server does
        "bf16-exact": lambda t: cpu_adam.lion_step_bf16(st["bf16-exact"][1], m16["bf16-exact"], g, st["bf16-exact"][2],
                                                        master_hi=st["bf16-exact"][2], sr_key=t, **kw),
        "int8": lambda t: cpu_adam.lion_step_int8(st["int8"][0], *m8s["int8"], g, out, sr_key=t, **kw),
        "int8-exact": lambda t: cpu_adam.lion_step_int8(st["int8-exact"][1], *m8s["int8-exact"], g, st["int8-exact"][2],
                                                        master_hi=st["int8-exact"][2], sr_key=t, **kw),
    }
    return interleaved(runs, reps)


def main_lion_state(sizes, threads, reps, write) -> int:
    rng = np.random.default_rng(0)
    print(f"simd={cpu_adam.simd_level()} openmp={cpu_adam.openmp_enabled()}")
    rows = ["| N | threads | state | B/param | ms | speed-up vs fp32 state | bytes ratio vs fp32 |",
            "|" + "---|" * 7]
    for n in sizes:
        for t in threads:
            r = bench_lion_state(n, t, reps, rng)
            for name, b in LION_BYTES.items():
                row = (f"| {size_label(n)} | {t} | {name} | {b} | {r[name]:.1f} | {r['fp32'] / r[name]:.2f}x | "
                       f"{LION_BYTES['fp32'] / b:.2f}x |")
                print(row, flush=True)
                rows.append(row)
    write_table(rows, "CPU Lion step by state dtype (scripts/bench_adam.py --state-dtypes --lion)",
                f"bf16 gradients and weights; median of {reps} steps, 256 MiB cache flush before each, all variants "
                f"interleaved in one run.", "bench_lion_state", write)
    return 0


def write_table(rows: list[str], title: str, note: str, name: str, write: bool) -> None:
    """The section `name` (per SIMD level): a title, the machine and the run's note, the rows."""
    body = (f"## {title}\n\n{machine_line()}; simd={cpu_adam.simd_level()}, openmp={cpu_adam.openmp_enabled()}; "
            f"{note}\n\n" + "\n".join(rows) + "\n")
    if write:
        update_section(section(name), body)


def cpu_adam_words(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    cpu_adam.cast_to_16(np.ascontiguousarray(x, np.float32), out, out_dtype="bf16")
    return out


def main_state(sizes, threads, reps, write) -> int:
    rng = np.random.default_rng(0)
    print(f"simd={cpu_adam.simd_level()} openmp={cpu_adam.openmp_enabled()}")
    head = ("| N | threads | state | B/param | ms | own bound ms | % of own bound | speed-up vs fp32 state | "
            "bound speed-up vs fp32 |")
    rows = [head, "|" + "---|" * 9]
    for n in sizes:
        for t in threads:
            r = bench_state(n, t, reps, rng)
            for name, b in STATE_BYTES.items():
                row = (f"| {size_label(n)} | {t} | {name} | {b} | {r[name]:.1f} | {r[name + ' bound']:.1f} | "
                       f"{100 * r[name + ' bound'] / r[name]:.0f}% | {r['fp32'] / r[name]:.2f}x | "
                       f"{r['fp32 bound'] / r[name + ' bound']:.2f}x |")
                print(row, flush=True)
                rows.append(row)
    write_table(rows, "CPU Adam step by state dtype (scripts/bench_adam.py --state-dtypes)",
                f"bf16 gradients and weights; median of {reps} steps, 256 MiB cache flush before each, all variants "
                f"interleaved in one run. Each state's bound is a loop with its own access pattern and trivial "
                f"arithmetic on the same buffers.", "bench_adam_state", write)
    return 0


PROGRESS_BLOCK = 1 << 20  # the engine's default (expert.progress_block_numel)


def main_progress(sizes, threads, reps, write) -> int:
    rng = np.random.default_rng(0)
    print(f"simd={cpu_adam.simd_level()} openmp={cpu_adam.openmp_enabled()}")
    rows = ["| N | threads | one call ms | 1M progress blocks ms | blocks vs one call |", "|" + "---|" * 5]
    for n in sizes:
        p, m, v, _, _ = make_state(n, rng)
        g = (rng.standard_normal(n, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bf16 words
        out = np.empty(n, np.uint16)
        word = np.zeros(1, np.uint64)
        kw = dict(lr=1e-4, weight_decay=0.01, grad_dtype="bf16", out_dtype="bf16")
        for t in threads:
            runs = {"one": lambda step: cpu_adam.adam_step(p, m, v, g, out, step=step, num_threads=t, **kw),
                    "blocks": lambda step: cpu_adam.adam_step(p, m, v, g, out, step=step, num_threads=t,
                                                              progress=word, progress_tag=step,
                                                              progress_block=PROGRESS_BLOCK, **kw)}
            r = interleaved(runs, reps)
            row = f"| {size_label(n)} | {t} | {r['one']:.1f} | {r['blocks']:.1f} | {r['one'] / r['blocks']:.2f}x |"
            print(row, flush=True)
            rows.append(row)
    write_table(rows, "CPU Adam step in progress blocks (scripts/bench_adam.py --progress)",
                f"fp32 state, bf16 gradients and weights; median of {reps} steps, 256 MiB cache flush before each, "
                f"interleaved.", "bench_adam_progress", write)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4M,32M,128M", help="comma-separated element counts (K/M/G suffixes)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per configuration (median reported)")
    ap.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    ap.add_argument("--state-dtypes", action="store_true", help="compare the state dtypes (section bench_adam_state)")
    ap.add_argument("--lion", action="store_true", help="with --state-dtypes: Lion's (section bench_lion_state)")
    ap.add_argument("--progress", action="store_true",
                    help="the update in the engine's progress blocks vs one call (section bench_adam_progress)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    if args.lion and not args.state_dtypes:
        ap.error("--lion compares Lion's state dtypes: give --state-dtypes too")
    if args.progress:
        return main_progress(sizes, threads, args.reps, not args.no_write)
    if args.state_dtypes:
        main_fn = main_lion_state if args.lion else main_state
        return main_fn(sizes, threads, args.reps, not args.no_write)
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
        update_section(section("bench_adam"), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
