"""Write one named section of BENCHMARKS.md, replacing the previous run's.

Each benchmark script owns the text between `<!-- begin NAME -->` and
`<!-- end NAME -->`; other sections (and hand-written notes) are left alone.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} cores"


def update_section(name: str, body: str, path: Path = BENCHMARKS) -> None:
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
