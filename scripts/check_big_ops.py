"""Every operation at a size this machine barely holds: it works, or it is refused with a
message naming what to do instead, and the optimizer server is alive after each.

    python scripts/check_big_ops.py --size 1.5e9 --state-dtype bf16 --write

A model that is nearly all one embedding table (scripts/bench_scale.py's Tables) under
OffloadAdamW on the CPU device: construction, 3 steps, a background save (the steps
while it is written, then wait_checkpoint), a blocking save, a load, master_state_dict(),
state_dict() without state_dir (the whole state as CPU tensors) and load_state_dict of
it.  After each: the server's pid alive and answering STATS, MemAvailable, and the
peaks of worker and server.  --write puts the table into BENCHMARKS.md (check_big_ops).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_md import machine_line, update_section  # noqa: E402
from bench_scale import Tables, peak_rss  # noqa: E402
from zero_offload import OffloadAdamW  # noqa: E402
from zero_offload.kernels import cpu_adam  # noqa: E402
from zero_offload.server.admission import read_mem_available  # noqa: E402
from zero_offload.server.procs import pid_alive  # noqa: E402

SEED = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=1.5e9)
    ap.add_argument("--state-dtype", default="bf16", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--dir", default="/var/tmp/zo-check-big")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    print(f"seed {SEED}", flush=True)
    rows = int(args.size) // 64
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    results = []

    model = Tables(rows)  # fp32, as a user's model comes: the engine keeps it 16-bit and frees the fp32 copy
    t0 = time.perf_counter()
    opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, state_dtype=args.state_dtype,
                       server={"threads": 2})
    construct_s = time.perf_counter() - t0
    pid = opt.engine._server.proc.pid

    def record(what: str, fn) -> object:
        t = time.perf_counter()
        try:
            value, how = fn(), "works"
        except (RuntimeError, ValueError, OSError, MemoryError) as e:
            value, how = None, f"refused: {type(e).__name__}: {' '.join(str(e).split())[:600]}"
        took = time.perf_counter() - t
        alive = pid_alive(pid)
        answers = False
        if alive:
            try:
                opt.engine.client.stats()
                answers = True
            except Exception:  # noqa: BLE001 - reported below
                pass
        row = (what, how, took, alive and answers, read_mem_available() / 2**30)
        print(row, flush=True)
        results.append(row)
        return value

    def step():
        model(torch.randint(0, rows, (8, 64), generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    results.append(("construct", f"works ({construct_s:.1f} s)", 0.0, pid_alive(pid), read_mem_available() / 2**30))
    record("3 steps", lambda: [step() for _ in range(3)])
    shutil.rmtree(args.dir, ignore_errors=True)
    d = os.path.join(args.dir, "ck")

    def background():
        opt.save_checkpoint(d, background=True)
        k = 0
        while opt.engine.checkpoint_in_flight() and k < 50:
            step()
            k += 1
        return opt.wait_checkpoint(), k
    record("background save (steps run while it writes, then wait_checkpoint)", background)
    record("blocking save", lambda: opt.save_checkpoint(d))
    record("load", lambda: opt.load_checkpoint(d))
    record("master_state_dict()", lambda: len(opt.master_state_dict()))
    # torch.save of the state without state_dir: the whole state as CPU tensors in this
    # process (the dict is lazy until then)
    pt = os.path.join(args.dir, "optimizer.pt")
    saved = record("torch.save(opt.state_dict()) (no state_dir)", lambda: torch.save(opt.state_dict(), pt) or True)
    if saved:  # (a refused torch.save leaves the empty file torch opened before pickling)
        record("load_state_dict(torch.load(...)) of it", lambda: opt.load_state_dict(torch.load(pt)))
    record("a step after all of it", step)
    worker_gib, server_gib = peak_rss() / 2**30, peak_rss(pid) / 2**30
    opt.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    n = sum(p.numel() for p in model.parameters())
    lines = [f"Machine: {machine_line()}; SIMD level {cpu_adam.simd_level()}; {n / 1e9:.2f}e9 parameters (an "
             f"embedding table built fp32, bf16 weights, {args.state_dtype} state, 2 server threads), OffloadAdamW on the CPU "
             f"device; peaks: worker {worker_gib:.1f} GiB, server {server_gib:.1f} GiB (VmHWM; the shared segment "
             f"counts in both).", "",
             "| operation | outcome | s | server alive and answering | MemAvailable after, GiB |",
             "|---|---|---|---|---|"]
    lines += [f"| {w} | {h} | {s:.1f} | {'yes' if a else 'NO'} | {m:.1f} |" for w, h, s, a, m in results]
    body = "\n".join(lines)
    print(body)
    if args.write:
        update_section("check_big_ops", "## Every operation at the largest size (scripts/check_big_ops.py)\n\n"
                       + body)
    if not all(r[3] for r in results):
        sys.exit("the server died or stopped answering")


if __name__ == "__main__":
    main()
