"""A resume's LOAD against the disk's bound: one pass (read into a new state while the
checksum is computed, swapped in once it verifies) against two passes (verify every
file, then read it), in one run.

Per size and state dtype: a checkpoint of one shard is written once; then, for each way,
a fresh server (as a resume has it: the process that crashed is gone) INITs the shard,
the page cache is dropped (root only; else the reads may come from memory, and the table
says so) and LOAD is timed, twice.  The bound, before each repetition: the faster of
two plain cold reads of the same file into reused buffers (read_bound; fresh memory is
part of what a LOAD pays, not of it), so each LOAD is compared with the disk as it was
then.

    python scripts/bench_load.py --sizes 6e8 --state-dtype fp32 --dir /var/tmp/zo-bench --write
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from zero_offload.kernels import cpu_adam  # noqa: E402
from zero_offload.server import ShardClient, spawn  # noqa: E402
from bench_md import machine_line, update_section  # noqa: E402
from bench_scale import drop_caches  # noqa: E402


def shard_kw(state_dtype: str) -> dict:
    return dict(state_dtype=state_dtype, dtype="bf16", exact_master=True) if state_dtype != "fp32" else {}


def write_checkpoint(n: int, state_dtype: str, d: str) -> int:
    with spawn(threads=2) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, **shard_kw(state_dtype))
        ramp = np.linspace(-1, 1, 1 << 20, dtype=np.float32)
        for lo, hi in c.init_chunks():  # a varied master without a whole-model temporary
            c.staging[:hi - lo] = np.resize(ramp, hi - lo)
            c.init_chunk(lo, hi)
        c.grads[0][:] = 0x3C00
        c.step(1, 0, 1e-3)
        c.save(d)
        c.close()
    return os.path.getsize(os.path.join(d, "shard-r0-of-1.bin"))


def resume_load(n: int, state_dtype: str, d: str, two_pass: bool) -> tuple[float, int, bool]:
    """(seconds, passes, cold) of one LOAD into a fresh server's INIT'd shard."""
    with spawn(threads=2, extra_args=["--two-pass-load"] if two_pass else []) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc, **shard_kw(state_dtype))
        for lo, hi in c.init_chunks():
            c.staging[:hi - lo] = 0.5
            c.init_chunk(lo, hi)
        cold = drop_caches()
        t0 = time.perf_counter()
        info = c.load(d)
        dt = time.perf_counter() - t0
        c.close()
    return dt, int(info.get("passes", 0)), cold


def read_bound(path: str) -> float:
    """Bytes/s of the faster of two plain cold reads of the checkpoint's own file into
    reused buffers (no state, no checksum): one sequential buffered read (as bench_scale's
    disk_bound), and 16 MiB O_DIRECT reads on 4 threads (what a fast disk needs in
    flight).  Measured beside each repetition: this VM's disk drifted 0.7-2.8 GB/s
    across one run."""
    from concurrent.futures import ThreadPoolExecutor
    from zero_offload.server.ckpt_io import chunk_buffer
    size, best = os.path.getsize(path), 0.0
    drop_caches()
    buf = bytearray(16 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    best = size / (time.perf_counter() - t0)
    if hasattr(os, "O_DIRECT"):
        drop_caches()
        bufs = [chunk_buffer(16 << 20) for _ in range(4)]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return best
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda i: [os.preadv(fd, [memoryview(bufs[i])], a)
                                       for a in range(i << 24, size, 4 << 24)], range(4)))
        finally:
            os.close(fd)
        best = max(best, size / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[6e8])
    ap.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default="/var/tmp/zo-bench-load")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    a = ap.parse_args()
    rows, table = [], []
    for n in a.sizes:
        d = os.path.join(a.dir, "ck")
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(a.dir, exist_ok=True)
        size = write_checkpoint(int(n), a.state_dtype, d)
        for rep in range(a.reps):  # interleaved: the disk and the VM drift over a run
            r = read_bound(os.path.join(d, "shard-r0-of-1.bin"))
            print(f"{n:.2g} rep {rep}: read bound {r / 1e9:.2f} GB/s", flush=True)
            for two in (False, True):
                dt, passes, cold = resume_load(int(n), a.state_dtype, d, two)
                print(f"{n:.2g} {a.state_dtype} passes={passes} rep {rep}: {dt:.2f} s, {size / dt / 1e9:.2f} GB/s "
                      f"(cold: {cold})", flush=True)
                rows.append((n, passes, dt, cold, r))
        for p in sorted({q for m, q, *_ in rows if m == n}):
            mine = [(dt, r) for m, q, dt, _, r in rows if m == n and q == p]
            table.append(f"| {n / 1e9:.2f}e9 | {a.state_dtype} | {size / 1e9:.2f} | {p} | "
                         + " / ".join(f"{dt:.2f} ({100 * size / dt / r:.0f}%)" for dt, r in mine)
                         + f" | {max(size / dt for dt, _ in mine) / 1e9:.2f} |")
        bounds = [r for m, *_, r in rows if m == n][::2]
        table.append("| | | | read bound | " + " / ".join(f"{r / 1e9:.2f}" for r in bounds)
                     + f" GB/s (cold: {rows[-1][3]}) | |")
        shutil.rmtree(d, ignore_errors=True)
    body = (f"{machine_line()}, SIMD {cpu_adam.simd_level()}; directory {a.dir}; "
            f"`python scripts/bench_load.py {' '.join(sys.argv[1:])}`.\n\n"
            "| params | state | file GB | passes | LOAD s (% of that rep's read bound) | best GB/s |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(table))
    print(body)
    if a.write:
        update_section(f"bench_load_{a.state_dtype}", body)


if __name__ == "__main__":
    main()
