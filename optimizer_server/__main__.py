"""Run the optimizer server: ``python -m zero_offload.server`` or ``zero-offload-server``.

    zero-offload-server --address-file ~/.zero-offload/addr --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import DEFAULT_HEARTBEAT_TIMEOUT_S, RAM_FRACTION_ENV, SAVE_RATE_ENV, TOKEN_ENV, ServerConfig
from .files import read_token_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zero-offload-server", description="ZeRO-Offload CPU optimizer server")
    ap.add_argument("--address", default="", help="ipc://PATH or tcp://[HOST]:PORT (default: private ipc socket)")
    ap.add_argument("--allow-remote", action="store_true",
                    help="permit a tcp bind beyond loopback (workers must still run on this host)")
    ap.add_argument("--address-file", default="", help="write the bound address here once ready")
    ap.add_argument("--token-file", default="",
                    help="read the auth token from this file (yours, mode 0600); default: $ZERO_OFFLOAD_TOKEN, "
                         "else random (written beside --address-file). Never on the command line: every user "
                         "of the machine can read a process's arguments (ps)")
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads per update (0: OpenMP default)")
    ap.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
                    help="drop a worker silent for this many seconds")
    ap.add_argument("--exit-when-idle", action="store_true", help="exit once the last worker is gone")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--trace-dir", default="", help="write a Chrome trace of the server's phases here")
    ap.add_argument("--max-ram-fraction", default=os.environ.get(RAM_FRACTION_ENV, "0.9"),
                    help=f"refuse a shard needing more than this fraction of MemAvailable; 0: no check "
                         f"(a VM whose RAM grows as it is used); default ${RAM_FRACTION_ENV} or 0.9")
    ap.add_argument("--max-sessions", type=int, default=64, help="refuse HELLO beyond this many shards (0: no cap)")
    ap.add_argument("--save-max-bytes-per-s", default=os.environ.get(SAVE_RATE_ENV, "0"),
                    help=f"cap a checkpoint save's writes at this many bytes per second, for a disk the job "
                         f"shares (0: no cap); default ${SAVE_RATE_ENV} or 0")
    ap.add_argument("--no-save-snapshot", action="store_true",
                    help="a background save takes no snapshot: the updates during it wait for the disk (benchmarks)")
    if argv is None:
        argv = sys.argv[1:]
    if any(x == "--token" or x.startswith("--token=") for x in argv):
        ap.error(f"--token would put the secret in this process's arguments, which every user of the machine can "
                 f"read (ps); pass it in ${TOKEN_ENV} or in a 0600 file named by --token-file")
    ap.add_argument("--two-pass-load", action="store_true",
                    help="LOAD verifies every file, then reads it, even where one pass would do (benchmarks)")
    a = ap.parse_args(argv)
    token = ""
    if a.token_file:
        try:
            token = read_token_file(a.token_file)
        except ValueError as e:
            ap.error(str(e))
    try:
        ram_fraction = float(a.max_ram_fraction)
    except ValueError:
        ap.error(f"--max-ram-fraction (or ${RAM_FRACTION_ENV}) must be a number in [0, 1], "
                 f"got {a.max_ram_fraction!r}")
    try:
        save_rate = float(a.save_max_bytes_per_s)
    except ValueError:
        ap.error(f"--save-max-bytes-per-s (or ${SAVE_RATE_ENV}) must be a number >= 0, "
                 f"got {a.save_max_bytes_per_s!r}")
    try:
        cfg = ServerConfig(address=a.address, allow_remote=a.allow_remote, address_file=a.address_file, token=token,
                           threads=a.threads,
                           heartbeat_timeout_s=a.heartbeat_timeout, exit_when_idle=a.exit_when_idle,
                           log_level=a.log_level, parent_pid=a.parent_pid,
                           trace_dir=a.trace_dir, max_ram_fraction=ram_fraction,
                           max_sessions=a.max_sessions, save_max_bytes_per_s=save_rate,
                           save_snapshot=not a.no_save_snapshot, load_one_pass=not a.two_pass_load)
    except ValueError as e:
        ap.error(str(e))
    if cfg.address_file:
        cfg.address_file = os.path.expanduser(cfg.address_file)
    from .server import run  # imports the kernel; keep --help fast
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
