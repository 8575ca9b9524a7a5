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
    device and host memory (a bounded estimate, not a search by OOM);
(e) --big (gpu_check.sh --big, a second call): the mission's own claim, a GPT that
    GPU-only mixed precision cannot hold on that GPU (16 B/param of model states),
    trained with offload: sized by the host's RAM (big_config), bf16 weights and
    state, mode="dpu", activation checkpointing per block, batch 8 x 2048 tokens:
    step time, model TFLOPS (6N + attention per token, the recomputation not
    counted), device memory, host bytes per parameter.
Prints a compact table last; writes DIR/gpu_results.json after every variant.

It must return a table whatever happens, since a lent GPU's first run may be the only
one: the model is built once (initialised on the device, its fp32 state dict kept on
the CPU and given to each variant), each variant runs in its own try/except (a failure
is a row saying so), and SIGTERM or --deadline-s ends the run with the table of what
finished.  ``--summary FILE`` prints that table from a JSON a killed run left.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
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
from zero_offload.server.shm import Segment  # noqa: E402
from zero_offload.demo.baseline import DeviceMixedPrecision  # noqa: E402
from zero_offload.config import OffloadConfig  # noqa: E402
from zero_offload.engine import OffloadEngine  # noqa: E402
from zero_offload.demo.gpt import GPT, GPTConfig, flops_per_token  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_step(model, eng, x, y, dev, losses: list | None = None) -> float:
    """One step (forward, backward, step) between device syncs: its seconds.  losses: the
    loss appended (a read that waits for the backward: only where the loss is wanted)."""
    sync(dev)
    t0 = time.perf_counter()
    loss = model(x, y)
    eng.backward(loss)
    if losses is not None:
        losses.append(float(loss.detach()))
    del loss
    eng.step()
    sync(dev)
    return time.perf_counter() - t0


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
            from zero_offload.host_memory import clear_cuda_last_error
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


_WEIGHTS: dict = {}


def make_model(mc: GPTConfig, dev=None) -> GPT:
    """A fresh fp32 GPT on the CPU with the same weights every call.  The first call
    initialises it on `dev` (a GPU draws the 1.5e9 random numbers in milliseconds, the CPU
    in ~10 s) and keeps its state dict on the CPU; later calls build on the meta device
    and take a copy of it (the engine consumes the fp32 parameters it is given)."""
    key = (mc.n_layer, mc.n_head, mc.d_model, mc.seq_len)
    if key not in _WEIGHTS:
        torch.manual_seed(0)
        with torch.device(dev if dev is not None else "cpu"):
            m = GPT(mc)
        _WEIGHTS.clear()
        _WEIGHTS[key] = {k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()}
        del m
    with torch.device("meta"):
        m = GPT(mc)
    m.load_state_dict({k: v.clone() for k, v in _WEIGHTS[key].items()}, assign=True)
    m.head.weight = m.tok.weight  # assign=True gave the head a tensor of its own: tied again, as GPT builds it
    return m


def count_params(mc: GPTConfig) -> int:
    """The model's size without building it: on the meta device (no 6 GB of fp32 for the 1.5B)."""
    with torch.device("meta"):
        return GPT(mc).num_params()


BIG_HOST_B = 12.0    # host bytes per parameter at --big's peak: 10 with bf16 state under DPU (the 1.48B
                     # run's table), plus the bf16 model's own copy until the engine has taken it
BIG_HOST_SHARE = 0.85  # of the host's RAM: the rest for the OS, the page cache, CUDA's pinned staging
BIG_D_MODEL = 5120   # 40 heads of 128: a 10e9-class layer width


