"""Step time of the whole pipeline: no offload vs offload sync vs DPU vs overlap_update (vs DeepSpeed).

    python scripts/bench_pipeline.py                        # 10.8M GPT, batches 8x128 and 1x32
    python scripts/bench_pipeline.py --batches 2x64 --steps 10 --passes 1 --no-write

All variants run in one process, interleaved pass by pass in a shuffled order
(machine drift and warm-up effects hit them alike), on the same model, data and seed.  On a 2-core machine the
optimizer server gets core 0 and the worker core 1 (the baseline also runs on
core 1, one thread), and that is printed.  From the traces of the synchronous
run: T_fb = forward + backward, T_cpu = the CPU path (the step: norm check,
signal, waiting for the update, weight copy; the gradient copies run inside
backward's hooks and are counted in T_fb).  DPU's ideal is max(T_fb, T_cpu),
synchronous offload's is T_fb + T_cpu.  Writes BENCHMARKS.md section "bench_pipeline".

    python scripts/bench_pipeline.py --state-dtypes --settings gpt2:1x2   # section "bench_pipeline_state"

runs sync, DPU and overlap_update with fp32, bf16 and int8 optimizer state (the
"-bf16state" and "-int8state" variants: the exact master in sync and overlap; DPU
predicts, so its master stays fp32 and only the moments are compact), interleaved
the same way.

    python scripts/bench_pipeline.py --speculation --settings small-cpu:1x4   # section "bench_pipeline_speculation"

runs sync, overlap_update and DPU, and overlap_update and sync with speculation during
backward (undo_log_bytes: "-spec"), without clipping and with clip_grad_norm 1.0 (which
fires on every step at these models' norms, so every speculation rolls back and the
back-off takes over), with fp32 and int8 state; it also reports what share of the
shard each step kept from speculation, and the waits that remain.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_md import machine_line, update_section  # noqa: E402
from zero_offload.demo.baseline import DeviceMixedPrecision  # noqa: E402
from zero_offload.config import OffloadConfig  # noqa: E402
from zero_offload.demo.data import Batches, Corpus  # noqa: E402
from zero_offload.engine import OffloadEngine  # noqa: E402
from zero_offload.exact_mode import strategy_of  # noqa: E402
from zero_offload.demo.gpt import GPT, GPTConfig  # noqa: E402
from zero_offload.trace_analysis import load  # noqa: E402


def pin(pid: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(pid, cores)
    except (AttributeError, OSError):
        pass


# Variants that run in one process use the whole machine (both cores), as a user
# of them would; ours splits it: the worker on one core, the server on the other.
# "baseline-1core" is the no-offload run with exactly our worker's compute.
# "dpu-shared": DPU with the worker on both cores too (2 threads) and the server
# unpinned, the set-up for a CPU device when forward/backward dominates.
# The weights' way up, A/B/C (runtime/weights_up.py): the plain names keep the CPU
# device's zero-copy weights (the model lives in the shared segment, landing is a
# swap); "*-copy" copies them as a GPU must, block by block as the server publishes
# them; "*-after" copies them in one piece after DONE (overlap_weights_up=False).
# "dpu-2slots": a second gradient slot, so backward never waits for the update in
# flight (the default one slot makes each range wait until the update has passed it).
# "overlap": overlap_update, bitwise sync, the update during the next forward
# (runtime/overlap.py); "overlap-copy" with the weights copied as a GPU must;
# "overlap-shared" with the worker on both cores, as "dpu-shared".
WHOLE_MACHINE = {"baseline", "deepspeed", "dpu-shared", "overlap-shared"}


def run_variant(name, mc, batches, steps, warm, dtype, dpu_warmup, worker_cores, server_cores, trace_dir="",
                stats_out=None):
    all_cores = worker_cores | server_cores
    cores = all_cores if name in WHOLE_MACHINE else worker_cores
    pin(0, cores)
    torch.set_num_threads(len(cores))
    torch.manual_seed(0)
    model = GPT(mc)
    state = "fp32"
    for dt in ("bf16", "int8"):
        if name.endswith(f"-{dt}state"):
            state, name = dt, name.removesuffix(f"-{dt}state")
    clip = 1.0
    if name.endswith("-noclip"):
        clip, name = None, name.removesuffix("-noclip")
    undo = 0
    if name.endswith("-spec"):  # speculation: an undo log for the whole model's state
        undo, name = 1 << 32, name.removesuffix("-spec")
    dpu = name.startswith("dpu")
    overlap = name.startswith("overlap")
    expert = dict(dpu_warmup_steps=dpu_warmup, dpu_predict=1.0 if dpu else 0.0,
                  overlap_weights_up=not name.endswith("-after"), cpu_zero_copy=not name.endswith(("-copy", "-after")),
                  dpu_grad_slots=2 if name == "dpu-2slots" else 1, trace_dir=trace_dir)
    if not dpu:  # mode="exact": the variant names its strategy ("exact" alone: the engine picks)
        expert["exact_strategy"] = "auto" if name.startswith("exact") else strategy_of(overlap, undo)
        if undo:
            expert["undo_log_bytes"] = undo
    cfg = OffloadConfig(lr=3e-4, weight_decay=0.1, dtype=dtype, mode="dpu" if dpu else "exact", state_dtype=state,
                        server={"threads": len(server_cores) or 1}, clip_grad_norm=clip, expert=expert)
    if name == "deepspeed":
        return run_deepspeed(model, batches, steps, warm, dtype)
    offload = not name.startswith("baseline")
    eng = OffloadEngine(model, cfg) if offload else DeviceMixedPrecision(model, cfg)
    if offload and server_cores:
        pin(eng._server.pid, server_cores if name not in WHOLE_MACHINE else all_cores)
    times = []
    at_warm: dict = {}  # the counts when the timed steps begin
    try:
        for i in range(steps + warm):
            if i == warm and stats_out is not None and offload:
                at_warm = eng.stats()
            x, y = batches[i % len(batches)]
            t0_ns = time.perf_counter_ns()
            with eng.tracer.span("forward"):
                loss = model(x, y)
            eng.backward(loss)
            eng.step()
            t1_ns = time.perf_counter_ns()
            eng.tracer.add("iteration", t0_ns, t1_ns)
            if i >= warm:
                times.append((t1_ns - t0_ns) / 1e9)
    finally:
        if stats_out is not None and offload:  # the timed steps' counts, summed over passes
            st = eng.stats()
            for k, v in st.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    stats_out[k] = stats_out.get(k, 0) + v - at_warm.get(k, 0)
            stats_out["shard_numel"] = st["shard_numel"]
        eng.close()
    return times


def run_deepspeed(model, batches, steps, warm, dtype):
    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():  # one process group of one rank, on gloo (CPU)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        deepspeed.init_distributed(dist_backend="gloo")
    ds_cfg = {"train_micro_batch_size_per_gpu": batches[0][0].shape[0], "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    times = []
    for i in range(steps + warm):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    eng.destroy()
    return times


def span_cost_us(n: int = 20000) -> float:
    """What one recorded span costs the worker (enabled tracer, in memory)."""
    from zero_offload.server.tracing import Tracer
    d = tempfile.mkdtemp(prefix="zo-span-")
    tr = Tracer(d, "probe", 0)
    t0 = time.perf_counter()
    for _ in range(n):
        with tr.span("x", step=1):
            pass
    cost = (time.perf_counter() - t0) / n * 1e6
    shutil.rmtree(d, ignore_errors=True)
    return cost


def spans_per_iteration(trace_dir: str) -> float:
    spans = [s for s in load(trace_dir) if s.role == "worker"]
    its = sum(1 for s in spans if s.name == "iteration")
    return (len(spans) - its) / max(1, its)  # "iteration" itself is added by this script


def trace_phases(trace_dir: str, warm: int) -> tuple[float, float]:
    spans = load(trace_dir)
    its = sorted((s for s in spans if s.role == "worker" and s.name == "iteration"), key=lambda s: s.ts)
    t0 = its[warm].ts if len(its) > warm else 0
    fb, cpu = [], []
    for it in its:
        if it.ts < t0:
            continue
        inside = [s for s in spans if s.role == "worker" and it.ts <= s.ts and s.end <= it.end]
        fb.append(sum(s.dur for s in inside if s.name in ("forward", "backward")))
        cpu.append(sum(s.dur for s in inside if s.name == "step"))
    return statistics.median(fb) / 1e3, statistics.median(cpu) / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="small-cpu:8x128,small-cpu:1x32,gpt2:1x8",
                    help="comma-separated MODEL:BATCHxSEQ (runtime.demo.gpt presets). Default: the 10.8M reference GPT "
                         "at a large and a small batch, and an 85M GPT at a batch where T_fb ~ T_cpu")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant per pass")
    ap.add_argument("--warm", type=int, default=5, help="untimed steps first (DPU switches on at step 3)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--section", default="bench_pipeline",
                    help="the BENCHMARKS.md section to write (a reduced run writes its own, not over the full one)")
    ap.add_argument("--state-dtypes", action="store_true",
                    help="sync, DPU and overlap with fp32, bf16 and int8 optimizer state (section bench_pipeline_state)")
    ap.add_argument("--speculation", action="store_true",
                    help="sync, overlap, DPU and speculation, with and without clipping (section "
                         "bench_pipeline_speculation)")
    ap.add_argument("--trace-dir", default="",
                    help="with --state-dtypes or --speculation: trace each variant's last pass into DIR/VARIANT "
                         "(scripts/trace_report.py reads one)")
    ap.add_argument("--spec-states", default="fp32,int8", help="with --speculation: the state dtypes (fp32, bf16, int8)")
    ap.add_argument("--spec-clips", default="none,1.0", help="with --speculation: no clipping (none), clip 1.0")
    a = ap.parse_args(argv)
    if a.state_dtypes:
        return main_state(a)
    if a.speculation:
        return main_spec(a)
    cores = sorted(os.sched_getaffinity(0))
    server_cores, worker_cores = ({cores[0]}, {cores[1]}) if len(cores) >= 2 else (set(), set(cores))
    print(f"cores: optimizer server {sorted(server_cores) or 'shared'}, worker {sorted(worker_cores)}, one thread "
          f"each; no-offload and DeepSpeed on all {len(cores)} cores, baseline-1core on the worker's", flush=True)
    variants = ["baseline", "baseline-1core", "sync", "sync-untraced", "dpu", "dpu-shared", "sync-copy", "dpu-copy",
                "sync-after", "dpu-after", "dpu-2slots", "overlap", "overlap-copy", "overlap-shared"]
    try:
        import deepspeed  # noqa: F401
        variants.append("deepspeed")
    except Exception:
        print("deepspeed not importable: its column is left out", flush=True)
    span_us = span_cost_us()
    corpus = Corpus.load(seed=0, max_bytes=8 << 20)
    rows, ab_rows = [], []
    for setting in a.settings.split(","):
        model_name, bs, sl, mc, batches = load_setting(setting, corpus)
        times = {v: [] for v in variants}
        phases = []
        order = list(variants)
        for p in range(a.passes):
            random.Random(p).shuffle(order)  # a different order each pass: no variant always runs first
            for v in order:
                tdir = tempfile.mkdtemp(prefix="zo-bench-") if v == "sync" else ""
                times[v] += run_variant(v, mc, batches, a.steps, a.warm, a.dtype, 3, worker_cores, server_cores,
                                        tdir)
                if tdir:
                    phases.append(trace_phases(tdir, a.warm))
                    n_spans = spans_per_iteration(tdir)
                    shutil.rmtree(tdir, ignore_errors=True)
        med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        t_fb = statistics.median(p[0] for p in phases)
        t_cpu = statistics.median(p[1] for p in phases)
        ideal, total = max(t_fb, t_cpu), t_fb + t_cpu
        tok = bs * sl
        ds = med.get("deepspeed", float("nan"))
        overhead = med["sync"] / med["sync-untraced"] - 1
        cost = n_spans * span_us / (med["sync-untraced"] * 1e3)
        best = min(med["dpu"], med["dpu-shared"])
        row = (f"| {model_name} {bs}x{sl} | {med['baseline']:.1f} | {med['baseline-1core']:.1f} | "
               f"{med['sync-untraced']:.1f} | {med['dpu']:.1f} | {med['dpu-shared']:.1f} | {ds:.1f} | "
               f"{t_fb:.1f} | {t_cpu:.1f} | {ideal:.1f} | {total:.1f} | {med['dpu'] / ideal:.2f} | "
               f"{med['sync-untraced'] / med['dpu']:.2f}x | {best / med['baseline']:.2f} | {best / ds:.2f} | "
               f"{tok / best * 1e3:.0f} | {100 * overhead:+.1f}% | {100 * cost:.3f}% |")
        ab = (f"| {model_name} {bs}x{sl} | {med['sync-after']:.1f} | {med['sync-copy']:.1f} | "
              f"{med['sync-untraced']:.1f} | {med['sync-after'] / med['sync-untraced']:.2f}x | "
              f"{med['dpu-after']:.1f} | {med['dpu-copy']:.1f} | {med['dpu']:.1f} | "
              f"{med['dpu-after'] / med['dpu']:.2f}x | {med['dpu-2slots']:.1f} | "
              f"{med['dpu'] / med['dpu-2slots']:.2f}x | {med['overlap']:.1f} | {med['overlap-copy']:.1f} | "
              f"{med['sync-untraced'] / med['overlap']:.2f}x | {med['overlap'] / med['dpu']:.2f} | "
              f"{med['sync-copy'] / med['overlap-copy']:.2f}x | {med['overlap-shared']:.1f} | "
              f"{min(med['overlap'], med['overlap-shared']) / med['baseline']:.2f} |")
        del batches
        print(row, flush=True)
        print(ab, flush=True)
        rows.append(row)
        ab_rows.append(ab)
    head = ("| model, batch | no offload ms | no offload, 1 core ms | offload sync ms | offload DPU ms "
            "| offload DPU, shared cores ms | DeepSpeed ms | T_fb ms | T_cpu ms | max(T_fb,T_cpu) | T_fb+T_cpu "
            "| DPU / ideal | sync / DPU | best DPU / no offload | best DPU / DeepSpeed | best DPU tokens/s "
            "| tracing A/B | tracing cost |")
    body = (f"## Pipeline step time (scripts/bench_pipeline.py)\n\n{machine_line()}; {a.dtype}; DPU with weight "
            f"prediction, switched on at step 3; "
            f"median of {a.steps} x {a.passes} interleaved steps per variant; ours: server on core "
            f"{sorted(server_cores)}, worker on core {sorted(worker_cores)}, one thread each; no offload and DeepSpeed "
            f"on both cores (2 threads); 'no offload, 1 core' has exactly our worker's compute.\n\n"
            + "\n".join([head, "|" + "---|" * 18, *rows]) + "\n"
            + "\nT_fb and T_cpu come from the traced synchronous run; the sync column is the untraced one. "
              "'tracing A/B' is traced/untraced - 1 for the same synchronous configuration (separate engines: "
              "its noise is several percent); 'tracing cost' is the worker's spans per step times the measured "
              f"cost of one span ({span_us:.1f} us), over the step time.\n"
            + "\nThe weights' way up, same run: copied in one piece after DONE (overlap_weights_up=False), "
              "copied block by block as the server publishes them (during the wait; with DPU inside the next "
              "backward), or not copied at all (the CPU device's zero-copy slots, the columns above); and DPU "
              "with a second gradient slot (dpu_grad_slots=2: backward never waits for the update, +2 B/param) "
              "against the default one slot, whose ranges backward writes once the update has passed them; and "
              "overlap_update (bitwise sync; the update during the next forward), zero-copy, copied, and with the "
              "worker on both cores as 'DPU, shared cores' (the server unpinned):\n\n"
            + "\n".join(["| model, batch | sync, copy after DONE ms | sync, copy as published ms | sync, zero-copy ms "
                          "| after / zero-copy | DPU, copy after DONE ms | DPU, copy in backward ms "
                          "| DPU, zero-copy ms | after / zero-copy | DPU, 2 gradient slots ms "
                          "| 1 slot / 2 slots | overlap ms | overlap, copy ms | sync / overlap | overlap / DPU "
                          "| sync / overlap, copy | overlap, shared cores ms | best overlap / no offload |",
                          "|" + "---|" * 18,
                          *ab_rows]) + "\n")
    if not a.no_write:
        update_section(a.section, body.replace("## Pipeline step time", "## Pipeline step time" + (
            f" ({a.section})" if a.section != "bench_pipeline" else ""), 1))
    return 0


def load_setting(setting: str, corpus):
    """MODEL:BATCHxSEQ -> (model name, batch, seq, GPTConfig, 8 fixed batches)."""
    from zero_offload.demo.gpt import PRESETS
    model_name, shape = setting.split(":")
    L, H, D = PRESETS[model_name]
    bs, sl = (int(v) for v in shape.lower().split("x"))
    src = Batches(corpus.train, bs, sl, seed=1)
    return model_name, bs, sl, GPTConfig(n_layer=L, n_head=H, d_model=D, seq_len=sl), [src.next() for _ in range(8)]


STATE_MODES = ("sync", "dpu", "overlap")
STATE_DTYPES = ("fp32", "bf16", "int8")
STATE_VARIANTS = [m if dt == "fp32" else f"{m}-{dt}state" for m in STATE_MODES for dt in STATE_DTYPES]


def _core_split() -> tuple[set, set]:
    """(server cores, worker cores): one each on a 2-core machine."""
    cores = sorted(os.sched_getaffinity(0))
    return ({cores[0]}, {cores[1]}) if len(cores) >= 2 else (set(), set(cores))


def _medians(variants, mc, batches, a, server_cores, worker_cores, stats=None) -> dict:
    """Each variant's median step (ms), the variants interleaved pass by pass in a shuffled order;
    stats: per variant, its engines' stats() summed (bench_pipeline_speculation)."""
    times = {v: [] for v in variants}
    order = list(variants)
    for p in range(a.passes):
        random.Random(p).shuffle(order)
        for v in order:
            tdir = os.path.join(a.trace_dir, v) if a.trace_dir and p == a.passes - 1 else ""
            times[v] += run_variant(v, mc, batches, a.steps, a.warm, a.dtype, 3, worker_cores, server_cores,
                                    tdir, stats_out=None if stats is None else stats.setdefault(v, {}))
    return {v: statistics.median(t) * 1e3 for v, t in times.items()}


