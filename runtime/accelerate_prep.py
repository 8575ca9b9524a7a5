"""Accelerate's prepare() of a model FSDP2 shards, on several processes.

A script written for Accelerate prepares everything at once::

    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)

With several processes and no FSDP plugin (Accelerate's MULTI_CPU / MULTI_GPU), that
wraps the model in DistributedDataParallel, whose constructor broadcasts every
parameter: for a model whose parameters FSDP2 shards (the library's own wrapping on
several ranks, ``expert.multi_rank``, or the user's ``fully_shard``) that fails inside
torch ("c10d.broadcast_.default does not have a sharding strategy"), and DDP would
all-reduce gradients FSDP2 already reduce-scatters.  So, once the engine trains such
a model, Accelerator.prepare_model leaves it as a model that owns its gradient
reduction and placement: autocast only (``evaluation_mode=True``, no device copy), as
OffloadTrainer prepares its model (runtime.hf).  Any other model is Accelerate's as
before.  Installed only where accelerate is imported already (a user's choice; this
module never imports it).
"""
from __future__ import annotations

import sys

from . import fsdp2

_ACCELERATE = {}  # the Accelerator method install() replaced


def would_wrap_in_ddp(accelerator) -> bool:
    """Whether `accelerator.prepare_model` would wrap a model in DDP (its distributed type
    is NO or MULTI_*; FSDP, DeepSpeed and XLA wrap in their own ways)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    return kind == "NO" or kind.startswith("MULTI_")


def install() -> None:
    mod = sys.modules.get("accelerate.accelerator")
    if mod is None or "prepare_model" in _ACCELERATE:
        return
    cls = mod.Accelerator
    _ACCELERATE["prepare_model"] = cls.prepare_model
    cls.prepare_model = _prepare_model


def _prepare_model(self, model, device_placement=None, evaluation_mode=False):
    if fsdp2.is_sharded(model) and would_wrap_in_ddp(self):
        return _ACCELERATE["prepare_model"](self, model, device_placement=False, evaluation_mode=True)
    return _ACCELERATE["prepare_model"](self, model, device_placement=device_placement,
                                        evaluation_mode=evaluation_mode)
