"""ZeRO-2 collectives of OffloadEngine across ranks (torch.distributed).

The flat parameter space is split into world_size contiguous shards; rank r
owns [r*S, (r+1)*S).  Per step:

  gradients   each complete bucket is averaged across ranks so that this
              rank's shard of it is valid here, then only that part is copied
              to the host (2 B/param/step / world_size per rank):
                NCCL: one dist.reduce(SUM) per rank whose shard intersects the
                      bucket, in 16 bits (a reduce-scatter over uneven pieces),
                      and the owner divides its part by world_size;
                gloo: gloo has no reduce-scatter for these uneven pieces, so an
                      all-reduce in fp32 (one rounding to 16 bits, closest to a
                      single-rank gradient) and each rank keeps its slice.  It is
                      started asynchronously as each bucket completes and waited
                      for once backward is done, so it overlaps backward.
  decision    the squared gradient norm is summed across ranks (one scalar
              all-reduce): inf/NaN anywhere becomes inf/NaN everywhere, so all
              ranks skip or step together and clip by the same global norm.
  weights     each rank copies its updated 16-bit shard up, then one in-place
              all_gather_into_tensor rebuilds the full flat16 on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


# torch >= 2.13 renamed all_gather_into_tensor (the old name warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_nccl() -> bool:
    return dist.get_backend() == "nccl"


def reduce_bucket(buf: torch.Tensor, lo: int, *, rank: int, world_size: int, shard_numel: int) -> None:
    """Average the bucket buf (flat elements [lo, lo + len)) so this rank's shard of it is valid."""
    if is_nccl():
        S = shard_numel
        hi_b = lo + buf.numel()
        for r in range(world_size):
            a, b = max(lo, r * S), min(hi_b, (r + 1) * S)
            if b > a:
                part = buf[a - lo:b - lo]
                dist.reduce(part, dst=r, op=dist.ReduceOp.SUM)
                if r == rank:
                    part.div_(world_size)
        return
    acc = buf.float()
    dist.all_reduce(acc)
    acc.div_(world_size)
    buf.copy_(acc)


def start_bucket_reduce(buf: torch.Tensor):
    """gloo: an asynchronous fp32 all-reduce of the bucket, so backward goes on meanwhile.
    Returns (the fp32 buffer, the work handle) for finish_bucket_reduce."""
    acc = buf.float()
    return acc, dist.all_reduce(acc, async_op=True)


def finish_bucket_reduce(work, acc: torch.Tensor, world_size: int) -> None:
    work.wait()  # bounded by the process group's timeout (torch.distributed's default: 30 min)
    acc.div_(world_size)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def all_gather_weights(flat16: torch.Tensor, lo: int, hi: int, tracer) -> None:
    """Every rank's shard [lo, hi) of flat16 into every rank's flat16, in place."""
    shard = flat16[lo:hi]
    with tracer.span("all_gather", bytes=2 * flat16.numel()):
        _all_gather(flat16, shard.clone() if not is_nccl() else shard)


def all_gather_cpu(shard: torch.Tensor, padded_numel: int, device: torch.device) -> torch.Tensor:
    """Every rank's fp32 master shard, concatenated (for master_state_dict)."""
    if is_nccl():
        dev = shard.to(device)
        out = torch.empty(padded_numel, dtype=shard.dtype, device=device)
        _all_gather(out, dev)
        return out.cpu()
    out = torch.empty(padded_numel, dtype=shard.dtype)
    _all_gather(out, shard)
    return out


def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    """True only if every rank passed True (a collective)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device if is_nccl() else "cpu")
    dist.all_reduce(flag)
    return int(flag) == 0


def barrier() -> None:
    dist.barrier()
