"""Fingerprints of fixed-seed training runs, to show that a refactor changes no bytes.

    python scripts/fingerprint.py -o before.json      # before the change
    python scripts/fingerprint.py -o after.json       # after it
    python scripts/fingerprint.py --compare before.json after.json

Each scenario trains a small GPT (runtime.demo.gpt) on fixed random tokens for a
few steps, saves a checkpoint and records the SHA-256 of every loss, of the fp32
master, of each optimizer-state array (m, v, ...) and of the device's 16-bit
weights.  Scenarios: synchronous, DPU with and without prediction, DPU with two
gradient slots, the copy path (no zero-copy), fp16 with an overflow skip and
accumulation, Lion and Adagrad, resume from a mid-run checkpoint, and 2 ranks
(gloo, through the launcher) synchronous and DPU.  The hashes are of this
machine's arithmetic: compare runs made on the same machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SCENARIOS = {
    "sync": dict(dtype="bf16", clip_grad_norm=1.0),
    "dpu": dict(dtype="bf16", dpu=True, dpu_warmup_steps=3),
    "dpu_predict": dict(dtype="bf16", dpu=True, dpu_warmup_steps=3, dpu_predict=1.0, clip_grad_norm=0.5),
    "dpu_two_slots": dict(dtype="bf16", dpu=True, dpu_warmup_steps=3, dpu_grad_slots=2),
    "copy_path_dpu": dict(dtype="bf16", dpu=True, dpu_warmup_steps=3, cpu_zero_copy=False),
    "fp16_overflow_accum": dict(dtype="fp16", grad_accumulation_steps=2, dpu=True, dpu_warmup_steps=5),
    "lion": dict(dtype="bf16", optimizer="lion", lr=1e-4),
    "adagrad": dict(dtype="bf16", optimizer="adagrad", lr=1e-2),
    "bf16_state_dpu": dict(dtype="bf16", state_dtype="bf16", dpu=True, dpu_warmup_steps=3),
    "bf16_state_fp16": dict(dtype="fp16", state_dtype="bf16"),
    "int8_state": dict(dtype="bf16", state_dtype="int8", clip_grad_norm=1.0),
    "int8_state_lion": dict(dtype="bf16", state_dtype="int8", optimizer="lion", lr=1e-4),
    "bf16_state_lion": dict(dtype="bf16", state_dtype="bf16", optimizer="lion", lr=1e-4),
}
STEPS = 10
OVERFLOW_STEP = 4  # fp16_overflow_accum: an inf gradient at this step


def sha(b) -> str:
    if isinstance(b, torch.Tensor):
        b = b.detach().contiguous().view(torch.uint8).numpy().tobytes() if b.dtype != torch.float32 else \
            b.detach().contiguous().numpy().tobytes()
    elif isinstance(b, np.ndarray):
        b = b.tobytes()
    return hashlib.sha256(b).hexdigest()[:16]


def make_model():
    try:
        from zero_offload.demo.gpt import GPT, GPTConfig
    except ImportError:  # before the demo moved apart from the library
        from zero_offload.demo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=32))


def batch(step: int, rank: int = 0, world: int = 1, bs: int = 8):
    g = torch.Generator().manual_seed(1000 * step)
    idx = torch.randint(0, 256, (bs, 33), generator=g)
    n = bs // world
    idx = idx[rank * n:(rank + 1) * n]
    return idx[:, :-1], idx[:, 1:]


def config(**kw):
    from zero_offload import OffloadConfig
    base = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), server_threads=1, bucket_numel=8192,
                progress_block_numel=1000, staging_numel=3000)
    base.update(kw)
    if "expert" in OffloadConfig.__dataclass_fields__:
        # the grouped config: the scenarios' flat names go to their groups (mode="exact"
        # with its default strategy, "auto", where the scenario is not DPU: the runs
        # before the groups were synchronous, and auto must give their bits)
        from zero_offload.config import DEPRECATED
        groups: dict = {}
        for k in [k for k in base if k in DEPRECATED]:
            group, name = DEPRECATED[k]
            groups.setdefault(group, {})[name] = base.pop(k)
        base["mode"] = "dpu" if base.pop("dpu", False) else "exact"
        groups.setdefault("expert", {}).setdefault("compute_dtype", base.get("dtype", "fp16"))
        return OffloadConfig(**base, **groups)
    if "compute_dtype" in OffloadConfig.__dataclass_fields__:
        # the 16-bit compute path on every machine (auto picks fp32 on a CPU without
        # native 16-bit matmul), so runs before and after that field compare
        base.setdefault("compute_dtype", base.get("dtype", "fp16"))
    return OffloadConfig(**base)


def train(engine, first: int, last: int, rank: int = 0, world: int = 1, overflow: bool = False) -> list[str]:
    losses = []
    model = engine.model
    for t in range(first, last + 1):
        for micro in range(engine.cfg.grad_accumulation_steps):
            x, y = batch(100 * t + micro, rank, world)
            h = None
            if overflow and t == OVERFLOW_STEP and micro == 0:
                h = model.head.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            loss = model(x, y)
            engine.backward(loss)
            if h is not None:
                h.remove()
            losses.append(sha(np.float32(float(loss.detach()))))
        engine.step()
    return losses


def state_hashes(engine, ckpt: Path) -> dict:
    """Hashes of master, optimizer state (from the server's checkpoint files) and device weights."""
    d = Path(engine.save_checkpoint(str(ckpt)))
    out = {}
    for man in sorted(d.glob("shard-r*-of-*.json")):
        m = json.loads(man.read_text())
        raw = np.fromfile(man.with_suffix(".bin"), np.float32)
        n = m["numel"]
        for i, name in enumerate(m["arrays"]):
            out[f"{man.stem}.{name}"] = sha(raw[i * n:(i + 1) * n])
    for f in sorted(d.glob("device16-r*.bin")) + sorted(d.glob("pending16-r*.bin")):
        out[f.stem] = sha(f.read_bytes())
    # (several ranks on FSDP2: this rank's local shards)
    out["flat16"] = sha(torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                                   for p in engine.model.parameters()]))
    return out


