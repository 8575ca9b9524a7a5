"""Does offload change what training computes?  Does DPU cost loss?

    python scripts/convergence.py                          # the recorded runs' size (200 steps of 8x128), 5 runs
    python scripts/convergence.py --lr 1e-3 --steps 400 --tag lr1e-3

Trains the same GPT on the same data and seed five ways:
  baseline   plain PyTorch mixed precision, AdamW on the device (no offload)
  sync       offload, synchronous
  dpu        offload with One-Step Delayed Parameter Update
  dpu-sim    plain-PyTorch simulation of the DPU schedule (the ZeRO-Offload paper's schedule)
  overlap    offload with the exact strategy overlap_update (must equal sync at every evaluation: it says so)
  overlap-spec  overlap_update with speculation during backward (equal to sync too)
  sync-bf16state  offload, synchronous, state_dtype="bf16" (bf16 moments, the exact master)
  sync-int8state  offload, synchronous, state_dtype="int8" (block-wise 8-bit moments, the exact master)
prints the validation losses at each evaluation, writes the curves as
docs/convergence-TAG.png and the numbers as docs/convergence-TAG.json, and
rewrites the "convergence" section of BENCHMARKS.md from all docs/convergence-*.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_md import machine_line, update_section  # noqa: E402
from zero_offload.demo.trainer import TrainConfig, train  # noqa: E402

RUNS = {
    "baseline": dict(offload=False, dpu=False),
    "sync": dict(offload=True, dpu=False, exact_strategy="sync"),
    "dpu": dict(offload=True, dpu=True),
    "overlap": dict(offload=True, dpu=False, exact_strategy="overlap_update"),
    # speculation during backward on top (an undo log for the whole state): also bitwise sync
    "overlap-spec": dict(offload=True, dpu=False, exact_strategy="overlap_update+speculation", undo_log_bytes=1 << 32),
    "dpu-sim": dict(offload=False, dpu=True, simulate_dpu=True),
    "sync-bf16state": dict(offload=True, dpu=False, exact_strategy="sync", state_dtype="bf16"),
    "sync-int8state": dict(offload=True, dpu=False, exact_strategy="sync", state_dtype="int8"),
}
# the main table's value columns (the state dtypes have a table of their own)
MAIN_RUNS = ("baseline", "sync", "dpu", "dpu-sim", "overlap")
STATE_RUNS = {"bf16": "sync-bf16state", "int8": "sync-int8state"}


def main(argv=None) -> int:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=d.model)
    # the size of every run recorded in BENCHMARKS.md and docs/ (the main job's was this
    # until it shrank to fit a minute on AVX2), so a rerun compares with them
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--dpu-warmup", type=int, default=d.dpu_warmup)
    ap.add_argument("--beta1", type=float, default=d.beta1)
    ap.add_argument("--dpu-beta1", type=float, default=None, help="beta1 for the DPU runs only (a mitigation)")
    ap.add_argument("--dpu-predict", type=float, default=d.dpu_predict,
                    help="weight prediction for the DPU runs (the mitigation; 0 = the paper's plain DPU)")
    ap.add_argument("--dtype", default=d.dtype)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--tag", default="default")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    base = TrainConfig(model=a.model, steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
                       warmup=a.warmup, dpu_warmup=a.dpu_warmup, beta1=a.beta1, dtype=a.dtype,
                       eval_every=a.eval_every, eval_batches=a.eval_batches, seed=a.seed, threads=1,
                       server_threads=1, progress=False)
    results = {}
    for name in a.runs.split(","):
        tc = replace(base, **RUNS[name])
        if name.startswith("dpu") and a.dpu_beta1 is not None:
            tc = replace(tc, beta1=a.dpu_beta1)
        if name.startswith("dpu"):
            tc = replace(tc, dpu_predict=a.dpu_predict)
        out = train(tc)
        h = out["history"]
        results[name] = {"step": h["step"], "loss": h["loss"], "val_step": h["val_step"], "val_loss": h["val_loss"],
                         "median_step_s": out["summary"]["median_step_s"]}
        print(f"{name:9s} val: " + " ".join(f"{s}:{v:.4f}" for s, v in zip(h["val_step"], h["val_loss"])),
              flush=True)
    for name in STATE_RUNS.values():
        if name in results and "sync" in results:
            gaps = [x / y - 1 for x, y in zip(results[name]["val_loss"], results["sync"]["val_loss"])]
            print(f"{name} vs sync: validation gap " + " ".join(f"{100 * g:+.2f}%" for g in gaps), flush=True)
    for name in ("overlap", "overlap-spec"):  # bitwise sync: every evaluation equal
        if name not in results or "sync" not in results:
            continue
        same = results[name]["val_loss"] == results["sync"]["val_loss"]
        print(f"{name} vs sync: validation losses {'identical at every evaluation' if same else 'DIFFER'}",
              flush=True)
    report = {"tag": a.tag, "args": vars(a), "machine": machine_line(), "runs": results}
    rows = summary_rows(report)
    for r in rows:
        print(r)
    if a.no_write:
        return 0
    docs = ROOT / "docs"
    docs.mkdir(exist_ok=True)
    (docs / f"convergence-{a.tag}.json").write_text(json.dumps(report, indent=1))
    plot(report, docs / f"convergence-{a.tag}.png")
    write_benchmarks(docs)
    return 0


def gap(report, a, b) -> float:
    ra, rb = report["runs"].get(a), report["runs"].get(b)
    if not ra or not rb:
        return float("nan")
    return ra["val_loss"][-1] / rb["val_loss"][-1] - 1


def summary_rows(report) -> list[str]:
    runs = report["runs"]
    max_sync = float("nan")
    if "sync" in runs and "baseline" in runs:
        max_sync = max(abs(s / b - 1) for s, b in zip(runs["sync"]["val_loss"], runs["baseline"]["val_loss"]))
    max_sim = float("nan")
    if "dpu" in runs and "dpu-sim" in runs:
        max_sim = max(abs(s / b - 1) for s, b in zip(runs["dpu"]["val_loss"], runs["dpu-sim"]["val_loss"]))
    a = report["args"]
    final = {k: v["val_loss"][-1] for k, v in runs.items()}

    def f(x, fmt):
        return "-" if x != x else format(x, fmt)  # nan: that run was not part of this setting

    return [f"| {report['tag']} | {a['model']} | {a['steps']} | {a['lr']:g} | {a['dpu_warmup']} | "
            f"{a['dpu_beta1'] if a['dpu_beta1'] is not None else a['beta1']:g} | {a.get('dpu_predict', 0.0):g} | "
            + " | ".join(f(final.get(k, float('nan')), ".4f") for k in MAIN_RUNS)
            + f" | {f(100 * max_sync, '.2f')}% | {f(100 * max_sim, '.2f')}% | {f(100 * gap(report, 'dpu', 'sync'), '+.2f')}% "
            f"| {gap_trend(report)} |"]


def gap_trend(report) -> str:
    """DPU's gap to sync at every evaluation, e.g. '50:+3.9 100:+3.2 ...' (percent)."""
    runs = report["runs"]
    if "dpu" not in runs or "sync" not in runs:
        return "-"
    return " ".join(f"{s}:{100 * (d / b - 1):+.1f}" for s, d, b in
                    zip(runs["dpu"]["val_step"], runs["dpu"]["val_loss"], runs["sync"]["val_loss"]))


