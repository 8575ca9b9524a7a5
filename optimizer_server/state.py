"""A shard's optimizer state in its state dtype: the master and the moments.

What the server holds per parameter, privately (the shared segment adds 4 B:
one gradient slot and one weights slot, optimizer_server.shm):

    state_dtype  master                          moments (Adam: m, v)   private  + shared
                                                 (Lion: m alone)
    fp32         fp32                   4 B      fp32  4 + 4 B          12 B     16 B
    bf16         exact (bf16 weights)   2 B      bf16  2 + 2 B           6 B     10 B
    bf16         fp32 (fp16 weights,    4 B      bf16  2 + 2 B           8 B     12 B
                 or DPU prediction)
    int8         exact                  2 B      int8  1 + 1 B           4 B      8 B
                                                 + a scale per 256: 0.03 B  (4.03)   (8.03)
    int8         fp32                   4 B      int8  1 + 1 B (+0.03)   6 B     10 B

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

int8 moments (adam/adamw: m and v; lion: m) are codes in blocks of QBLOCK = 256
elements with one fp32 scale per block and moment (cython_ext/_kernels_int8.h draws
the codes).
A block's scale depends on all of its elements, so an update handles whole
blocks: one kernel call over the shard whose groups carry each range's
hyper-parameters (update_blocks), and shards start on a block (HELLO refuses
an int8 shard of another length when there are several ranks).

Checkpoints hold the master as fp32 whatever the state dtype (joined chunk by
chunk), and the moments in their state dtype, each int8 moment's scales after
all the arrays; a checkpoint of another state dtype converts on load (down,
fp32 -> bf16 -> int8, rounds to nearest: that loses precision; up is exact).
"""
from __future__ import annotations

import threading

import numpy as np

from zero_offload.kernels import cpu_adam

from .checkpoint import LEGACY_INT8
from .ckpt_io import IO_THREADS, read_file_verified, touch_ahead
from .protocol import COMPACT_OPTIMIZERS, QBLOCK, STATE_DTYPES
from .reshard import read_range
from .update_rules import rule_for

assert QBLOCK == cpu_adam.QBLOCK, "protocol.QBLOCK and the int8 kernel's block disagree"
ITEM_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, LEGACY_INT8: 1}
INT8_CODES = ("int8", LEGACY_INT8)  # array dtypes with block scales after the arrays

STATE_ARRAYS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                "adagrad": ("state_sum",), "lion": ("exp_avg",)}
# fp32 elements converted per piece on save and load (a reused buffer, 64 MiB):
# host RAM is tightest exactly then, so nothing the size of the shard is allocated
CONVERT_CHUNK = 1 << 24
HUGE_ARRAY_BYTES = 32 << 20  # _zeros64: arrays from this size on huge pages


def _widen(w: np.ndarray) -> np.ndarray:
    return (w.astype(np.uint32) << 16).view(np.float32)


