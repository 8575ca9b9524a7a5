"""The flat 16-bit parameter buffer and its gradient buckets.

All trainable parameters become views into one flat device tensor, laid out in
reverse registration order: backward produces gradients roughly last layer
first, so each bucket (a contiguous range of that flat space) completes early
and its copy to the host overlaps the rest of backward.

    flat16 (device):  [ p_last |g| ... | p_1 |g| p_0 | pad ]  numel padded to a
                      |<- bucket 0 ->|<- bucket 1 ->| ...      multiple of world_size
                                                               (x 256 with int8 state)
                      |<-- shard rank 0 -->|<-- shard rank 1 -->|

Each parameter starts at a multiple of `align` elements (on CUDA 128: 256 bytes of
16-bit weights, so cuBLAS gets aligned operands; 1, packed, on the CPU).  The gap g
before a parameter (its ``lead``, < align elements) belongs to that parameter's
bucket and group, and holds zeros everywhere: weights, gradients, master and state
(a zero gradient leaves a zero weight and zero moments zero under every update rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# elements a cast through a 16-bit dtype handles at a time (cast_and_bind): 32 MiB of
# 16-bit temporary at most
CAST_CHUNK = 1 << 24


@dataclass
class ParamSpan:
    """Where one parameter lies in the flat space."""
    param: torch.nn.Parameter
    offset: int          # into the flat space
    numel: int
    bucket: int
    group: int = 0       # its param group (FlatParams' groups)
    lead: int = 0        # zero elements right before it (alignment), in its bucket and group


@dataclass
class Bucket:
    """A contiguous range [lo, hi) of the flat space whose gradients go down together.
    (What a step's gradients are doing in it is runtime.grads_down's per-step state.)"""
    index: int
    lo: int
    hi: int
    params: list = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class FlatParams:
    """The layout of the flat space: the parameters' spans, the buckets, the shards.

    It owns no buffer: the update cycle owns flat16 (the device's, or a weights
    slot of the shared segment) and makes the parameters views into it with
    ``cast_and_bind`` once and ``bind`` after each swap.
    """

    def __init__(self, params: list[torch.nn.Parameter], *, bucket_numel: int, world_size: int,
                 groups: list[int] | None = None, shard_multiple: int = 1, align: int = 1):
        """groups[i]: the param group of params[i] (None: one group).  Each group's
        parameters lie together, in one contiguous range (group_ranges), so an update
        is one kernel call per group; inside a group, and for the groups' order, the
        layout stays reverse registration order (the group of the last parameter first).
        shard_multiple: with several ranks, each shard's length is a multiple of it (int8
        state: its blocks of 256 must not straddle two ranks); the padding grows to fit.
        align: each parameter's offset is a multiple of it (the module docstring)."""
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        self.params = params
        self.spans: list[ParamSpan] = []
        self.buckets: list[Bucket] = []
        order = list(reversed(range(len(params))))
        if groups is not None:
            first = {}
            for i in order:
                first.setdefault(groups[i], len(first))
            order.sort(key=lambda i: first[groups[i]])  # stable: reverse registration inside a group
        self.group_ranges: list[tuple[int, int, int]] = []  # (group, lo, hi) in flat coordinates, in order
        off = 0
        cur: Bucket | None = None
        for i in order:
            p = params[i]
            g = groups[i] if groups is not None else 0
            n = p.numel()
            start = (off + align - 1) // align * align  # the gap [off, start) goes with this parameter
            if not self.group_ranges or self.group_ranges[-1][0] != g:
                self.group_ranges.append((g, off, off))
            self.group_ranges[-1] = (g, self.group_ranges[-1][1], start + n)
            if cur is None or (cur.numel > 0 and start + n - cur.lo > bucket_numel):
                cur = Bucket(index=len(self.buckets), lo=off, hi=off)
                self.buckets.append(cur)
            span = ParamSpan(p, start, n, cur.index, g, lead=start - off)
            cur.params.append(span)
            cur.hi = start + n
            self.spans.append(span)
            off = start + n
        self.numel = off  # the flat space's end (alignment gaps included)
        self.param_numel = sum(s.numel for s in self.spans)
        self.has_gaps = self.param_numel != off
        self.world_size = world_size
        unit = world_size * (shard_multiple if world_size > 1 else 1)
        self.padded_numel = (off + unit - 1) // unit * unit
        self.shard_numel = self.padded_numel // world_size
        self.by_param = {id(s.param): s for s in self.spans}

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of rank's shard in the flat space."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_groups(self, rank: int) -> list[tuple[int, int, int]]:
        """(group, lo, hi) in shard coordinates, in order, covering rank's whole shard
        (the padding goes with the last group: its zeros stay zeros under any update)."""
        S, lo0 = self.shard_numel, self.shard_range(rank)[0]
        ranges = list(self.group_ranges)
        g, a, _ = ranges[-1]
        ranges[-1] = (g, a, self.padded_numel)
        out = []
        for g, a, b in ranges:
            a2, b2 = max(a, lo0), min(b, lo0 + S)
            if b2 > a2:
                out.append((g, a2 - lo0, b2 - lo0))
        return out

    def shard_runs(self, rank: int, values: list[int]) -> list[tuple[int, int, int, int]]:
        """(group, lo, hi, value) in shard coordinates, in order, covering rank's whole
        shard: shard_groups split where values[i] (one per span, in span order) changes,
        consecutive spans of one group with one value merged.  The padding goes with
        the shard's last run.  One pass over the spans (it runs every step)."""
        lo0, S = self.shard_range(rank)[0], self.shard_numel
        out: list[list[int]] = []
        for i, s in enumerate(self.spans):  # spans tile [0, numel) in offset order
            x, y = max(lo0, s.offset) - lo0, min(lo0 + S, s.offset + s.numel) - lo0
            if y <= x:
                continue
            if out and out[-1][0] == s.group and out[-1][3] == values[i]:
                out[-1][2] = y
            else:  # from where the last run ended (an alignment gap goes with the span after it)
                out.append([s.group, out[-1][2] if out else 0, y, values[i]])
        if not out:  # a shard of padding only: the last group's
            out.append([self.spans[-1].group, 0, S, values[-1]])
        out[-1][2] = S  # the padding (past numel) with the last run
        return [tuple(r) for r in out]

    def copy_fp32_range(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """out[:] = the model's current weights [lo, hi) of the flat space, as fp32
        (padding zero), straight from each parameter: no flat copy of the whole model."""
        assert out.numel() == hi - lo and out.dtype == torch.float32
        # packed, the parameters tile [0, numel): only the padding needs zeros
        if self.has_gaps:
            out.zero_()
        else:
            out[max(self.numel, lo) - lo:].zero_()
        for s in self.spans:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if b > a:
                src = s.param.detach().reshape(-1)[a - s.offset:b - s.offset]
                out[a - lo:b - lo].copy_(src)

    def cast_and_bind(self, flat16: torch.Tensor, via: torch.dtype | None = None) -> None:
        """Cast every parameter into its place in flat16, then make it a view there.
        via: round through this 16-bit dtype first (an fp32 flat16 holding 16-bit values).

        One parameter at a time, so each fp32 tensor is released as soon as its
        16-bit copy exists (unless the caller holds another reference): the host
        never holds the fp32 model and a second full copy of it at once."""
        assert flat16.numel() == self.padded_numel
        flat16[self.numel:].zero_()
        with torch.no_grad():
            for s in self.spans:
                if s.lead:
                    flat16[s.offset - s.lead:s.offset].zero_()
                view = flat16[s.offset:s.offset + s.numel]
                src = s.param.detach().reshape(-1)
                if via is not None and via != view.dtype:
                    # in chunks: a whole 16-bit temporary of a 1e9-element parameter would
                    # be 2 GB more at set-up's peak (runtime.wiring.worker_peak_bytes)
                    for lo in range(0, s.numel, CAST_CHUNK):
                        view[lo:lo + CAST_CHUNK].copy_(src[lo:lo + CAST_CHUNK].to(via))
                else:
                    view.copy_(src)
                s.param.data = view.view(s.param.shape)

    def bind(self, flat16: torch.Tensor) -> None:
        """Make every parameter a view of flat16 (its 16-bit weights live there now)."""
        assert flat16.numel() == self.padded_numel
        with torch.no_grad():
            for s in self.spans:
                view = flat16[s.offset:s.offset + s.numel].view(s.param.shape)
                s.param.data = view

    def check_views(self, flat16: torch.Tensor, dtype: torch.dtype) -> None:
        """The parameters must still view flat16: what the server writes reaches the model
        only through it.  O(parameters) pointer compares per backward."""
        base = flat16.data_ptr()
        size = flat16.element_size()
        for s in self.spans:
            if s.numel == 0:  # an empty view has no address (data_ptr 0): nothing to reach it
                continue
            if s.param.data_ptr() != base + size * s.offset or s.param.dtype != dtype:
                raise RuntimeError(
                    "the model's parameters no longer view the engine's 16-bit weights: something replaced their "
                    "storage (accelerator.prepare(model) with several CPU processes, which moves it to cpu:0, a "
                    "copy, and wraps it in DistributedDataParallel; model.to(...); load_state_dict(assign=True)), "
                    "so updates would not reach the model. "
                    "The engine reduces gradients across ranks itself (ZeRO-2): do not wrap the model in DDP (with "
                    "Accelerate, prepare the optimizer, dataloader and scheduler but not the model), and move the "
                    "model to its device before creating the engine")
