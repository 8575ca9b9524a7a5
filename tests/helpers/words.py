"""16-bit words and float64 Adam: what the compact-state kernel tests compare against.

    bf16_words(x)    fp32 -> bf16 words, rounded to nearest even by torch (its own cast)
    widen(words)     bf16 words -> float32, exact
    adamw_f64(...)   AdamW in float64 (torch's formula) on given gradients: the reference
"""
from __future__ import annotations

import numpy as np
import torch


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
