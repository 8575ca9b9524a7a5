"""Checkpoints and set-up at a user's size: a model that is mostly one embedding table
(cheap forward and backward on any CPU, a large optimizer state), through OffloadEngine
on the CPU device.

Per size: construction, first step, steady step, blocking save, background save (the
time save_checkpoint takes to return, the steps run while it writes, the time to
publish), load, master_state_dict, zero-offload-export; peak RSS of worker and server; save and load GB/s
against this run's bound: one plain sequential write (16 MiB writes, one fsync) and
read of the same number of bytes in the same directory.

    python scripts/bench_scale.py --sizes 0.5e9 1e9 --state-dtype bf16 --dir /var/tmp/zo-bench --write
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from zero_offload.kernels import cpu_adam  # noqa: E402
from zero_offload.server import ShardClient, spawn  # noqa: E402
from zero_offload.server.admission import read_mem_available  # noqa: E402
from zero_offload.server.checkpoint import resolve  # noqa: E402
from zero_offload import OffloadConfig, OffloadEngine  # noqa: E402
from bench_md import machine_line, update_section  # noqa: E402

SEED = 0
CHUNK = 16 << 20


class Tables(torch.nn.Module):
    """An embedding of `rows` x 64 and a small head: nearly every parameter is the table."""

    def __init__(self, rows: int, dim: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, idx):
        return self.head(self.emb(idx)).float().square().mean()


def peak_rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


WARM = False  # --warm: leave the page cache alone (a test's run, beside other work)


def drop_caches() -> bool:
    """Empty the page cache (root only), so a read measures the disk, not memory: the bound
    and the load are both read cold (a resume after a crash, or on another node)."""
    if WARM:
        return False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


def disk_bound(d: str, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes/s of one plain sequential write with one fsync, then a read
    (cold where the page cache can be dropped)."""
    path = os.path.join(d, "bound.bin")
    buf = bytearray(os.urandom(1 << 20)) * 16
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(buf)[:min(CHUNK, left)])
        os.fsync(f.fileno())
    w = nbytes / (time.perf_counter() - t0)
    drop_caches()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    r = nbytes / (time.perf_counter() - t0)
    os.unlink(path)
    return w, r


def one(n: float, state_dtype: str, root: str, threads: int, compute: str = "auto") -> dict:
    rows = int(n) // 64
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    model = Tables(rows)
    cfg = OffloadConfig(lr=1e-3, dtype="bf16", state_dtype=state_dtype, server={"threads": threads},
                        expert={"compute_dtype": compute})
    eng = OffloadEngine(model, cfg)
    out = {"params": sum(p.numel() for p in model.parameters()), "state_dtype": state_dtype,
           "compute_dtype": str(eng.compute_dtype).replace("torch.", "")}
    out["construct_s"] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(SEED)

    def step():
        idx = torch.randint(0, rows, (8, 64), generator=gen)
        eng.backward(model(idx))
        eng.step()
    try:
        t0 = time.perf_counter()
        step()
        eng.synchronize()
        out["first_step_s"] = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            eng.synchronize()
            times.append(time.perf_counter() - t0)
        out["steady_step_s"] = sorted(times)[1]
        d = os.path.join(root, "ck")
        t0 = time.perf_counter()
        path = eng.save_checkpoint(d)
        out["save_s"] = time.perf_counter() - t0
        nbytes = os.path.getsize(os.path.join(path, "shard-r0-of-1.bin"))
        out["save_bytes"] = nbytes
        # what the engine's save wrote: the server's file, the device's weights, the manifests
        out["engine_save_bytes"] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        t0 = time.perf_counter()
        eng.save_checkpoint(d, background=True)
        out["bg_return_s"] = time.perf_counter() - t0
        k = 0
        t0 = time.perf_counter()
        while eng.checkpoint_in_flight() and k < 50:
            step()
            k += 1
        eng.wait_checkpoint()
        out["bg_steps_meanwhile"] = k
        out["bg_total_s"] = time.perf_counter() - t0
        st = eng.client.save_status()
        out["bg_update_wait_s"] = st.get("waited_s", 0.0)
        drop_caches()
        t0 = time.perf_counter()
        eng.load_checkpoint(d)
        out["load_s"] = time.perf_counter() - t0
        # the whole fp32 master in this process (4 B/param) beside the state: at the largest
        # sizes a 24 GiB machine has not got it, and the OOM killer would end the run
        need = 4 * out["params"] * 1.25
        if read_mem_available() > need:
            t0 = time.perf_counter()
            eng.master_state_dict()  # built whole, then dropped
            out["master_state_dict_s"] = time.perf_counter() - t0
        else:
            out["master_state_dict_s"] = None
            print(f"master_state_dict skipped: it needs ~{need / 2**30:.1f} GiB, {read_mem_available() / 2**30:.1f} "
                  f"available", flush=True)
        out["worker_peak_gib"] = peak_rss() / 2**30
        out["server_peak_gib"] = peak_rss(eng._server.proc.pid) / 2**30
        w, r = disk_bound(root, nbytes)
        out["bound_write_gbs"], out["bound_read_gbs"] = w / 1e9, r / 1e9
        exact = cfg.exact_master
        eng.close()
        out.update(server_io(d, state_dtype, exact, threads))
        out.update(export(d))
    finally:
        eng.close()
        shutil.rmtree(os.path.join(root, "ck"), ignore_errors=True)
    return out


