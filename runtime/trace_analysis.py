"""Read, merge and summarise the per-process Chrome traces of a run.

Every process (worker ranks, the optimizer server) writes
``<trace-dir>/<role>-<rank>-<pid>.json`` with CLOCK_MONOTONIC microseconds, so
spans of different processes on one node are directly comparable.
Used by scripts/trace_merge.py, scripts/trace_report.py and the benchmarks.
"""
from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import dataclass

WORKER_PHASES = ("iteration", "forward", "backward", "step", "grad_bucket", "grad_slot_wait", "grad_check", "signal",
                 "wait_server", "weights_up", "weights_up_tail", "weights_swap", "all_gather", "skip",
                 "overlap_wait", "speculate_signal")
# the server's update work: a STEP's, and the pieces speculation ran during backward
SERVER_UPDATE = ("update", "speculate")
SERVER_PHASES = ("update", "speculate", "rollback")


@dataclass
class Span:
    name: str
    role: str
    rank: int
    pid: int
    ts: float   # us
    dur: float  # us
    args: dict

    @property
    def end(self) -> float:
        return self.ts + self.dur


def load(trace_dir: str) -> list[Span]:
    spans = []
    files = sorted(glob.glob(os.path.join(trace_dir, "*.json")))
    if not files:
        raise FileNotFoundError(f"no trace files (*.json) in {trace_dir}; run with --trace-dir {trace_dir}")
    for f in files:
        with open(f) as fh:
            data = json.load(fh)
        other = data.get("otherData", {})
        role, rank = other.get("role", "?"), int(other.get("rank", 0))
        for e in data.get("traceEvents", []):
            if e.get("ph") == "X":
                spans.append(Span(e["name"], role, rank, e["pid"], float(e["ts"]), float(e["dur"]), e.get("args", {})))
    return spans


def merge(trace_dir: str) -> dict:
    """One trace with every process as its own track (Perfetto, chrome://tracing)."""
    events = []
    for i, f in enumerate(sorted(glob.glob(os.path.join(trace_dir, "*.json")))):
        with open(f) as fh:
            data = json.load(fh)
        evs = data.get("traceEvents", [])
        if evs:
            events.append({"ph": "M", "name": "process_sort_index", "pid": evs[0]["pid"], "args": {"sort_index": i}})
        events += evs
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase_table(spans: list[Span], skip_first: int = 3) -> tuple[list[dict], float]:
    """Per-phase statistics of rank-0 worker spans after the first `skip_first` iterations."""
    w = [s for s in spans if s.role in ("worker", "baseline") and s.rank == 0]
    its = sorted((s for s in w if s.name == "iteration"), key=lambda s: s.ts)
    t_start = its[skip_first].ts if len(its) > skip_first else (its[0].ts if its else 0.0)
    w = [s for s in w if s.ts >= t_start]
    its = [s for s in its if s.ts >= t_start]
    step_us = statistics.mean(s.dur for s in its) if its else float("nan")
    n_it = max(1, len(its))
    rows = []
    server = [s for s in spans if s.role == "server" and s.name in SERVER_PHASES and s.ts >= t_start]
    for name in WORKER_PHASES + tuple(f"server {n}" for n in SERVER_PHASES):
        on_server = name.startswith("server ")
        ds = [s.dur for s in (server if on_server else w) if s.name == name.removeprefix("server ")]
        if not ds:
            continue
        rows.append({"phase": name, "count": len(ds),
                     "mean_ms": statistics.mean(ds) / 1e3, "p50_ms": _pct(ds, 0.5) / 1e3,
                     "p99_ms": _pct(ds, 0.99) / 1e3, "share": sum(ds) / n_it / step_us if its else float("nan")})
    return rows, step_us / 1e3


STEADY_ITERATIONS = 8  # the steady state: this many last iterations (what timeline_png shows, and more)


def has_server(spans: list[Span]) -> bool:
    return any(s.role == "server" for s in spans)


