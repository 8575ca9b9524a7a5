"""One FSDP2 rank in the test's own process: a gloo group of one over a file store, and
a tiny sharded MLP, for the tests that need FSDP2's objects but no second process."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def one_rank_group(tmp_path):
    """A gloo process group of one rank, taken down after (the store a file in tmp_path)."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_mlp(width: int = 32, dtype: torch.dtype = torch.bfloat16, **shard_kw) -> torch.nn.Sequential:
    """Linear(16, width) and Linear(width, 4) (seed 0) in `dtype`, each layer and then the
    whole fully_shard'ed (shard_kw: fully_shard's options, e.g. mp_policy)."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Linear(width, 4)).to(dtype)
    for layer in m:
        fully_shard(layer, **shard_kw)
    fully_shard(m, **shard_kw)
    return m
