"""torch.nn.utils.clip_grad_norm_ (and Accelerate's) on offloaded parameters, routed
to their engine.

The engine's gradient hooks copy each gradient to the host as backward produces it
and free it on the device, so the parameters hold no .grad when a training loop
clips: torch's clip_grad_norm_ would see none, return 0 and clip nothing, silently
(every ported loop, Accelerate and the HF Trainer call it).  install() wraps it
once: a call whose parameters with requires_grad are all trained by one open
OffloadEngine (an OffloadAdamW's included) returns that engine's clip_grad_norm_
(the true global norm, clipping applied in the CPU update); any other call goes
to torch's own function unchanged.  Mixing offloaded parameters with others that
hold gradients is refused, since no single norm covers both.

Accelerate (1.16 on) no longer calls torch's clip_grad_norm_: its
Accelerator.clip_grad_norm_ sums the norms of the parameters whose .grad is set
itself, so it would return 0 for ours.  install() wraps that method the same way
once accelerate.accelerator is imported; the engine calls install() at every
micro-batch, so an Accelerator made after the engine is covered from the next
backward on (before its clip_grad_norm_ can be called).
"""
from __future__ import annotations

import math
import sys

import torch

_TORCH = {}  # the functions install() replaced, by the module that holds them


def install() -> None:
    """Route torch.nn.utils.clip_grad_norm_, and Accelerate's when it is imported
    (idempotent; cheap enough to call at every micro-batch)."""
    for m in (torch.nn.utils, torch.nn.utils.clip_grad):
        if getattr(m.clip_grad_norm_, "_zero_offload", False):
            continue
        _TORCH.setdefault(m.__name__, m.clip_grad_norm_)
        m.clip_grad_norm_ = clip_grad_norm_
    acc = sys.modules.get("accelerate.accelerator")  # never imported here: a user's choice
    cls = getattr(acc, "Accelerator", None)
    if cls is not None and not getattr(cls.clip_grad_norm_, "_zero_offload", False):
        _TORCH["accelerate"] = cls.clip_grad_norm_
        cls.clip_grad_norm_ = _accelerator_clip_grad_norm_


def check_request(max_norm, norm_type) -> float:
    """A clip_grad_norm_ call's arguments: the L2 norm only, max_norm > 0 (inf: measure only)."""
    if float(norm_type) != 2.0:
        raise ValueError(f"norm_type {norm_type!r}: the offloaded gradients have an L2 norm only (norm_type=2)")
    max_norm = float(max_norm)
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    return max_norm


def unscaled_norm(sq: float, loss_scale: float) -> float:
    """The global L2 norm from the scaled gradients' sum of squares (inf if it overflowed):
    what clip_grad_norm_ returns and what the step clips with."""
    return math.sqrt(sq) / loss_scale if math.isfinite(sq) else float("inf")


def clip_coefficient(norm: float, configured: float | None, requested: float | None) -> float:
    """The factor a step's gradients are multiplied by inside the CPU update: torch's
    min(1, max_norm / (norm + 1e-6)) with the smaller of the config's clip_grad_norm and
    this step's clip_grad_norm_ calls (1.0 if neither)."""
    max_norm = configured
    if requested is not None:
        max_norm = requested if max_norm is None else min(max_norm, requested)
    return 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))


def _engine_of(parameters) -> tuple[list, object]:
    """(the parameters as a list, the one engine that trains them or None)."""
    from .owners import owner_of
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {}
    others = False
    for p in params:
        e = owner_of(p)
        if e is not None:
            owners[id(e)] = e
        elif p.grad is not None:
            others = True
    if not owners:
        return params, None
    if len(owners) > 1 or others:
        raise ValueError("clip_grad_norm_ got parameters of several offload engines, or offloaded parameters "
                         "together with others that hold .grad: clip each optimizer's parameters in a call of "
                         "their own (optimizer.clip_grad_norm_(max_norm))")
    (engine,) = owners.values()
    return params, engine


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.clip_grad_norm_, which offloaded parameters reach through their engine."""
    params, engine = _engine_of(parameters)
    if engine is None:
        torch_fn = _TORCH.get("torch.nn.utils.clip_grad") or _TORCH["torch.nn.utils"]
        return torch_fn(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                        foreach=foreach)
    return torch.tensor(engine.clip_grad_norm_(max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite))


def _accelerator_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
    """accelerate.Accelerator.clip_grad_norm_, which offloaded parameters reach through their engine."""
    params, engine = _engine_of(parameters)
    if engine is None:
        return _TORCH["accelerate"](self, params, max_norm, norm_type=norm_type)
    return torch.tensor(engine.clip_grad_norm_(max_norm, norm_type=norm_type))


clip_grad_norm_._zero_offload = True
_accelerator_clip_grad_norm_._zero_offload = True
