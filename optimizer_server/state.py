"""A shard's optimizer state in its state dtype: the master and the moments.

What the server holds per parameter, privately (the shared segment adds 4 B:
one gradient slot and one weights slot, optimizer_server.shm):

    state_dtype  master                          moments (Adam: m, v)   private  + shared
                                                 (Lion: m; 2 B less)
    fp32         fp32                   4 B      fp32  4 + 4 B          12 B     16 B
    bf16         exact (bf16 weights)   2 B      bf16  2 + 2 B           6 B     10 B
    bf16         fp32 (fp16 weights,    4 B      bf16  2 + 2 B           8 B     12 B
                 or DPU prediction)

The exact master (``exact_master``): the fp32 master is its high 16 bits, which
are the bf16 weights the update writes into the weights slot anyway, plus a
private 16-bit remainder (cython_ext/_kernels.h draws the rounding that makes
this lossless).  Joined, they are the same fp32 bits an fp32 master would hold,
so the update's arithmetic is unchanged.  It needs the weights slot to hold the
master's high half: bf16 weights, no weight prediction, and a weights slot that
only the server writes.  ``hi_slot`` is the slot that holds it: the one the
last STEP wrote (after INIT, slot 0; after LOAD, the slot LOAD names).

bf16 moments are rounded stochastically, keyed by (step, model-wide element
index): deterministic, and independent of threads and of the sharding.

Checkpoints hold the master as fp32 whatever the state dtype (joined chunk by
chunk), and the moments in their state dtype; a checkpoint of another state
dtype converts on load (fp32 -> bf16 rounds to nearest: that loses precision;
bf16 -> fp32 is exact).
"""
from __future__ import annotations

import numpy as np

from cython_ext import cpu_adam

from .protocol import COMPACT_OPTIMIZERS, STATE_DTYPES
from .reshard import read_range

STATE_ARRAYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                "adagrad": ("state_sum",), "lion": ("exp_avg",)}
# fp32 elements converted per piece on save and load (a reused buffer, 64 MiB):
# host RAM is tightest exactly then, so nothing the size of the shard is allocated
CONVERT_CHUNK = 1 << 24


def _widen(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.uint32) << 16).view(np.float32)


def bytes_per_param(optimizer: str, state_dtype: str = "fp32", exact_master: bool = False) -> int:
    """The server's private bytes per parameter (the table above)."""
    n = len(STATE_ARRAYS[optimizer])
    if state_dtype == "fp32":
        return 4 * (1 + n)
    return (2 if exact_master else 4) + 2 * n


