"""A checkpoint's fp32 master weights as the model's state dict, without the model, the
optimizer server or a GPU (what DeepSpeed's zero_to_fp32.py does for its checkpoints):

    zero-offload-export CHECKPOINT model.safetensors [--dtype bf16]     # a file HF loads
    zero-offload-export CHECKPOINT DIR --max-shard-size 5GB            # shards + index, as save_pretrained
    sd = zero_offload.export.master_state_dict_from_checkpoint("ckpt")  # in memory

A checkpoint holds the flat parameter space cut into the shard files of the ranks that
saved it (docs/checkpoint.md); the rank-0 engine file's ``params`` says where each
parameter lies in that space, its shape and its state_dict names.  Any checkpoint
this version writes has it: one rank or many, the built-in path or FSDP2.

export_safetensors streams: the master goes from the shard files to the output
CHUNK elements at a time through one buffer, so its memory does not grow with the
model (a 1.5e9-parameter checkpoint, 6 GB of master, exports in ~64 MiB besides the
page cache).  master_state_dict_from_checkpoint holds the whole master (4 B/param).
Every shard file is checked against its checksum first (reading it whole: 12-16
B/param with fp32 state), unless verify=False.

The safetensors file holds each parameter once, under its first name; a tied weight's
other names (GPT-2's lm_head.weight) are in the file's metadata ("aliases"), as
transformers' save_pretrained leaves them out (from_pretrained ties them again).
Buffers are not in a checkpoint (it holds what the optimizer trains): a model's
persistent buffers come from its own construction.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zero_offload.server import checkpoint as C
from zero_offload.server.atomic import atomic_write
from zero_offload.server.reshard import read_range
from zero_offload.server.state import ShardStateArrays

CHUNK = 1 << 24  # elements read and written at a time: 64 MiB of fp32
DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}  # --dtype -> safetensors' name
MAX_NAME_BYTES = 4096  # a parameter name longer than this is not one of ours
MASTER = "master"


@dataclass(frozen=True)
class Param:
    """One row of a checkpoint's "params": where the parameter lies in the flat space."""
    offset: int
    shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class CheckpointMaster:
    """The fp32 master of a checkpoint directory (root/latest's target, or a step directory):
    its parameter table (``params``) and reads of any range of the flat space."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True):
        d = C.resolve(directory)
        self.dir = d
        worlds = C.saved_world_sizes(d, C.ENGINE)
        if len(worlds) != 1:
            why = "no engine files" if not worlds else f"engine files of several world sizes: {worlds}"
            raise C.CheckpointError(f"{d} holds no checkpoint ({why}); pass a checkpoint directory or one of its "
                                    f"step-N directories")
        (W,) = worlds
        ep = C.rank_file(d, C.ENGINE, 0, W, ".json")
        meta = json.loads(ep.read_text())
        C.check_version(ep, "version", meta.get("version"), C.ENGINE_VERSION)
        self.numel = meta.get("numel")
        if not isinstance(self.numel, int) or self.numel < 0:
            raise C.CheckpointError(f"{ep} has numel={self.numel!r}; load another checkpoint")
        if "params" not in meta:
            raise C.CheckpointError(
                f"checkpoint {d} was saved before checkpoints named their parameters ({ep.name} has no 'params'): "
                f"load it into its model (engine.load_checkpoint, then engine.master_state_dict()), or save it "
                f"again with this version and export that")
        self.params = _parse_table(ep, meta["params"], self.numel)
        self.iteration = meta.get("iteration")
        # each parameter's step count, by row (the table and the counts are both in the
        # flat space's order); older checkpoints: every parameter at every update
        counts = meta.get("param_updates", [meta.get("updates", 0)] * len(self.params))
        if not (isinstance(counts, list) and len(counts) == len(self.params)
                and all(isinstance(c, int) and c >= 0 for c in counts)):
            raise C.CheckpointError(f"{ep} has {len(counts) if isinstance(counts, list) else counts!r} step counts "
                                    f"for {len(self.params)} parameters; load another checkpoint")
        self.param_updates = counts
        mans = []
        self.files = [C.rank_file(d, C.SHARD, k, W, ".bin") for k in range(W)]
        for k in range(W):
            mp = C.rank_file(d, C.SHARD, k, W, ".json")
            if not mp.exists() or not self.files[k].exists():
                raise C.CheckpointError(f"checkpoint {d} is incomplete: {mp.name} or {self.files[k].name} is "
                                        f"missing; export another checkpoint (an earlier step-N beside it)")
            man = json.loads(mp.read_text())
            C.check_shard_manifest(mp, man)
            mans.append(man)
        per = {m["numel"] for m in mans}
        if len(per) != 1 or per.pop() * W < self.numel or MASTER not in mans[0].get("arrays", []):
            raise C.CheckpointError(f"checkpoint {d}: its {W} shard manifests disagree on their size, are too small "
                                    f"for {self.numel} elements, or hold no master; export another checkpoint")
        self.per_file = mans[0]["numel"]
        self.arrays, self.dtypes = list(mans[0]["arrays"]), C.saved_array_dtypes(mans[0])
        at, size = ShardStateArrays.file_layout(self.arrays, self.dtypes, self.per_file)
        self.at = at  # where each array (and an int8 array's scales) starts in every shard file
        self.base = at[MASTER]
        for f in self.files:
            if f.stat().st_size != size:
                raise C.CheckpointError(f"checkpoint file {f} has {f.stat().st_size} bytes where its manifest lays "
                                        f"out {size}; export another checkpoint (an earlier step-N beside it)")
        if verify:
            for f, man in zip(self.files, mans):
                C.verify(f, man.get("checksum"))

    def read(self, lo: int, hi: int, out: np.ndarray) -> None:
        """out[:] = the master's elements [lo, hi) of the flat space (fp32)."""
        read_range(self.files, self.per_file, self.base, lo, hi, out)


