"""ZeRO-2 collectives of OffloadEngine across ranks (torch.distributed).

The flat parameter space is split into world_size contiguous shards; rank r
owns [r*S, (r+1)*S).  Per step:

  gradients   each complete bucket is averaged across ranks so that this
              rank's shard of it is valid here, then only that part is copied
              to the host (2 B/param/step / world_size per rank).  Buckets are
              reduced in bucket-index order on every rank, whatever order
              backward completes them in (as DDP does): ranks whose unused
              parameters differ would otherwise issue collectives in different
              orders and hang.  The sums are taken in fp32 (one rounding to 16
              bits at the end; fp16 gradients summed in 16 bits would overflow at
              1/world_size of one rank's threshold, and bf16 would round at every
              hop):
                NCCL: one asynchronous dist.reduce per rank whose shard intersects
                      the bucket (a reduce-scatter over uneven pieces); the owner
                      waits for it on the copy stream, not the compute stream, so
                      communication overlaps backward.
                gloo: gloo has no reduce-scatter for these uneven pieces, so an
                      asynchronous all-reduce, waited for once backward is done.
  decision    the squared gradient norm is summed across ranks (one scalar
              all-reduce): inf/NaN anywhere becomes inf/NaN everywhere, so all
              ranks skip or step together and clip by the same global norm.
  weights     each rank copies its updated 16-bit shard up, then one in-place
              all_gather_into_tensor rebuilds the full flat16 on every rank.
  master      master_state_dict gathers the fp32 shards window by window through
              a buffer of MASTER_WINDOW elements per rank (never a full fp32 model
              on a device) into one host tensor, on rank 0 alone with rank0_only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
MASTER_WINDOW = 1 << 22  # fp32 elements per rank per gather of master_state_dict (16 MiB)


def backend_for(config: str, device_type: str) -> str:
    """The backend that serves tensors of device_type, from dist.get_backend_config()'s
    text: "nccl", or "cpu:gloo,cuda:nccl" after an init_process_group() that named none
    (where dist.get_backend() says "undefined")."""
    config = config.strip()
    if ":" not in config:
        return config
    table = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
    return table.get(device_type, "")


def uses_nccl(device: torch.device) -> bool:
    return device.type == "cuda" and backend_for(str(dist.get_backend_config()), "cuda") == "nccl"


class Collectives:
    """The collectives of one rank, with the backend decided once (NCCL for CUDA tensors or not)."""

    def __init__(self, device: torch.device, rank: int, world_size: int, shard_numel: int):
        self.device, self.rank, self.world_size, self.S = device, rank, world_size, shard_numel
        self.nccl = uses_nccl(device)

    # -- gradients ------------------------------------------------------------
    def start_bucket_reduce(self, buf: torch.Tensor, lo: int) -> "BucketReduce":
        """Start averaging the bucket buf (flat elements [lo, lo + len)) asynchronously."""
        if self.nccl:
            mine, works = None, []
            for r in range(self.world_size):
                a, b = max(lo, r * self.S), min(lo + buf.numel(), (r + 1) * self.S)
                if b > a:
                    acc = buf[a - lo:b - lo].float()
                    works.append((acc, dist.reduce(acc, dst=r, op=dist.ReduceOp.SUM, async_op=True)))
                    if r == self.rank:
                        mine = acc
            return BucketReduce(mine, works, self.world_size)
        acc = buf.float()
        return BucketReduce(acc, [(acc, dist.all_reduce(acc, async_op=True))], self.world_size)

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    # -- weights --------------------------------------------------------------
    def all_gather_weights(self, flat16: torch.Tensor, tracer) -> None:
        """Every rank's shard of flat16 into every rank's flat16, in place."""
        shard = flat16[self.rank * self.S:(self.rank + 1) * self.S]
        with tracer.span("all_gather", bytes=2 * flat16.numel()):
            _all_gather(flat16, shard if self.nccl else shard.clone())

    def gather_master(self, shard: torch.Tensor, rank0_only: bool, window: int = MASTER_WINDOW):
        """Every rank's fp32 master shard (a CPU tensor of S elements) concatenated into
        one host tensor, window by window; None on ranks other than 0 with rank0_only."""
        W, S = self.world_size, self.S
        dev = self.device if self.nccl else torch.device("cpu")
        out = torch.empty(W * S, dtype=torch.float32) if (self.rank == 0 or not rank0_only) else None
        for o in range(0, S, window):
            n = min(window, S - o)
            piece = shard[o:o + n].to(dev)
            got = torch.empty(W * n, dtype=torch.float32, device=dev)
            _all_gather(got, piece)
            if out is not None:
                got = got.cpu().view(W, n)
                for k in range(W):
                    out[k * S + o:k * S + o + n] = got[k]
        return out

    # -- agreement ------------------------------------------------------------
    def all_ok(self, ok: bool) -> bool:
        """True only if every rank passed True."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self.device if self.nccl else "cpu")
        dist.all_reduce(flag)
        return int(flag) == 0

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """The largest of each value over all ranks (float64; a few numbers)."""
        x = torch.tensor(values, dtype=torch.float64, device=self.device if self.nccl else "cpu")
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return [float(v) for v in x.cpu()]

    def barrier(self) -> None:
        if self.nccl:
            dist.barrier(device_ids=[self.device.index])  # NCCL would otherwise guess the GPU
        else:
            dist.barrier()


class BucketReduce:
    """A bucket's reduce in flight.  wait() (on the current stream for NCCL, on the
    host for gloo) returns this rank's fp32 average: the owned part (NCCL) or the
    whole bucket (gloo's all-reduce); None where this rank owns none of it (NCCL)."""

    def __init__(self, acc, works, world_size: int):
        self.acc, self.works, self.world_size = acc, works, world_size

    def wait(self) -> torch.Tensor | None:
        for _, work in self.works:
            work.wait()  # bounded by the process group's timeout (torch.distributed's default: 30 min)
        if self.acc is not None:
            self.acc.div_(self.world_size)
        return self.acc

    def done(self) -> bool:
        """Whether wait() would return at once (gloo: the all-reduce has finished)."""
        return all(work.is_completed() for _, work in self.works)

    def record_stream(self, stream) -> None:
        """The buffers are read on `stream` (CUDA): keep them alive for it."""
        for acc, _ in self.works:
            acc.record_stream(stream)
