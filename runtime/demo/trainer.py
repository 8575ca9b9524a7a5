"""The GPT training loop behind scripts/train_gpt.py and scripts/convergence.py.

One function, ``train(TrainConfig)``, that builds the model, the corpus and the
engine (OffloadEngine, or the plain-PyTorch baseline with offload=False), runs
the steps with a progress bar, evaluates periodically, checkpoints, and returns
the loss history and timings.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .baseline import DeviceMixedPrecision
from ..config import OffloadConfig
from .data import Batches, Corpus
from ..engine import OffloadEngine
from .gpt import GPT, PRESETS, GPTConfig
from .schedule import WarmupCosine


@dataclass(kw_only=True)
class TrainConfig:
    """model: a preset of runtime.demo.gpt.PRESETS; n_layer/n_head/d_model override it.
    warmup: lr warm-up updates; lr decays by cosine to min_lr_ratio x lr at `steps`.
    dpu_predict: weight prediction under DPU (1.0: the measured default that keeps DPU's
        loss cost under 2% at lr 3e-4; 0 = the paper's plain DPU).
    exact_strategy: with dpu=False (mode="exact"): the engine's expert.exact_strategy
        ("auto": it measures and picks; or "sync", "overlap_update", "speculation",
        "overlap_update+speculation").
    undo_log_bytes: with dpu=False: the engine's expert.undo_log_bytes (0: its default,
        what a whole update needs where that fits).
    state_dtype: the engine's state_dtype ("bf16": 6 B/param of optimizer state on the
        host instead of 12, the exact master where the weights are bf16 and dpu_predict 0;
        "int8": 4 B/param, block-wise 8-bit moments).
    multi_rank: under a launcher, the engine's expert.multi_rank ("auto": FSDP2 ZeRO-2;
        "fsdp2-zero3"; "builtin": the engine's own ZeRO-2).
    offload: False runs the baseline (fp32 master + torch AdamW on the device);
        with simulate_dpu the baseline follows the DPU schedule in plain PyTorch.
    threads: torch intra-op threads of this worker (0 = leave torch's default).
    resume: continue from ckpt_dir's latest checkpoint (it must exist).
    auto_resume: continue from it if there is one, else start fresh: what a run under
        `zero-offload-launch --max-restarts N` wants, so a restart picks up where the
        last checkpoint left off.
    eval_every: validation every K steps (0 = only at the end) over eval_batches batches."""
    model: str = "cpu-mini"
    n_layer: int = 0
    n_head: int = 0
    d_model: int = 0
    steps: int = 160           # with seq_len 64: the README's main job, under a minute on 2 AVX2 cores
    batch_size: int = 8
    seq_len: int = 64
    device: str = "auto"
    dtype: str = "bf16"
    offload: bool = True
    dpu: bool = True
    dpu_warmup: int = 40
    dpu_predict: float = 1.0
    exact_strategy: str = "auto"
    undo_log_bytes: int = 0
    state_dtype: str = "fp32"
    multi_rank: str = "auto"
    grad_accum: int = 1
    clip: float | None = 1.0
    lr: float = 3e-4
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    ckpt_dir: str = ""
    ckpt_every: int = 0
    resume: bool = False
    auto_resume: bool = False
    trace_dir: str = ""
    seed: int = 0
    log_json: str = ""
    eval_every: int = 40
    eval_batches: int = 8
    server_threads: int = 1
    threads: int = 0
    progress: bool = True
    simulate_dpu: bool = False

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {sorted(PRESETS)}, got {self.model!r}")
        for f in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if (self.resume or self.auto_resume) and not self.ckpt_dir:
            raise ValueError("resume needs ckpt_dir (the checkpoint to resume from)")
        if self.auto_resume and not self.offload:
            raise ValueError("auto_resume needs offload (the baseline writes no checkpoints)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name} asked for CUDA but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
                           f"use --device cpu or install a CUDA build of torch")
    return torch.device(name)


def model_config(tc: TrainConfig) -> GPTConfig:
    L, H, D = PRESETS[tc.model]
    return GPTConfig(n_layer=tc.n_layer or L, n_head=tc.n_head or H, d_model=tc.d_model or D, seq_len=tc.seq_len)


def make_engine(tc: TrainConfig, model: torch.nn.Module, total_updates: int, device: torch.device):
    """The model arrives in fp32 on the CPU.  Offload: only its 16-bit weights go to the
    device (a model whose fp32 copy would not fit there still trains).  Baseline: all of it."""
    sched = WarmupCosine(peak=tc.lr, warmup=tc.warmup, total=total_updates, min_ratio=tc.min_lr_ratio)
    expert = dict(dpu_warmup_steps=tc.dpu_warmup, dpu_predict=tc.dpu_predict, trace_dir=tc.trace_dir,
                  multi_rank=tc.multi_rank)
    if not tc.dpu:
        expert["exact_strategy"] = tc.exact_strategy
        if tc.undo_log_bytes:
            expert["undo_log_bytes"] = tc.undo_log_bytes
    oc = OffloadConfig(lr=sched, betas=(tc.beta1, tc.beta2), weight_decay=tc.weight_decay, dtype=tc.dtype,
                       clip_grad_norm=tc.clip, grad_accumulation_steps=tc.grad_accum,
                       mode="dpu" if tc.dpu else "exact", state_dtype=tc.state_dtype,
                       server={"threads": tc.server_threads}, expert=expert, device=str(device))
    if tc.offload:
        return OffloadEngine(model, oc)
    return DeviceMixedPrecision(model.to(device), oc, simulate_dpu=tc.simulate_dpu)


def init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size).  Under a launcher (WORLD_SIZE > 1) this makes the process
    group, as deepspeed.init_distributed does: gloo on the CPU, NCCL on GPUs (each
    rank on its node-local GPU), so the N workers train one model together."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list) -> float:
    was = model.training
    model.eval()
    losses = [float(model(x, y)) for x, y in batches]
    model.train(was)
    return sum(losses) / len(losses)


def train(tc: TrainConfig) -> dict:
    if tc.threads:
        torch.set_num_threads(tc.threads)
    device = resolve_device(tc.device)
    rank, world = init_distributed(device)
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and not tc.offload:
        raise ValueError("the no-offload baseline runs on one rank; drop --no-offload or the launcher")
    corpus = Corpus.load(seed=tc.seed)
    torch.manual_seed(tc.seed)  # the same initial model on every rank
    mc = model_config(tc)
    model = GPT(mc)
    n_params = model.num_params()
    # each rank draws its own batches: the step's batch is world x batch_size sequences
    train_b = Batches(corpus.train, tc.batch_size, tc.seq_len, seed=tc.seed + 1 + 1000 * rank, device=device)
    val_src = Batches(corpus.val, tc.batch_size, tc.seq_len, seed=tc.seed + 2, device=device)
    val_batches = [val_src.next() for _ in range(tc.eval_batches)]
    engine = make_engine(tc, model, tc.steps, device)
    if tc.log_json:
        Path(tc.log_json).parent.mkdir(parents=True, exist_ok=True)
    log = open(tc.log_json, "a") if tc.log_json and rank == 0 else None
    history = {"step": [], "loss": [], "val_step": [], "val_loss": [], "step_s": [], "wait_s": []}
    start = 1
    try:
        if tc.resume or (tc.auto_resume and OffloadEngine.has_checkpoint(tc.ckpt_dir)):
            engine.load_checkpoint(tc.ckpt_dir)
            print(f"resumed from {engine.resolve_checkpoint(tc.ckpt_dir)} at step {engine.iteration}",
                  file=sys.stderr, flush=True)
            start = engine.iteration + 1
            for _ in range((start - 1) * tc.grad_accum):  # replay the data stream to where it stopped
                train_b.next()
        tokens_per_step = tc.batch_size * tc.seq_len * tc.grad_accum
        bar = None
        if tc.progress and rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=tc.steps, initial=start - 1, desc=f"{'offload' if tc.offload else 'baseline'}"
                       f"{'+dpu' if tc.offload and tc.dpu else ''} {n_params / 1e6:.1f}M", file=sys.stderr,
                       dynamic_ncols=True)
        t_run = time.perf_counter()
        for step in range(start, tc.steps + 1):
            t0_ns = time.perf_counter_ns()
            t0 = time.perf_counter()
            w0 = engine.stats()["wait_s"]
            for _ in range(tc.grad_accum):
                x, y = train_b.next()
                with engine.tracer.span("forward"):
                    loss = model(x, y)
                engine.backward(loss)
            engine.step()
            loss_v = float(loss.detach())
            dt = time.perf_counter() - t0
            engine.tracer.add("iteration", t0_ns, time.perf_counter_ns(), {"step": step})
            wait = engine.stats()["wait_s"] - w0
            history["step"].append(step)
            history["loss"].append(loss_v)
            history["step_s"].append(dt)
            history["wait_s"].append(wait)
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"loss is {loss_v} at step {step}; lower --lr or use --dtype bf16")
            rec = {"step": step, "loss": loss_v, "tokens_per_s": tokens_per_step / dt, "step_s": dt,
                   "wait_s": wait, "lr": engine.cfg.lr_at(max(1, engine.updates))}
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                vl = evaluate(model, val_batches)
                history["val_step"].append(step)
                history["val_loss"].append(vl)
                rec["val_loss"] = vl
                if bar is not None:
                    bar.write(f"step {step}: val loss {vl:.4f}")
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss_v:.3f}", tok_s=f"{tokens_per_step / dt:.0f}", step_ms=f"{dt * 1e3:.0f}")
                bar.update(1)
            if tc.ckpt_dir and tc.ckpt_every and step % tc.ckpt_every == 0:
                engine.save_checkpoint(tc.ckpt_dir, background=True)  # published at a later step
        if tc.ckpt_dir and tc.offload:
            engine.wait_checkpoint()
            engine.save_checkpoint(tc.ckpt_dir)
        run_s = time.perf_counter() - t_run
        if bar is not None:
            bar.close()
        stats = engine.stats()
    finally:
        engine.close()
        if log:
            log.close()
        if world > 1:
            dist.destroy_process_group()
    n = len(history["step_s"])
    steady = sorted(history["step_s"][n // 4:]) or [float("nan")]
    summary = {"params": n_params, "steps": tc.steps, "final_loss": history["loss"][-1] if n else float("nan"),
               "final_val_loss": history["val_loss"][-1] if history["val_loss"] else float("nan"),
               "median_step_s": steady[len(steady) // 2], "run_s": run_s,
               "tokens_per_s": tokens_per_step / steady[len(steady) // 2], "stats": stats,
               "rank": rank, "world_size": world, "config": {k: v for k, v in asdict(tc).items()}}
    return {"history": history, "summary": summary}
