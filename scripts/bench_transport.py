"""Control-message round trips worker <-> server, and copies into/out of the shared buffers.

    python scripts/bench_transport.py [--n 5000] [--numel 8M] [--no-write]

Round trips (p50/p99): STATS (socket + decode, answered on the socket thread)
and STEP of a 16-element shard (socket + hand-off to the update thread + the
wake-up pipe + reply): the control overhead a real step pays on top of the
update itself.  Copies: a gradient shard into the shared segment and the
weights out of it, against a plain copy between private tensors of the same
size, both pre-faulted.  Server on core 0, client on core 1 when there are two.
Writes BENCHMARKS.md section "bench_transport".
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
import torch  # noqa: E402

from bench_md import machine_line, update_section  # noqa: E402
from bench_adam import parse_size  # noqa: E402
from zero_offload.server import ShardClient, spawn  # noqa: E402


ECHO = r"""
import sys, zmq
c = zmq.Context(); s = c.socket(zmq.ROUTER); s.bind(sys.argv[1]); print("ready", flush=True)
while True:
    i, m = s.recv_multipart()
    if m == b"quit":
        break
    s.send_multipart([i, m])
"""


def raw_echo_latency(n: int, core) -> list[float]:
    """Baseline: the same round trip through a bare ROUTER that echoes, nothing else."""
    import subprocess
    import tempfile
    import zmq
    d = tempfile.mkdtemp(prefix="zo-echo-")
    addr = f"ipc://{d}/echo.sock"
    p = subprocess.Popen([sys.executable, "-c", ECHO, addr], stdout=subprocess.PIPE, text=True)
    try:
        if core is not None:
            os.sched_setaffinity(p.pid, {core})
        p.stdout.readline()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        msg = b"\x82\xa1t\xa5STATS\xa7session\xb0abcdef0123456789"
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            s.send(msg)
            if not s.poll(5000):
                raise TimeoutError("echo server did not answer")
            s.recv()
            lat.append(time.perf_counter() - t0)
        s.send(b"quit")
        s.close()
        ctx.term()
        p.wait(10)
    finally:
        p.kill()
        import shutil
        shutil.rmtree(d, ignore_errors=True)
    return lat[n // 10:]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per kind")
    ap.add_argument("--numel", default="8M", help="elements for the copy measurement")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[1]})
    # one thread on one core: more would wait on each other's time slices
    torch.set_num_threads(1)
    rows = []
    raw = raw_echo_latency(a.n, cores[0] if len(cores) >= 2 else None)
    rows.append(f"| baseline: bare ZeroMQ echo, same message | {statistics.median(raw) * 1e6:.0f} us | "
                f"{pct(raw, 0.99) * 1e6:.0f} us | |")
    print(rows[-1], flush=True)
    with spawn(threads=1) as srv:
        if len(cores) >= 2:
            os.sched_setaffinity(srv.pid, {cores[0]})
        c = ShardClient(srv.address, srv.token, numel=16, server_proc=srv.proc, grad_slots=2)
        c.init_weights(np.zeros(16, np.float32))
        for name, fn in (("STATS", lambda k: c.stats()), ("STEP (16 params)", lambda k: c.step(k, k % 2, 0.0))):
            lat = []
            for k in range(1, a.n + 1):
                t0 = time.perf_counter()
                fn(k)
                lat.append(time.perf_counter() - t0)
            lat = lat[a.n // 10:]
            over = (statistics.median(lat) - statistics.median(raw)) * 1e6
            rows.append(f"| round trip {name} | {statistics.median(lat) * 1e6:.0f} us | {pct(lat, 0.99) * 1e6:.0f} us | "
                        f"+{over:.0f} us over the bare echo |")
            print(rows[-1], flush=True)
        c.close()
        n = parse_size(a.numel)
        big = ShardClient(srv.address, srv.token, numel=n, server_proc=srv.proc)
        shared_g = torch.from_numpy(big.grads[0].view(np.int16)).view(torch.float16)
        shared_w = torch.from_numpy(big.weights16.view(np.int16)).view(torch.float16)
        src = torch.randn(n).half()
        dst = torch.empty(n, dtype=torch.float16)
        for t in (shared_g, shared_w, dst):
            t.zero_()  # fault every page in first
        reps = 20

        def timed(f):
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        t_down = timed(lambda: shared_g.copy_(src))
        t_up = timed(lambda: dst.copy_(shared_w))
        t_plain = timed(lambda: dst.copy_(src))
        gb = 2 * n / 1e9
        for name, t in (("gradient shard -> shared buffer", t_down), ("weights shared buffer -> device tensor", t_up),
                        ("plain memcpy, private tensors", t_plain)):
            rows.append(f"| {name} ({2 * n / 2**20:.0f} MiB) | {t * 1e3:.2f} ms | | {gb / t:.1f} GB/s "
                        f"({t_plain / t:.2f}x of plain) |")
            print(rows[-1], flush=True)
        shared_g = shared_w = None  # drop the views before the segment is unmapped
        big.close()
    body = (f"## Transport (scripts/bench_transport.py)\n\n{machine_line()}; ZeroMQ over ipc, msgpack; server on core "
            f"{cores[0]}, client on core {cores[-1]}; {a.n} round trips each (first 10% dropped).\n\n"
            "| what | p50 / time | p99 | bandwidth / overhead |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    if not a.no_write:
        update_section("bench_transport", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