def _zeros64(numel: int, dtype=np.float32) -> np.ndarray:
    """np.zeros(numel, dtype) starting on a 64-byte line: the twin's out-of-place
    update streams its stores, which need the state's arrays aligned alike.  A large
    one is an anonymous map on transparent huge pages (zeros too, untouched until
    written, page-aligned): first touches of 4 KiB pages ran at 0.7-2 GB/s where 2 MiB
    ones ran at 5-8 on a 2-core VM, and a LOAD or an update first writes GBs of them."""
    item = np.dtype(dtype).itemsize
    if numel * item >= HUGE_ARRAY_BYTES:
        from .ckpt_io import chunk_buffer
        return chunk_buffer(numel * item).view(dtype)
    buf = np.zeros(numel + 64 // item, dtype)
    off = (-buf.ctypes.data % 64) // item
    return buf[off:off + numel]


def nblocks(numel: int) -> int:
    """int8 blocks (scales per moment) of numel elements."""
    return (numel + QBLOCK - 1) // QBLOCK


def bytes_per_param(optimizer: str, state_dtype: str = "fp32", exact_master: bool = False) -> float:
    """The server's private bytes per parameter (the table above)."""
    n = len(STATE_ARRAYS[optimizer])
    if state_dtype == "fp32":
        return 4 * (1 + n)
    extra = n * 4 / QBLOCK if state_dtype == "int8" else 0
    return (2 if exact_master else 4) + ITEM_BYTES[state_dtype] * n + extra


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
        mdt = {"fp32": np.float32, "bf16": np.uint16, "int8": np.uint8}[state_dtype]
        # np.zeros: pages stay untouched until the first update writes them
        self.master = None if exact_master else _zeros64(numel)
        self.remainder = _zeros64(numel, np.uint16) if exact_master else None
        self.moments = {name: _zeros64(numel, mdt) for name in STATE_ARRAYS[optimizer]}
        # int8: each moment's per-block scales (all zero: every code decodes to 0)
        self.scales = ({name: np.zeros(nblocks(numel), np.float32) for name in self.moments}
                       if state_dtype == "int8" else {})
        self.hi_slot = 0
        self.rule = rule_for(optimizer, state_dtype)  # the kernel calls (optimizer_server.update_rules)
        # speculation's twin (make_twin): a second master (or remainder) and moments that an
        # out-of-place update writes while the current ones stay as they were, so undoing it
        # is free
        self.twin: dict | None = None

    # ------------------------------------------------------------------ the twin
    @property
    def can_twin(self) -> bool:
        """Adam/AdamW with fp32 state, or bf16 state and the exact master: the kernels
        that update out of place (read_from)."""
        return self.optimizer in ("adam", "adamw") and (
            self.state_dtype == "fp32" or (self.state_dtype == "bf16" and self.exact_master))

    def _mirrored(self) -> dict:
        """The arrays an update rewrites in place, which the twin mirrors: the master (or
        the exact master's remainder) and the moments."""
        first = {"remainder": self.remainder} if self.exact_master else {"master": self.master}
        return {**first, **self.moments}

    def make_twin(self) -> None:
        """Allocate the twin (zeros: its pages are committed by prefault_twin)."""
        assert self.can_twin and self.twin is None
        self.twin = {name: _zeros64(self.numel, a.dtype) for name, a in self._mirrored().items()}
        self._twin_faulted = False

    def prefault_twin(self) -> None:
        """Commit the twin's pages at once (a write into each), before the first piece
        writes them: first touches inside a piece made it 10-20x slower (undo.py)."""
        if self.twin is not None and not self._twin_faulted:
            for a in self.twin.values():
                a.view(np.uint8)[::4096] = 0
            # the state's moments too: np.zeros left them untouched until an update wrote
            # them, and after the first flip they are the twin (each page keeps its value)
            for a in self._mirrored().values():
                w = a.view(np.uint8)
                w[::4096] |= 0  # a real write (a[::k] = a[::k] is skipped)
            self._twin_faulted = True

    def flip(self) -> None:
        """After a STEP that wrote the whole new state into the twin (part of it while
        speculating): the twin becomes the state, and the old state the twin."""
        t = self.twin
        if self.exact_master:
            self.remainder, t["remainder"] = t["remainder"], self.remainder
        else:
            self.master, t["master"] = t["master"], self.master
        for name in self.moments:
            self.moments[name], t[name] = t[name], self.moments[name]

    @property
    def names(self) -> list[str]:
        return ["master", *self.moments]

    @property
    def state_bytes(self) -> int:
        """The host bytes the state holds privately: the master (or the exact master's
        remainder, whose high halves are the weights slot's), the moments and int8's
        scales; speculation's twin apart."""
        first = self.remainder if self.exact_master else self.master
        return first.nbytes + sum(a.nbytes for a in (*self.moments.values(), *self.scales.values()))

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
        return self.numel * (2 + master + 2 * ITEM_BYTES[self.state_dtype] * len(self.moments) + 2)

    def clear_moments(self) -> None:
        for a in (*self.moments.values(), *self.scales.values()):
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
    def keep_range(self, lo: int, hi: int, slots: list, weights_slot: int, dtype: str, threads: int,
                   twin: bool = False) -> None:
        """A range without a gradient this step: master and state stay (twin: are copied
        into the twin, which becomes the state after this STEP); the out slot (which may
        hold older weights: two slots alternate) gets the master's 16 bits."""
        sl = slice(lo, hi)
        if twin:
            cur = self._mirrored()
            for name, a in self.twin.items():
                np.copyto(a[sl], cur[name][sl])
        if self.exact_master:
            if weights_slot != self.hi_slot:
                np.copyto(slots[weights_slot][sl], slots[self.hi_slot][sl])
        else:
            cpu_adam.cast_to_16(self.master[sl], slots[weights_slot][sl], out_dtype=dtype, num_threads=threads)

    def update_range(self, lo: int, hi: int, h: dict, updates: int, *, step: int, gin, slots: list, weights_slot: int,
                     index_base: int, kw: dict, twin: bool = False) -> None:
        """One kernel call over shard elements [lo, hi) at Adam step `updates`.
        kw: the dtype, scale, thread and progress keywords every kernel takes.
        twin: read the state and write the new one into the twin (the state stays)."""
        sl = slice(lo, hi)
        g, o = gin[sl], slots[weights_slot][sl]
        dst = cur = self._mirrored()
        if twin:  # adam/adamw (can_twin): the old state is read, the new one goes to the twin
            dst = self.twin
            kw = dict(kw, read_from=tuple(a[sl] for a in cur.values()))  # (master or remainder, m, v)
        st = {name: dst[name][sl] for name in self.moments}
        p = dst["remainder" if self.exact_master else "master"][sl]
        sr = {}
        if self.state_dtype == "bf16":  # stochastic rounding, and the exact master's high halves
            sr = dict(sr_key=cpu_adam.rounding_key(step, self.seed), index_base=index_base + lo)
            if self.exact_master:
                sr["master_hi"] = slots[self.hi_slot][sl]
        self.rule.update(p, st, g, o, h, updates, sr=sr, kw=kw)

    def update_blocks(self, lo: int, hi: int, groups: list, *, step: int, gin, slots: list, weights_slot: int,
                      index_base: int, kw: dict) -> None:
        """int8: one kernel call over whole blocks [lo, hi) (lo on a block; hi on one or
        the shard's end).  groups: (a, b, hparams with "updates", or None to keep) in
        shard coordinates, covering [lo, hi).  kw: as update_range's."""
        assert self.state_dtype == "int8" and lo % QBLOCK == 0 and (hi % QBLOCK == 0 or hi == self.numel)
        sl = slice(lo, hi)
        bl = slice(lo // QBLOCK, nblocks(hi))
        call = []
        for a, b, h in groups:
            a, b = max(a, lo) - lo, min(b, hi) - lo
            if b > a:
                call.append((a, b, None if h is None else self.rule.group_hparams(h)))
        extra = dict(master_hi=slots[self.hi_slot][sl]) if self.exact_master else {}
        extra.update(groups=call, sr_key=cpu_adam.rounding_key(step, self.seed), index_base=index_base + lo)
        p = self.remainder[sl] if self.exact_master else self.master[sl]
        st = {name: m[sl] for name, m in self.moments.items()}
        scales = {name: sc[bl] for name, sc in self.scales.items()}
        self.rule.update_blocks(p, st, scales, gin[sl], slots[weights_slot][sl], extra=extra, kw=kw)

    def update_writes(self, lo: int, hi: int, slots: list, weights_slot: int) -> list[np.ndarray]:
        """The array slices an update of [lo, hi) overwrites that a rollback must put back
        (what the undo log saves before a speculative update): the master or remainder,
        each moment and the int8 scales of the blocks it touches (none of them with the
        twin, which leaves the state as it is), and the out weights slot where it is the
        one weights slot (the worker's current weights, which a SKIP leaves as they
        were) or holds the exact master's high halves (weights_slot == hi_slot; they are
        read from hi_slot when weights_slot differs).  Of two slots, a STEP writes the one
        the worker does not compute with: its old bytes are the weights before the
        current ones, which nothing reads again and the next STEP rewrites whole."""
        sl = slice(lo, hi)
        slot = [slots[weights_slot][sl]] if len(slots) == 1 or (self.exact_master and weights_slot == self.hi_slot) else []
        if self.twin is not None:
            return slot
        out = [self.remainder[sl] if self.exact_master else self.master[sl]]
        out += [a[sl] for a in self.moments.values()]
        out += [a[lo // QBLOCK:nblocks(hi)] for a in self.scales.values()]
        out += slot
        return out

    def finish_step(self, weights_slot: int) -> None:
        """After a STEP: the slot it wrote holds the exact master's high halves."""
        self.hi_slot = weights_slot

    # ------------------------------------------------------------------ checkpoints
    # A shard file: master (fp32), each moment (its dtype), then each int8 moment's
    # block scales (fp32, nblocks(per_file) of them).
    def saved_bytes(self) -> int:
        return self.file_bytes(self.names, self.dtypes, self.numel)

    def save_parts(self, slots: list, layout_numel: int | None = None) -> list:
        """The file's regions as ckpt_io.Parts over the live arrays (held by reference: a
        save job writes them while later updates run, guarded by SaveJob.ensure): the
        master (fp32; the exact master joined chunk by chunk), each moment in its dtype,
        then the int8 scales.  layout_numel: the bases of a file of that many elements
        (a shared file the save places its pieces in), not of this state's."""
        from .ckpt_io import SAVE_CHUNK, Part
        at, _ = self.file_layout(self.names, self.dtypes, self.numel if layout_numel is None else layout_numel)
        n = self.numel

        def view(a_: np.ndarray):
            return lambda a, b, _buf: memoryview(a_[a:b]).cast("B")
        if self.exact_master:
            hi, rem = slots[self.hi_slot], self.remainder

            def joined(a, b, buf):
                out = buf.view(np.float32)[:b - a]
                cpu_adam.join_master(hi[a:b], rem[a:b], out)
                return memoryview(out).cast("B")
            parts = [Part(at["master"], 4, n, 1, joined, scratch_bytes=4 * min(SAVE_CHUNK, max(n, 1)))]
        else:
            parts = [Part(at["master"], 4, n, 1, view(self.master))]
        for name, a_ in self.moments.items():
            parts.append(Part(at[name], a_.itemsize, n, 1, view(a_)))
        for name, sc in self.scales.items():
            parts.append(Part(at[name + ".scale"], 4, sc.size, QBLOCK, view(sc)))
        return parts

    @staticmethod
    def file_layout(names: list, dtypes: dict, per_file: int) -> tuple[dict, int]:
        """Where each array of a shard file starts ("NAME.scale": an int8 array's scales,
        after all the arrays), and the file's length in bytes."""
        at, pos = {}, 0
        for name in names:
            at[name] = pos
            pos += per_file * ITEM_BYTES[dtypes.get(name, "fp32")]
        for name in names:
            if dtypes.get(name, "fp32") in INT8_CODES:
                at[name + ".scale"] = pos
                pos += 4 * nblocks(per_file)
        return at, pos

    @staticmethod
    def file_bytes(names: list, dtypes: dict, per_file: int) -> int:
        return ShardStateArrays.file_layout(names, dtypes, per_file)[1]

    def read_from(self, bins: list, per_file: int, dtypes: dict, place, slots: list, load_slot: int,
                  threads: int) -> None:
        """Read this shard's elements of a checkpoint whose arrays have `dtypes`
        (converting where they differ from this shard's): place (a piece_map.PieceMap)
        says where they lie in its flat space (the built-in layout: one range); straight
        into the state where the dtypes agree, through one bounded buffer where they do not."""
        n = self.numel
        bases, _ = self.file_layout(self.names, dtypes, per_file)
        for name in self.names:
            src_dt = dtypes.get(name, "fp32")
            src = _Source(bins, per_file, bases[name], bases.get(name + ".scale"), src_dt, name, place)
            if name == "master" and self.exact_master:
                self.hi_slot = load_slot
                self._read_converted(src, "exact", slots[load_slot], threads)
                continue
            dst = self.master if name == "master" else self.moments[name]
            want = "fp32" if name == "master" else self.state_dtype
            if want != src_dt:
                self._read_converted(src, want, dst, threads, self.scales.get(name))
                continue
            src.read(0, n, dst)
            if want == "int8":  # lo is on a block (HELLO), and so is every file's start
                lo = src.flat_lo()
                read_range(bins, nblocks(per_file), src.scale_base, lo // QBLOCK, lo // QBLOCK + nblocks(n),
                           self.scales[name])

    def can_read_verified(self, dtypes: dict) -> bool:
        """read_verified takes a file whose arrays are saved in this state's dtypes (the
        master as fp32, whatever the state dtype): no conversion but the exact master's
        split."""
        return dtypes.get("master", "fp32") == "fp32" and all(
            dtypes.get(name, "fp32") == self.state_dtype for name in self.moments)

    def verified_read_bytes(self) -> int:
        """Host RAM read_verified's new state takes beside the running one: a state, and
        the exact master's high halves staged until the file has verified (the running
        state's are the weights slot's)."""
        return self.state_bytes + (2 * self.numel if self.exact_master else 0)

    def read_verified(self, path, dtypes: dict, hi_out: np.ndarray | None = None) -> list:
        """One pass over one whole shard file of this shard's size into this state, which
        nothing uses yet (Shard.load swaps it in once the file verified; can_read_verified
        says which files): each block of the file checksummed as it is read, then copied
        where its arrays live.  The exact master is split on the reading threads, its high
        halves into hi_out (uint16, numel: staged, since the weights slot holds the running
        state's), the remainder into this state.  Returns the blocks' (offset, length, CRC)
        for combine_pieces."""
        assert self.can_read_verified(dtypes)
        n = self.numel
        bases, size = self.file_layout(self.names, dtypes, n)

        def into(dst: np.ndarray):
            u8 = dst.view(np.uint8)
            return lambda a, b, raw: np.copyto(u8[a:b], raw)

        def split(a: int, b: int, raw: np.ndarray) -> None:  # a, b on elements: the master starts the file
            cpu_adam.split_master(raw.view(np.float32), hi_out[a // 4:b // 4], self.remainder[a // 4:b // 4],
                                  num_threads=1)
        if bases["master"] % 4:  # (file_layout puts it first: blocks split it on elements)
            raise AssertionError("the master must start on a 4-byte file offset")
        regions = []
        for name in self.names:
            if name == "master":
                sink = split if self.exact_master else into(self.master)
                regions.append((bases[name], 4 * n, sink))
                continue
            regions.append((bases[name], self.moments[name].nbytes, into(self.moments[name])))
            if name in self.scales:
                regions.append((bases[name + ".scale"], self.scales[name].nbytes, into(self.scales[name])))
        stop = threading.Event()
        first = [hi_out, self.remainder] if self.exact_master else [self.master]
        toucher = threading.Thread(target=touch_ahead, name="ckpt-touch", daemon=True,
                                   args=([first] + [[a] for a in self.moments.values()], stop))
        toucher.start()
        try:
            return read_file_verified(path, size, regions, threads=IO_THREADS)
        finally:
            stop.set()
            toucher.join()

    def _read_converted(self, src: "_Source", want: str, dst, threads: int, scales=None) -> None:
        """Read the shard's elements of src piece by piece, as fp32, into dst in `want`:
        "exact" (the master split into weights slot dst and the remainder), "fp32",
        "bf16" or "int8" (rounded to nearest, with `scales`)."""
        n = self.numel
        buf = np.empty(min(CONVERT_CHUNK, max(n, 1)), np.float32)
        for a in range(0, n, CONVERT_CHUNK):  # CONVERT_CHUNK is a multiple of QBLOCK
            b = min(n, a + CONVERT_CHUNK)
            x = buf[:b - a] if want != "fp32" else dst[a:b]
            src.read_fp32(a, b, x)
            if want == "exact":
                cpu_adam.split_master(x, dst[a:b], self.remainder[a:b], num_threads=threads)
            elif want == "bf16":  # round to nearest even, straight into the moment
                cpu_adam.cast_to_16(x, dst[a:b], out_dtype="bf16", num_threads=threads)
            elif want == "int8":
                cpu_adam.quantize_int8(x, dst[a:b], scales[a // QBLOCK:nblocks(b)], moment=src.name)


class _Source:
    """One array of a checkpoint, the shard's elements of it read (as they are, or as
    fp32 whatever its dtype) by local index: place (a piece_map.PieceMap) says where
    they lie in the checkpoint's flat space; elements it does not cover read as zeros."""

    def __init__(self, bins, per_file, base, scale_base, dtype, name, place):
        self.bins, self.per_file, self.base, self.scale_base = bins, per_file, base, scale_base
        self.dtype, self.name, self.place = dtype, name, place

    def read(self, a: int, b: int, out: np.ndarray) -> None:
        """out[:] = the shard's elements [a, b) in the file's own dtype."""
        runs = list(self.place.split(a, b))
        if not (len(runs) == 1 and runs[0][:2] == (a, b)):
            out[:] = 0  # alignment padding between pieces (or past the flat space)
        for x, y, f in runs:
            read_range(self.bins, self.per_file, self.base, f, f + (y - x), out[x - a:y - a])

    def flat_lo(self) -> int:
        """Where the shard's element 0 lies, when the shard is one range of the flat space
        (int8 reads by blocks: only the built-in layout)."""
        ps = self.place.pieces
        if len(ps) > 1 or (ps and ps[0][0] != 0):
            raise ValueError("int8 state cannot be read through a piece map: its scales follow blocks of 256")
        return ps[0][1] if ps else 0

    def read_fp32(self, a: int, b: int, out: np.ndarray) -> None:
        """out[:] = the shard's elements [a, b) as fp32 (a on a block when the array is int8)."""
        if self.dtype == "fp32":
            self.read(a, b, out)
            return
        if self.dtype == "bf16":
            w = np.empty(b - a, np.uint16)
            self.read(a, b, w)
            out[:] = _widen(w)
            return
        lo, hi = self.flat_lo() + a, self.flat_lo() + b
        assert lo % QBLOCK == 0
        codes = np.empty(hi - lo, np.uint8)
        sc = np.empty(nblocks(hi - lo), np.float32)
        read_range(self.bins, self.per_file, self.base, lo, hi, codes)
        read_range(self.bins, nblocks(self.per_file), self.scale_base, lo // QBLOCK, lo // QBLOCK + sc.size, sc)
        if self.dtype == LEGACY_INT8:
            out[:] = _legacy_int8(codes, sc, self.name)
        else:
            cpu_adam.dequantize_int8(codes, sc, out, moment=self.name)


def _legacy_int8(codes: np.ndarray, scales: np.ndarray, moment: str) -> np.ndarray:
    """A format-1 checkpoint's int8 moments: the power-law codes of before (m = scale
    (q/127)^4 with a sign bit, v = scale (q/255)^8), decoded in fp32 with the operations
    (and so the bits) of the kernel that wrote them."""
    scale = np.repeat(scales, QBLOCK)[:codes.size]
    if moment == "exp_avg":
        t = (codes & 0x7f).astype(np.float32) * np.float32(1.0 / 127.0)
        t2 = t * t
        x = (scale * t2) * t2
        return np.where(codes & 0x80, -x, x)
    t = codes.astype(np.float32) * np.float32(1.0 / 255.0)
    t4 = (t * t) * (t * t)
    return (scale * t4) * t4
