"""What speculating costs on the server, per element: a plain update against a
speculated one with the undo log and with the state's twin, in the same run.

    python scripts/bench_spec_piece.py [--numel 32M] [--reps 3] [--states fp32,bf16] [--no-write]

One shard per state (fp32 state; bf16 state with the exact master), AdamW, bf16
gradients and weights, one thread, driven
in-process through optimizer_server.shard.Shard as the server's update thread
drives it: a STEP alone (the baseline), and SPECULATE of the whole shard then
its STEP, with undo_log_bytes one byte under the whole update's writes (the undo
log: the state's old bytes are copied into the log first; its last element is
left to the STEP) and with enough for
all of it (the twin: the new state is written beside the old, only the weights
slot is logged, and with two weights slots, as a CPU worker has, nothing is).  The first speculation of each shard commits the log's (and
the twin's) pages and is not timed.  Speculation's time is split into the log's
save and the update.  Writes BENCHMARKS.md section "bench_spec_piece".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402

from bench_adam import parse_size  # noqa: E402
from bench_md import machine_line, update_section  # noqa: E402
from zero_offload.server import protocol as P  # noqa: E402
from zero_offload.server import undo as U  # noqa: E402
from zero_offload.server.shard import Shard  # noqa: E402
from zero_offload.server.shm import Segment, ShardLayout  # noqa: E402
from zero_offload.server.state import bytes_per_param  # noqa: E402


def make_shard(n: int, state: str, undo_log_bytes: int, weights_slots: int = 1) -> Shard:
    msg = P.Hello(version=P.PROTOCOL_VERSION, token="t", rank=0, world_size=1, numel=n, dtype="bf16",
                  optimizer="adamw", undo_log_bytes=undo_log_bytes, state_dtype=state, exact_master=state == "bf16",
                  weights_slots=weights_slots)
    layout = ShardLayout(numel=n, weights_slots=msg.weights_slots, grad_slots=msg.grad_slots, staging_numel=1 << 20)
    seg = Segment.create(f"zo-bench-spec-{os.getpid()}-{time.monotonic_ns()}", layout.total_bytes)
    sh = Shard("s", msg, seg, layout, 1)
    sh.staging[:] = 0.01
    for lo in range(0, n, 1 << 20):
        sh.init_chunk(lo, min(1 << 20, n - lo))
    sh.grads[0].view(np.uint16)[:] = 0x3c00  # bf16 words of 0.0078125 and 1.0 alike: any finite gradient
    return sh


class SaveTimer:
    """Time spent in UndoLog.save (the undo log's copy), summed."""

    def __init__(self):
        self.s = 0.0
        self._orig = U.UndoLog.save

    def __enter__(self):
        timer = self

        def save(log, views):
            t = time.perf_counter()
            try:
                return timer._orig(log, views)
            finally:
                timer.s += time.perf_counter() - t
        U.UndoLog.save = save
        return self

    def __exit__(self, *exc):
        U.UndoLog.save = self._orig


def run(sh: Shard, k: int, speculate: bool) -> tuple[float, float]:
    """Update k (speculated whole, then its STEP, or a STEP alone): (seconds, seconds saving)."""
    # of two weights slots, each STEP writes the other one (as a CPU worker's do)
    out = k % 2 if len(sh.weights16_slots) > 1 else 0
    step = P.Step(session="s", step=k, grad_slot=0, lr=1e-3, weights_slot=out)
    with SaveTimer() as st:
        t0 = time.perf_counter()
        if speculate:
            assert sh.accept_speculation(P.Speculate(session="s", step=k, grad_slot=0, lr=1e-3, upto=sh.numel,
                                                     weights_slot=out))
            sh.speculate(0, sh.numel)
        assert sh.accept_step(step) is None
        sh.step(step)
        sh.finish_update()
        dt = time.perf_counter() - t0
    if speculate:
        # the undo log's variant has one byte too few for the last element
        assert sh.last_speculated >= sh.numel - 1, "the whole shard was speculated and kept"
    return dt, st.s


def measure(n: int, state: str, reps: int, label: str) -> list[str]:
    """One state dtype's rows: a plain update, and speculation with the log and the twin."""
    # what one update writes: the state (bf16: with the exact master) and the bf16 weights slot
    whole = int(n * (bytes_per_param("adamw", state, exact_master=state == "bf16") + 2))
    # the twin with one weights slot logs it (a GPU worker's); with two (a CPU worker's) nothing
    variants = {"undo log": (whole - 1, 1), "twin": (whole, 1), "twin, two weights slots": (whole, 2)}
    shards = {name: make_shard(n, state, b, slots) for name, (b, slots) in variants.items()}
    try:
        for name, sh in shards.items():
            assert (sh.arrays.twin is not None) == name.startswith("twin"), name
            run(sh, 1, True)  # commits the log's and the twin's pages: not timed
            run(sh, 2, False)
        times = {v: [] for v in ("plain", *variants)}
        saves = {v: [] for v in variants}
        k = 3
        for _ in range(reps):  # interleaved, so that drift hits every variant alike
            for name, sh in shards.items():
                times["plain"].append(run(sh, k, False)[0] / n)
                dt, save = run(sh, k + 1, True)
                times[name].append(dt / n)
                saves[name].append(save / n)
            k += 2
    finally:
        for sh in shards.values():
            sh.close()
    ns = {v: 1e9 * statistics.median(t) for v, t in times.items()}
    rows = [f"| {label} | {state} | plain update | {ns['plain']:.2f} | - | 1.00x |"]
    for name in variants:
        save = 1e9 * statistics.median(saves[name])
        rows.append(f"| {label} | {state} | speculated, {name} | {ns[name]:.2f} | {save:.2f} | "
                    f"{ns[name] / ns['plain']:.2f}x |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default="32M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--states", default="fp32,bf16", help="state dtypes (bf16: with the exact master)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    n = parse_size(a.numel)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rows = []
    for state in a.states.split(","):
        rows += measure(n, state, a.reps, a.numel)
    for r in rows:
        print(r)
    body = (f"## Speculation's cost per element (scripts/bench_spec_piece.py)\n\n{machine_line()}; one shard per "
            f"state, AdamW, bf16, one thread on one core; median of {a.reps} interleaved updates per variant (the "
            f"plain one measured beside both shards).\n\n"
            "| shard | state | update | ns/element | of which the undo log's save | / plain |\n"
            "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if not a.no_write:
        update_section("bench_spec_piece", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