def server_io(d: str, state_dtype: str, exact: bool, threads: int) -> dict:
    """The server's SAVE and LOAD alone, on the checkpoint in d, in a fresh server (as a
    resume has it): a 1-rank shard's cold LOAD, its SAVE into a new directory, then two
    shards (ranks 0 and 1 of 2) loading the 1-rank checkpoint at once (resharding 1 -> 2)."""
    step = resolve(d)
    total = json.loads((step / "shard-r0-of-1.json").read_text())["numel"]
    nbytes = os.path.getsize(step / "shard-r0-of-1.bin")
    out = {"server_bytes": nbytes}
    kw = dict(dtype="bf16", state_dtype=state_dtype, exact_master=exact)
    with spawn(threads=threads) as srv:
        c = ShardClient(srv.address, srv.token, numel=total, server_proc=srv.proc, **kw)
        out["cold"] = drop_caches()
        t0 = time.perf_counter()
        c.load(str(step))
        out["server_load_s"] = time.perf_counter() - t0
        again = os.path.join(d, "again")
        t0 = time.perf_counter()
        c.save(again)
        out["server_save_s"] = time.perf_counter() - t0
        shutil.rmtree(again, ignore_errors=True)
        c.close()
    half = -(-total // 2)
    half += -half % 256
    with spawn(threads=threads) as srv:
        cs = [ShardClient(srv.address, srv.token, rank=k, world_size=2, numel=half, server_proc=srv.proc, **kw)
              for k in range(2)]
        drop_caches()
        t0 = time.perf_counter()
        ths = [threading.Thread(target=c.load, args=(str(step),)) for c in cs]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        out["reshard_s"] = time.perf_counter() - t0
        assert all(c.stats().updates > 0 for c in cs), "the resharded shards did not load"
        for c in cs:
            c.close()
    return out


def export(d: str) -> dict:
    """zero-offload-export of the checkpoint in d, as a user runs it after training: a fresh
    process, the page cache dropped; the fp32 master written beside it, then removed.  Its
    peak memory is the process's own (VmHWM)."""
    target = os.path.join(d, "export.safetensors")
    code = ("import sys; from zero_offload.export import main; rc = main(sys.argv[1:]); "
            "print('VmHWM', [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); "
            "sys.exit(rc)")
    drop_caches()
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, d, target], capture_output=True, text=True)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"zero-offload-export failed: {p.stderr}")
    out = {"export_s": took, "export_bytes": os.path.getsize(target),
           "export_peak_gib": int(p.stdout.split("VmHWM")[1].split()[0]) * 1024 / 2**30}
    os.unlink(target)
    return out


