"""Admission of a HELLO: the checks a worker must pass before anything is allocated.

In order: protocol version, token, host RAM (MemAvailable), /dev/shm space.  The
order matters: a client of another version or without the token learns nothing
about this machine, and nothing is allocated for a client that fails any check.
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


def admit(msg: P.Hello, *, token: str, max_ram_fraction: float) -> ShardLayout:
    """The layout of the segment to create for msg, or Refused saying why not."""
    if msg.version != P.PROTOCOL_VERSION:
        raise Refused(P.E_VERSION, f"protocol version mismatch: client {msg.version}, server "
                                   f"{P.PROTOCOL_VERSION}; install the same zero-offload on both")
    if not hmac.compare_digest(msg.token.encode(), token.encode()):
        raise Refused(P.E_AUTH, "wrong or missing token: pass the token the server wrote next to its address file "
                                "(ZERO_OFFLOAD_TOKEN)")
    layout = ShardLayout(numel=msg.numel, weight_slots=msg.weight_slots, grad_slots=msg.grad_slots,
                         staging_numel=msg.staging_numel)
    need = (int(msg.numel * bytes_per_param(msg.optimizer, msg.state_dtype, msg.exact_master)) + layout.total_bytes
            + msg.undo_log_bytes)  # the undo log may fill entirely
    # the worker's fp32 model is resident now and goes once INIT has cast it (frees_bytes):
    # what the shard may count on is what is free after that
    avail = read_mem_available() + msg.frees_bytes
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
        raise Refused(P.E_RESOURCE, f"shard of {msg.numel} params needs {need / 2**30:.2f} GiB of host RAM "
                                    f"({need} bytes) but {avail / 2**30:.2f} GiB ({avail} bytes) is available, "
                                    f"counting the {msg.frees_bytes / 2**30:.2f} GiB the worker frees after set-up; "
                                    f"use {smaller}{'a smaller undo_log_bytes, ' if msg.undo_log_bytes else ''}"
                                    f"more ranks/nodes or a smaller model (where RAM grows as it is "
                                    f"used, as in some VMs, ZERO_OFFLOAD_MAX_RAM_FRACTION=0 turns this check off)")
    free = shm_free_bytes()
    if free is not None and layout.total_bytes > free:
        raise Refused(P.E_RESOURCE, f"shard segment needs {layout.total_bytes} bytes but {SHM_DIR} has {free} "
                                    f"free; enlarge {SHM_DIR} (docker: --shm-size)")
    return layout