def _parse_table(path: Path, rows, numel: int) -> list[Param]:
    """The "params" rows, checked before anything is read on their word: each within the
    flat space, none overlapping another, every name a string used once."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise C.CheckpointError(f"{path} has an invalid 'params' table: {what}; export another checkpoint")
    need(isinstance(rows, list), "not a list")
    out, seen, end = [], set(), 0
    for i, r in enumerate(rows):
        need(isinstance(r, dict) and {"offset", "shape", "names"} <= set(r), f"row {i} lacks offset, shape or names")
        off, shape, names = r["offset"], r["shape"], r["names"]
        need(isinstance(off, int) and off >= end, f"row {i}'s offset {off!r} is not past the row before it")
        need(isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape),
             f"row {i}'s shape {shape!r}")
        need(isinstance(names, list) and names and all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_BYTES
                                                       for n in names), f"row {i}'s names")
        need(not seen.intersection(names), f"row {i} repeats a name of another row")
        seen.update(names)
        p = Param(off, tuple(shape), tuple(names))
        end = off + p.numel
        need(end <= numel, f"row {i} ends at {end}, past the flat space's {numel} elements")
        out.append(p)
    return out


def master_state_dict_from_checkpoint(directory: str | os.PathLike, verify: bool = True) -> "OrderedDict":
    """The checkpoint's fp32 master as CPU tensors keyed like model.state_dict() (a tied
    weight under each of its names, one tensor), as engine.master_state_dict() gives it
    while training: views into one flat tensor of the master (4 B/param)."""
    import torch
    src = CheckpointMaster(directory, verify)
    flat = np.empty(src.numel, np.float32)
    src.read(0, src.numel, flat)
    full = torch.from_numpy(flat)
    out = OrderedDict()
    for p in src.params:
        view = full[p.offset:p.offset + p.numel].view(p.shape)
        for name in p.names:
            out[name] = view
    return out


def to_16(x: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 -> bf16 or fp16 bits, rounded to nearest even (as torch's .to() rounds)."""
    if dtype == "fp16":
        return x.astype(np.float16)
    u = x.view(np.uint32)
    r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # a NaN stays a NaN (the rounding's carry could make it an infinity)
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return r


