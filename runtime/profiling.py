"""Ranges for torch.profiler on CUDA (nsys/Kineto timelines); nothing on the CPU,
where the Chrome trace of optimizer_server.tracing already has the spans."""
from __future__ import annotations

import contextlib

import torch

_NULL = contextlib.nullcontext()


def marker(name: str, cuda: bool):
    return torch.profiler.record_function(name) if cuda else _NULL
