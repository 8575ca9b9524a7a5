"""mode="exact": does the engine's own pick keep up with the fastest exact strategy?

    python scripts/bench_exact_mode.py                 # both models, writes BENCHMARKS.md (bench_exact_mode)
    python scripts/bench_exact_mode.py --models embedding --steps 24 --no-write

Each model trains under every exact strategy forced (sync, overlap_update,
overlap_update+speculation) and under "auto", in one run, the order reversed in the
second round so that drift of the machine's speed falls on every strategy alike.  A
run's time is the median step time after auto's trial (the steps the pick governs);
the baseline is the fastest forced strategy of the same round.  The models:

- embedding: a 134M-parameter embedding table and a small head, batch 8x64: the
  table's gradient, nearly all of the model, arrives last in backward, so speculation
  has little to start early (the case the picker must not get wrong);
- mlp: eight 2048x2048 layers (34M) at batch 8: the update outlasts forward and
  backward, where overlap and speculation hide it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from bench_md import machine_line, update_section  # noqa: E402
from zero_offload import OffloadConfig, OffloadEngine  # noqa: E402
from zero_offload.kernels import cpu_adam  # noqa: E402

FORCED = ["sync", "overlap_update", "overlap_update+speculation"]
SEED = 0


class Embedding(torch.nn.Module):
    def __init__(self, vocab=524288, d=256, classes=256):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1).float(), y.flatten())


class MLP(torch.nn.Module):
    def __init__(self, d=2048, layers=8, classes=256):
        super().__init__()
        self.inp = torch.nn.Embedding(classes, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.out = torch.nn.Linear(d, classes)

    def forward(self, x, y):
        h = self.inp(x)
        for m in self.layers:
            h = torch.relu(m(h))
        return torch.nn.functional.cross_entropy(self.out(h).flatten(0, 1).float(), y.flatten())


MODELS = {"embedding": (Embedding, (8, 64), 524288), "mlp": (MLP, (8, 1), 256)}


def run(name: str, strategy: str, steps: int, threads: int) -> dict:
    make, shape, vocab = MODELS[name]
    torch.manual_seed(SEED)
    model = make()
    n = sum(p.numel() for p in model.parameters())
    cfg = OffloadConfig(lr=1e-4, dtype="bf16", server={"threads": threads}, expert={"exact_strategy": strategy})
    times = []
    g = torch.Generator().manual_seed(SEED)
    with OffloadEngine(model, cfg) as eng:
        dt = eng.compute_dtype
        for t in range(steps):
            x = torch.randint(0, vocab, shape, generator=g)
            y = torch.randint(0, 256, shape, generator=g)
            t0 = time.perf_counter()
            loss = model(x, y)
            eng.backward(loss.to(dt))
            eng.step()
            times.append(time.perf_counter() - t0)
        st = eng.stats()
    return {"params": n, "times": times, "pick": st.get("exact_strategy"), "why": st.get("exact_strategy_why", ""),
            "medians": st.get("exact_medians_ms", {})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="embedding,mlp")
    ap.add_argument("--steps", type=int, default=30, help="steps per run; auto's trial takes steps 3-14")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the server's threads (the worker takes the rest)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - a.threads))
    first = 15  # the steps after auto's trial (2 warm-up + 3 candidates x 4)
    if a.steps < first + 5:
        ap.error(f"--steps must be >= {first + 5}: auto's trial takes steps 3-14")
    lines = []
    print(f"simd={cpu_adam.simd_level()} seed={SEED}", flush=True)
    for name in a.models.split(","):
        # a first process on a model runs slower (page faults of its first large allocations,
        # the allocator's first growth): one untimed run, so no strategy pays for being first
        run(name, "sync", 4, a.threads)
        rows = []
        for r in range(a.rounds):
            order = FORCED + ["auto"]
            if r % 2:
                order = order[::-1]
            res = {}
            for s in order:
                out = run(name, s, a.steps, a.threads)
                out["median"] = statistics.median(out["times"][first:])
                res[s] = out
                print(f"{name} round {r + 1} {s}: {out['median'] * 1e3:.1f} ms/step"
                      + (f" (picked {out['pick']}: {out['why']})" if s == "auto" else ""), flush=True)
            best = min(FORCED, key=lambda s: res[s]["median"])
            rows.append((r + 1, res, best))
        n = rows[0][1]["sync"]["params"]
        lines.append(f"\n**{name}** ({n / 1e6:.0f}M parameters, batch {MODELS[name][1][0]}x{MODELS[name][1][1]}):\n")
        lines.append("| round | sync ms | overlap_update ms | overlap+speculation ms | auto ms | auto's pick | "
                     "auto / fastest forced |")
        lines.append("|---|---|---|---|---|---|---|")
        for r, res, best in rows:
            ms = lambda s: f"{res[s]['median'] * 1e3:.1f}"  # noqa: E731
            lines.append(f"| {r} | {ms('sync')} | {ms('overlap_update')} | {ms('overlap_update+speculation')} | "
                         f"{ms('auto')} | {res['auto']['pick']} | "
                         f"{res['auto']['median'] / res[best]['median']:.2f}x (fastest: {best}) |")
        med = {s: statistics.median(res[s]["median"] for _, res, _ in rows) for s in FORCED + ["auto"]}
        best = min(FORCED, key=med.get)
        lines.append(f"| median of rounds | {med['sync'] * 1e3:.1f} | {med['overlap_update'] * 1e3:.1f} | "
                     f"{med['overlap_update+speculation'] * 1e3:.1f} | {med['auto'] * 1e3:.1f} | "
                     f"{', '.join(sorted({res['auto']['pick'] for _, res, _ in rows}))} | "
                     f"{med['auto'] / med[best]:.2f}x (fastest: {best}) |")
        lines.append(f"\nauto's reason (round 1): {rows[0][1]['auto']['why']}")
    body = (f"## mode=\"exact\": the engine's pick against each strategy forced (scripts/bench_exact_mode.py)\n\n"
            f"{machine_line()}; simd={cpu_adam.simd_level()}; CPU device, bf16 weights, fp32 state, the server "
            f"on {a.threads} thread(s); {a.steps} steps a run, median step time over steps {first + 1}-{a.steps} "
            f"(after auto's trial), {a.rounds} rounds (every other one in reverse order) after one untimed run; "
            f"seed {SEED}.  A strategy's step time moves 5-15% from one run to the next on this machine: "
            f"compare the median of the rounds.\n"
            + "\n".join(lines))
    print(body)
    if not a.no_write:
        update_section("bench_exact_mode", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