class ShardStateArrays:
    """The master and moments of one shard, and every way they are read and written."""

    def __init__(self, optimizer: str, numel: int, *, state_dtype: str, exact_master: bool, seed: int = 0):
        assert state_dtype in STATE_DTYPES
        assert state_dtype == "fp32" or optimizer in COMPACT_OPTIMIZERS, "refused at HELLO"
        assert not exact_master or state_dtype != "fp32", "refused at HELLO"
        self.optimizer = optimizer
        self.numel = numel
        self.state_dtype = state_dtype
        self.exact_master = exact_master
        self.seed = seed
        mdt = np.float32 if state_dtype == "fp32" else np.uint16
        # np.zeros: pages stay untouched until the first update writes them
        self.master = None if exact_master else np.zeros(numel, np.float32)
        self.remainder = np.zeros(numel, np.uint16) if exact_master else None
        self.moments = {name: np.zeros(numel, mdt) for name in STATE_ARRAYS[optimizer]}
        self.hi_slot = 0

    @property
    def names(self) -> list[str]:
        return ["master", *self.moments]

    @property
    def dtypes(self) -> dict:
        """Each checkpointed array's dtype (the master is always saved as fp32)."""
        return {"master": "fp32", **{k: self.state_dtype for k in self.moments}}

    @property
    def bytes_per_update(self) -> int:
        """Memory traffic of one update (Adam: 28 B/param with fp32 state; 18 with bf16
        state and the exact master, 20 with an fp32 master)."""
        if self.state_dtype == "fp32":
            return self.numel * 2 * (2 + 4 * (1 + len(self.moments)))
        master = 6 if self.exact_master else 8  # hi in + rem in/out, or p in/out
        return self.numel * (2 + master + 4 * len(self.moments) + 2)

    def clear_moments(self) -> None:
        for a in self.moments.values():
            a.fill(0)

    # ------------------------------------------------------------------ master in and out
    def set_master(self, offset: int, src: np.ndarray, slots: list, threads: int) -> None:
        """master[offset:offset+len(src)] = src (an INIT chunk).  The exact master's
        high halves go straight into weights slot 0 (hi_slot)."""
        sl = slice(offset, offset + src.size)
        if self.exact_master:
            self.hi_slot = 0
            cpu_adam.split_master(src, slots[0][sl], self.remainder[sl], num_threads=threads)
        else:
            np.copyto(self.master[sl], src)

    def get_master(self, offset: int, dst: np.ndarray, slots: list) -> None:
        sl = slice(offset, offset + dst.size)
        if self.exact_master:
            cpu_adam.join_master(slots[self.hi_slot][sl], self.remainder[sl], dst)
        else:
            np.copyto(dst, self.master[sl])

    def write_weights(self, slots: list, dtype: str, threads: int, slot: int = 0) -> None:
        """The 16-bit weights of the master into weights slot `slot` (INIT, LOAD)."""
        if self.exact_master:
            if slot != self.hi_slot:
                np.copyto(slots[slot], slots[self.hi_slot])
                self.hi_slot = slot
            return
        # in place, no temporaries: this runs while the worker still holds the
        # user's fp32 model, the moment host memory peaks
        cpu_adam.cast_to_16(self.master, slots[slot], out_dtype=dtype, num_threads=threads)

    # ------------------------------------------------------------------ the update
    def keep_range(self, lo: int, hi: int, slots: list, out_slot: int, dtype: str, threads: int) -> None:
        """A range without a gradient this step: master and state stay; the out slot
        (which may hold older weights: two slots alternate) gets the master's 16 bits."""
        sl = slice(lo, hi)
        if self.exact_master:
            if out_slot != self.hi_slot:
                np.copyto(slots[out_slot][sl], slots[self.hi_slot][sl])
        else:
            cpu_adam.cast_to_16(self.master[sl], slots[out_slot][sl], out_dtype=dtype, num_threads=threads)

    def update_range(self, lo: int, hi: int, h: dict, updates: int, *, step: int, gin, slots: list, out_slot: int,
                     index_base: int, kw: dict) -> None:
        """One kernel call over shard elements [lo, hi) at Adam step `updates`.
        kw: the dtype, scale, thread and progress keywords every kernel takes."""
        sl = slice(lo, hi)
        g, o = gin[sl], slots[out_slot][sl]
        st = self.moments
        if self.state_dtype == "bf16":
            # adam, adamw and lion (refused at HELLO otherwise)
            extra = dict(master_hi=slots[self.hi_slot][sl]) if self.exact_master else {}
            p = self.remainder[sl] if self.exact_master else self.master[sl]
            sr = dict(sr_key=cpu_adam.rounding_key(step, self.seed), index_base=index_base + lo)
            if self.optimizer == "lion":
                cpu_adam.lion_step_bf16(p, st["exp_avg"][sl], g, o, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"],
                                        weight_decay=h["weight_decay"], **sr, **extra, **kw)
                return
            cpu_adam.adam_step_bf16(p, st["exp_avg"][sl], st["exp_avg_sq"][sl], g, o,
                                    step=updates, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                                    weight_decay=h["weight_decay"], adamw=self.optimizer == "adamw", **sr,
                                    **extra, **kw)
            return
        p = self.master[sl]
        if self.optimizer in ("adamw", "adam"):
            cpu_adam.adam_step(p, st["exp_avg"][sl], st["exp_avg_sq"][sl], g, o,
                               step=updates, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
                               weight_decay=h["weight_decay"], adamw=self.optimizer == "adamw", **kw)
        elif self.optimizer == "adagrad":
            cpu_adam.adagrad_step(p, st["state_sum"][sl], g, o, lr=h["lr"], eps=h["eps"],
                                  weight_decay=h["weight_decay"], **kw)
        else:
            cpu_adam.lion_step(p, st["exp_avg"][sl], g, o, lr=h["lr"], beta1=h["beta1"],
                               beta2=h["beta2"], weight_decay=h["weight_decay"], **kw)

    def finish_step(self, out_slot: int) -> None:
        """After a STEP: the slot it wrote holds the exact master's high halves."""
        self.hi_slot = out_slot

    # ------------------------------------------------------------------ checkpoints
    def saved_bytes(self) -> int:
        return self.file_bytes(self.names, self.dtypes, self.numel)

    def write_to(self, f, crc_update, crc: int, slots: list) -> int:
        """Write master (fp32) then each moment (its dtype) to f; returns the CRC."""
        if self.exact_master:
            buf = np.empty(min(CONVERT_CHUNK, self.numel), np.float32)
            for a in range(0, self.numel, CONVERT_CHUNK):
                b = min(self.numel, a + CONVERT_CHUNK)
                piece = buf[:b - a]
                cpu_adam.join_master(slots[self.hi_slot][a:b], self.remainder[a:b], piece)
                f.write(memoryview(piece))
                crc = crc_update(crc, piece)
        else:
            f.write(memoryview(self.master))
            crc = crc_update(crc, self.master)
        for a in self.moments.values():
            f.write(memoryview(a))
            crc = crc_update(crc, a)
        return crc

    @staticmethod
    def file_bytes(names: list, dtypes: dict, per_file: int) -> int:
        return sum(per_file * (4 if dtypes.get(n, "fp32") == "fp32" else 2) for n in names)

    def read_from(self, bins: list, per_file: int, dtypes: dict, lo: int, slots: list, load_slot: int,
                  threads: int) -> None:
        """Read this shard's range [lo, lo + numel) of a checkpoint whose arrays have
        `dtypes` (converting where they differ from this shard's); straight into the
        state where the dtypes agree, through one bounded buffer where they do not."""
        base = 0
        n = self.numel
        for name in self.names:
            src_dt = dtypes.get(name, "fp32")
            item = 4 if src_dt == "fp32" else 2
            if name == "master" and self.exact_master:
                self.hi_slot = load_slot
                self._read_converted(bins, per_file, base, item, lo, src_dt, "exact", slots[load_slot], threads)
            else:
                dst = self.master if name == "master" else self.moments[name]
                want = "fp32" if name == "master" else self.state_dtype
                if want == src_dt:
                    read_range(bins, per_file, base, lo, lo + n, dst)
                else:
                    self._read_converted(bins, per_file, base, item, lo, src_dt, want, dst, threads)
            base += per_file * item

    def _read_converted(self, bins, per_file, base, item, lo, src_dt, want, dst, threads) -> None:
        n = self.numel
        buf = np.empty(min(CONVERT_CHUNK, max(n, 1)), np.float32 if item == 4 else np.uint16)
        for a in range(0, n, CONVERT_CHUNK):
            b = min(n, a + CONVERT_CHUNK)
            piece = buf[:b - a]
            read_range(bins, per_file, base, lo + a, lo + b, piece)
            x = piece if src_dt == "fp32" else _widen(piece)
            if want == "exact":
                cpu_adam.split_master(np.ascontiguousarray(x), dst[a:b], self.remainder[a:b], num_threads=threads)
            elif want == "bf16":  # round to nearest even, straight into the moment
                cpu_adam.cast_to_16(np.ascontiguousarray(x), dst[a:b], out_dtype="bf16", num_threads=threads)
            else:
                dst[a:b] = x
