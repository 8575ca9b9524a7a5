"""The training corpus present on every machine: the Python standard library's source.

Every ``*.py`` under the interpreter's stdlib directory (site-packages excluded),
split into train and validation by file with a seeded shuffle, read as bytes
(vocabulary 256).  Batches are random windows drawn with a seeded generator,
so two runs with the same seed see the same data in the same order.
"""
from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    if not files:
        raise RuntimeError(f"no *.py files under the stdlib directory {root}; is this a full Python install?")
    return sorted(files)


@dataclass
class Corpus:
    train: np.ndarray   # uint8
    val: np.ndarray
    n_train_files: int
    n_val_files: int

    @classmethod
    def load(cls, seed: int = 0, val_fraction: float = 0.05, max_bytes: int = 64 << 20) -> "Corpus":
        files = stdlib_files()
        random.Random(seed).shuffle(files)
        n_val = max(1, int(len(files) * val_fraction))
        parts = {"val": files[:n_val], "train": files[n_val:]}
        out = {}
        for name, fs in parts.items():
            chunks, total = [], 0
            for f in fs:
                try:
                    b = f.read_bytes()
                except OSError:
                    continue
                chunks.append(b)
                total += len(b) + 2
                if total >= max_bytes:
                    break
            out[name] = np.frombuffer(b"\n\n".join(chunks), dtype=np.uint8).copy()
        return cls(out["train"], out["val"], len(parts["train"]), n_val)


class Batches:
    """Random (batch, seq_len + 1) windows of one split, deterministic by seed."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int, device="cpu"):
        if data.size <= seq_len + 1:
            raise ValueError(f"split of {data.size} bytes is shorter than seq_len + 1 = {seq_len + 1}")
        self.data = torch.from_numpy(data.astype(np.int64))
        self.batch_size, self.seq_len = batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.data[idx]
        return w[:, :-1].to(self.device), w[:, 1:].to(self.device)
