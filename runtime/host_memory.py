"""Host memory the engine manages outside torch's allocator.

- Page-locking the shared segment for CUDA (cudaHostRegister), so the gradient
  and weight copies are DMA that overlaps compute, and unregistering it.
- Giving the heap freed by the cast of the user's fp32 model back to the OS.
- Refusing a whole-model copy in the worker that would not fit beside the optimizer
  server (``has_room``): the kernel's OOM killer would pick the largest process,
  the server, and the training state since the last checkpoint would be lost.
"""
from __future__ import annotations

import ctypes
import os
import warnings

import numpy as np
import torch

from zero_offload.server.admission import read_mem_available
from zero_offload.server.config import RAM_FRACTION_ENV

PIN_MODES = ("auto", "require", "off")


class PinnedRegion:
    """A host range registered with CUDA for one device; ``release`` unregisters it."""

    def __init__(self, ptr: int, size: int, device: torch.device):
        self.ptr, self.size, self.device = ptr, size, device

    def release(self) -> None:
        if self.ptr is None:
            return
        # the copies that read or write the range must be done before it is unregistered
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.ptr = None
        if int(err) != 0:
            clear_cuda_last_error()
            warnings.warn(f"cudaHostUnregister of the shared segment failed with {err}", RuntimeWarning,
                          stacklevel=2)


def pin(buffer, size: int, device: torch.device, mode: str) -> PinnedRegion | None:
    """Page-lock `buffer` (the shared segment's mmap) for `device`.

    mode "auto": a refusal (the locked-memory limit, a sandbox) warns and returns
    None (pageable copies: slower, and they block); "require": it raises; "off":
    nothing is tried."""
    if mode not in PIN_MODES:
        raise ValueError(f"pin_host_memory must be one of {PIN_MODES}, got {mode!r}")
    if mode == "off":
        return None
    ptr = np.frombuffer(buffer, np.uint8).ctypes.data
    # in the context of the engine's device: registration is per context
    with torch.cuda.device(device):
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        clear_cuda_last_error()
        msg = (f"cudaHostRegister of the shared segment ({size} bytes) failed with {err}; raise the "
               f"locked-memory limit (ulimit -l) or use more ranks (smaller shards)")
        if mode == "require":
            raise RuntimeError(msg)
        warnings.warn(msg + "; going on with pageable copies, which are slower and do not overlap compute "
                      "(pin_host_memory='require' makes this an error)", RuntimeWarning, stacklevel=3)
        return None
    return PinnedRegion(ptr, size, device)


def clear_cuda_last_error() -> None:
    """Reset the CUDA runtime's per-thread last error after a failed call we handled.

    torch checks cudaGetLastError() after its kernel launches, so a refused
    cudaHostRegister would otherwise surface as an unrelated error at the next
    launch.  torch.cuda.cudart() has no cudaGetLastError, so call it in the
    libcudart this process already loaded (the same instance, hence the same
    error state); best effort: a statically linked runtime is not reachable."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libcudart" in line}
        for path in libs:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass


def return_freed_heap() -> None:
    """Give the heap pages freed by the cast (the user's fp32 parameters) back to the OS.

    glibc keeps freed chunks below its mmap threshold in the heap, so a model of
    many few-MB tensors would otherwise keep its 4 B/param of fp32 resident after
    the engine let go of it: host RAM the optimizer server needs.  Best effort
    (other C libraries have no malloc_trim)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# what streams the master instead of holding it whole
MASTER_INSTEAD = ("Save a checkpoint (save_checkpoint) and stream the master out of it with zero-offload-export "
                  "(or zero_offload.export.master_state_dict_from_checkpoint, one tensor at a time)")


def has_room(nbytes: int) -> bool:
    """True if `nbytes` of new host memory fit in MemAvailable times the RAM fraction
    admission uses (ZERO_OFFLOAD_MAX_RAM_FRACTION, 0.9; 0: no check); else the
    MemoryError to raise is built by ``room_error`` (callers with several ranks agree
    first, so that one rank's refusal is every rank's).  The server's RAM fraction
    switch, so that 0 turns both checks off (a VM whose RAM grows as it is used)."""
    fraction = _ram_fraction()
    return not fraction or nbytes <= read_mem_available() * fraction


def _ram_fraction() -> float:
    try:
        return float(os.environ.get(RAM_FRACTION_ENV, "0.9"))
    except ValueError:
        return 0.9


def room_error(nbytes: int, what: str, instead: str) -> MemoryError:
    avail, fraction = read_mem_available(), _ram_fraction() or 1.0
    return MemoryError(f"{what} needs {nbytes / 2**30:.2f} GiB of host RAM in this process and "
                       f"{avail * fraction / 2**30:.2f} GiB may be taken beside the optimizer server's state "
                       f"({fraction:g} of the {avail / 2**30:.2f} GiB available): "
                       f"refused before anything was built (the OOM killer would take the server, and the training "
                       f"since the last checkpoint with it). {instead} (ZERO_OFFLOAD_MAX_RAM_FRACTION=0 turns this "
                       f"check off)")