def big_config(host: int, dry: bool) -> tuple[GPTConfig, str]:
    """The --big model: as many 5120-wide blocks (12 d^2 parameters each) as BIG_HOST_B
    bytes per parameter allow in BIG_HOST_SHARE of `host` bytes (about 10e9 parameters on
    a 128 GiB host); the dry run's a tiny one of the same shape.  Returns it and a line
    saying how it was sized."""
    if dry:
        return GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32), "dry run: a tiny model of the same code path"
    budget = host * BIG_HOST_SHARE / BIG_HOST_B
    layers = max(1, int(budget // (12 * BIG_D_MODEL ** 2)))
    mc = GPTConfig(n_layer=layers, n_head=BIG_D_MODEL // 128, d_model=BIG_D_MODEL, seq_len=2048)
    why = (f"sized by host RAM: {host / 2**30:.0f} GiB x {BIG_HOST_SHARE} / {BIG_HOST_B:.0f} B/param -> "
           f"{layers} blocks of d_model {BIG_D_MODEL}")
    return mc, why


def run_big(mc: GPTConfig, dev, batch: int, steps: int, warm: int) -> dict:
    """(e): the model initialised on the device in bf16 (no fp32 copy anywhere: at 10e9
    parameters that would be 40 GB), moved to the host, handed to the engine with bf16
    state under DPU; each block's forward checkpointed (recomputed in backward)."""
    import torch.utils.checkpoint as ckpt
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    host = HostSampler().start()
    host0 = host.now()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = GPT(mc)
    finally:
        torch.set_default_dtype(old)
    model = model.to("cpu")
    for b in model.blocks:  # activation checkpointing: each block's activations recomputed in backward
        b.forward = (lambda f: lambda x: ckpt.checkpoint(f, x, use_reentrant=False))(b.forward)
    n = model.num_params()
    cfg = OffloadConfig(lr=1e-4, weight_decay=0.1, dtype="bf16", mode="dpu", state_dtype="bf16", clip_grad_norm=1.0,
                        server={"threads": max(1, (os.cpu_count() or 2) - 2)}, device=str(dev),
                        expert=dict(dpu_warmup_steps=2))
    eng = OffloadEngine(model, cfg)
    build_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mc.vocab_size, (batch, mc.seq_len + 1), generator=gen).to(dev)
    x, y = idx[:, :-1], idx[:, 1:]
    times, losses = [], []
    try:
        for i in range(steps + warm):
            dt = timed_step(model, eng, x, y, dev, losses)
            if i >= warm:
                times.append(dt)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        states = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        host_steady = host.now()
    finally:
        eng.close()
        host.stop()
        del eng, model
    return {"step_s": statistics.median(times), "build_s": build_s, "params": n, "state_bytes": states,
            "peak_bytes": peak, "host_peak_B": (host.peak - host0) / n, "host_steady_B": (host_steady - host0) / n,
            "losses": losses}


class Skipped(Exception):
    """A variant that cannot run here (its table row says why)."""


def run_deepspeed(mc: GPTConfig, dev, batch: int, steps: int, warm: int, dtype: str) -> dict:
    """The same model and batch under DeepSpeed's ZeRO-Offload: ZeRO-2 with
    offload_optimizer to the CPU (DeepSpeedCPUAdam, pinned memory), overlap_comm, the
    same lr, weight decay and clip, one process (a process group of one).  Its CPU Adam
    op builds on first use with the machine's compiler and ninja: a failure there is
    this variant's FAILED row, and the table goes on."""
    if dev.type != "cuda":
        raise Skipped("DeepSpeed's ZeRO-Offload needs a CUDA device")
    try:
        import deepspeed
    except ImportError as e:
        raise Skipped(f"deepspeed is not installed ({e}): carry ../shared/wheels in .whl/") from None
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        deepspeed.init_distributed(dist_backend="nccl")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    host = HostSampler().start()
    host0 = host.now()
    model = make_model(mc, dev)
    n = model.num_params()
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                    "overlap_comm": True, "contiguous_gradients": True},
              "steps_per_print": 1 << 30}
    eng, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mc.vocab_size, (batch, mc.seq_len + 1), generator=gen).to(dev)
    x, y = idx[:, :-1], idx[:, 1:]
    times, state_bytes = [], 0
    try:
        for i in range(steps + warm):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            loss = eng(x, y)
            eng.backward(loss)
            del loss
            eng.step()
            torch.cuda.synchronize(dev)
            if i >= warm:
                times.append(time.perf_counter() - t0)
            if i == 0:
                state_bytes = torch.cuda.memory_allocated(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        host_steady = host.now()
    finally:
        host.stop()
        del eng, model
        gc.collect()
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "state_bytes": state_bytes, "peak_bytes": peak, "pinned": None,
            "early_up": None, "server_update_s": None, "host_peak_B": (host.peak - host0) / n,
            "host_steady_B": (host_steady - host0) / n}


