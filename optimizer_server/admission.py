"""Admission of a HELLO: the checks a worker must pass before anything is allocated.

In order: protocol version, token, the session cap, frees_bytes, host RAM, /dev/shm
space.  The order matters: a client of another version or without the token learns
nothing about this machine, and nothing is allocated for a client that fails any check.

Admission adds up.  Every admitted shard reserves the bytes it may come to use
(``need``: its state, its segment, its undo log, its worker's peak); the state's pages are committed
only as updates first write them, so MemAvailable does not yet show what an admitted
shard will take.  A new shard is admitted only if its need plus what the admitted
ones reserved and have not yet made resident (their reservations less the growth of
this process's resident memory since it started, ``Reservations.outstanding``) fits
in MemAvailable, plus what the new worker frees after INIT, times max_ram_fraction.
``frees_bytes`` is the client's word, so it is bounded by what the client cannot
inflate: the fp32 copy of its own shard (4 B per parameter of it).
"""
from __future__ import annotations

import hmac
import os

from . import protocol as P
from .shm import SHM_DIR, ShardLayout
from .state import bytes_per_param


def read_mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Refused(Exception):
    """A HELLO that is not admitted: code and message go back as an ERROR reply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def read_rss() -> int:
    """This process's resident bytes, less what it lent back to the kernel (MADV_FREE:
    the save pool's idle buffers, which the kernel takes at need and MemAvailable counts
    as free): /proc/self/smaps_rollup's Rss - LazyFree, else /proc/self/statm's resident
    pages.  Counted whole, a filled pool made the admitted shards' reservations look
    resident already, and a later HELLO was admitted against RAM they will take."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = {}
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "LazyFree"):
                    kb[key] = int(rest.split()[0])
        if "Rss" in kb:
            return (kb["Rss"] - kb.get("LazyFree", 0)) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Reservations:
    """The bytes admitted shards may still come to use (see the module docstring)."""

    def __init__(self):
        self.base_rss = read_rss()
        self.by_session: dict[str, int] = {}

    def add(self, session: str, nbytes: int) -> None:
        self.by_session[session] = nbytes

    def drop(self, session: str) -> None:
        self.by_session.pop(session, None)

    @property
    def outstanding(self) -> int:
        return max(0, sum(self.by_session.values()) - max(0, read_rss() - self.base_rss))


def shard_need(msg: P.Hello, layout: ShardLayout) -> int:
    """Host bytes one shard may use: its state, its segment, a full undo log, and what its
    worker takes at its peak beside them (gradients before they go down, set-up's casts:
    runtime.wiring.worker_peak_bytes), which it comes back to every step."""
    return (int(msg.numel * bytes_per_param(msg.optimizer, msg.state_dtype, msg.exact_master)) + layout.total_bytes
            + msg.undo_log_bytes + msg.worker_peak_bytes)


def admit(msg: P.Hello, *, token: str, max_ram_fraction: float, reserved: int = 0, sessions: int = 0,
          max_sessions: int = 0) -> ShardLayout:
    """The layout of the segment to create for msg, or Refused saying why not.
    reserved: what admitted shards may still take (Reservations.outstanding);
    sessions / max_sessions: how many are admitted, and the cap (0: none)."""
    if msg.version != P.PROTOCOL_VERSION:
        raise Refused(P.E_VERSION, f"protocol version mismatch: client {msg.version}, server "
                                   f"{P.PROTOCOL_VERSION}; install the same zero-offload on both")
    if not hmac.compare_digest(msg.token.encode(), token.encode()):
        raise Refused(P.E_AUTH, "wrong or missing token: pass the token the server wrote next to its address file "
                                "(ZERO_OFFLOAD_TOKEN)")
    if max_sessions and sessions >= max_sessions:
        raise Refused(P.E_RESOURCE, f"this server already serves {sessions} shards (max_sessions={max_sessions}); "
                                    f"close idle clients, or start the server with a larger --max-sessions")
    # bounded by what the client cannot inflate: this shard's own fp32 copy (its world_size
    # is its word too: claiming 2^20 ranks once let a 29.8 GiB shard in on 21 GiB)
    most = 4 * msg.numel
    if msg.frees_bytes > most:
        raise Refused(P.E_INVALID, f"frees_bytes={msg.frees_bytes} exceeds what admission counts a worker as "
                                   f"freeing, the fp32 copy of its shard ({most} bytes for {msg.numel} parameters); "
                                   f"send at most that")
    layout = ShardLayout(numel=msg.numel, weights_slots=msg.weights_slots, grad_slots=msg.grad_slots,
                         staging_numel=msg.staging_numel)
    need = shard_need(msg, layout)  # the undo log may fill entirely
    # the worker's fp32 model is resident now and goes once INIT has cast it (frees_bytes):
    # what the shard may count on is what is free after that, less what admitted shards
    # have reserved and not yet touched
    avail = read_mem_available() + msg.frees_bytes - reserved
    if max_ram_fraction and need > avail * max_ram_fraction:
        smaller = ""
        if msg.optimizer in P.COMPACT_OPTIMIZERS:  # the smaller state dtypes, with their B/param
            now = bytes_per_param(msg.optimizer, msg.state_dtype, msg.exact_master)
            fit = [(d, bytes_per_param(msg.optimizer, d, True)) for d in P.STATE_DTYPES[1:]]
            fit = [(d, b) for d, b in fit if b < now]
            if fit:
                smaller = (f"state_dtype={' or '.join(repr(d) for d, _ in fit)} "
                           f"({' or '.join(f'{b:.3g}' for _, b in fit)} B/param of optimizer state instead of "
                           f"{now:.3g}, with bf16 weights), ")
        worker = (f", {msg.worker_peak_bytes / 2**30:.2f} GiB of it the worker's own peak: its gradients before "
                  f"they go down, its set-up casts" if msg.worker_peak_bytes else "")
        raise Refused(P.E_RESOURCE, f"shard of {msg.numel} params needs {need / 2**30:.2f} GiB of host RAM "
                                    f"({need} bytes{worker}) but {avail / 2**30:.2f} GiB ({avail} bytes) is available, "
                                    f"counting the {msg.frees_bytes / 2**30:.2f} GiB the worker frees after set-up and "
                                    f"less the {reserved / 2**30:.2f} GiB admitted shards have reserved; "
                                    f"use {smaller}{'a smaller undo_log_bytes, ' if msg.undo_log_bytes else ''}"
                                    f"more ranks/nodes or a smaller model (where RAM grows as it is "
                                    f"used, as in some VMs, ZERO_OFFLOAD_MAX_RAM_FRACTION=0 turns this check off)")
    free = shm_free_bytes()
    if free is not None and layout.total_bytes > free:
        raise Refused(P.E_RESOURCE, f"shard segment needs {layout.total_bytes} bytes but {SHM_DIR} has {free} "
                                    f"free; enlarge {SHM_DIR} (docker: --shm-size)")
    return layout
