"""Per-process phase tracing to Chrome trace-event JSON (Perfetto / chrome://tracing).

Each process records complete ("X") events with time.perf_counter_ns(), which
is CLOCK_MONOTONIC on Linux: one clock for every process of a node, so the
files of the workers and the server line up when merged
(scripts/trace_merge.py).  Disabled, ``span`` returns a shared no-op context:
one attribute lookup and a call, nothing recorded.

Importable without torch (the server uses it too).  The directory may be one others
can reach (``--trace-dir`` on a shared disk): it must be the user's own or sticky
(files.check_private_dir), and each file goes through the atomic writer (a random
temporary name opened O_EXCL|O_NOFOLLOW, then renamed), so nothing planted there
(a file, a link) receives a trace or redirects one.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from .atomic import atomic_write_bytes
from .files import check_private_dir

_NULL = contextlib.nullcontext()


class Tracer:
    def __init__(self, trace_dir: str = "", role: str = "worker", rank: int = 0):
        self.enabled = bool(trace_dir)
        self.dir = trace_dir
        self.role = role
        self.rank = rank
        self.pid = os.getpid()
        self.events: list[dict] = []
        self._lock = threading.Lock()
        if self.enabled:
            Path(trace_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
            check_private_dir(trace_dir, "trace")
            self.events.append({"ph": "M", "name": "process_name", "pid": self.pid,
                                "args": {"name": f"{role}-{rank}"}})

    @contextlib.contextmanager
    def _span(self, name: str, args: dict | None):
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, t0, time.perf_counter_ns(), args)

    def span(self, name: str, **args):
        if not self.enabled:
            return _NULL
        return self._span(name, args or None)

    def add(self, name: str, t0_ns: int, t1_ns: int, args: dict | None = None) -> None:
        if not self.enabled:
            return
        ev = {"ph": "X", "name": name, "pid": self.pid, "tid": threading.get_native_id(),
              "ts": t0_ns / 1000.0, "dur": (t1_ns - t0_ns) / 1000.0}
        if args:
            ev["args"] = args
        with self._lock:
            self.events.append(ev)

    def path(self) -> str:
        return os.path.join(self.dir, f"{self.role}-{self.rank}-{self.pid}.json")

    def flush(self) -> str | None:
        """Write all events so far (atomically); returns the file path."""
        if not self.enabled:
            return None
        with self._lock:
            data = {"traceEvents": list(self.events), "displayTimeUnit": "ms",
                    "otherData": {"role": self.role, "rank": self.rank, "clock": "CLOCK_MONOTONIC"}}
        p = self.path()
        atomic_write_bytes(Path(p), json.dumps(data).encode(), fsync=False)  # a trace need not survive a crash
        return p
