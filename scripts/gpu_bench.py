"""Measurements of the CUDA path, run by scripts/gpu_check.sh on a lent GPU.

    python scripts/gpu_bench.py --out DIR            # on a CUDA machine
    python scripts/gpu_bench.py --dry-run            # the same code on the CPU, tiny sizes

(a) host<->device bandwidth through a cudaHostRegister'ed shared segment (ours)
    vs torch pinned tensors of the same size;
(b) device memory of model states after a step (activations gone): engine vs plain
    torch mixed-precision AdamW on the same model;
(c) step time and TFLOPS of a ~1.5B GPT: GPU-only AdamW, offload sync, offload DPU,
    at two batch sizes;
(d) the largest GPT each can hold, from the measured bytes/param and the free
    device and host memory (a bounded estimate, not a search by OOM).
Prints a compact table last; writes DIR/gpu_results.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_memory import HostSampler  # noqa: E402
from optimizer_server.shm import Segment  # noqa: E402
from runtime.demo.baseline import DeviceMixedPrecision  # noqa: E402
from runtime.config import OffloadConfig  # noqa: E402
from runtime.engine import OffloadEngine  # noqa: E402
from runtime.demo.gpt import GPT, GPTConfig, flops_per_token  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bandwidth(dev, nbytes: int) -> dict:
    """(a): GB/s of H2D and D2H for a registered shared segment vs torch pinned memory."""
    n = nbytes // 2
    seg = Segment.create(f"zo-bench-{os.getpid()}", nbytes)
    try:
        arr = seg.array(np.int16, 0, n)
        arr[:] = 1
        ptr = arr.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        registered = int(err) == 0  # the engine falls back to pageable copies; report it, do not fail
        if not registered:
            from runtime.host_memory import clear_cuda_last_error
            clear_cuda_last_error()
        ours = torch.from_numpy(arr).view(torch.float16)
        pinned = torch.empty(n, dtype=torch.float16, pin_memory=True)
        d = torch.empty(n, dtype=torch.float16, device=dev)
        res = {"registered": registered, "register_error": int(err)}
        for name, host in (("ours", ours), ("torch_pinned", pinned)):
            for direction in ("h2d", "d2h"):
                ts = []
                for _ in range(8):
                    sync(dev)
                    t0 = time.perf_counter()
                    (d.copy_(host, non_blocking=True) if direction == "h2d" else host.copy_(d, non_blocking=True))
                    sync(dev)
                    ts.append(time.perf_counter() - t0)
                res[f"{name}_{direction}_GBps"] = nbytes / statistics.median(ts[2:]) / 1e9
        del ours, arr
        if registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    finally:
        seg.close()
        seg.unlink()
    for direction in ("h2d", "d2h"):
        res[f"ratio_{direction}"] = res[f"ours_{direction}_GBps"] / res[f"torch_pinned_{direction}_GBps"]
    return res


def make_model(mc: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(mc)


def count_params(mc: GPTConfig) -> int:
    """The model's size without building it: on the meta device (no 6 GB of fp32 for the 1.5B)."""
    with torch.device("meta"):
        return GPT(mc).num_params()