def repro(n: int, root: str) -> str:
    """The issue's reproduction: one server, a shard of n parameters with fp32 state, a
    second client polling STATS every 0.5 s, then save and load."""
    import numpy as np
    with spawn(threads=2) as srv:
        c = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)
        other = ShardClient(srv.address, srv.token, numel=1024, server_proc=srv.proc)
        other.init_weights(np.zeros(1024, np.float32))
        for lo, hi in c.init_chunks():
            c.staging[:hi - lo] = 0.5
            c.init_chunk(lo, hi)
        c.grads[0][:] = 0x3C00  # fp16 1.0
        c.step(1, 0, 1e-3)
        stop, worst, errors = threading.Event(), [0.0], []

        def poll():
            try:
                while not stop.wait(0.5):
                    t0 = time.monotonic()
                    other.stats()
                    worst[0] = max(worst[0], time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        th = threading.Thread(target=poll, daemon=True)
        th.start()
        d = os.path.join(root, "repro")
        t0 = time.perf_counter()
        info = c.save(d)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        c.load(d)
        load_s = time.perf_counter() - t0
        stop.set()
        th.join()
        c.close()
        other.close()
    shutil.rmtree(os.path.join(root, "repro"), ignore_errors=True)
    return (f"Reproduction ({n / 1e9:.1f}e9 parameters, fp32 state, a second client polling STATS every 0.5 s): "
            f"save {info['bytes'] / 2**30:.1f} GiB in {save_s:.1f} s, load in {load_s:.1f} s, the poller's slowest "
            f"answer {worst[0]:.2f} s, errors: {len(errors) and repr(errors[0]) or 'none'}.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[0.5e9])
    ap.add_argument("--state-dtype", default="bf16", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--dir", default="/var/tmp/zo-bench-scale")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repro", type=float, default=0.6e9, help="the fp32 reproduction's size (0: skip it)")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    ap.add_argument("--section", default="bench_scale", help="the BENCHMARKS.md section --write replaces")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache (reads may then hit it)")
    ap.add_argument("--compute-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="the engine's expert.compute_dtype (fp32: what a CPU without native bf16 matmul gets, "
                         "4 B/param of worker weights instead of 2)")
    a = ap.parse_args()
    global WARM
    WARM = a.warm
    os.makedirs(a.dir, mode=0o700, exist_ok=True)
    rows = [one(n, a.state_dtype, a.dir, a.threads, a.compute_dtype) for n in a.sizes]
    repro_line = repro(int(a.repro), a.dir) if a.repro else ""
    simd = cpu_adam.simd_level()
    head = ("| params | state | construct s | first step s | steady step s | save s (GB/s, % of write bound) | "
            "background: return s / steps meanwhile / publish s / update waited s | load s | server SAVE s (GB/s, % "
            "of write bound) | server LOAD s (GB/s, % of read bound) | master_state_dict s | reshard 1 -> 2 s | "
            "worker / server peak GiB |")
    lines = [f"Machine: {machine_line()}, SIMD {simd}; directory {a.dir}; `python scripts/bench_scale.py "
             f"--sizes {' '.join(f'{s:g}' for s in a.sizes)} --state-dtype {a.state_dtype}"
             f"{'' if a.compute_dtype == 'auto' else ' --compute-dtype ' + a.compute_dtype}`; compute dtype "
             f"{', '.join(sorted({r['compute_dtype'] for r in rows}))}.", "", head,
             "|" + "---|" * 13]
    for r in rows:
        sv, ld = r["server_bytes"] / r["server_save_s"] / 1e9, r["server_bytes"] / r["server_load_s"] / 1e9
        sa = r["engine_save_bytes"] / r["save_s"] / 1e9
        msd = "skipped (RAM)" if r["master_state_dict_s"] is None else f"{r['master_state_dict_s']:.1f}"
        lines.append(
            f"| {r['params'] / 1e9:.2f}e9 | {r['state_dtype']} | {r['construct_s']:.1f} | {r['first_step_s']:.2f} | "
            f"{r['steady_step_s']:.2f} | {r['save_s']:.1f} ({sa:.2f}, {100 * sa / r['bound_write_gbs']:.0f}%) | "
            f"{r['bg_return_s']:.2f} / {r['bg_steps_meanwhile']} / "
            f"{r['bg_total_s']:.1f} / {r['bg_update_wait_s']:.1f} | {r['load_s']:.1f} | {r['server_save_s']:.1f} "
            f"({sv:.2f}, {100 * sv / r['bound_write_gbs']:.0f}%) | {r['server_load_s']:.1f} ({ld:.2f}, "
            f"{100 * ld / r['bound_read_gbs']:.0f}%) | {msd} | {r['reshard_s']:.1f} | "
            f"{r['worker_peak_gib']:.1f} / {r['server_peak_gib']:.1f} |")
    lines += ["", "Export (`zero-offload-export CKPT OUT`, fp32, in a fresh process after training; it checks the "
                  "shard file's checksum, reading it whole, then streams the master out):", "",
              "| params | export s | read GB + written GB | the bound s (that read and write at this run's bounds) "
              "| % of the bound | peak GiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        bound = r["save_bytes"] / 1e9 / r["bound_read_gbs"] + r["export_bytes"] / 1e9 / r["bound_write_gbs"]
        lines.append(f"| {r['params'] / 1e9:.2f}e9 | {r['export_s']:.1f} | {r['save_bytes'] / 1e9:.2f} + "
                     f"{r['export_bytes'] / 1e9:.2f} | {bound:.1f} | {100 * bound / r['export_s']:.0f}% | "
                     f"{r['export_peak_gib']:.2f} |")
    cold = all(r["cold"] for r in rows)
    lines += ["", ("Loads and the read bound are cold (page cache dropped before each)." if cold else
                   "Loads and the read bound may hit the page cache (it could not be dropped)."), repro_line]
    table = "\n".join(lines)
    print(table, flush=True)
    for r in rows:
        print(r)
    if a.write:
        update_section(a.section, table)


if __name__ == "__main__":
    main()
