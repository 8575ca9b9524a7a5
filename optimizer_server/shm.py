"""POSIX shared-memory segments: one per shard, holding its gradients, weights and staging.

The server creates (and alone unlinks) each segment; workers attach to it by
name.  ShardLayout's docstring draws the layout.  Segments are created with
mode 0600 under names unique to the server instance.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np

from .protocol import DEFAULT_STAGING_NUMEL

try:
    import _posixshmem  # CPython's shm_open/shm_unlink, without resource_tracker
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

PAGE = 4096
SHM_DIR = "/dev/shm"


def _round_up(x: int, a: int = PAGE) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """Where everything lies in one shard's segment (offsets in bytes):

     0                                   grad_offsets[1]      weights_offsets[0]         progress_offset  ready_offset
     +-----------------+-----------------+ . . . . . +-----------------+ . . . . +----------+ . . +--------+ . .
     | grad slot 0     | grad slot 1     |  padding  | weights16 slot 0| (slot 1)| progress |     | ready  | to
     | numel x 2 B     | numel x 2 B     |  to 4 KiB | numel x 2 B     | to 64 B | uint64   |     | uint64 | 4 KiB
     +-----------------+-----------------+ . . . . . +-----------------+ . . . . +----------+ . . +--------+ . .
     |<- staging fp32: staging_numel x 4 B ->|

    Gradient slots (grad_slots, 1 or 2): the worker writes a step's 16-bit
    gradients into one and names it in STEP.  One slot is the default, for DPU
    too: the worker writes each range of the next step's gradients only once
    the update in flight has published that it is past it.  A second slot
    (DPU with dpu_grad_slots=2) spares backward that wait, for +2 B/param.

    The fp32 staging area is a window of staging_numel elements over the start
    of the gradient region, which is made at least that long: it is used only
    when no step is in flight, and INIT and GET_MASTER move the fp32 weights
    through it in chunks, so it costs at most the window (64 MiB by default)
    beyond the gradient slots, nothing once they are longer.

    Weights slots (weights_slots, 1 or 2), each page-aligned: the server writes
    the new 16-bit weights into the one STEP.weights_slot names.  A worker whose
    device is this CPU keeps its model's weights in the other slot, so an update
    needs no copy up at all, only a swap (cpu_zero_copy).

    The progress word, on a cache line of its own, is written by the server alone:
    during an update, (step << 40) | weights16 elements already final, after each
    block (cython_ext.cpu_adam, release store); 0 after INIT and LOAD.  The worker
    reads it (acquire) to copy finished weights up while the update still runs.

    The ready word, on the next cache line, is written by the worker alone, the
    other way round: while backward runs, (step << 40) | gradient elements [0, n)
    already final in the slot, after each bucket lands (release store).  The
    server reads it (acquire) only between a step's first SPECULATE and its STEP,
    to speculate further without a message per bucket; the worker stores it before
    that SPECULATE, so no older value is read for the step.

    Host RAM per parameter: 12 private (the server's master, m, v) + 4 shared (one
    gradient slot, one weights slot) = 16; +2 for a second gradient slot, +2 for a
    second weights slot (which spares the CPU worker its own copy of the model).
    With state_dtype="bf16" and the exact master the private part is 6, so 10 in
    all (int8: 4.03, so 8.03): the weights slot then also holds the master's high
    halves, and only the server writes it (optimizer_server.state).
    """

    numel: int
    weights_slots: int = 1
    grad_slots: int = 1
    staging_numel: int = 0  # as asked (0: protocol.DEFAULT_STAGING_NUMEL); then what it is, at most numel

    def __post_init__(self) -> None:
        object.__setattr__(self, "staging_numel", min(self.numel, self.staging_numel or DEFAULT_STAGING_NUMEL))

    @property
    def grad_offsets(self) -> tuple[int, ...]:
        return tuple(i * 2 * self.numel for i in range(self.grad_slots))

    @property
    def staging_offset(self) -> int:
        return 0

    @property
    def weights_offsets(self) -> tuple[int, ...]:
        first = _round_up(max(self.grad_slots * 2 * self.numel, 4 * self.staging_numel))
        return tuple(first + i * _round_up(2 * self.numel) for i in range(self.weights_slots))

    @property
    def progress_offset(self) -> int:
        # its own cache line: the worker polls it while the server writes weights
        return _round_up(self.weights_offsets[-1] + 2 * self.numel, 64)

    @property
    def ready_offset(self) -> int:
        # a line of its own too: the worker writes it while the server polls it
        return self.progress_offset + 64

    @property
    def total_bytes(self) -> int:
        return _round_up(self.ready_offset + 8)


class Segment:
    """A mapped shared-memory segment.  ``create`` for the server, ``attach`` for workers."""

    def __init__(self, name: str, size: int, mm: mmap.mmap):
        self.name = name
        self.size = size
        self._mm = mm

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
            os.ftruncate(fd, size)
            # commit the pages now: a full /dev/shm is a clear refusal at HELLO, not a SIGBUS
            # at the first write of a sparse page in the middle of training
            if size:
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        return cls(name, size, mm)

    @classmethod
    def attach(cls, name: str, size: int) -> "Segment":
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"shared segment {name} has {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mm)

    def array(self, dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

    @property
    def buffer(self) -> mmap.mmap:
        return self._mm

    def close(self) -> None:
        """Unmap.  Every array view onto the segment must be dropped first."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # a view is still alive somewhere; the map goes when it does
                pass
            self._mm = None

    def unlink(self) -> None:
        unlink(self.name)


def unlink(name: str) -> bool:
    """Remove a segment's name; True if it existed."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False
