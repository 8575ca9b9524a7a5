"""Reading the server's checkpointed state: each array of shard-r*-of-*.bin in its dtype."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def shard_arrays(checkpoint: str | Path) -> dict[str, np.ndarray]:
    """{"r{rank}.{array}": values} of a checkpoint directory (step-N), fp32 arrays as
    float32 and bf16 arrays as raw uint16 words (the manifest's array_dtypes)."""
    d = Path(checkpoint)
    out = {}
    for man_path in sorted(d.glob("shard-r*-of-*.json")):
        man = json.loads(man_path.read_text())
        raw = man_path.with_suffix(".bin").read_bytes()
        n, pos = man["numel"], 0
        dtypes = man.get("array_dtypes", {})
        for name in man["arrays"]:
            dt = np.float32 if dtypes.get(name, "fp32") == "fp32" else np.uint16
            size = n * np.dtype(dt).itemsize
            out[f"r{man['rank']}.{name}"] = np.frombuffer(raw[pos:pos + size], dt).copy()
            pos += size
        assert pos == len(raw), f"{man_path}: {len(raw) - pos} bytes past the arrays"
    return out


def widen(words: np.ndarray) -> np.ndarray:
    """bf16 words -> float32 (exact)."""
    return (words.astype(np.uint32) << 16).view(np.float32)
