"""One rank of tests/test_torch_state.py's several-rank case, run under zero-offload-launch.

    python -m zero_offload.launch --nproc-per-node N tests/helpers/torch_state_worker.py OUT [MULTI_RANK]

Every rank runs the same torch AdamW training (an MLP in fp32, 3 steps on the whole
global batch, one parameter without a gradient in the first step), so every rank holds
the same state dict, as each would after torch.load of one optimizer.pt.  Then
OffloadAdamW on the model (state_dir=OUT/state) loads it and trains 5 steps, each rank
on its rows of the batch (each rank's shard of the state; MULTI_RANK is expert.multi_rank,
the library's default without it).  Rank 0 writes
OUT/result.pt: the weights torch left, the masters, the update counter and per-parameter step counts, the
error a load without state_dir raised, and (several ranks) the one it raised when only
rank 1's dict was bad.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SEED = 7
ROWS = 32


def batch(step: int):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    return torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 8, generator=g)


def make_model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 8))


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3}]


def main():
    out = sys.argv[1]
    expert = {"multi_rank": sys.argv[2]} if len(sys.argv) > 2 else {}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ref = torch.optim.AdamW(groups(model), lr=1e-2, betas=(0.9, 0.95))
    for t in range(1, 4):
        x, y = batch(t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if t == 1:
            model[0].bias.grad = None  # its step count is 2, the others' 3
        ref.step()
        ref.zero_grad()
    sd = ref.state_dict()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    from zero_offload import OffloadAdamW
    res = {}
    with OffloadAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), model=model, server={"threads": 1},
                     expert=expert) as opt:
        try:
            opt.load_state_dict(sd)
        except ValueError as e:
            res["without_state_dir"] = str(e)
    opt = OffloadAdamW(groups(model), lr=1e-2, betas=(0.9, 0.95), model=model, server={"threads": 1},
                       state_dir=os.path.join(out, "state"), expert=expert)
    if world > 1:  # rank 1's dict has a wrong shape: every rank refuses, none waits in a collective
        bad = dict(sd, state={**sd["state"], 0: {**sd["state"][0], "exp_avg": sd["state"][0]["exp_avg"][:1]}})
        try:
            opt.load_state_dict(bad if rank == 1 else sd)
        except ValueError as e:
            res["one_refused"] = str(e)
    opt.load_state_dict(sd)
    per = ROWS // world
    for t in range(4, 9):
        x, y = batch(t)
        rows = slice(rank * per, (rank + 1) * per)
        torch.nn.functional.mse_loss(model(x[rows].bfloat16()).float(), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    res.update(start=start, master=opt.master_state_dict(), updates=opt.engine.updates,
               param_updates=opt.engine.param_updates.tolist(), left=sorted(os.listdir(os.path.join(out, "state"))))
    opt.close()
    if rank == 0:
        torch.save(res, os.path.join(out, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
