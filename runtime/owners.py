"""The open engine of each trained parameter (by id; weak: a dropped engine leaves no
entry), so a second engine or OffloadAdamW on a parameter is refused instead of
fighting over its weights, and torch's clip_grad_norm_ finds the engine
(runtime.clipping).  Its own module, so that clipping and the engine do not import
each other."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .engine import OffloadEngine

_OWNER: "weakref.WeakValueDictionary[int, OffloadEngine]" = weakref.WeakValueDictionary()


def owner_of(p: torch.Tensor) -> "OffloadEngine | None":
    """The open engine that trains parameter p, or None."""
    e = _OWNER.get(id(p))
    return e if e is not None and not e.closed and trains(e, p) else None


def trains(e: "OffloadEngine", p: torch.Tensor) -> bool:
    s = e.flat.by_param.get(id(p))  # ids are reused once a tensor dies: check identity
    if s is not None and s.param is p:
        return True
    # a tensor the engine trains through another (an FSDP2 parameter through its local
    # shard's proxy: runtime.fsdp2)
    return getattr(e, "param_aliases", {}).get(id(p)) is p


def check_free(params: list) -> None:
    """ValueError naming the fix if an open engine already trains one of params."""
    for p in params:
        if owner_of(p) is not None:
            raise ValueError("a parameter of this model already has an open OffloadEngine or OffloadAdamW (it "
                             "views that one's weights, and its close() would take them back): close that one "
                             "first (engine.close() / optimizer.close()), or build the model anew")


def claim(engine: "OffloadEngine", params: list) -> None:
    for p in params:
        _OWNER[id(p)] = engine


def release(engine: "OffloadEngine", params: list) -> None:
    for p in params:
        if _OWNER.get(id(p)) is engine:
            del _OWNER[id(p)]
