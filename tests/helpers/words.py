"""16-bit words and float64 Adam: what the compact-state kernel tests compare against.

    bf16_words(x)    fp32 -> bf16 words, rounded to nearest even by torch (its own cast)
    widen(words)     bf16 words -> float32, exact
    adamw_f64(...)   AdamW in float64 (torch's formula) on given gradients: the reference
    Master(p0, out, exact)  a kernel run's master: the exact master or an fp32 copy
"""
from __future__ import annotations

import numpy as np
import torch

from zero_offload.kernels import cpu_adam


def bf16_words(x) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def widen(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def adamw_f64(p0, grads, *, lr=1e-3, wd=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """(p, m, v) after AdamW in float64 from p0 over `grads` (bf16 words, or any float
    array: each is read as float64)."""
    p = p0.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        gf = (widen(g) if g.dtype == np.uint16 else g).astype(np.float64)
        p *= 1 - lr * wd
        m = b1 * m + (1 - b1) * gf
        v = b2 * v + (1 - b2) * gf * gf
        p -= lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    return p, m, v


class Master:
    """The master of a kernel run from p0: with exact, the exact master's low halves
    (param) whose high halves are `out`, the one weights slot, read and written in
    place as the server does (kw passes it as master_hi); else an fp32 copy of p0."""

    def __init__(self, p0: np.ndarray, out: np.ndarray, exact: bool):
        self.out, self.exact = out, exact
        if exact:
            self.param = np.zeros(p0.size, np.uint16)
            cpu_adam.split_master(p0, out, self.param)
            self.kw = dict(master_hi=out)
        else:
            self.param = p0.copy()
            self.kw = {}

    def fp32(self) -> np.ndarray:
        """The master now, as fp32 (joined from the two halves with exact)."""
        if not self.exact:
            return self.param.copy()
        p = np.empty(self.param.size, np.float32)
        cpu_adam.join_master(self.out, self.param, p)
        return p
