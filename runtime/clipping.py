"""torch.nn.utils.clip_grad_norm_ on offloaded parameters, routed to their engine.

The engine's gradient hooks copy each gradient to the host as backward produces it
and free it on the device, so the parameters hold no .grad when a training loop
clips: torch's clip_grad_norm_ would see none, return 0 and clip nothing, silently
(every ported loop, Accelerate and the HF Trainer call it).  install() wraps it
once: a call whose parameters with requires_grad are all trained by one open
OffloadEngine (an OffloadAdamW's included) returns that engine's clip_grad_norm_
(the true global norm, clipping applied in the CPU update); any other call goes
to torch's own function unchanged.  Mixing offloaded parameters with others that
hold gradients is refused, since no single norm covers both.
"""
from __future__ import annotations

import torch

_TORCH = {}  # the functions install() replaced, by the module that holds them


def install() -> None:
    """Route torch.nn.utils.clip_grad_norm_ (idempotent)."""
    mods = (torch.nn.utils, torch.nn.utils.clip_grad)
    for m in mods:
        if getattr(m.clip_grad_norm_, "_zero_offload", False):
            continue
        _TORCH.setdefault(m.__name__, m.clip_grad_norm_)
        m.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, which offloaded parameters reach through their engine."""
    from .engine import owner_of
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {}
    others = []
    for p in params:
        e = owner_of(p)
        if e is not None:
            owners[id(e)] = e
        elif p.grad is not None:
            others.append(p)
    torch_fn = _TORCH.get("torch.nn.utils.clip_grad") or _TORCH["torch.nn.utils"]
    if not owners:
        return torch_fn(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                        foreach=foreach)
    if len(owners) > 1 or others:
        raise ValueError("clip_grad_norm_ got parameters of several offload engines, or offloaded parameters "
                         "together with others that hold .grad: clip each optimizer's parameters in a call of "
                         "their own (optimizer.clip_grad_norm_(max_norm))")
    (engine,) = owners.values()
    norm = engine.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
    return torch.tensor(norm)


clip_grad_norm_._zero_offload = True