def run(kind: str, mc: GPTConfig, dev, batch: int, steps: int, warm: int, dtype: str) -> dict:
    """Build kind (baseline | sync | dpu | overlap | overlap-spec | dpu-after), train a few steps, return time
    and memory.  overlap: overlap_update (bitwise sync, the update during the next forward); overlap-spec: with
    speculation during backward too (an undo log for the whole state, and no clipping, which would roll every
    speculation back; the clip's own cost is a coefficient, nothing on the timeline);
    dpu-after: weights up in one piece after DONE (the A/B for copying them inside backward).
    A suffix ":bf16" or ":int8" sets the server's state dtype (fp32 otherwise)."""
    kind, _, state_dtype = kind.partition(":")
    if kind == "deepspeed":
        return run_deepspeed(mc, dev, batch, steps, warm, dtype)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    host = HostSampler().start()  # host RAM of this process, the server and their segments
    host0 = host.now()
    model = make_model(mc, dev)
    n = model.num_params()
    expert = dict(dpu_warmup_steps=2, overlap_weights_up=kind != "dpu-after")
    if not kind.startswith("dpu"):
        expert["exact_strategy"] = {"overlap": "overlap_update", "overlap-spec": "overlap_update+speculation"}.get(
            kind, "sync")
        if kind == "overlap-spec":
            expert["undo_log_bytes"] = 16 * n
    cfg = OffloadConfig(lr=1e-4, weight_decay=0.1, dtype=dtype, mode="dpu" if kind.startswith("dpu") else "exact",
                        state_dtype=state_dtype or "fp32",
                        clip_grad_norm=None if kind == "overlap-spec" else 1.0,
                        server={"threads": max(1, (os.cpu_count() or 2) - 2)}, device=str(dev), expert=expert)
    if kind == "broken":  # --dry-run --inject-failure: a variant that raises, as a CUDA error would
        raise RuntimeError("injected failure (gpu_bench --inject-failure)")
    if kind == "hang":  # --inject-hang: a variant that never ends, as a hung kernel would
        time.sleep(3600)
    if kind == "baseline":
        eng = DeviceMixedPrecision(model.to(dev), cfg)
    else:
        eng = OffloadEngine(model, cfg)  # built on the CPU: only 16-bit weights go to the device
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mc.vocab_size, (batch, mc.seq_len + 1), generator=gen).to(dev)
    x, y = idx[:, :-1], idx[:, 1:]
    times, state_bytes, update0 = [], 0, 0.0
    # False: page-locking was refused (a warning said why); None: not applicable
    pinned = getattr(eng, "_pinned", None) is not None if dev.type == "cuda" else None
    try:
        for i in range(steps + warm):
            dt = timed_step(model, eng, x, y, dev)
            if i >= warm:
                times.append(dt)
            if i == warm - 1 and kind != "baseline":  # the server's time from here on: no first touch in it
                update0 = eng.stats()["server_update_s"]
            if i == 0 and dev.type == "cuda":
                state_bytes = torch.cuda.memory_allocated(dev)  # after a step: model states only
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        host_steady = host.now()
        st = eng.stats() if kind != "baseline" else {}
        # share of the weights that went up while the update ran or inside backward
        early = st["bytes_to_device_early"] / st["bytes_to_device"] if st.get("bytes_to_device") else None
        # the server's own time in updates, per timed step (DONE.update_s: the kernel's passes and the
        # weights' copy-back, not the wait for gradients; the warm-up's first touch left out)
        update_s = (st["server_update_s"] - update0) / steps if "server_update_s" in st else None
    finally:
        eng.close()
        host.stop()
        del eng, model
    return {"step_s": statistics.median(times), "state_bytes": state_bytes, "peak_bytes": peak,
            "pinned": pinned if kind != "baseline" else None, "early_up": early, "server_update_s": update_s,
            "host_peak_B": (host.peak - host0) / n, "host_steady_B": (host_steady - host0) / n}


class Deadline(Exception):
    """SIGTERM or --deadline-s: stop starting variants, print what finished."""


def _on_sigterm(*_):
    raise Deadline("SIGTERM")


