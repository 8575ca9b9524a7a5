"""Set up a node's ranks one after another, so its host holds one fp32 model at a time.

    from runtime import OffloadEngine, in_turn
    model, engine = in_turn(lambda: (m := build_model(), OffloadEngine(m, cfg)))

Each rank builds its model in fp32 on the CPU and hands it to OffloadEngine,
which keeps the 16-bit weights (on the device) and lets go of the fp32 tensors.
Done by all of a node's ranks at once, that is LOCAL_WORLD_SIZE fp32 copies of
the whole model on the host at the same moment (4 B/param each: 32 B/param with
8 ranks) on top of the optimizer server's 16 B/param; in turn, one copy.  The
price is time: the set-ups run one after another instead of side by side.
Without torch.distributed it simply calls fn.
"""
from __future__ import annotations

import os
from typing import Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def in_turn(fn: Callable[[], T]) -> T:
    """fn() on this node's ranks one at a time (torchrun's LOCAL_RANK order); every
    rank returns its own result.  A rank whose fn raises stops the others at their
    next barrier, bounded by the process group's timeout (the launcher stops the
    whole job as soon as a worker fails)."""
    if not (dist.is_available() and dist.is_initialized()):
        return fn()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    # torchrun gives every node the same number of workers, so every rank makes
    # the same number of barrier calls
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if not 0 <= local_rank < local_world:
        raise ValueError(f"LOCAL_RANK={local_rank} is not in [0, LOCAL_WORLD_SIZE={local_world})")
    out = None
    for turn in range(local_world):
        if turn == local_rank:
            out = fn()
        dist.barrier()  # the next rank starts once this one's fp32 model is gone
    return out
