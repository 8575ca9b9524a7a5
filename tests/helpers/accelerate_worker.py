"""A training script written for Accelerate, with OffloadAdamW as its optimizer.

    python -m zero_offload.launch --nproc-per-node 2 tests/helpers/accelerate_worker.py OUT_DIR OPT STEPS

OPT: offload (the library's default multi-rank path: with several processes it shards
the plain model with FSDP2, expert.multi_rank="auto") | offload-builtin (the engine's
own ZeRO-2, expert.multi_rank="builtin") | offload-prepared (the default path, with the
model prepared by Accelerate as a plain script does: accelerator.prepare(model, opt, dl,
sched)) | offload-ddp (the built-in path with the model prepared: must be refused) |
torch (torch.optim.AdamW: the reference).  Unchanged between them but for the
optimizer's class: accelerator.prepare, accumulate, backward, clip_grad_norm_.  Writes each rank's
losses, norms and final weights (or the error) to OUT_DIR.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from accelerate import Accelerator  # noqa: E402

from zero_offload import OffloadAdamW  # noqa: E402
from tests.helpers.models import gpt  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, 256, (n, 17), generator=g)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def train(out: str, which: str, steps: int) -> dict:
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = gpt()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    if which.startswith("offload"):
        if which in ("offload-builtin", "offload-ddp"):
            kw["expert"] = {"multi_rank": "builtin"}
        opt = OffloadAdamW(model.parameters(), **kw, model=model, grad_accumulation_steps=2, server={"threads": 1})
        hooks_open = len(model._forward_pre_hooks)
    else:
        opt = torch.optim.AdamW(model.parameters(), **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    dl = torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=False)
    if which in ("offload", "offload-builtin") and acc.num_processes > 1:
        opt, dl, sched = acc.prepare(opt, dl, sched)
    else:
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    losses, norms = [], []
    done = 0
    while done < steps:
        for idx in dl:
            with acc.accumulate(model):
                loss = model(idx[:, :-1], idx[:, 1:])
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                    losses.append(float(loss.detach()))
                    done += 1
                opt.step()
                sched.step()
                opt.zero_grad()
            if done >= steps:
                break
    weights = {k: getattr(v, "full_tensor", lambda: v)().detach().float().clone()  # FSDP2: whole tensors
               for k, v in acc.unwrap_model(model).state_dict().items()}
    hooks = None
    if which.startswith("offload"):
        opt.optimizer.close()
        hooks = (hooks_open, len(model._forward_pre_hooks))  # the model's forward pre-hooks, open and closed
    res = {"hooks": hooks, "losses": losses, "norms": norms, "weights": weights, "rank": acc.process_index,
           "world": acc.num_processes,  # the model's local shards' dtypes where FSDP2 sharded it
           "shards": sorted({str(p.to_local().dtype) for p in model.parameters() if hasattr(p, "to_local")})}
    torch.save(res, os.path.join(out, f"{which}-rank{acc.process_index}.pt"))
    return res


if __name__ == "__main__":
    try:
        train(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    except RuntimeError as e:
        with open(os.path.join(sys.argv[1], f"error-rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(str(e))
        raise
    finally:
        # the process group Accelerate made, ended before the interpreter's: left to exit,
        # gloo's threads met static destructors ("terminate called without an active
        # exception", SIGABRT: seen once in a full suite on 2 loaded cores)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