def one(name: str, tmp: Path) -> dict:
    from zero_offload import OffloadEngine
    kw = SCENARIOS[name]
    model = make_model()
    with OffloadEngine(model, config(**kw)) as eng:
        losses = train(eng, 1, STEPS, overflow=name == "fp16_overflow_accum")
        res = {"losses": losses, **state_hashes(eng, tmp / name), "stats": _stats(eng)}
    return res


def resume(tmp: Path) -> dict:
    """DPU with prediction: 6 steps, save (mid-DPU: an update has landed that the
    device does not have yet), then a fresh engine loads it and trains 6 more."""
    from zero_offload import OffloadEngine
    kw = SCENARIOS["dpu_predict"]
    with OffloadEngine(make_model(), config(**kw)) as eng:
        losses = train(eng, 1, 6)
        eng.save_checkpoint(str(tmp / "resume"))
    with OffloadEngine(make_model(), config(**kw)) as eng:
        eng.load_checkpoint(str(tmp / "resume"))
        losses += train(eng, 7, 12)
        return {"losses": losses, **state_hashes(eng, tmp / "resume-end"), "stats": _stats(eng)}


def _stats(eng) -> dict:
    s = eng.stats()
    return {k: s[k] for k in ("steps", "updates", "skipped_steps", "loss_scale", "bytes_to_host", "bytes_to_device")}


def worker(out: str, mode: str) -> None:
    """One rank of the 2-rank scenarios (under the launcher)."""
    import torch.distributed as dist
    from zero_offload import OffloadEngine
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = SCENARIOS["sync" if mode == "sync" else "dpu"]
    with OffloadEngine(make_model(), config(**kw)) as eng:
        losses = train(eng, 1, STEPS, rank, world)
        res = {"losses": losses, **state_hashes(eng, Path(out) / mode), "stats": _stats(eng)}
    Path(out, f"{mode}-rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def two_ranks(mode: str, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", "2", "--server-threads", "1",
           str(Path(__file__).resolve()), "--worker", str(tmp), mode]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode != 0:
        raise RuntimeError(f"2-rank {mode} failed:\n{p.stdout}\n{p.stderr}")
    return {f"rank{r}": json.loads((tmp / f"{mode}-rank{r}.json").read_text()) for r in range(2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--out", default="")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--worker", nargs=2, metavar=("DIR", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    if a.compare:
        x, y = (json.loads(Path(f).read_text()) for f in a.compare)
        bad = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        for k in bad:
            print(f"DIFFERENT: {k}\n  {x.get(k)}\n  {y.get(k)}")
        print(f"{len(set(x) | set(y)) - len(bad)} scenarios equal, {len(bad)} different")
        return 1 if bad else 0
    torch.set_num_threads(1)
    res = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for name in SCENARIOS:
            res[name] = one(name, tmp)
            print(name, "done", flush=True)
        res["resume"] = resume(tmp)
        for mode in ("sync", "dpu"):
            res[f"2ranks_{mode}"] = two_ranks(mode, tmp)
            print(f"2ranks_{mode} done", flush=True)
    text = json.dumps(res, indent=1, sort_keys=True)
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
