"""Which multi-rank path: FSDP2's ZeRO-2 (fully_shard, reshard_after_forward=False) under
OffloadAdamW against the engine's built-in ZeRO-2 (a plain model, the engine shards the
optimizer state and runs its own collectives), on 2 gloo ranks in the same launch.

    python scripts/bench_fsdp2.py                  # writes BENCHMARKS.md (bench_fsdp2)
    python scripts/bench_fsdp2.py --steps 8 --no-write
    python scripts/bench_fsdp2.py --checkpoint 0.3e9      # checkpoints at scale (bench_fsdp2_checkpoint)
    python scripts/bench_fsdp2.py --engine         # OffloadEngine's paths (bench_fsdp2_engine)

One byte-level GPT-2 from its config (no download), bf16 weights, the same text rows for
both paths (each rank its half of a fixed global batch), two param groups, clipping at
1.0, exact mode forced to sync on both (the update's time is then in every step alike).
The paths run in one launch, in the order builtin, fsdp2, fsdp2, builtin, so drift of
the machine's speed falls on both; a path's time is the median step (forward, backward,
clip, step) of rank 0 over both of its rounds, after WARMUP steps of each.  Bytes per
rank per step: host<->device from the engine's counters (the CPU device's zero-copy
weights move none up), and the collectives' bytes from what each path calls (computed
from the sizes, not measured).

--checkpoint N: a model that is nearly all one embedding table of N parameters (bf16,
fp32 state), on 2 gloo ranks, under the built-in path and then under FSDP2 (each in
the same launch): two steps, then save_checkpoint and load_checkpoint of the same
state, timed (FSDP2's checkpoint is the shared layout, runtime/fsdp2_checkpoint.py: each
rank's server writes and reads its rows of it); then, after 3 steps, a background save,
and the steps that run while it is written against the steady step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

SEED = 20261204
ROWS, SEQ = 8, 128  # the global batch; each rank its half
WARMUP = 3
ORDER = ["builtin", "fsdp2", "fsdp2-zero3", "fsdp2-zero3", "fsdp2", "builtin"]
PATHS = ("builtin", "fsdp2", "fsdp2-zero3")


def text_rows(step: int):
    import json as j, logging, os as o, torch
    data = b"".join(open(m.__file__, "rb").read() for m in (j, logging, o))
    g = torch.Generator().manual_seed(SEED + step)
    starts = torch.randint(0, len(data) - SEQ - 1, (ROWS,), generator=g)
    return torch.tensor([list(data[s:s + SEQ]) for s in starts.tolist()], dtype=torch.long)


def make_model(n_embd: int, n_layer: int):
    import torch
    import transformers
    torch.manual_seed(SEED)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer, n_head=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)


def run_path(path: str, args) -> dict:
    """One path's timed steps: OffloadAdamW on a model wrapped here for FSDP2's paths, or
    (--engine) OffloadEngine on the plain model."""
    import torch
    import torch.distributed as dist

    from zero_offload import OffloadAdamW, OffloadConfig, OffloadEngine
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(args.n_embd, args.n_layer)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    if args.engine:  # the path from expert.multi_rank: the library shards the model for FSDP2's
        how = {"builtin": "builtin", "fsdp2": "fsdp2-zero2", "fsdp2-zero3": "fsdp2-zero3"}[path]
        cfg = OffloadConfig(lr=1e-3, dtype="bf16", clip_grad_norm=1.0, server={"threads": 1},
                            expert={"exact_strategy": "sync", "multi_rank": how})
        opt = OffloadEngine(model, cfg, param_groups=[{"params": decay, "weight_decay": 0.1},
                                                      {"params": rest, "weight_decay": 0.0}])

        def train_step(loss):
            opt.backward(loss)
            opt.step()
    else:
        if path.startswith("fsdp2"):
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            zero3 = path == "fsdp2-zero3"
            for block in model.transformer.h:
                fully_shard(block, mp_policy=mp, reshard_after_forward=zero3)
            fully_shard(model, mp_policy=mp, reshard_after_forward=zero3)
            decay = [p for p in model.parameters() if p.dim() >= 2]  # (fully_shard replaced them)
            rest = [p for p in model.parameters() if p.dim() < 2]
        # "builtin" asks for the engine's own ZeRO-2 (the default on a plain model is FSDP2's)
        how = {"exact_strategy": "sync", **({"multi_rank": "builtin"} if path == "builtin" else {})}
        opt = OffloadAdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                           lr=1e-3, model=model, server={"threads": 1}, expert=how)

        def train_step(loss):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    per = ROWS // world
    times, losses = [], []
    for t in range(1, args.steps + 1):
        x = text_rows(t)[rank * per:(rank + 1) * per]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        train_step(loss)
        times.append(time.perf_counter() - t0)
        lt = loss.detach().float().reshape(1)
        dist.all_reduce(lt)
        losses.append(float(lt) / world)
    st = opt.stats()
    numel = sum(p.numel() for p in model.parameters())
    assert st["multi_rank"] == ("builtin" if path == "builtin" else "fsdp2"), st["multi_rank"]
    opt.close()
    return {"times": times[WARMUP:], "losses": losses, "numel": numel, "updates": st["updates"],
            "bytes_to_host": st["bytes_to_host"], "bytes_to_device": st["bytes_to_device"]}


def ckpt_path(path: str, args) -> dict:
    """One path's save and load at --checkpoint parameters (module docstring)."""
    import shutil

    import torch
    import torch.distributed as dist

    from bench_scale import Tables
    from zero_offload import OffloadAdamW
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    rows = int(args.checkpoint) // 64
    model = Tables(rows).to(torch.bfloat16)
    if path == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    opt = OffloadAdamW(model.parameters(), lr=1e-3, model=model, server={"threads": 1},
                       expert={"exact_strategy": "sync", **({"multi_rank": "builtin"} if path == "builtin" else {})})
    gen = torch.Generator().manual_seed(SEED + rank)
    for _ in range(2):
        model(torch.randint(0, rows, (8, 64), generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    d = os.path.join(args.worker, f"ck-{path}")
    dist.barrier()
    t0 = time.perf_counter()
    step_dir = opt.save_checkpoint(d)
    dist.barrier()
    save_s = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in Path(step_dir).glob("*.bin"))
    t0 = time.perf_counter()
    opt.load_checkpoint(d)
    dist.barrier()
    load_s = time.perf_counter() - t0

    def step() -> float:
        dist.barrier()
        t = time.perf_counter()
        model(torch.randint(0, rows, (8, 64), generator=gen)).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - t
    steady = statistics.median([step() for _ in range(3)])  # it trains on after the load
    # a background save: its return, then the steps while it is written (each step
    # polls it; it is published at the first that finds every rank's server done)
    t0 = time.perf_counter()
    opt.save_checkpoint(d, background=True)
    bg_return_s = time.perf_counter() - t0
    during = []
    while opt.engine.checkpoint_in_flight() and len(during) < 200:
        during.append(step())
    t1 = time.perf_counter()
    opt.wait_checkpoint()
    bg_total_s = time.perf_counter() - t0
    bg_wait_s = time.perf_counter() - t1
    out = {"params": sum(p.numel() for p in model.parameters()), "save_s": save_s, "load_s": load_s,
           "bytes": nbytes, "updates": opt.stats()["updates"] - len(during), "steady_s": steady,
           "bg_return_s": bg_return_s, "bg_total_s": bg_total_s, "bg_wait_s": bg_wait_s, "during": during}
    opt.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(d, ignore_errors=True)
    return out


def worker(args) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if args.checkpoint:
        order = ("fsdp2", "builtin") if args.fsdp2_first else ("builtin", "fsdp2")
        res = {p: ckpt_path(p, args) for p in order}
        if dist.get_rank() == 0:
            Path(args.worker, "rank0.json").write_text(json.dumps(res))
        dist.destroy_process_group()
        return
    res = {p: [] for p in ORDER}
    for path in ORDER:
        res[path].append(run_path(path, args))
    if dist.get_rank() == 0:
        Path(args.worker, "rank0.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def collective_bytes(path: str, n: int, world: int) -> float:
    """Bytes each rank sends per step in its collectives (ring algorithms): the built-in
    path all-reduces fp32 gradient buckets (2 (w-1)/w x 4 B) and all-gathers the bf16
    weights (w-1)/w x 2 B; FSDP2's ZeRO-2 all-gathers bf16 parameters once per step
    ((w-1)/w x 2 B: kept unsharded through backward) and reduce-scatters fp32 gradients
    ((w-1)/w x 4 B)."""
    f = (world - 1) / world
    if path == "builtin":
        return n * (2 * f * 4 + f * 2)
    gathers = 2 if path == "fsdp2-zero3" else 1  # ZeRO-3 gathers again for backward
    return n * (gathers * f * 2 + f * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--checkpoint", type=float, default=0.0,
                    help="time save and load at this many parameters instead (module docstring)")
    ap.add_argument("--dir", default="/var/tmp", help="where the checkpoints go (--checkpoint)")
    ap.add_argument("--fsdp2-first", action="store_true", help="--checkpoint: FSDP2's run before the built-in one")
    ap.add_argument("--nproc", type=int, default=2, help="gloo ranks")
    ap.add_argument("--engine", action="store_true",
                    help="OffloadEngine (engine.backward) on the plain model, the library sharding it for FSDP2's "
                         "paths, instead of OffloadAdamW on a model wrapped here (bench_fsdp2_engine)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from zero_offload.kernels import cpu_adam
    with tempfile.TemporaryDirectory(prefix="bench-fsdp2-", dir=args.dir if args.checkpoint else None) as out:
        cmd = [sys.executable, "-m", "zero_offload.launch", "--nproc-per-node", str(args.nproc), __file__,
               "--worker", out, "--steps", str(args.steps), "--n-embd", str(args.n_embd),
               "--n-layer", str(args.n_layer), "--checkpoint", str(args.checkpoint)] + \
            (["--fsdp2-first"] if args.fsdp2_first else []) + (["--engine"] if args.engine else [])
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        res = json.loads(Path(out, "rank0.json").read_text())
    print(json.dumps(res))  # the raw figures, whatever the report below makes of them
    if args.checkpoint:
        return report_checkpoint(res, args)
    world = args.nproc
    rows, med = [], {}
    for path in PATHS:
        runs = res[path]
        med[path] = statistics.median(t for r in runs for t in r["times"])
        r = runs[0]
        n = r["numel"]
        steps = r["updates"]
        rows.append((path, med[path], r["losses"][-1], r["bytes_to_host"] / steps / n,
                     r["bytes_to_device"] / steps / n, collective_bytes(path, n, world) / n))
        # the same path twice in one launch: the same losses (both deterministic)
        assert runs[0]["losses"] == runs[1]["losses"], path
    lb, lf = res["builtin"][0]["losses"], res["fsdp2"][0]["losses"]
    diff = max(abs(a - b) / abs(b) for a, b in zip(lf, lb))
    z3 = res["fsdp2-zero3"][0]["losses"]
    diff3 = max(abs(a - b) / abs(b) for a, b in zip(z3, lf))
    names = {"builtin": "built-in ZeRO-2 (plain model)", "fsdp2": "FSDP2 ZeRO-2 (reshard_after_forward=False)",
             "fsdp2-zero3": "FSDP2 ZeRO-3 (reshard_after_forward=True)"}
    lines = [f"Machine: {__import__('bench_md').machine_line()}; SIMD level {cpu_adam.simd_level()}, "
             f"OpenMP {cpu_adam.openmp_enabled()}; {world} gloo ranks on the CPU device, one server thread; "
             f"GPT-2 {args.n_embd}x{args.n_layer} bytes ({res['builtin'][0]['numel'] / 1e6:.1f}M params), "
             f"batch {ROWS}x{SEQ}, bf16, sync; median of {2 * (args.steps - WARMUP)} steps per path; "
             + ("OffloadEngine with engine.backward on the plain model, the path from expert.multi_rank (the "
                "library shards it for FSDP2's)." if args.engine else "OffloadAdamW, the model wrapped by the script "
                                                                      "for FSDP2's paths."),
             "",
             "| path | step (ms) | vs built-in | final loss | host B/param/step (down, up) | collectives B/param/step (computed) |",
             "|---|---|---|---|---|---|"]
    for path, t, loss, down, up, coll in rows:
        lines.append(f"| {names[path]} | {t * 1e3:.0f} | {med['builtin'] / t:.2f}x | {loss:.4f} | "
                     f"{down:.2f}, {up:.2f} | {coll:.1f} |")
    lines += ["", "B/param: bytes per rank per step over the model's parameters.  Host traffic is the same "
                  "2/world B/param down (each rank's 1/world in bf16); up, FSDP2's proxies live in the shared "
                  "segment on the CPU device (zero-copy; the copy into the local shards is a device-side "
                  "2/world B/param), while the built-in path copies its 1/world up and all-gathers the rest.",
              "", f"Losses of the two paths: at most {diff:.1e} apart (relative) over {args.steps} steps "
                  f"(FSDP2 reduces in fp32 per unit, the built-in path per bucket: the same sums in another order); "
                  f"FSDP2's ZeRO-3 against its ZeRO-2: {diff3:.1e}."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        from bench_md import update_section
        name = ("bench_fsdp2" if world == 2 else f"bench_fsdp2_{world}ranks") + ("_engine" if args.engine else "")
        flag = " --engine" if args.engine else ""
        who = "OffloadEngine: " if args.engine else ""
        update_section(name, f"## {who}FSDP2 against the built-in ZeRO-2, {world} ranks (bench_fsdp2.py --nproc "
                             f"{world}{flag})\n\n" + body)


def report_checkpoint(res: dict, args) -> None:
    from bench_md import machine_line, update_section
    from zero_offload.kernels import cpu_adam
    b, f = res["builtin"], res["fsdp2"]
    lines = [f"Machine: {machine_line()}; SIMD level {cpu_adam.simd_level()}; 2 gloo ranks on the CPU device, "
             f"one server thread; an embedding table of {b['params'] / 1e9:.2f}e9 parameters (bf16 weights, "
             f"fp32 state), 2 steps, then save_checkpoint and load_checkpoint of the same state (blocking), "
             f"page cache warm; one run.",
             "",
             "| path | checkpoint GB | save s | save GB/s | load s | load GB/s | save, load vs built-in |",
             "|---|---|---|---|---|---|---|"]
    for name, r in (("built-in ZeRO-2", b), ("FSDP2 (shared layout)", f)):
        gb = r["bytes"] / 1e9
        lines.append(f"| {name} | {gb:.2f} | {r['save_s']:.1f} | {gb / r['save_s']:.2f} | {r['load_s']:.1f} | "
                     f"{gb / r['load_s']:.2f} | {r['save_s'] / b['save_s']:.2f}x, {r['load_s'] / b['load_s']:.2f}x |")
    lines += ["", "Then, after 3 steady steps, a background save of the next state: its return, the steps while it "
              "is written (each polls it: published at the first that finds both servers done), against the "
              "steady step; wait_checkpoint at the end.", "",
              "| path | steady step s | save returns s | steps during it | median, slowest step during it | "
              "published after s |", "|---|---|---|---|---|---|"]
    for name, r in (("built-in ZeRO-2", b), ("FSDP2 (shared layout)", f)):
        dur = r["during"]
        med, worst = (statistics.median(dur), max(dur)) if dur else (0.0, 0.0)
        lines.append(f"| {name} | {r['steady_s']:.2f} | {r['bg_return_s']:.2f} | {len(dur)} | "
                     f"{med:.2f} ({med / r['steady_s']:.2f}x), {worst:.2f} ({worst / r['steady_s']:.2f}x) | "
                     f"{r['bg_total_s']:.1f} |")
    # 2 steps, the load (of step 2's state), 3 steps after it, and those during the background save
    assert b["updates"] == f["updates"] == 5, (b["updates"], f["updates"])
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        update_section("bench_fsdp2_checkpoint", "## FSDP2 checkpoints at scale (bench_fsdp2.py --checkpoint)\n\n"
                       + body)


if __name__ == "__main__":
    main()
