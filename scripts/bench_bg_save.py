"""The steps around a background save, at a user's size: does save_checkpoint(background=True)
stop training?

A model that is mostly one embedding table (cheap forward and backward on any CPU, a large
optimizer state) trains through OffloadEngine on the CPU device against a server this script
starts.  Per size and state dtype, in one process and one run:
  - the steady step (median of 5; each step waits for its update, so the update is in it);
  - a blocking save_checkpoint (the baseline a user compares with);
  - three background saves (--saves: the process's first, whose snapshot and writers take
    memory it never used before, then later ones, which reuse those buffers: ckpt_io.BufferPool), with the snapshot (the default), then in a new server with it
    turned off (--no-save-snapshot: each update writes what it overwrites first, as before
    the snapshot): for each, how long save_checkpoint took to return, every step until the
    save was published (the slowest and the median, against the steady step), the update's
    time in SaveJob.ensure, the time to publish, the server's write speed against this run's
    disk bound (one plain sequential write of as many bytes, one fsync), and the snapshot's
    host RAM at its peak.

    python scripts/bench_bg_save.py --sizes 0.6e9 --state-dtype fp32 --dir /var/tmp/zo-bench --write
    python scripts/bench_bg_save.py --sizes 1e9 --state-dtype bf16 --dir /var/tmp/zo-bench --write
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from zero_offload import OffloadConfig, OffloadEngine  # noqa: E402
from zero_offload.kernels import cpu_adam  # noqa: E402
from zero_offload.server import spawn  # noqa: E402
from bench_md import machine_line, update_section  # noqa: E402
from bench_scale import Tables, disk_bound  # noqa: E402

SEED = 0


def run(n: float, state_dtype: str, root: str, threads: int, snapshot: bool, saves: int = 3, gap_s: float = 30.0) -> dict:
    """One size, one server: steady steps, a blocking save, a background one."""
    rows = int(n) // 64
    torch.manual_seed(SEED)
    model = Tables(rows)
    extra = [] if snapshot else ["--no-save-snapshot"]
    out = {"params": sum(p.numel() for p in model.parameters()), "state_dtype": state_dtype, "snapshot": snapshot}
    with spawn(threads=threads, extra_args=extra) as srv:
        cfg = OffloadConfig(lr=1e-3, dtype="bf16", state_dtype=state_dtype,
                            server={"address": srv.address, "token": srv.token, "threads": threads})
        eng = OffloadEngine(model, cfg)
        gen = torch.Generator().manual_seed(SEED)

        def step() -> float:
            t0 = time.perf_counter()
            idx = torch.randint(0, rows, (8, 64), generator=gen)
            eng.backward(model(idx))
            eng.step()
            eng.synchronize()
            return time.perf_counter() - t0
        d = os.path.join(root, "ck")
        try:
            for _ in range(3):  # first touches, the exact mode's trial steps settle
                step()
            out["steady_step_s"] = statistics.median(step() for _ in range(5))
            t0 = time.perf_counter()
            path = eng.save_checkpoint(d)
            out["blocking_save_s"] = time.perf_counter() - t0
            out["file_bytes"] = os.path.getsize(os.path.join(path, "shard-r0-of-1.bin"))
            out["saves"] = []
            for _ in range(saves):  # the first background save of a process, then later ones
                t_gap = time.perf_counter()  # training between saves, as a user's run does (saves minutes apart)
                while time.perf_counter() - t_gap < gap_s:
                    step()
                t0 = time.perf_counter()
                eng.save_checkpoint(d, background=True)
                bg = {"return_s": time.perf_counter() - t0}
                times = []
                while eng.checkpoint_in_flight() and len(times) < 200:
                    times.append(step())
                eng.wait_checkpoint()
                bg["publish_s"] = time.perf_counter() - t0
                st = eng.client.save_status()
                bg.update(steps=times, server_write_s=st.get("seconds", 0.0), snapshot_peak_bytes=st.get("snapshot_peak", 0),
                          snapshot_taken=bool(st.get("snapshot")),
                          update_writes=st.get("update_writes", 0), update_waited_s=st.get("waited_s", 0.0))
                out["saves"].append(bg)
        finally:
            eng.close()
            shutil.rmtree(d, ignore_errors=True)
    return out


def row(r: dict, bg: dict, which: str, bound_w: float) -> str:
    steps = bg["steps"] or [float("nan")]
    worst, med = max(steps), statistics.median(steps)
    gbs = r["file_bytes"] / bg["server_write_s"] / 1e9 if bg["server_write_s"] else float("nan")
    snap = "off" if not r["snapshot"] else "on" if bg["snapshot_taken"] else "refused (RAM)"
    return (f"| {r['params'] / 1e9:.2f}e9 | {r['state_dtype']} | {snap} | {which} | "
            f"{r['steady_step_s']:.2f} | {r['blocking_save_s']:.1f} | {bg['return_s']:.2f} | {len(steps)} | "
            f"{worst:.2f} ({worst / r['steady_step_s']:.2f}x) | {med:.2f} ({med / r['steady_step_s']:.2f}x) | "
            f"{bg['update_waited_s']:.2f} | {bg['publish_s']:.1f} | {gbs:.2f} ({100 * gbs / (bound_w / 1e9):.0f}%) | "
            f"{bg['snapshot_peak_bytes'] / 2**30:.2f} |")


HEADER = ("| params | state | snapshot | save | steady step s | blocking save s | background: return s | "
          "steps during it | slowest step s (x steady) | median step s (x steady) | update waited s | publish s | "
          "server write GB/s (% of disk bound) | snapshot peak GiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[6e8])
    ap.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--saves", type=int, default=3, help="background saves per server")
    ap.add_argument("--gap-s", type=float, default=30.0,
                    help="seconds of training before each background save (a user's saves are minutes apart)")
    ap.add_argument("--dir", default="/var/tmp/zo-bench-bg")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    ap.add_argument("--section", default="", help="the BENCHMARKS.md section (default bench_bg_save_<dtype>)")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    rows = []
    for n in a.sizes:
        res = [run(n, a.state_dtype, a.dir, a.threads, snap, a.saves, a.gap_s) for snap in (True, False)]
        w, _ = disk_bound(a.dir, res[0]["file_bytes"])
        for r in res:
            print(json.dumps(r), flush=True)
            for i, bg in enumerate(r["saves"]):
                which = f"#{i + 1}"
                rows.append(row(r, bg, which, w))
        rows.append(f"| | disk bound: {w / 1e9:.2f} GB/s write | | | | | | | | | | | | |")
    cmd = "python scripts/bench_bg_save.py " + " ".join(sys.argv[1:])
    body = (f"{machine_line()}, SIMD {cpu_adam.simd_level()}; directory {a.dir}; `{cmd}`.\n\n{HEADER}\n"
            + "\n".join(rows))
    print(body)
    if a.write:
        update_section(a.section or f"bench_bg_save_{a.state_dtype}", body)


if __name__ == "__main__":
    main()
