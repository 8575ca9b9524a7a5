"""torch.optim's state contract for OffloadAdamW/OffloadLion without state_dir.

A torch optimizer's state_dict() holds its state as CPU tensors, so
`torch.save(opt.state_dict())` and `load_state_dict(torch.load(...))` into a new
optimizer on a new model resume it.  Here the state (master, moments, and the
device weights a delayed update left) lives in the optimizer server, so
state_dict() without state_dir puts an InMemoryState under its own key: nothing is
copied while it stays in this process (Accelerate's prepare() takes a state dict
and loads it straight back: that costs nothing), and when it is pickled
(torch.save) or deep-copied it becomes the engine's checkpoint files as uint8 CPU
tensors (a checkpoint written to a private temporary directory, read back and
removed).  That copy is the whole server state in worker memory at once (about
14 B/param with fp32 state, 6 with bf16 state): state_dir avoids it, and writes
the same files to disk instead.

The files are a checkpoint like any other (optimizer_server.checkpoint: CRCs,
format version), so a load checks them as load_checkpoint does.  One rank only:
with several, a checkpoint is a collective and torch.save runs on one rank, so
pickling it raises naming state_dir.  Under FSDP2 each rank's engine is a one-rank
engine over its own shards: each rank's torch.save holds those (runtime.fsdp2).
"""
from __future__ import annotations

import collections
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from . import host_memory, scratch

SCRATCH_PREFIX = "zero-offload-state-"  # runtime.scratch: a killed process's is swept by the next

FILES_KEY = "files"
# the most bytes one file of a state dict may claim when written back (a checkpoint
# file is at most a shard's largest array, 4 B x 2^40 elements)
MAX_FILE_BYTES = 1 << 42


DCP_MODULE = "torch.distributed.checkpoint"


def refuse_dcp(what: str) -> None:
    """ValueError naming the fix when torch.distributed.checkpoint's get_state_dict /
    set_state_dict (or another of its functions) called `what`: it keeps only the
    optimizer state torch's own optimizers hold per parameter, so the master and
    moments, which live in the optimizer server, would be dropped from the checkpoint
    without a word."""
    f = sys._getframe(2)
    for _ in range(6):  # DCP's own helpers call state_dict() a few frames down
        if f is None:
            return
        if str(f.f_globals.get("__name__", "")).startswith(DCP_MODULE):
            raise ValueError(f"{what} called by torch.distributed.checkpoint (get_state_dict/set_state_dict): "
                             f"its optimizer format holds per-parameter tensors, and this optimizer's master and "
                             f"moments live in the optimizer server, so DCP would save none of them. Save the "
                             f"optimizer with opt.save_checkpoint(dir) (loads at any world size and topology) or "
                             f"torch.save(opt.state_dict()) on each rank (resumes at the same world size), and "
                             f"the model with DCP or model.state_dict() as before")
        f = f.f_back


class InMemoryState:
    """The state of `opt` at `iteration`, taken lazily (module docstring)."""

    def __init__(self, opt, iteration: int):
        self.opt, self.iteration = opt, iteration

    def materialize(self) -> dict:
        """{"iteration": the step it was taken at, "files": {relative path: uint8 tensor}}."""
        engine = self.opt.engine
        if engine.world_size > 1:
            raise ValueError("torch.save(opt.state_dict()) without state_dir works on one rank (a checkpoint is a "
                             "collective, and torch.save runs on one): build the optimizer with "
                             "state_dir='...' so that state_dict() writes master, m and v there on every rank")
        if engine.iteration != self.iteration:
            raise ValueError(f"this state dict was taken at step {self.iteration} and the optimizer is at step "
                             f"{engine.iteration} now: torch.save(opt.state_dict()) right after taking it, or "
                             f"pass state_dir='...' to save master, m and v when it is taken")
        # the checkpoint's files are read whole into this process: the server's state bytes
        # (master and moments as a save writes them) plus the device's 16-bit weights
        need = int(engine.stats().get("server_state_bytes", 0)) + 4 * engine.flat.shard_numel + 2 * engine.flat.padded_numel
        instead = ("Pass state_dir='...' to the optimizer: state_dict() then writes master and moments there "
                   "and holds only the path")
        if not host_memory.has_room(need):
            raise host_memory.room_error(need, "torch.save(opt.state_dict()) without state_dir (the optimizer's "
                                         "whole state in this process)", instead)
        tmp = scratch.make(SCRATCH_PREFIX)
        try:
            step_dir = Path(engine.save_own_checkpoint(tmp, keep=1))
            files = {}
            for p in sorted(step_dir.rglob("*")):
                if p.is_file():  # one copy: the file's bytes into the tensor's own buffer
                    files[str(p.relative_to(step_dir))] = torch.from_numpy(np.fromfile(p, dtype=np.uint8))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"iteration": self.iteration, FILES_KEY: files}

    def __reduce__(self):
        # an OrderedDict of tensors and plain values: what torch.load(weights_only=True) reads
        return (collections.OrderedDict, (list(self.materialize().items()),))

    def __deepcopy__(self, memo):
        return collections.OrderedDict(self.materialize())


def load_files(opt, files: dict) -> None:
    """Write a state dict's checkpoint files to a private temporary directory and load
    them (the checkpoint's checks run there: a damaged file is refused, naming it)."""
    if not isinstance(files, dict) or not files:
        raise ValueError("this state dict's files are missing: it was not made by OffloadAdamW.state_dict()")
    tmp = scratch.make(SCRATCH_PREFIX)
    try:
        root = Path(tmp) / "state"
        for rel, t in files.items():
            p = (root / rel).resolve()
            if not isinstance(rel, str) or root.resolve() not in p.parents:
                raise ValueError(f"state dict file name {rel!r} leaves its directory: not an OffloadAdamW state dict")
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
                    and t.numel() <= MAX_FILE_BYTES):
                raise ValueError(f"state dict file {rel!r} is not a 1-D uint8 tensor: not an OffloadAdamW state dict")
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(t.contiguous().numpy()))  # no copy: the file's bytes straight from the tensor
        opt.engine.load_own_checkpoint(str(root))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