def table(res: dict) -> str:
    """The compact table of what finished (and which variants failed), from the results."""
    rows = [(k, v) for k, v in res.items()
            if isinstance(v, dict) and "_b" in k and ("step_s" in v or "error" in v or "skipped" in v)]
    out = ["| batch | variant | ms/step | TFLOPS | model states GiB | peak GiB | host B/param, peak | vs GPU-only "
           "| server update ms/step |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in rows:
        kind, b = key.rsplit("_b", 1)
        if "error" in r:
            out.append(f"| {b} | {kind} | FAILED: {r['error'][:120]} | | | | | | |")
            continue
        if "skipped" in r:
            out.append(f"| {b} | {kind} | skipped: {r['skipped'][:120]} | | | | | | |")
            continue
        base = res.get(f"baseline_b{b}", {}).get("step_s")
        out.append(f"| {b}x{res.get('seq_len', '?')} | {kind} | {r['step_s'] * 1e3:.0f} | {r.get('tflops', 0):.1f} | "
                   f"{r['state_bytes'] / 2**30:.2f} | {r['peak_bytes'] / 2**30:.2f} | {r['host_peak_B']:.1f} | "
                   + (f"{r['step_s'] / base:.2f}x |" if base else "- |")
                   + (f" {r['server_update_s'] * 1e3:.0f} |" if r.get("server_update_s") is not None else " - |"))
    if "bandwidth" in res:
        bw = res["bandwidth"]
        if "error" in bw:
            out.append(f"\nbandwidth: FAILED: {bw['error'][:200]}")
        else:
            if not bw["registered"]:
                out.append(f"\nthe shared segment could NOT be page-locked here (cudaHostRegister "
                           f"{bw['register_error']}): 'ours' is pageable memory")
            out.append(f"\nbandwidth GB/s ({bw['nbytes'] / 2**20:.0f} MiB): ours h2d {bw['ours_h2d_GBps']:.1f} / d2h "
                       f"{bw['ours_d2h_GBps']:.1f}; torch pinned h2d {bw['torch_pinned_h2d_GBps']:.1f} / d2h "
                       f"{bw['torch_pinned_d2h_GBps']:.1f} (ratio {bw['ratio_h2d']:.2f} / {bw['ratio_d2h']:.2f})")
    sb = res.get("state_bytes_per_param")
    if sb:
        out.append(f"model states per param: baseline {sb['baseline']:.1f} B, engine {sb['engine']:.1f} B "
                   f"({sb['ratio']:.1f}x)")
    c = res.get("capacity_params")
    if c:
        out.append(f"capacity: baseline {c['baseline_device_bound'] / 1e9:.1f}B params (device), engine "
                   f"{min(c['engine_device_bound'], c['engine_host_bound']) / 1e9:.1f}B (device bound "
                   f"{c['engine_device_bound'] / 1e9:.1f}B, host bound {c['engine_host_bound'] / 1e9:.1f}B, host "
                   f"{c['host_bytes'] / 2**30:.0f} GiB measured)")
    out.append(f"{res.get('params', 0) / 1e9:.2f}B-param GPT on {res.get('device', '?')}; "
               f"{res.get('seconds', 0):.0f} s{'; STOPPED EARLY: ' + res['stopped'] if res.get('stopped') else ''}")
    return "\n".join(out)


def shm_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def host_bytes() -> int:
    """MemTotal now (a VM whose RAM grows as it is used reports its size after the runs)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (checks the code)")
    ap.add_argument("--inject-failure", action="store_true", help="add a variant that raises (checks the harness)")
    ap.add_argument("--inject-hang", action="store_true",
                    help="add a variant that never ends, after the first batch's baseline (checks the kill path)")
    ap.add_argument("--summary", default="", help="print the table of a results JSON and exit")
    ap.add_argument("--big", action="store_true", help="(e) only: the model GPU-only cannot hold, with offload")
    ap.add_argument("--big-host-gib", type=float, default=float(os.environ.get("GPU_BIG_HOST_GIB", "0")),
                    help="the host RAM --big sizes the model by (0: MemTotal now)")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no variant after this many seconds")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--d-model", type=int, default=1600)
    ap.add_argument("--heads", type=int, default=25)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batches", default="16,4", help="the first runs first, with every variant users ask about")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kinds", default="",
                    help="comma-separated variants for every batch, e.g. baseline,dpu,dpu:bf16 (default: the full set)")
    a = ap.parse_args(argv)
    if a.summary:
        print(table(json.loads(Path(a.summary).read_text())))
        return 0
    if a.big:
        return big_main(a)
    if a.dry_run:
        dev = torch.device("cpu")
        a.layers, a.d_model, a.heads, a.seq_len, a.batches, a.steps = 2, 64, 2, 32, "4,2", 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; skipped")
            return 0
        dev = torch.device("cuda", 0)
    signal.signal(signal.SIGTERM, _on_sigterm)
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)",
                 "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "seq_len": a.seq_len}
    t_start = time.perf_counter()

    def save() -> None:  # after every variant: a run cut short keeps what finished
        res["seconds"] = time.perf_counter() - t_start
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            tmp = Path(a.out) / "gpu_results.json.tmp"
            tmp.write_text(json.dumps(res, indent=1, default=float))
            os.replace(tmp, Path(a.out) / "gpu_results.json")
    mc = GPTConfig(n_layer=a.layers, n_head=a.heads, d_model=a.d_model, seq_len=a.seq_len)
    batches = [int(v) for v in a.batches.split(",")]
    try:
        if dev.type == "cuda":
            # sized by /dev/shm: a segment larger than its free space is a SIGBUS, not an error
            nbytes = int(min(1 << 30, shm_bytes() // 4)) & ~((1 << 20) - 1)
            try:
                res["bandwidth"] = dict(bandwidth(dev, nbytes), nbytes=nbytes)
            except Exception as e:  # noqa: BLE001 - a row saying so, and on to the rest
                res["bandwidth"] = {"error": f"{type(e).__name__}: {e}"}
            print("(a)", json.dumps(res["bandwidth"]), flush=True)
            save()
        n_params = count_params(mc)
        res["params"] = n_params
        save()
        fpt = flops_per_token(mc, n_params)
        # what users ask first runs first (the deadline cuts the end): the largest batch,
        # GPU-only, DPU with bf16 state, with fp32 state, sync, DeepSpeed side by side; then
        # the smaller batch and the A/B variants
        kinds_last = ("overlap-spec", "dpu-after")
        for b in batches:
            kinds = (("baseline", "dpu:bf16", "dpu", "sync", "deepspeed", "overlap") if b == batches[0]
                     else ("baseline", "sync", "dpu", "overlap")) + (kinds_last if b == batches[-1] else ())
            if a.kinds:
                kinds = tuple(k for k in a.kinds.split(",") if k)
            if a.inject_failure and b == batches[0]:
                kinds = kinds[:1] + ("broken",) + kinds[1:]
            if a.inject_hang and b == batches[0]:
                kinds = kinds[:1] + ("hang",) + kinds[1:]
            for kind in kinds:
                if a.deadline_s and time.perf_counter() - t_start > a.deadline_s:
                    raise Deadline(f"--deadline-s {a.deadline_s:.0f} passed")
                try:
                    r = run(kind, mc, dev, b, a.steps, 2, a.dtype)
                except Deadline:
                    raise
                except Skipped as e:
                    res[f"{kind}_b{b}"] = {"skipped": str(e)}
                    print(f"(c) batch {b} {kind}: skipped: {e}", flush=True)
                    save()
                    continue
                except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the table
                    res[f"{kind}_b{b}"] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"(c) batch {b} {kind}: FAILED {type(e).__name__}: {e}", flush=True)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                    save()
                    continue
                r["tflops"] = fpt * b * mc.seq_len / r["step_s"] / 1e12
                res[f"{kind}_b{b}"] = r
                save()
                print(f"(c) batch {b} {kind}: {r['step_s'] * 1e3:.0f} ms/step, {r['tflops']:.1f} TFLOPS, "
                      f"states {r['state_bytes'] / 2**30:.2f} GiB, peak {r['peak_bytes'] / 2**30:.2f} GiB"
                      + f", host {r['host_peak_B']:.1f} B/param peak, {r['host_steady_B']:.1f} steady"
                      + ("" if r["early_up"] is None else f", {100 * r['early_up']:.0f}% of weights up early")
                      + ("" if r["server_update_s"] is None else f", server update {r['server_update_s'] * 1e3:.0f} ms")
                      + ("" if r["pinned"] is not False else ", host segment NOT page-locked"), flush=True)
    except Deadline as e:
        res["stopped"] = str(e)
        print(f"stopped early ({e}): the table of what finished", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:  # the derived lines from whatever finished, deadline or not
            _derived(res, dev, batches, res.get("params", 0))
        except Exception as e:  # noqa: BLE001 - the table still prints
            res["derived_error"] = f"{type(e).__name__}: {e}"
        save()
        print("\n" + table(res), flush=True)
    return 0


def big_main(a) -> int:
    """--big: one run of (e), its line printed and written to OUT/gpu_big.json."""
    dev = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device; skipped")
        return 0
    host = int(a.big_host_gib * 2**30) or host_bytes()
    mc, why = big_config(host, a.dry_run)
    batch, steps, warm = (2, 2, 2) if a.dry_run else (8, 3, 2)
    n = count_params(mc)
    print(f"(e) {n / 1e9:.2f}e9 parameters ({why}); GPU-only mixed precision would need {16 * n / 2**30:.0f} GiB "
          f"of model states on the device", flush=True)
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (dry run)",
           "date": time.strftime("%Y-%m-%d"), "params": n, "sized": why, "batch": batch, "seq_len": mc.seq_len,
           "n_layer": mc.n_layer, "d_model": mc.d_model}
    if dev.type == "cuda":
        res["device_total_bytes"] = torch.cuda.mem_get_info(dev)[1]
    try:
        r = run_big(mc, dev, batch, steps, warm)
        r["tflops"] = flops_per_token(mc, n) * batch * mc.seq_len / r["step_s"] / 1e12
        res["big"] = r
        line = (f"| {n / 1e9:.2f}e9 | {batch}x{mc.seq_len} | dpu, bf16 state, activation checkpointing | "
                f"{r['step_s']:.2f} | {r['tflops']:.1f} | {r['state_bytes'] / 2**30:.1f} | {r['peak_bytes'] / 2**30:.1f} | "
                f"{r['host_peak_B']:.1f} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |")
    except Exception as e:  # noqa: BLE001 - the line says what failed
        res["big"] = {"error": f"{type(e).__name__}: {e}"}
        line = f"| {n / 1e9:.2f}e9 | {batch}x{mc.seq_len} | FAILED: {type(e).__name__}: {str(e)[:200]} | | | | | | |"
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_big.json").write_text(json.dumps(res, indent=1, default=float))
    print("\n| params | batch | variant | s/step | model TFLOPS | model states GiB | peak GiB | host B/param, peak "
          "| loss first -> last |\n|---|---|---|---|---|---|---|---|---|\n" + line, flush=True)
    print(f"on {res['device']}; {why}", flush=True)
    return 0 if "error" not in res["big"] else 1


def _derived(res: dict, dev, batches: list, n_params: int) -> None:
    """(b) model-state bytes per parameter on the device, (d) the capacity estimate."""
    b0 = batches[0]
    base, eng = res.get(f"baseline_b{b0}", {}), res.get(f"sync_b{b0}", {})
    if dev.type != "cuda" or not n_params or "state_bytes" not in base or "state_bytes" not in eng:
        return
    bb, eb = base["state_bytes"] / n_params, eng["state_bytes"] / n_params
    res["state_bytes_per_param"] = {"baseline": bb, "engine": eb, "ratio": bb / eb if eb else float("nan")}
    # (d) free device memory / bytes per param; host RAM (measured now) / the engine's host
    # bytes per param (16 by its layout; its set-up peak is lower: scripts/bench_memory.py)
    free, total = torch.cuda.mem_get_info(dev)
    host = host_bytes()
    hb = max([16.0] + [res[k]["host_peak_B"] for k in res if k.startswith("dpu_b") and "host_peak_B" in res[k]])
    res["capacity_params"] = {"baseline_device_bound": total * 0.9 / bb, "engine_device_bound": total * 0.9 / eb,
                              "engine_host_bound": host * 0.9 / hb, "host_bytes_per_param": hb, "host_bytes": host}


if __name__ == "__main__":
    sys.exit(main())
