"""A checkpoint kept in tests/data, and its load on today's default path.

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/kept_ckpt_worker.py save DIR
    python -m zero_offload.launch --nproc-per-node N tests/helpers/kept_ckpt_worker.py load DIR OUT

save: the built-in multi-rank path (expert.multi_rank="builtin", the engine's own ZeRO-2,
the only multi-rank path OffloadAdamW had before FSDP2 became its default) trains a
small MLP (fp32 state, bf16 weights, two param groups) for 3 steps on 2 ranks, each on
its rows of a seeded batch, and saves a checkpoint in DIR.  This is how
tests/data/builtin-2rank-20261207 was made, on 2026-12-07, by the commit that added it
(the built-in path and its checkpoint code as they were at a6ea0a9, before FSDP2 became
the default).

load: the same model on the default path (several ranks: the library shards it with
FSDP2; one rank: a plain engine) loads DIR; rank 0 writes OUT: the master_state_dict()
(whole tensors by name), the step counts, the update counter, and the losses of 2 more
steps.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEED = 1207
ROWS = 16


def make_model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 8))


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def batch(step: int):
    g = torch.Generator().manual_seed(SEED * 100 + step)
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 8, generator=g)


def train(model, opt, first: int, last: int, rank: int, world: int) -> list[float]:
    per, losses = ROWS // world, []
    for t in range(first, last + 1):
        x, y = batch(t)
        rows = slice(rank * per, (rank + 1) * per)
        loss = torch.nn.functional.mse_loss(model(x[rows].bfloat16()).float(), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        lt = loss.detach().reshape(1)
        if world > 1:
            dist.all_reduce(lt)
        losses.append(float(lt) / world)
    return losses


def main():
    what, d = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    from zero_offload import OffloadAdamW
    model = make_model()
    expert = {"multi_rank": "builtin"} if what == "save" else {}
    opt = OffloadAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), model=model, server={"threads": 1},
                       expert=expert)
    if what == "save":
        train(model, opt, 1, 3, rank, world)
        opt.save_checkpoint(d, keep=1)
        opt.close()
    else:
        opt.load_checkpoint(d)
        res = {"master": opt.master_state_dict(), "param_updates": opt.engine.param_updates.tolist(),
               "updates": opt.engine.updates}
        res["losses"] = train(model, opt, 4, 5, rank, world)
        opt.close()
        if rank == 0:
            torch.save(res, sys.argv[3])
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
