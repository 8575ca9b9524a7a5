"""Where the engine runs: the device of the 16-bit weights, and whether torch.distributed is up."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def resolve_device(name: str, src: torch.device) -> torch.device:
    device = torch.device(name) if name else src
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name or str(src)!r} asked for CUDA but torch.cuda.is_available() is False")
    if device.type == "cuda" and device.index is None:
        # a launched rank takes its node-local GPU, as torchrun numbers them
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
    return device


def process_group() -> bool:
    """Whether torch.distributed is initialised; an error naming the fix where a
    launcher started several ranks but nobody made the process group."""
    if dist.is_available() and dist.is_initialized():
        return True
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise RuntimeError(f"WORLD_SIZE is {world} but torch.distributed is not initialised: call "
                           f"torch.distributed.init_process_group() (backend 'gloo' on the CPU, 'nccl' on GPUs) "
                           f"in each worker before creating the OffloadEngine; without it every rank would train "
                           f"a whole copy of the model on its own")
    return False
