"""Per-phase table, hidden share of the CPU update, bytes per step, and a timeline PNG.

    python scripts/train_gpt.py --steps 30 --trace-dir /tmp/tr
    python scripts/trace_report.py /tmp/tr --png timeline.png
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero_offload.trace_analysis import (STEADY_ITERATIONS, bytes_per_step, has_server, hidden_fraction, load,  # noqa: E402
                                    phase_table, timeline_png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--png", default="", help="write a timeline of a few steady-state steps here")
    ap.add_argument("--skip", type=int, default=3, help="iterations to leave out as warm-up")
    a = ap.parse_args(argv)
    spans = load(a.trace_dir)
    rows, step_ms = phase_table(spans, a.skip)
    print(f"mean iteration {step_ms:.2f} ms (rank 0, after {a.skip} warm-up iterations)")
    print(f"{'phase':16s} {'count':>6s} {'mean ms':>9s} {'p50 ms':>9s} {'p99 ms':>9s} {'share':>7s}")
    for r in rows:
        print(f"{r['phase']:16s} {r['count']:6d} {r['mean_ms']:9.3f} {r['p50_ms']:9.3f} {r['p99_ms']:9.3f} "
              f"{100 * r['share']:6.1f}%")
    server = has_server(spans)
    if not server:
        print(f"no optimizer server trace in {a.trace_dir}: the share of the update hidden and the update's GB/s "
              f"need it (zero-offload-launch --trace-dir DIR traces the launched server too; a standalone server "
              f"takes --trace-dir DIR)")
    else:
        h = hidden_fraction(spans)
        print("CPU update hidden behind forward/backward (steady state, the last "
              f"{STEADY_ITERATIONS} iterations): " + (f"{100 * h:.1f}%" if h is not None else
                                                     "no update in those iterations"))
        spec = [s for s in spans if s.role == "server" and s.name == "speculate"]
        if spec:
            steps = {s.args.get("step") for s in spec}
            rolled = [s for s in spans if s.role == "server" and s.name == "rollback"]
            print(f"speculation: {len(spec)} pieces in {len(steps)} steps, {sum(s.dur for s in spec) / 1e3:.1f} ms "
                  f"of update inside backward; {len(rolled)} rollbacks ({sum(s.dur for s in rolled) / 1e3:.1f} ms "
                  f"restoring), so {len(steps) - len(rolled)} steps kept what backward updated")
    b = bytes_per_step(spans)
    if b["to_device_B"]:
        up = (f"{b['to_device_B'] / 1e6:.2f} MB to device ({100 * b['to_device_early_B'] / b['to_device_B']:.0f}% "
              f"of it before the update ended or inside backward), at {b['to_device_GBps']:.1f} GB/s host-side")
    else:
        up = "no weight copies (the CPU device's zero-copy slots)"
    upd = f"; server update at {b['update_GBps']:.1f} GB/s" if b["update_GBps"] is not None else ""
    print(f"per step: {b['to_host_B'] / 1e6:.2f} MB to host, {up}{upd}")
    if a.png:
        timeline_png(spans, a.png)
        print(f"timeline: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