def _umask_mode() -> int:
    """0o666 less this process's umask (read without setting it: os.umask would race other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


def _plan(params: list[Param], dtype: str, max_shard_bytes: int | None) -> list[list[Param]]:
    """The parameters (flat order) split into files of at most max_shard_bytes of tensor
    data each, greedily, as transformers' save_pretrained splits (a parameter larger than
    the limit gets a file of its own); one file where max_shard_bytes is None."""
    if max_shard_bytes is None:
        return [params]
    item = 4 if dtype == "fp32" else 2
    files: list[list[Param]] = [[]]
    size = 0
    for p in params:
        if files[-1] and size + p.numel * item > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(p)
        size += p.numel * item
    return files


def _write_file(path: Path, src: "CheckpointMaster", params: list[Param], dtype: str) -> int:
    """One safetensors file of `params` (each under its first name, its other names in the
    metadata's aliases), to a temporary name beside `path`, renamed into place; returns
    its tensor data's bytes."""
    item = 4 if dtype == "fp32" else 2
    header, pos, aliases = {}, 0, {}
    for p in params:
        header[p.names[0]] = {"dtype": DTYPES[dtype], "shape": list(p.shape),
                              "data_offsets": [pos, pos + p.numel * item]}
        pos += p.numel * item
        aliases.update({alias: p.names[0] for alias in p.names[1:]})
    # "format": "pt" is what transformers' from_pretrained asks of a safetensors file
    header["__metadata__"] = {"format": "pt", "source": f"zero_offload checkpoint {src.dir.name}",
                              "aliases": json.dumps(aliases)}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it

    # the data: the parameters in flat order, each a contiguous range; runs of them that
    # touch (every one but where alignment padding lies between) are read as one
    runs: list[list[int]] = []
    for p in params:
        if runs and runs[-1][1] == p.offset:
            runs[-1][1] += p.numel
        elif p.numel:
            runs.append([p.offset, p.offset + p.numel])
    buf = np.empty(min(CHUNK, max((b - a for a, b in runs), default=0)), np.float32)

    def write(f) -> None:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for a, b in runs:
            for lo in range(a, b, CHUNK):
                n = min(CHUNK, b - lo)
                src.read(lo, lo + n, buf[:n])
                data = buf[:n] if dtype == "fp32" else to_16(buf[:n], dtype)
                f.write(memoryview(data).cast("B"))
    atomic_write(path, write, mode=_umask_mode())
    return pos


SINGLE = "model.safetensors"            # transformers' names: one file,
INDEX = "model.safetensors.index.json"  # or shards and their index
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _ours(name: str) -> bool:
    """Whether a file name is one an export into a directory writes."""
    return name in (SINGLE, INDEX) or SHARD_NAME.fullmatch(name) is not None


def export_safetensors(directory: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32",
                       verify: bool = True, overwrite: bool = False,
                       max_shard_bytes: int | None = None) -> Path:
    """Write the checkpoint's master as safetensors (in `dtype`: fp32, or bf16 / fp16
    rounded to nearest even), each parameter once under its first name.

    max_shard_bytes None: one file at `out`.  Otherwise `out` is a directory (made if
    missing) that gets what transformers' save_pretrained writes: model.safetensors if it
    all fits in one file, else model-0000k-of-0000N.safetensors of at most that many bytes
    of tensors each and model.safetensors.index.json (the weight_map from_pretrained
    reads), written last.  Each file goes to a temporary name beside it and is renamed
    into place (a failed export leaves no index); existing outputs are refused unless
    overwrite, which removes an earlier index before writing and, once done, the shards
    of an earlier export that the new index does not name.  Returns the file, or the
    directory."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    out = Path(out)
    if max_shard_bytes is None:
        if out.exists() and not overwrite:
            raise FileExistsError(f"{out} exists: pass overwrite=True (--overwrite) to replace it, or another path")
        if not out.parent.is_dir():
            raise FileNotFoundError(f"{out.parent} is not a directory: make it first")
    else:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out} is a file: with a shard size the output is a directory (as "
                                     f"save_pretrained's); name one")
        old = [f for f in (out.iterdir() if out.is_dir() else ()) if _ours(f.name)]
        if old and not overwrite:
            raise FileExistsError(f"{out} already holds {', '.join(sorted(f.name for f in old))}: pass "
                                  f"overwrite=True (--overwrite) to replace them, or another directory")
    src = CheckpointMaster(directory, verify)
    files = _plan(src.params, dtype, max_shard_bytes)
    if max_shard_bytes is None:
        _write_file(out, src, files[0], dtype)
        return out
    out.mkdir(parents=True, exist_ok=True)
    # an earlier index goes first: rewriting shards of the same names under it, an export
    # that failed half-way would leave it naming a mix of two checkpoints' files
    (out / INDEX).unlink(missing_ok=True)
    names = [SINGLE] if len(files) == 1 else \
        [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    total = sum(_write_file(out / name, src, group, dtype) for name, group in zip(names, files))
    keep = set(names)
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {p.names[0]: name for name, group in zip(names, files) for p in group}}
        atomic_write(out / INDEX, lambda f: f.write(json.dumps(index, indent=2).encode()), mode=_umask_mode())
        keep.add(INDEX)
    for f in out.iterdir():  # an earlier export's files that this one does not use (overwrite only)
        if f.name not in keep and _ours(f.name):
            f.unlink()
    return out


def parse_size(text: str) -> int:
    """"5GB", "500MB", "2GiB", "1000000" as bytes (decimal units as transformers reads
    them: GB = 10^9; GiB = 2^30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r}: give bytes or a number with KB, MB, GB (or KiB, MiB, GiB)")
    unit = (m.group(2) or "B").upper()
    scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(m.group(1)) * scale)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zero-offload-export",
                                 description="Write a zero-offload checkpoint's fp32 master weights as a safetensors "
                                             "file keyed like the model's state_dict (no model, server or GPU needed)")
    ap.add_argument("checkpoint", help="the directory save_checkpoint wrote (its latest step) or a step-N directory")
    ap.add_argument("out", help="the safetensors file to write (e.g. DIR/model.safetensors beside a config.json); "
                                "with --max-shard-size, the directory to write the shards and their index into")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="fp32 (the master as it is), or bf16 / fp16 rounded to nearest even")
    ap.add_argument("--max-shard-size", metavar="SIZE",
                    help="split into files of at most SIZE of tensors (e.g. 5GB) with a model.safetensors.index.json, "
                         "as save_pretrained does; OUT is then a directory")
    ap.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip checking the shard files' checksums (which reads them whole)")
    a = ap.parse_args(argv)
    try:
        shard = None if a.max_shard_size is None else parse_size(a.max_shard_size)
        path = export_safetensors(a.checkpoint, a.out, a.dtype, verify=not a.no_verify, overwrite=a.overwrite,
                                  max_shard_bytes=shard)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"zero-offload-export: {e}", file=sys.stderr)
        return 1
    files = [path] if path.is_file() else [f for f in path.iterdir() if _ours(f.name) and f.name != INDEX]
    print(f"wrote {path} ({len(files)} file{'s' if len(files) > 1 else ''}, "
          f"{sum(f.stat().st_size for f in files) / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
