"""The undo log of speculation: the bytes a speculative update overwrote, so that a
rollback puts them back bit for bit (never by inverting Adam's arithmetic, which is
neither exact nor defined for an inf gradient).

Layout: one buffer of HELLO.undo_log_bytes (at most what one update of the whole
shard writes: a step never saves more), allocated at HELLO with np.empty, and its
pages committed all at once before the first speculation (``prefault``: not at
INIT, while the worker still holds its fp32 copy of the model; and not page by page
as speculation first reaches them, which slowed the pieces at each step's frontier
step after step through a long warm-up: BENCHMARKS.md), filled front to back:

    [ entry 0 bytes | entry 1 bytes | ... | free ]
      entry = a copy of one array slice an update of [lo, hi) writes
              (ShardStateArrays.update_writes: master or remainder, the moments,
              int8 scales, and the out weights slot where it is the one slot or
              holds the exact master's high halves)

save() appends a range's slices, or refuses (returns False, nothing written) when
they do not fit: speculation then stops there and the STEP updates the rest.
restore() copies every entry back, last first (two entries never overlap, so the
order only matters for clarity), and empties the log; clear() empties it when the
speculated bytes are kept.  The log is owned by one shard and used only on that
shard's update thread.

With the state's twin (Adam/AdamW with fp32 state, or bf16 state and the exact
master, and a log that covers the whole update: ShardStateArrays.make_twin) the
speculative update writes the new state beside the old, and the log holds only
the out weights slot, where it is saved at all: with two slots it stays empty.
"""
from __future__ import annotations

import numpy as np


PAGE = 4096


class UndoLog:
    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._buf = np.empty(self.capacity, np.uint8)
        self._entries: list[tuple[np.ndarray, int, int]] = []  # (the live slice, offset, bytes)
        self.used = 0
        self.faulted = False

    def prefault(self) -> None:
        """Commit every page of the buffer (a write into each), once."""
        if not self.faulted:
            self._buf[::PAGE] = 0
            self.faulted = True

    @staticmethod
    def nbytes(views: list[np.ndarray]) -> int:
        return sum(v.nbytes for v in views)

    def fits(self, views: list[np.ndarray]) -> bool:
        return self.used + self.nbytes(views) <= self.capacity

    def save(self, views: list[np.ndarray]) -> bool:
        """Copy these slices in, or return False (and copy nothing) if they do not fit."""
        if not self.fits(views):
            return False
        for v in views:
            assert v.flags.c_contiguous and v.ndim == 1, "the state's slices are 1-D and contiguous"
            b = v.view(np.uint8)
            self._buf[self.used:self.used + b.size] = b
            self._entries.append((v, self.used, b.size))
            self.used += b.size
        return True

    def restore(self) -> None:
        """Every saved slice gets its bytes back; the log is empty after."""
        for v, off, n in reversed(self._entries):
            v.view(np.uint8)[:] = self._buf[off:off + n]
        self.clear()

    def clear(self) -> None:
        self._entries = []
        self.used = 0

    @property
    def empty(self) -> bool:
        return not self._entries
