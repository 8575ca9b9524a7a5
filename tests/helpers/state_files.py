"""Reading the server's checkpointed state: each array of shard-r*-of-*.bin in its dtype."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

QBLOCK = 256  # elements per int8 block (optimizer_server.protocol.QBLOCK)


def shard_arrays(checkpoint: str | Path) -> dict[str, np.ndarray]:
    """{"r{rank}.{array}": values} of a checkpoint directory (step-N), fp32 arrays as
    float32, bf16 arrays as raw uint16 words and int8 arrays as uint8 codes (the
    manifest's array_dtypes), each int8 array's block scales as "r{rank}.{array}.scale"
    (float32; they follow all the arrays in the file)."""
    d = Path(checkpoint)
    out = {}
    for man_path in sorted(d.glob("shard-r*-of-*.json")):
        man = json.loads(man_path.read_text())
        raw = man_path.with_suffix(".bin").read_bytes()
        n, pos = man["numel"], 0
        dtypes = man.get("array_dtypes", {})
        kinds = {"fp32": np.float32, "bf16": np.uint16, "int8": np.uint8}
        for name in man["arrays"]:
            dt = kinds[dtypes.get(name, "fp32")]
            size = n * np.dtype(dt).itemsize
            out[f"r{man['rank']}.{name}"] = np.frombuffer(raw[pos:pos + size], dt).copy()
            pos += size
        for name in man["arrays"]:
            if dtypes.get(name) == "int8":
                size = 4 * ((n + QBLOCK - 1) // QBLOCK)
                out[f"r{man['rank']}.{name}.scale"] = np.frombuffer(raw[pos:pos + size], np.float32).copy()
                pos += size
        assert pos == len(raw), f"{man_path}: {len(raw) - pos} bytes past the arrays"
    return out


def widen(words: np.ndarray) -> np.ndarray:
    """bf16 words -> float32 (exact)."""
    return (words.astype(np.uint32) << 16).view(np.float32)