def _write_table(section, title, what, a, server_cores, worker_cores, head, rows) -> None:
    body = (f"## {title}\n\n{machine_line()}; {a.dtype}; {what}; median of {a.steps} x {a.passes} interleaved "
            f"steps per variant; server on core {sorted(server_cores)}, worker on core {sorted(worker_cores)}, one "
            f"thread each.\n\n" + "\n".join([head, "|" + "---|" * (head.count("|") - 1), *rows]) + "\n")
    if not a.no_write:
        update_section(section, body)


def main_state(a) -> int:
    """The state dtypes' rows: each of sync, DPU, overlap with fp32, bf16 and int8 state, interleaved."""
    server_cores, worker_cores = _core_split()
    corpus = Corpus.load(seed=0, max_bytes=8 << 20)
    rows = []
    for setting in a.settings.split(","):
        model_name, bs, sl, mc, batches = load_setting(setting, corpus)
        med = _medians(STATE_VARIANTS, mc, batches, a, server_cores, worker_cores)
        for m in STATE_MODES:
            ms = [med[m if dt == "fp32" else f"{m}-{dt}state"] for dt in STATE_DTYPES]
            row = (f"| {model_name} {bs}x{sl} | {m} | " + " | ".join(f"{x:.1f}" for x in ms) + " | "
                   + " | ".join(f"{ms[0] / x:.2f}x" for x in ms[1:]) + " |")
            print(row, flush=True)
            rows.append(row)
    head = ("| model, batch | mode | fp32 state ms | bf16 state ms | int8 state ms | fp32 / bf16 state "
            "| fp32 / int8 state |")
    _write_table("bench_pipeline_state", "Pipeline step time by state dtype (scripts/bench_pipeline.py --state-dtypes)",
                 "clip 1.0; DPU with weight prediction (so its master stays fp32: 20 and 16 B/param moved, not 18 "
                 "and 14)", a, server_cores, worker_cores, head, rows)
    return 0