def write_benchmarks(docs: Path) -> None:
    head = ("| tag | model | steps | peak lr | DPU warm-up | DPU beta1 | DPU predict | "
            + " | ".join(f"val {k}" for k in MAIN_RUNS)
            + " | max \\|sync/baseline-1\\| | max \\|dpu/dpu-sim-1\\| | DPU gap vs sync "
            "| gap at each evaluation (step:%) |")
    rows = [head, "|" + "---|" * (11 + len(MAIN_RUNS))]
    state_head = ("| tag | model | batch | steps | peak lr | state | val sync (fp32 state) | val sync (this state) "
                  "| max \\|gap\\| over evaluations | gap at each evaluation (step:%) |")
    state_rows = [state_head, "|" + "---|" * 10]
    machine = state_machine = ""  # the machine line of the newest run in each table
    for f in sorted(glob.glob(str(docs / "convergence-*.json"))):
        rep = json.loads(Path(f).read_text())
        if any(k in rep["runs"] for k in MAIN_RUNS if k != "sync"):
            rows += summary_rows(rep)
            machine = max(machine, rep["machine"])
        more = state_summary_rows(rep)
        if more:
            state_rows += more
            state_machine = max(state_machine, rep["machine"])
    body = (f"## Convergence (scripts/convergence.py)\n\n{machine}. Final validation loss of each run; the "
            f"max columns are over every evaluation. Figures: docs/convergence-TAG.png.\n\n" + "\n".join(rows) + "\n")
    update_section("convergence", body)
    body = (f"## Convergence by state dtype (scripts/convergence.py --runs sync,sync-bf16state,sync-int8state)\n\n"
            f"{state_machine}. "
            f"Synchronous offload with the optimizer state in fp32 and in a compact dtype, same data and seed: "
            f"the validation-loss gap at every evaluation (target: within 0.5%).\n\n" + "\n".join(state_rows) + "\n")
    update_section("convergence_state", body)


def state_summary_rows(report) -> list[str]:
    runs, a = report["runs"], report["args"]
    out = []
    for dt, name in STATE_RUNS.items():
        if name not in runs or "sync" not in runs:
            continue
        gaps = [100 * (x / y - 1) for x, y in zip(runs[name]["val_loss"], runs["sync"]["val_loss"])]
        trend = " ".join(f"{s}:{g:+.2f}" for s, g in zip(runs[name]["val_step"], gaps))
        out.append(f"| {report['tag']} | {a['model']} | {a['batch_size']}x{a['seq_len']} | {a['steps']} | {a['lr']:g} | {dt} | "
                   f"{runs['sync']['val_loss'][-1]:.4f} | {runs[name]['val_loss'][-1]:.4f} | "
                   f"{max(abs(g) for g in gaps):.2f}% | {trend} |")
    return out


def plot(report, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in report["runs"].items():
        k = 10
        sm = [sum(r["loss"][max(0, i - k + 1):i + 1]) / len(r["loss"][max(0, i - k + 1):i + 1])
              for i in range(len(r["loss"]))]
        ax1.plot(r["step"], sm, label=name, lw=1)
        ax2.plot(r["val_step"], r["val_loss"], marker="o", ms=3, label=name)
    a = report["args"]
    ax1.set_title(f"training loss (10-step mean), {a['model']}, lr {a['lr']:g}")
    ax2.set_title(f"validation loss, DPU warm-up {a['dpu_warmup']}")
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