def steady_start(spans: list[Span], n: int = STEADY_ITERATIONS) -> float:
    """Start of the last n rank-0 iterations (at most the later half of them), in trace time."""
    its = sorted((s.ts for s in spans if s.role == "worker" and s.rank == 0 and s.name == "iteration"))
    if not its:
        return float("-inf")
    return its[max(len(its) - n, len(its) // 2)]


def hidden_fraction(spans: list[Span], since: float | None = None) -> float | None:
    """Share of the server's update time (STEP updates and speculated pieces) that overlaps
    a worker's forward or backward,
    over the updates that start at or after `since` (default: the steady state, the
    last STEADY_ITERATIONS iterations: DPU's synchronous warm-up and the first,
    page-faulting update hide nothing by design).  None when there is no server trace
    or no update in that window (the report says which)."""
    if since is None:
        since = steady_start(spans)
    busy = sorted(((s.ts, s.end) for s in spans if s.role == "worker" and s.name in ("forward", "backward")))
    upd = sorted((s for s in spans if s.role == "server" and s.name in SERVER_UPDATE and s.ts >= since),
                 key=lambda s: s.ts)
    total = sum(s.dur for s in upd)
    if not total:
        return None
    hidden = 0.0
    for u in upd:
        for a, b in busy:
            if b <= u.ts:
                continue
            if a >= u.end:
                break
            hidden += min(b, u.end) - max(a, u.ts)
    return hidden / total


def bytes_per_step(spans: list[Span]) -> dict:
    w = [s for s in spans if s.role == "worker" and s.rank == 0]
    n = max(1, sum(1 for s in w if s.name == "iteration"))
    down = [s for s in w if s.name == "grad_bucket"]
    up = [s for s in w if s.name == "weights_up"]
    res = {"to_host_B": sum(s.args.get("bytes", 0) for s in down) / n,
           "to_device_B": sum(s.args.get("bytes", 0) for s in up) / n,
           # copied while the update still ran, or inside backward (runtime.weights_up)
           "to_device_early_B": sum(s.args.get("bytes", 0) for s in up if s.args.get("early")) / n}
    t_up = sum(s.dur for s in up)
    # host-side time: on CUDA the span covers issuing asynchronous copies, not the copy itself
    res["to_device_GBps"] = sum(s.args.get("bytes", 0) for s in up) / (t_up * 1e3) if t_up else None
    upd = [s for s in spans if s.role == "server" and s.name == "update"]
    # a STEP's bytes are moved by its span and by the speculated pieces before it
    t_upd = sum(s.dur for s in spans if s.role == "server" and s.name in SERVER_UPDATE)
    res["update_GBps"] = sum(s.args.get("bytes", 0) for s in upd) / (t_upd * 1e3) if t_upd else None
    return res


def timeline_png(spans: list[Span], path: str, n_steps: int = 4) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    its = sorted((s for s in spans if s.role == "worker" and s.rank == 0 and s.name == "iteration"),
                 key=lambda s: s.ts)
    if len(its) < 2:
        raise ValueError("need at least two traced iterations for a timeline")
    i0 = max(0, len(its) - n_steps - 1)
    t0, t1 = its[i0].ts, its[min(len(its) - 1, i0 + n_steps)].end
    colors = {"forward": "tab:blue", "backward": "tab:orange", "wait_server": "tab:red", "weights_up": "tab:green",
              "grad_check": "tab:purple", "signal": "tab:brown", "update": "tab:olive", "all_gather": "tab:cyan",
              "grad_bucket": "tab:pink", "speculate": "gold", "rollback": "black", "overlap_wait": "tab:gray"}
    tracks = sorted({(s.role, s.rank, s.pid) for s in spans if s.role in ("worker", "server")},
                    key=lambda k: (k[0] != "worker", k[1]))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(tracks)))
    for y, (role, rank, pid) in enumerate(tracks):
        for s in spans:
            if (s.role, s.rank, s.pid) != (role, rank, pid) or s.name not in colors or s.end < t0 or s.ts > t1:
                continue
            ax.barh(y, s.dur / 1e3, left=(s.ts - t0) / 1e3, color=colors[s.name], height=0.6)
    ax.set_yticks(range(len(tracks)), [f"{r}-{k}" for r, k, _ in tracks])
    ax.set_xlabel("ms")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
              loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title("steady-state steps: server update vs worker forward/backward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
