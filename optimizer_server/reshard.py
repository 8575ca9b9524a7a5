"""Reading one shard's range out of a checkpoint saved with any world size.

A checkpoint holds, for each rank k of the W that saved it, that rank's shard
[k*S, (k+1)*S) of the flat parameter space, in files named ``...-r{k}-of-{W}...``.
The shards laid end to end are the whole flat space, padded to a multiple of W;
the padding past the model's last element is zero in every array (the weights
start at zero there and their gradients are zero, so no update moves them).

So the shard of rank r among W' ranks is the range [r*S', (r+1)*S') of that
concatenation, with zeros past its end, whatever W was: the server's LOAD and
the engine's load_checkpoint read it piece by piece, straight into the
destination array (no temporaries: loading is when host memory is tightest).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .ckpt_io import parallel_read


def read_range(files: list[Path], per_file: int, base_bytes: int, lo: int, hi: int, out: np.ndarray) -> None:
    """out[:] = elements [lo, hi) of the concatenation, over files, of each file's
    per_file elements (of out's itemsize) starting at byte base_bytes; zeros past
    the last file."""
    assert out.ndim == 1 and out.size == hi - lo and out.flags.c_contiguous
    item = out.itemsize
    pos = lo
    while pos < hi:
        k = pos // per_file if per_file else len(files)
        end = min(hi, (k + 1) * per_file) if k < len(files) else hi
        if k >= len(files):
            out[pos - lo:end - lo] = 0  # the padding of a larger world size
        else:
            # large preads on several threads: a resume reads at the disk's speed
            parallel_read(files[k], base_bytes + (pos - k * per_file) * item, out[pos - lo:end - lo])
        pos = end
