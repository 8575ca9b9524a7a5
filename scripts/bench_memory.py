"""Host RAM per parameter: what training with offload costs the host, at its peak and steadily.

    python scripts/bench_memory.py                    # 85M GPT, writes BENCHMARKS.md section "bench_memory"
    python scripts/bench_memory.py --layers 2 --d-model 128 --no-write
    python scripts/bench_memory.py --ds-python /tmp/dsvenv/bin/python   # adds DeepSpeed ZeRO-2 offload

Each variant runs in a fresh child process (peaks must not mix) that builds the
same GPT in fp32, wraps it, and trains a few steps.  A sampler thread reads,
every SAMPLE_INTERVAL_S, the private resident memory (RssAnon) of the child and
of every process it started (the optimizer server), plus the pages allocated to
shared-memory files that appeared in /dev/shm during the run, counted once.
Everything is reported per parameter, over what the process held before it
built the model (the interpreter, torch): so the user's own fp32 model (4 B/param)
is part of every variant's peak.

What the model states should take (B/param; the 'expected' column), the device being the CPU:
  baseline            torch mixed precision, AdamW on the host: fp32 master, m, v 12 + weights 2 + grads 2 = 16
  offload-sync        server master, m, v 12 + segment: one gradient slot 2 + two weights16 slots 4
                      (the model lives in one of them: zero-copy) = 18
  offload-sync-copy   12 + one gradient slot 2 + weights16 2, and the model's own 16-bit copy 2 = 18
  offload-dpu(-copy)  the same: DPU's next gradients wait, range by range, until the update
                      in flight has read that range of the one slot (dpu_grad_slots=2 adds 2)
  ...-bf16state       state_dtype="bf16": the server keeps a 2 B remainder of the exact master and
                      bf16 m, v (6 in all) instead of 12: 12 zero-copy, 12 copy (10 on a GPU machine)
  ...-int8state       state_dtype="int8": the remainder and int8 m, v with a scale per 256 (4.03):
                      10.03 (8.03 on a GPU machine)
The '-copy' rows have a GPU's layout: there the model's 2 B/param live on the
device, and the host keeps 16.  Everything above the
expected figure is the interpreter's and allocator's (freed memory the C
library keeps, autograd's gradient buffers).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

SAMPLE_INTERVAL_S = 0.002  # a sample costs ~0.1 ms (a few /proc reads): 5% of one core at most
CHILD_TIMEOUT_S = 600.0
VARIANTS = ("baseline", "offload-sync", "offload-sync-copy", "offload-dpu", "offload-dpu-copy",
            "offload-sync-bf16state", "offload-sync-copy-bf16state", "offload-dpu-copy-bf16state",
            "offload-sync-int8state", "offload-sync-copy-int8state", "offload-dpu-copy-int8state")
EXPECTED_B = {"baseline": 16, "offload-sync": 18, "offload-sync-copy": 18, "offload-dpu": 18, "offload-dpu-copy": 18,
              "offload-sync-bf16state": 12, "offload-sync-copy-bf16state": 12, "offload-dpu-copy-bf16state": 12,
              "offload-sync-int8state": 10.03, "offload-sync-copy-int8state": 10.03, "offload-dpu-copy-int8state": 10.03}
STATE_SUFFIXES = {"-bf16state": "bf16", "-int8state": "int8"}


def _status_kb(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    """Every descendant, including processes started by threads other than the main one."""
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        return kids
    return kids + [g for k in kids for g in _children(k)]


def _shm_bytes(names: set[str]) -> int:
    total = 0
    for n in names:
        try:
            total += os.stat(f"/dev/shm/{n}").st_blocks * 512  # pages actually allocated
        except OSError:
            pass
    return total


class HostSampler:
    """Peak and current host bytes of this process tree (private + new shared segments)."""

    def __init__(self):
        self.pid = os.getpid()
        self.shm_before = set(os.listdir("/dev/shm"))
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        anon = sum(_status_kb(p, "RssAnon:") for p in [self.pid] + _children(self.pid)) * 1024
        return anon + _shm_bytes(set(os.listdir("/dev/shm")) - self.shm_before)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(SAMPLE_INTERVAL_S)

    def start(self) -> "HostSampler":
        self._t.start()
        return self

    def reset_peak(self) -> None:
        self.peak = self.now()

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)


def child(variant: str, layers: int, d_model: int, steps: int) -> dict:
    import torch

    from zero_offload.demo.gpt import GPT, GPTConfig
    torch.set_num_threads(1)
    sampler = HostSampler().start()
    base = sampler.now()
    torch.manual_seed(0)
    mc = GPTConfig(n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model, seq_len=64)
    model = GPT(mc)
    n = model.num_params()
    built = sampler.now()
    sampler.reset_peak()
    if variant == "deepspeed":
        from bench_pipeline import run_deepspeed
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, mc.vocab_size, (1, mc.seq_len + 1), generator=gen)
        t0 = time.perf_counter()
        run_deepspeed(model, [(idx[:, :-1], idx[:, 1:])], steps, 0, "bf16")
        sampler.stop()
        return {"variant": variant, "params": n, "model_B": (built - base) / n, "peak_B": (sampler.peak - base) / n,
                "steady_B": float("nan"), "init_peak_B": float("nan"), "seconds": time.perf_counter() - t0}
    from zero_offload.demo.baseline import DeviceMixedPrecision
    from zero_offload.config import OffloadConfig
    from zero_offload.engine import OffloadEngine
    state, layout = "fp32", variant
    for suffix, dt in STATE_SUFFIXES.items():
        if variant.endswith(suffix):
            state, layout = dt, variant.removesuffix(suffix)
    cfg = OffloadConfig(lr=1e-4, dtype="bf16", mode="dpu" if layout.startswith("offload-dpu") else "exact",
                        server={"threads": 1}, expert={"dpu_warmup_steps": 1,
                                                       "cpu_zero_copy": not layout.endswith("-copy")}, state_dtype=state)
    t0 = time.perf_counter()
    eng = DeviceMixedPrecision(model, cfg) if variant == "baseline" else OffloadEngine(model, cfg)
    init_peak = sampler.peak
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, mc.vocab_size, (1, mc.seq_len + 1), generator=gen)
    for _ in range(steps):
        loss = model(idx[:, :-1], idx[:, 1:])
        eng.backward(loss)
        del loss
        eng.step()
    if hasattr(eng, "synchronize"):
        eng.synchronize()
    steady = sampler.now()
    peak = sampler.peak
    eng.close()
    sampler.stop()
    return {"variant": variant, "params": n, "model_B": (built - base) / n, "init_peak_B": (init_peak - base) / n,
            "peak_B": (peak - base) / n, "steady_B": (steady - base) / n, "seconds": time.perf_counter() - t0}


def run_child(py: str, variant: str, a) -> dict:
    cmd = [py, __file__, "--child", variant, "--layers", str(a.layers), "--d-model", str(a.d_model),
           "--steps", str(a.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["variant"] == "baseline"), None)
    out = ["| variant | model fp32 B/param | peak during set-up B/param | peak B/param | steady B/param "
           "| expected B/param | peak vs torch |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["peak_B"] / base["peak_B"] if base else float("nan")
        exp = EXPECTED_B.get(r["variant"])
        out.append(f"| {r['variant']} | {r['model_B']:.1f} | {r['init_peak_B']:.1f} | {r['peak_B']:.1f} | "
                   f"{r['steady_B']:.1f} | {exp if exp else '-'} | {ratio:.2f}x |")
    return "\n".join(out)


CAPACITY_HOSTS_GIB = (24, 128)
RAM_FRACTION = 0.9  # what the server's admission lets a shard take of MemAvailable (its default)


def capacity_table(rows: list[dict]) -> str:
    """The largest model a host trains, from each variant's measured steady B/param:
    RAM_FRACTION x the host's RAM over it (the CPU device: everything is host memory),
    and from the model states alone on a GPU machine (the '-copy' layout less the
    model's own 2 B/param, which live on the device there)."""
    out = ["| variant | steady B/param (measured, CPU device) | params on a 24 GiB host | on a 128 GiB host "
           "| host B/param on a GPU machine (model states) | params on 24 GiB | on 128 GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r["variant"]
        if not v.startswith("offload") or "-copy" not in v:
            continue
        gpu_b = EXPECTED_B[v] - 2
        cpu = [RAM_FRACTION * g * 2**30 / r["steady_B"] / 1e9 for g in CAPACITY_HOSTS_GIB]
        gpu = [RAM_FRACTION * g * 2**30 / gpu_b / 1e9 for g in CAPACITY_HOSTS_GIB]
        out.append(f"| {v} | {r['steady_B']:.1f} | {cpu[0]:.2f}B | {cpu[1]:.1f}B | {gpu_b:g} | {gpu[0]:.2f}B | "
                   f"{gpu[1]:.1f}B |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ds-python", default="", help="a Python with deepspeed installed: adds its column")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    ap.add_argument("--rows", default="", help="a file of the JSON rows an earlier run printed: write its tables "
                                                "again (with the capacity table) without measuring")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.layers, a.d_model, a.steps)))
        return 0
    rows = []
    if a.rows:
        rows = [json.loads(line) for line in Path(a.rows).read_text().splitlines() if line.startswith("{")]
    for v in ([] if a.rows else a.variants.split(",")):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        rows.append(run_child(sys.executable, v, a))
        print(json.dumps(rows[-1]), flush=True)
    if a.ds_python:
        rows.append(run_child(a.ds_python, "deepspeed", a))
        print(json.dumps(rows[-1]), flush=True)
    body = table(rows) + ("\n\nCapacity: the largest model each state dtype trains on a host, from the steady "
                          f"B/param above, at the server's default admission of {RAM_FRACTION:.0%} of the RAM "
                          "(the CPU device; and a GPU machine's host, which keeps the model states alone).\n\n"
                          + capacity_table(rows))
    print(body)
    if not a.no_write:
        from bench_md import machine_line, update_section
        n = rows[0]["params"]
        update_section("bench_memory", "## Host RAM per parameter (scripts/bench_memory.py)\n\n"
                       f"{machine_line()}; GPT of {n / 1e6:.1f}M parameters built in fp32, bf16 training, "
                       f"{a.steps} steps at batch 1x64; the device is the CPU, so 'host' is all of it. Bytes over "
                       f"what the process held before it built the model, sampled every "
                       f"{SAMPLE_INTERVAL_S * 1e3:.0f} ms: private memory of the worker and the server plus "
                       f"the shared segments, counted once.\n\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
