"""Configuration of the optimizer server process."""
from __future__ import annotations

import logging
from dataclasses import dataclass

DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
# The environment variables that carry a server's settings to its workers and children.
ADDRESS_ENV = "ZERO_OFFLOAD_ADDRESS"            # the launcher sets it for its workers
TOKEN_ENV = "ZERO_OFFLOAD_TOKEN"                # spawn() and the launcher pass the token so, never in argv
RAM_FRACTION_ENV = "ZERO_OFFLOAD_MAX_RAM_FRACTION"
TRACE_DIR_ENV = "ZERO_OFFLOAD_TRACE_DIR"        # the launcher's --trace-dir, for workers and server alike
SAVE_RATE_ENV = "ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S"  # --save-max-bytes-per-s for a server an engine spawns


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


def tcp_host(address: str) -> str:
    """The host of a tcp:// address ("" when it names a port alone, which binds loopback)."""
    hostport = address[len("tcp://"):] if address.startswith("tcp://") else ""
    return hostport.rsplit(":", 1)[0] if ":" in hostport else ""


@dataclass(kw_only=True)
class ServerConfig:
    """Settings of one optimizer server.

    address: ZeroMQ endpoint to bind. "" = ipc:// in a fresh private 0700 directory.
        tcp://:PORT or tcp://PORT binds 127.0.0.1 only; another host (or *) needs
        allow_remote.
    allow_remote: permit a tcp bind on a non-loopback interface.  Workers still need the
        shared segment, so they must run on this host: listening wider only exposes
        the token check to the network.
    address_file: write the bound address here (atomically) once ready; the token
        goes to ADDRESS_FILE.token (0600) and the segment list to .segments, which
        the next server with the same file uses to sweep a killed server's leftovers.
    token: shared secret workers must present in HELLO ("" = ZERO_OFFLOAD_TOKEN or random).
    threads: OpenMP threads per shard update (0 = OpenMP default).
    heartbeat_timeout_s: a worker silent this long is dropped and its segment unlinked.
    exit_when_idle: exit once the last worker has said BYE or been dropped.
    max_ram_fraction: refuse a shard needing more than this fraction of MemAvailable;
        0 turns the check off, for machines whose RAM grows as it is used (VMs with
        memory hot-plug or ballooning report far less at first).  The command line's
        default comes from ZERO_OFFLOAD_MAX_RAM_FRACTION, so a server that an engine
        spawns can be told too.
    max_sessions: refuse a HELLO once this many shards are admitted (0: no cap); a
        node runs a handful of ranks, and each session holds a segment and a thread.
    save_max_bytes_per_s: the most bytes per second a checkpoint save writes (0: as fast
        as the disk takes them).  For a disk or network filesystem that the job shares
        (its data loader, other jobs), so that a save does not starve them; the command
        line's default comes from ZERO_OFFLOAD_SAVE_MAX_BYTES_PER_S, as for
        max_ram_fraction.
    save_snapshot: a background save snapshots what the updates during it overwrite
        (ckpt_io.SaveJob), where host RAM allows; False: they write it to the file
        first and wait for the disk (an A/B switch for benchmarks).
    load_one_pass: a LOAD reads a rank's own file once, into a new state it swaps in
        once the file verified, where host RAM admits that second state; False: it
        always verifies every file first, then reads (an A/B switch for benchmarks).
    log_level: logging level name.
    parent_pid: exit when this process is gone (spawn() sets it: a killed trainer or
        launcher leaves no orphan server).  0 = run on its own.
    trace_dir: write this server's Chrome trace (server-0-PID.json) here at exit.
    """

    address: str = ""
    allow_remote: bool = False
    address_file: str = ""
    token: str = ""
    threads: int = 0
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    exit_when_idle: bool = False
    max_ram_fraction: float = 0.9
    max_sessions: int = 64
    save_max_bytes_per_s: float = 0.0
    save_snapshot: bool = True
    load_one_pass: bool = True
    log_level: str = "INFO"
    parent_pid: int = 0
    trace_dir: str = ""

    def __post_init__(self) -> None:
        if self.address and not self.address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"address must start with ipc:// or tcp://, got {self.address!r}")
        if self.address.startswith("tcp://") and not self.allow_remote:
            host = tcp_host(self.address)
            if host and host not in LOOPBACK_HOSTS:
                raise ValueError(f"address {self.address} listens beyond this host; workers share memory with the "
                                 f"server, so they run here: bind tcp://127.0.0.1:PORT, or pass --allow-remote "
                                 f"(allow_remote=True) to listen on {host!r} anyway")
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0 (0: no cap), got {self.max_sessions}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = OpenMP default), got {self.threads}")
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if not (self.save_max_bytes_per_s >= 0 and self.save_max_bytes_per_s < float("inf")):
            raise ValueError(f"save_max_bytes_per_s must be a finite number >= 0 (0: no cap), "
                             f"got {self.save_max_bytes_per_s}")
        if not 0 <= self.max_ram_fraction <= 1:
            raise ValueError(f"max_ram_fraction must be in [0, 1] (0: no check), got {self.max_ram_fraction}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):
            raise ValueError(f"log_level must be a logging level name (DEBUG, INFO, ...), got {self.log_level!r}")