def run(kind: str, mc: GPTConfig, dev, batch: int, steps: int, warm: int, dtype: str) -> dict:
    """Build kind (baseline | sync | dpu | overlap | overlap-spec | dpu-after), train a few steps, return time
    and memory.  overlap: overlap_update (bitwise sync, the update during the next forward); overlap-spec: with
    speculation during backward too (an undo log for the whole state, and no clipping, which would roll every
    speculation back; the clip's own cost is a coefficient, nothing on the timeline);
    dpu-after: weights up in one piece after DONE (the A/B for copying them inside backward)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    host = HostSampler().start()  # host RAM of this process, the server and their segments
    host0 = host.now()
    model = make_model(mc)
    n = model.num_params()
    cfg = OffloadConfig(lr=1e-4, weight_decay=0.1, dtype=dtype, dpu=kind.startswith("dpu"), dpu_warmup_steps=2,
                        overlap_weights_up=kind != "dpu-after", overlap_update=kind.startswith("overlap"),
                        undo_log_bytes=16 * n if kind == "overlap-spec" else 0,
                        clip_grad_norm=None if kind == "overlap-spec" else 1.0,
                        server_threads=max(1, (os.cpu_count() or 2) - 2), device=str(dev))
    if kind == "baseline":
        eng = DeviceMixedPrecision(model.to(dev), cfg)
    else:
        eng = OffloadEngine(model, cfg)  # built on the CPU: only 16-bit weights go to the device
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mc.vocab_size, (batch, mc.seq_len + 1), generator=gen).to(dev)
    x, y = idx[:, :-1], idx[:, 1:]
    times, state_bytes = [], 0
    # False: page-locking was refused (a warning said why); None: not applicable
    pinned = getattr(eng, "_pinned", None) is not None if dev.type == "cuda" else None
    try:
        for i in range(steps + warm):
            sync(dev)
            t0 = time.perf_counter()
            loss = model(x, y)
            eng.backward(loss)
            del loss
            eng.step()
            sync(dev)
            if i >= warm:
                times.append(time.perf_counter() - t0)
            if i == 0 and dev.type == "cuda":
                state_bytes = torch.cuda.memory_allocated(dev)  # after a step: model states only
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        host_steady = host.now()
        st = eng.stats() if kind != "baseline" else {}
        # share of the weights that went up while the update ran or inside backward
        early = st["bytes_to_device_early"] / st["bytes_to_device"] if st.get("bytes_to_device") else None
    finally:
        eng.close()
        host.stop()
        del eng, model
    return {"step_s": statistics.median(times), "state_bytes": state_bytes, "peak_bytes": peak,
            "pinned": pinned if kind != "baseline" else None, "early_up": early,
            "host_peak_B": (host.peak - host0) / n, "host_steady_B": (host_steady - host0) / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (checks the code)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=1600)
    ap.add_argument("--heads", type=int, default=25)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--host-gib", type=float, default=0.0,
                    help="host RAM for the capacity estimate (0: what the OS reports; a VM whose RAM grows "
                         "as it is used reports far less at first)")
    a = ap.parse_args(argv)
    if a.dry_run:
        dev = torch.device("cpu")
        a.layers, a.d_model, a.heads, a.seq_len, a.batches, a.steps = 2, 64, 2, 32, "2,4", 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; skipped")
            return 0
        dev = torch.device("cuda", 0)
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)",
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    t_start = time.perf_counter()
    if dev.type == "cuda":
        res["bandwidth"] = bandwidth(dev, 1 << 30)
        print("(a)", json.dumps(res["bandwidth"]), flush=True)
    mc = GPTConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d_model, seq_len=a.seq_len)
    n_params = count_params(mc)
    res["params"] = n_params

    def save() -> None:  # after every variant: a run cut short by its timeout keeps what finished
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "gpu_results.json").write_text(json.dumps(res, indent=1, default=float))
    save()
    fpt = flops_per_token(mc, n_params)
    rows = []
    batches = [int(v) for v in a.batches.split(",")]
    for b in batches:
        # the A/B of the overlapped weight copy only at the larger batch, last (bounded time)
        for kind in ("baseline", "sync", "dpu", "overlap") + (("overlap-spec", "dpu-after") if b == batches[-1] else ()):
            r = run(kind, mc, dev, b, a.steps, 2, a.dtype)
            r["tflops"] = fpt * b * mc.seq_len / r["step_s"] / 1e12
            res[f"{kind}_b{b}"] = r
            rows.append((b, kind, r))
            save()
            print(f"(c) batch {b} {kind}: {r['step_s'] * 1e3:.0f} ms/step, {r['tflops']:.1f} TFLOPS, "
                  f"states {r['state_bytes'] / 2**30:.2f} GiB, peak {r['peak_bytes'] / 2**30:.2f} GiB"
                  + f", host {r['host_peak_B']:.1f} B/param peak, {r['host_steady_B']:.1f} steady"
                  + ("" if r["early_up"] is None else f", {100 * r['early_up']:.0f}% of weights up early")
                  + ("" if r["pinned"] is not False else ", host segment NOT page-locked"), flush=True)
    # (b) model-state bytes per parameter on the device
    bb = res[f"baseline_b{rows[0][0]}"]["state_bytes"] / n_params if dev.type == "cuda" else float("nan")
    eb = res[f"sync_b{rows[0][0]}"]["state_bytes"] / n_params if dev.type == "cuda" else float("nan")
    res["state_bytes_per_param"] = {"baseline": bb, "engine": eb, "ratio": bb / eb if eb == eb and eb else float("nan")}
    # (d) capacity estimate: free device memory / bytes per param; host RAM / the engine's host
    # bytes per param (16 by its layout; its set-up peak is lower: scripts/bench_memory.py)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        host = a.host_gib * 2**30 or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # the engine's host bytes/param as measured here (DPU, larger batch), at least the layout's 16
        hb = max(16.0, res[f"dpu_b{batches[-1]}"]["host_peak_B"])
        res["capacity_params"] = {"baseline_device_bound": total * 0.9 / bb,
                                  "engine_device_bound": total * 0.9 / eb,
                                  "engine_host_bound": host * 0.9 / hb, "host_bytes_per_param": hb,
                                  "host_bytes": host}
    res["seconds"] = time.perf_counter() - t_start
    print("\n| batch | variant | ms/step | TFLOPS | model states GiB | peak GiB | host B/param, peak | vs GPU-only |")
    print("|---|---|---|---|---|---|---|---|")
    for b, kind, r in rows:
        base = res[f"baseline_b{b}"]["step_s"]
        print(f"| {b}x{mc.seq_len} | {kind} | {r['step_s'] * 1e3:.0f} | {r['tflops']:.1f} | "
              f"{r['state_bytes'] / 2**30:.2f} | {r['peak_bytes'] / 2**30:.2f} | {r['host_peak_B']:.1f} | "
              f"{r['step_s'] / base:.2f}x |")
    if "bandwidth" in res:
        bw = res["bandwidth"]
        if not bw["registered"]:
            print(f"\nthe shared segment could NOT be page-locked here (cudaHostRegister {bw['register_error']}): "
                  f"'ours' is pageable memory")
        print(f"\nbandwidth GB/s: ours h2d {bw['ours_h2d_GBps']:.1f} / d2h {bw['ours_d2h_GBps']:.1f}; torch pinned "
              f"h2d {bw['torch_pinned_h2d_GBps']:.1f} / d2h {bw['torch_pinned_d2h_GBps']:.1f} "
              f"(ratio {bw['ratio_h2d']:.2f} / {bw['ratio_d2h']:.2f})")
    print(f"model states per param: baseline {bb:.1f} B, engine {eb:.1f} B ({res['state_bytes_per_param']['ratio']:.1f}x)")
    if "capacity_params" in res:
        c = res["capacity_params"]
        print(f"capacity: baseline {c['baseline_device_bound'] / 1e9:.1f}B params (device), engine "
              f"{min(c['engine_device_bound'], c['engine_host_bound']) / 1e9:.1f}B (device bound "
              f"{c['engine_device_bound'] / 1e9:.1f}B, host bound {c['engine_host_bound'] / 1e9:.1f}B)")
    print(f"{n_params / 1e9:.2f}B-param GPT; {res['seconds']:.0f} s")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
