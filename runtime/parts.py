"""What each of the engine's parts needs of another: narrow, typed collaborators.

A part takes the protocol below, not the whole object it happens to be given, so a
reader sees what it may call and a test can hand it a small stand-in.  The engine
wires the real ones (runtime.wiring):

    part                         collaborator        is, in the engine
    UpdateCycle                  ShardServer         zero_offload.server.client.ShardClient
    SlotGate (grads_down)        GateCycle           UpdateCycle
    ForwardPipeline (overlap)    PipelineCycle       UpdateCycle
    Speculator (speculation)     SpeculationCycle    UpdateCycle
    every part                   Tracing             zero_offload.server.tracing.Tracer

Structural (typing.Protocol): nothing inherits from them, and nothing checks them at
run time; they are read by people and type checkers.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch


class Tracing(Protocol):
    def span(self, name: str, **args) -> AbstractContextManager: ...

    def flush(self) -> None: ...


class ShardServer(Protocol):
    """The optimizer server as the update cycle uses it: STEP, SPECULATE and the ready
    word out; the progress word and DONE back."""
    request_timeout_s: float
    weights16_slots: list[np.ndarray]

    def step_async(self, step: int, grad_slot: int, lr: float, **step_fields) -> None: ...

    def speculate(self, step: int, grad_slot: int, lr: float, grad_scale: float, hparams: dict | None, *,
                  upto: int, **speculate_fields) -> None: ...

    def announce(self, step: int, upto: int) -> None: ...

    def published(self, step: int) -> int: ...

    def reply_ready(self, timeout_s: float) -> bool: ...

    def wait_done(self, timeout_s: float | None = None): ...


class GateCycle(Protocol):
    """SlotGate: whether the update in flight has read a gradient slot's range."""
    @property
    def in_flight(self) -> int | None: ...

    @property
    def request_timeout_s(self) -> float: ...

    def published(self, k: int) -> int: ...

    def reply_ready(self, timeout_s: float) -> bool: ...


class PipelineCycle(GateCycle, Protocol):
    """ForwardPipeline: the update's blocks as they are published, and its landing."""
    flat16: torch.Tensor
    zero_copy: bool

    def incoming_tensor(self) -> torch.Tensor: ...

    @property
    def up_stream(self): ...

    def land(self, copy: bool) -> None: ...

    def mark_on_device(self) -> None: ...


class SpeculationCycle(Protocol):
    """Speculator: SPECULATE and the ready word, when nothing forbids them."""
    @property
    def can_speculate(self) -> bool: ...

    def speculate(self, k: int, *, upto: int, **step_fields) -> None: ...

    def announce(self, k: int, upto: int) -> None: ...
