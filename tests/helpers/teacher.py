"""Teacher forcing for the torch.optim-style classes (OffloadAdamW, OffloadLion): a
torch reference optimizer over fp32 masters is fed, each step, the 16-bit gradients
the offloaded model's own weights give, so the two updates can be compared without
16-bit trajectories drifting apart."""
from __future__ import annotations

import copy

import torch

from tests.helpers.models import gpt_batch


def reference_of(model, groups_fn):
    """(ref, masters, groups): a copy of model, fp32 masters of its parameters by name,
    and groups_fn(ref)'s groups over those masters (for the reference optimizer).
    Call before the offloaded optimizer casts model; ref is cast by teach()."""
    ref = copy.deepcopy(model)
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in ref.named_parameters()}
    by_id = {id(p): n for n, p in ref.named_parameters()}
    groups = [dict(g, params=[masters[by_id[id(p)]] for p in g["params"]]) for g in groups_fn(ref)]
    return ref, masters, groups


def teach(model, opt, sched, ref, masters, ref_opt, ref_sched, steps: int, max_norm: float, each_step=None):
    """steps of: ref takes model's weights, its gradients go to the masters, torch's
    clip_grad_norm_ clips them and ref_opt steps; then model does the same with opt
    (torch's clip_grad_norm_ on its parameters is routed to the engine).  each_step(t)
    after both stepped.  Returns (opt's masters by name, [(ref norm, norm)] per step)."""
    # the reference computes in what the offloaded model computes in (bf16, or fp32 on
    # the bf16 values: runtime.compute_dtype), and rounds each gradient to bf16 as it does
    ref.to(torch.bfloat16).to(next(model.parameters()).dtype)
    norms = []
    try:
        for t in range(1, steps + 1):
            with torch.no_grad():
                for p, q in zip(model.parameters(), ref.parameters()):
                    q.copy_(p)
            gpt_batch(t, "bf16")(ref).backward()
            for n, q in ref.named_parameters():
                masters[n].grad, q.grad = q.grad.bfloat16().float(), None
            ref_norm = float(torch.nn.utils.clip_grad_norm_(list(masters.values()), max_norm))
            ref_opt.step()
            ref_sched.step()
            gpt_batch(t, "bf16")(model).backward()
            norms.append((ref_norm, float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))))
            opt.step()
            sched.step()
            if each_step is not None:
                each_step(t)
        opt.engine.synchronize()
        return opt.master_state_dict(), norms
    finally:
        opt.close()