SPEC_MODES = ("sync", "overlap", "overlap-spec", "sync-spec", "dpu")


def main_spec(a) -> int:
    """Speculation's rows: per state dtype and clip setting, each mode's step time, interleaved."""
    server_cores, worker_cores = _core_split()
    corpus = Corpus.load(seed=0, max_bytes=8 << 20)
    states, clips = a.spec_states.split(","), a.spec_clips.split(",")
    if not set(clips) <= {"none", "1.0"} or not set(states) <= {"fp32", "bf16", "int8"}:
        raise SystemExit("--spec-clips takes none and 1.0, --spec-states fp32, bf16 and int8")
    combos = [(st, "noclip" if clip == "none" else "clip") for st in states for clip in clips]

    def vname(m, st, clip):
        return m + ("-noclip" if clip == "noclip" else "") + ("" if st == "fp32" else f"-{st}state")
    rows = []
    for setting in a.settings.split(","):
        model_name, bs, sl, mc, batches = load_setting(setting, corpus)
        stats: dict = {}
        med = _medians([vname(m, st, c) for st, c in combos for m in SPEC_MODES], mc, batches, a, server_cores,
                       worker_cores, stats)
        for st, clip in combos:
            ms = {m: med[vname(m, st, clip)] for m in SPEC_MODES}
            sp = stats[vname("overlap-spec", st, clip)]
            n = max(1, sp.get("steps", 1))
            kept = sp.get("spec_kept_numel", 0) / (n * sp.get("shard_numel", 1))
            tried = sp.get("spec_steps", 0) / n
            rolled = sp.get("spec_rollback_steps", 0) / n
            row = (f"| {model_name} {bs}x{sl} | {st} | {'1.0' if clip == 'clip' else 'none'} | "
                   + " | ".join(f"{ms[m]:.1f}" for m in SPEC_MODES)
                   + f" | {ms['sync'] / ms['overlap']:.2f}x | {ms['sync'] / ms['overlap-spec']:.2f}x | "
                   f"{ms['overlap-spec'] / ms['dpu']:.2f} | {ms['sync'] / ms['sync-spec']:.2f}x | "
                   f"{ms['sync-spec'] / ms['dpu']:.2f} | "
                   f"{tried:.0%} / {rolled:.0%} / {kept:.0%} | "
                   f"{1e3 * sp.get('overlap_wait_s', 0) / n:.1f} + {1e3 * sp.get('wait_s', 0) / n:.1f} |")
            print(row, flush=True)
            rows.append(row)
    head = ("| model, batch | state | clip | sync ms | overlap ms | overlap + spec ms | sync + spec ms | DPU ms "
            "| sync / overlap | sync / (overlap + spec) | (overlap + spec) / DPU | sync / (sync + spec) "
            "| (sync + spec) / DPU "
            "| steps speculated / rolled back / shard kept (timed steps) | overlap + spec: forward waits + DONE wait, "
            "ms/step |")
    # --section names a reduced run's own section (as in main()); the default one keeps its title
    section = "bench_pipeline_speculation" if a.section == "bench_pipeline" else a.section
    named = "" if section == "bench_pipeline_speculation" else f"({section}) "
    _write_table(section, f"Pipeline step time with speculation {named}(scripts/bench_pipeline.py --speculation)",
                 "speculation with an undo log for the whole state; DPU with weight prediction",
                 a, server_cores, worker_cores, head, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
