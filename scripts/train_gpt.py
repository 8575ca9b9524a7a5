"""Train a byte-level GPT on the Python standard library's source, with ZeRO-Offload.

    python scripts/train_gpt.py                       # CPU defaults: under a minute on 2 cores
    python scripts/train_gpt.py --no-offload          # the plain-PyTorch baseline
    python scripts/train_gpt.py --device cuda --model gpt2 --batch-size 16 --seq-len 1024 --dtype fp16

Defaults: 3.2M-parameter GPT (cpu-mini), bf16, DPU with weight prediction after 40 warm-up
steps (costs 0.8% validation loss at these settings, see BENCHMARKS.md), lr 3e-4 with
20 warm-up updates and cosine decay, clip 1.0, one core for the optimizer server.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_offload.demo.gpt import PRESETS  # noqa: E402
from zero_offload.config import EXACT_STRATEGIES, MULTI_RANK  # noqa: E402
from zero_offload.demo.trainer import TrainConfig, train  # noqa: E402
from zero_offload.exact_mode import strategy_of  # noqa: E402


def parse(argv=None) -> TrainConfig:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=d.model, choices=sorted(PRESETS), help="model size preset")
    ap.add_argument("--n-layer", type=int, default=0, help="override the preset's layers")
    ap.add_argument("--n-head", type=int, default=0, help="override the preset's heads")
    ap.add_argument("--d-model", type=int, default=0, help="override the preset's width")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=d.dtype, choices=["fp16", "bf16"])
    ap.add_argument("--dpu", action=argparse.BooleanOptionalAction, default=d.dpu,
                    help="one-step delayed parameter update")
    ap.add_argument("--dpu-warmup", type=int, default=d.dpu_warmup, help="synchronous steps before DPU")
    ap.add_argument("--dpu-predict", type=float, default=d.dpu_predict,
                    help="weight prediction under DPU (0: plain DPU as in the paper)")
    ap.add_argument("--exact-strategy", default=d.exact_strategy,
                    choices=EXACT_STRATEGIES,
                    help="with --no-dpu (mode exact, bitwise synchronous): how the CPU update is hidden; auto: "
                         "the engine measures the candidates and keeps the fastest")
    ap.add_argument("--overlap-update", action="store_true",
                    help="short for --exact-strategy overlap_update (with --undo-log-bytes: "
                         "overlap_update+speculation)")
    ap.add_argument("--undo-log-bytes", type=int, default=d.undo_log_bytes,
                    help="speculation during backward, with an undo log of this many bytes of host RAM "
                         "(with --no-dpu; alone it means --exact-strategy speculation)")
    ap.add_argument("--state-dtype", default=d.state_dtype, choices=["fp32", "bf16", "int8"],
                    help="optimizer state on the host: bf16 moments and the exact master, 10 B/param instead of 16; "
                         "int8 moments, 8 B/param (the exact master needs --dtype bf16 and --dpu-predict 0 or --no-dpu)")
    ap.add_argument("--multi-rank", default=d.multi_rank, choices=MULTI_RANK,
                    help="under a launcher: auto (FSDP2 ZeRO-2; the engine's own ZeRO-2 for int8 state and "
                         "overlap_update), fsdp2-zero2, fsdp2-zero3, or builtin (the engine's own ZeRO-2)")
    ap.add_argument("--no-offload", dest="offload", action="store_false",
                    help="baseline: fp32 master + torch AdamW on the device")
    ap.add_argument("--grad-accum", type=int, default=d.grad_accum)
    ap.add_argument("--clip", type=float, default=d.clip, help="global grad-norm clip (0 = off)")
    ap.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=d.warmup, help="lr warm-up updates")
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--beta1", type=float, default=d.beta1)
    ap.add_argument("--beta2", type=float, default=d.beta2)
    ap.add_argument("--ckpt-dir", default="", help="save a checkpoint here at the end (and every --ckpt-every)")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="resume from --ckpt-dir")
    ap.add_argument("--auto-resume", action="store_true",
                    help="resume from --ckpt-dir if it holds a checkpoint, else start fresh (for --max-restarts)")
    ap.add_argument("--trace-dir", default=os.environ.get("ZERO_OFFLOAD_TRACE_DIR", ""),
                    help="write per-process Chrome traces here (under zero-offload-launch, give the launcher "
                         "--trace-dir so its optimizer server traces too)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--log-json", default="", help="append one JSON line per step here")
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches per evaluation")
    ap.add_argument("--server-threads", type=int, default=d.server_threads, help="optimizer server threads")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of the worker (0: cores minus the server's, or every core below 4 cores)")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    a = ap.parse_args(argv)
    # below 4 cores the worker shares the server's: this model's update is a few percent of
    # a step (and overlaps it under DPU), so a core kept for it would idle most of the time
    # and halve the forward and backward on 2 cores (775 -> 443 ms a step, 2-core AVX2)
    cores = os.cpu_count() or 2
    threads = a.threads or (cores if cores < 4 else max(1, cores - (a.server_threads if a.offload else 0)))
    strategy = a.exact_strategy
    if a.overlap_update or a.undo_log_bytes:
        strategy = strategy_of(a.overlap_update, a.undo_log_bytes)
    try:
        return TrainConfig(model=a.model, n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, steps=a.steps,
                           batch_size=a.batch_size, seq_len=a.seq_len, device=a.device, dtype=a.dtype,
                           offload=a.offload, dpu=a.dpu, dpu_warmup=a.dpu_warmup, dpu_predict=a.dpu_predict,
                           state_dtype=a.state_dtype, multi_rank=a.multi_rank, grad_accum=a.grad_accum,
                           exact_strategy=strategy, undo_log_bytes=a.undo_log_bytes,
                           clip=a.clip or None, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                           beta1=a.beta1, beta2=a.beta2, ckpt_dir=a.ckpt_dir, ckpt_every=a.ckpt_every,
                           resume=a.resume, auto_resume=a.auto_resume, trace_dir=a.trace_dir, seed=a.seed, log_json=a.log_json,
                           eval_every=a.eval_every, eval_batches=a.eval_batches, server_threads=a.server_threads, threads=threads,
                           progress=a.progress)
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> int:
    tc = parse(argv)
    try:
        out = train(tc)
    except KeyboardInterrupt:
        # engine.close() has stopped the private server (on its way out of train)
        print("train_gpt.py: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        if "CUDA" in str(e):
            print(f"train_gpt.py: {e}", file=sys.stderr)
            return 2
        raise
    s = out["summary"]
    if s["rank"] != 0:
        return 0  # rank 0 reports for the job
    print(f"done: {s['params'] / 1e6:.2f}M params, {s['steps']} steps on {s['world_size']} rank(s), final loss {s['final_loss']:.4f}, "
          f"val loss {s['final_val_loss']:.4f}, {s['tokens_per_s']:.0f} tokens/s, "
          f"median step {s['median_step_s'] * 1e3:.0f} ms, waited on optimizer {s['stats']['wait_s']:.2f} s, "
          f"skipped {s['stats']['skipped_steps']}")
    print(json.dumps({k: v for k, v in s.items() if k != "config"}, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
