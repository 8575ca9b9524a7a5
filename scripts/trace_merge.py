"""Merge the per-process traces of a run into one file for Perfetto / chrome://tracing.

    python scripts/trace_merge.py TRACE_DIR -o run.json
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zero_offload.trace_analysis import merge  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("-o", "--output", default="run.json")
    a = ap.parse_args(argv)
    data = merge(a.trace_dir)
    Path(a.output).write_text(json.dumps(data))
    print(f"{a.output}: {len(data['traceEvents'])} events; open it in ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
