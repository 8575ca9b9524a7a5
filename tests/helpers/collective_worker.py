"""A worker for the collectives tests, run under the launcher with 2 ranks (gloo).

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/collective_worker.py OUT_DIR MODE[,MODE]

Each MODE runs in turn in the same ranks (a launch costs ~15 s of 2 cores).  MODE gloo: the CPU ranks' path (asynchronous fp32 all-reduces).  MODE owner: the
NCCL-style path (an fp32 reduce to each shard's owner, DeviceBucketStep) run over
gloo on the CPU, so the code a GPU job runs is exercised here.  Either way the model
has an odd number of parameters (the last shard is padded), a branch that only
rank 0 uses (so the ranks complete their buckets in different orders), and at step 2
an fp16 gradient of 40000 on both ranks (its sum would overflow 16 bits).
"""
import copy
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from zero_offload import OffloadConfig, OffloadEngine  # noqa: E402
from zero_offload.grads_down import DeviceBucketStep  # noqa: E402

STEPS = 4
BIG = 40000.0  # < fp16's max 65504, but twice it is not


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 62), torch.nn.GELU(), torch.nn.Linear(62, 8))
        self.extra = torch.nn.Linear(16, 1)  # registered last: first in the flat space, its own bucket

    def forward(self, x, use_extra: bool):
        y = self.body(x)
        return y + self.extra(x) if use_extra else y


def main():
    out, modes = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a mismatch fails, not hangs
    for mode in modes:
        run_mode(out, mode)
        dist.barrier()
    dist.destroy_process_group()


def run_mode(out: str, mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model()
    cfg = OffloadConfig(lr=1e-3, dtype="fp16", loss_scaling={"scale": 1.0}, server={"threads": 1},
                        expert={"bucket_numel": 1024, "multi_rank": "builtin"})  # the built-in collectives
    eng = OffloadEngine(model, cfg)
    if mode == "owner":
        eng.grads.coll = copy.copy(eng.coll)
        eng.grads.coll.nccl = True
        eng.grads.kind = DeviceBucketStep
    n = sum(p.numel() for p in model.parameters())
    for t in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        h = None
        if t == 2:
            h = model.body[2].bias.register_hook(lambda gr: gr.index_fill(0, torch.tensor([0]), BIG))
        loss = torch.nn.functional.mse_loss(model(x.to(eng.compute_dtype), use_extra=rank == 0).float(), y)
        eng.backward(loss)
        eng.step()
        if h is not None:
            h.remove()
    S = eng.flat.shard_numel
    pad = eng.flat.padded_numel - n
    # the gradient the last update read (before GET_MASTER's staging window covers the slot)
    grad_pad = [int(v) for v in eng.client.grads[0][S - pad:]] if rank == world - 1 else []
    shard = eng.client.get_master()
    res = {"numel": n, "pad": pad, "skipped": eng.skipped_steps, "grad_pad": grad_pad,
           "master_pad": [float(v) for v in shard[S - pad:]] if rank == world - 1 else []}
    full = eng.master_state_dict()
    flat = torch.cat([v.reshape(-1) for v in full.values()])
    windowed = eng.coll.gather_master(torch.from_numpy(shard), rank0_only=False, window=7)
    flat_space = torch.empty(eng.flat.padded_numel)
    for p in eng.flat.params:
        s = eng.flat.by_param[id(p)]
        flat_space[s.offset:s.offset + s.numel] = full[[k for k, q in model.named_parameters() if q is p][0]].reshape(-1)
    res["windowed_equal"] = bool(torch.equal(windowed[:n], flat_space[:n]))
    res["rank0_only_len"] = len(eng.master_state_dict(rank0_only=True))
    eng.close()
    torch.save(flat, os.path.join(out, f"{mode}-master-r{rank}.pt"))
    with open(os.path.join(out, f"{mode}-r{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
