"""Start one optimizer server for this node, then the training workers through torchrun.

    zero-offload-launch --nproc-per-node 2 scripts/train_gpt.py --steps 100
    python -m zero_offload.launch --nproc-per-node 8 --server-threads 8 train.py ...
    # multi-node: the same on every node, with torchrun's rendezvous options
    zero-offload-launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 8 train.py

    # survive crashes: restart the server and the workers (from the last checkpoint)
    zero-offload-launch --max-restarts 3 scripts/train_gpt.py --ckpt-dir ck --ckpt-every 50 --auto-resume

The server's address and token reach the workers through ZERO_OFFLOAD_ADDRESS
and ZERO_OFFLOAD_TOKEN, which OffloadEngine reads; --trace-dir DIR makes the
server and every worker trace into DIR (ZERO_OFFLOAD_TRACE_DIR, which
OffloadConfig.trace_dir defaults to).  Each worker must make its process group
(torch.distributed.init_process_group) before its engine: scripts/train_gpt.py
does.  The CPU cores are split
between the server's update threads and the workers (affinity and
OMP_NUM_THREADS), and the split is printed.  When a worker fails, or on
Ctrl-C / SIGTERM, everything is stopped within STOP_TIMEOUT_S: torchrun's
process group, then the server (which unlinks its shared segments); the
launcher exits with the workers' exit code.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

from zero_offload.server.config import ADDRESS_ENV, TOKEN_ENV, TRACE_DIR_ENV
from zero_offload.server.procs import describe_exit
from zero_offload.server.spawn import spawn

STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
# torchrun options that take no value; every other option before SCRIPT takes one
TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path"}
OPTIONS = {"--nproc-per-node": "nproc", "--nproc_per_node": "nproc", "--server-threads": "server_threads",
           "--worker-threads": "worker_threads", "--server-log-level": "log_level", "--max-restarts": "max_restarts",
           "--trace-dir": "trace_dir"}
TEXT_OPTIONS = ("log_level", "trace_dir")
# torchrun's elastic restarts re-run the workers against the same (possibly dead)
# server: one spelling, one meaning, so torchrun's is refused with the launcher's named
REFUSED = {"--max_restarts": "--max_restarts is torchrun's elastic restart, which re-runs the workers without a "
                             "fresh optimizer server; use --max-restarts N (server and workers restart together, "
                             "resuming from the last checkpoint)"}

USAGE = ("usage: zero-offload-launch [--nproc-per-node N] [--server-threads T] [--worker-threads W] "
         "[--server-log-level L] [--max-restarts R] [--trace-dir DIR] [torchrun options] SCRIPT [ARGS...]")


def parse(argv: list[str]) -> tuple[dict, list[str], list[str]]:
    opts = {"nproc": 1, "server_threads": 0, "worker_threads": 0, "log_level": "WARNING", "max_restarts": 0,
            "trace_dir": ""}
    torch_opts: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(USAGE)
            print(__doc__)
            sys.exit(0)
        if not a.startswith("-"):
            return opts, torch_opts, argv[i:]
        name, eq, val = a.partition("=")
        if name in REFUSED:
            raise SystemExit(f"zero-offload-launch: {REFUSED[name]}")
        if name in OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"zero-offload-launch: {name} needs a value\n{USAGE}")
                val = argv[i + 1]
                i += 1
            key = OPTIONS[name]
            if key in TEXT_OPTIONS:
                opts[key] = val
            else:
                try:
                    opts[key] = int(val)
                except ValueError:
                    raise SystemExit(f"zero-offload-launch: {name} must be an integer, got {val!r}") from None
                if opts[key] < (1 if key == "nproc" else 0):
                    raise SystemExit(f"zero-offload-launch: {name} must be >= {1 if key == 'nproc' else 0}")
        elif name in TORCHRUN_FLAGS or eq:
            torch_opts.append(a)
        else:
            if i + 1 >= len(argv):
                raise SystemExit(f"zero-offload-launch: {name} needs a value\n{USAGE}")
            torch_opts += [a, argv[i + 1]]
            i += 1
        i += 1
    raise SystemExit(f"zero-offload-launch: no training script given\n{USAGE}")


# torchrun options that say where the workers meet; without any, torchrun would use
# 127.0.0.1:29500, so two single-node jobs on one machine would collide there
RENDEZVOUS_OPTIONS = ("--standalone", "--nnodes", "--node-rank", "--node_rank", "--master-addr", "--master_addr",
                      "--master-port", "--master_port", "--rdzv")


def rendezvous(torch_opts: list[str]) -> list[str]:
    """torch_opts, plus --standalone (a free port, one node) when they name no rendezvous."""
    if any(a.partition("=")[0].startswith(RENDEZVOUS_OPTIONS) for a in torch_opts):
        return torch_opts
    return ["--standalone", *torch_opts]


def gpus_visible() -> bool:
    """Whether the workers will see a GPU, told without importing torch (which costs
    the launcher ~3 s of a core): an NVIDIA or AMD GPU device node, unless
    CUDA_VISIBLE_DEVICES hides every device.  It only decides how cores are split."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None and vis.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def split_cores(nproc: int, server_threads: int, worker_threads: int, cuda: bool) -> tuple[list[int], list[int], int, int]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    n = len(cores)
    if not server_threads:
        # GPU workers need little CPU: the update gets the rest.  CPU workers do
        # the forward/backward themselves: one share each, the server one share.
        server_threads = max(1, n - nproc) if cuda else max(1, n // (nproc + 1))
    server_threads = min(server_threads, n)
    server_cores = cores[:server_threads]
    worker_cores = cores[server_threads:] or cores
    if not worker_threads:
        worker_threads = max(1, len(worker_cores) // nproc)
    return server_cores, worker_cores, server_threads, worker_threads


def main(argv: list[str] | None = None) -> int:
    opts, torch_opts, script = parse(sys.argv[1:] if argv is None else argv)
    cuda = gpus_visible()
    server_cores, worker_cores, st, wt = split_cores(opts["nproc"], opts["server_threads"], opts["worker_threads"],
                                                     cuda)
    print(f"zero-offload-launch: {len(os.sched_getaffinity(0))} cores: optimizer server {st} thread(s) on cores "
          f"{server_cores}; {opts['nproc']} worker(s) x {wt} thread(s) on cores {worker_cores}", flush=True)
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    rc = 1
    for attempt in range(opts["max_restarts"] + 1):
        if attempt:
            print(f"zero-offload-launch: restart {attempt} of {opts['max_restarts']}: a fresh optimizer server and "
                  f"workers (they resume from their last checkpoint)", file=sys.stderr, flush=True)
        rc, why = _attempt(opts, torch_opts, script, server_cores, worker_cores, st, wt, stop, attempt)
        if rc == 0 or stop["sig"] is not None:
            break
        print(f"zero-offload-launch: {why}", file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc


def _attempt(opts, torch_opts, script, server_cores, worker_cores, st, wt, stop, attempt) -> tuple[int, str]:
    """One run of server + workers; (exit code, what ended it)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(st))
    server = spawn(threads=st, log_level=opts["log_level"], env=env, stderr=None, trace_dir=opts["trace_dir"])
    try:
        os.sched_setaffinity(server.pid, server_cores)
    except (AttributeError, OSError):
        pass
    wenv = dict(os.environ, OMP_NUM_THREADS=str(wt), ZERO_OFFLOAD_RESTART_COUNT=str(attempt))
    wenv.update({ADDRESS_ENV: server.address, TOKEN_ENV: server.token})
    if opts["trace_dir"]:
        wenv[TRACE_DIR_ENV] = opts["trace_dir"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts["nproc"]),
           *rendezvous(torch_opts), *script]

    def pin():
        try:
            os.sched_setaffinity(0, worker_cores)
        except (AttributeError, OSError):
            pass

    workers = subprocess.Popen(cmd, env=wenv, start_new_session=True, preexec_fn=pin)
    rc, why = None, ""
    try:
        while rc is None:
            rc = workers.poll()
            if rc is not None:
                why = f"workers {describe_exit(rc)}"
                break
            if stop["sig"] is not None:
                print(f"zero-offload-launch: {signal.Signals(stop['sig']).name}: stopping workers and server",
                      file=sys.stderr, flush=True)
                rc = 128 + stop["sig"]
                why = f"stopped by {signal.Signals(stop['sig']).name}"
                break
            if not server.alive():
                why = f"optimizer server {describe_exit(server.returncode)}"
                print(f"zero-offload-launch: {why}; stopping workers", file=sys.stderr, flush=True)
                deadline = time.monotonic() + STOP_TIMEOUT_S  # workers raise OptimizerServerDeadError themselves
                while workers.poll() is None and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                rc = workers.poll() or 1  # a dead server is a failure even if the workers exit 0
                break
            time.sleep(POLL_S)
    finally:
        _stop_group(workers)
        server.stop(STOP_TIMEOUT_S)
    if rc != 0 and not why.startswith("workers"):
        why += f"; workers {describe_exit(rc)}"
    return rc, why


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of an exited torchrun
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(STOP_TIMEOUT_S)


if __name__ == "__main__":
    sys.exit(main())
