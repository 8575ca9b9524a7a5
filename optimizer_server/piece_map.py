"""Where a shard's elements lie in a checkpoint's flat space, when that is not one range.

A shard of the built-in layout is one range [lo, lo + numel) of the checkpoint's
flat space.  An FSDP2 rank's shard is not: it holds rows [r0, r1) of every
parameter, a range of each parameter's place in the flat space, with the other
ranks' rows between them.  A PieceMap lists those ranges, so the rank's server
writes its rows straight into the shared files of a checkpoint (SAVE.pieces) and
reads them back out (LOAD.pieces), with no private copy of the checkpoint between:

    shard (local)   [ a0 ........ a0+n0 )[ a1 ..... a1+n1 )[pad]
                         |                     |
    flat space      ...[ f0 ........ f0+n0 )......[ f1 ..... f1+n1 )...

piece = (local_lo, flat_lo, n), by local_lo, none overlapping on either side.  Local
elements no piece covers (the shard's alignment padding) are not in the checkpoint:
a save skips them and a load sets them to zero.  On the wire a PieceMap is bytes
(little-endian int64 triples), at most MAX_PIECES of them: one control message.
Importable without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .protocol import MAX_PIECES  # 48 KiB on the wire, inside a 64 KiB control message: a piece per parameter


class PieceMapError(ValueError):
    """A piece map that does not describe a shard of the given sizes."""


@dataclass(frozen=True)
class PieceMap:
    pieces: tuple[tuple[int, int, int], ...]  # (local_lo, flat_lo, n), by local_lo
    numel: int        # the shard's (local) elements
    flat_numel: int   # the checkpoint's flat space

    @classmethod
    def contiguous(cls, lo: int, numel: int, flat_numel: int) -> "PieceMap":
        """The built-in layout's shard: [lo, lo + numel) of the flat space, the part
        past flat_numel being padding (zeros in a load)."""
        n = max(0, min(numel, flat_numel - lo))
        return cls(((0, lo, n),) if n else (), numel, flat_numel)

    @classmethod
    def build(cls, pieces, numel: int, flat_numel: int) -> "PieceMap":
        """Checked: each piece inside both spaces, sorted and disjoint on both sides
        (PieceMapError naming the piece otherwise)."""
        ps = tuple((int(a), int(b), int(n)) for a, b, n in pieces)
        if len(ps) > MAX_PIECES:
            raise PieceMapError(f"{len(ps)} pieces, at most {MAX_PIECES}")
        ends = []
        for i, (a, b, n) in enumerate(ps):
            if n <= 0 or a < 0 or b < 0 or a + n > numel or b + n > flat_numel:
                raise PieceMapError(f"piece {i} {(a, b, n)} is empty or outside the shard's {numel} or the flat "
                                    f"space's {flat_numel} elements")
            if i and a < ps[i - 1][0] + ps[i - 1][2]:
                raise PieceMapError(f"piece {i} {(a, b, n)} overlaps or precedes the one before it in the shard")
            ends.append((b, b + n))
        ends.sort()
        for (_, e0), (b1, _) in zip(ends, ends[1:]):
            if b1 < e0:
                raise PieceMapError(f"two pieces overlap in the flat space at element {b1}")
        return cls(ps, numel, flat_numel)

    def to_bytes(self) -> bytes:
        return np.asarray(self.pieces, dtype="<i8").reshape(-1).tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, numel: int, flat_numel: int) -> "PieceMap":
        if len(data) % 24 or len(data) > 24 * MAX_PIECES:
            raise PieceMapError(f"a piece map is a whole number of 24-byte pieces, at most {MAX_PIECES}; got "
                                f"{len(data)} bytes")
        arr = np.frombuffer(data, dtype="<i8").reshape(-1, 3)
        return cls.build(arr.tolist(), numel, flat_numel)

    def split(self, a: int, b: int):
        """The pieces of local range [a, b): (local lo, local hi, flat lo) of each part
        a piece covers, in order; the parts between them are not in the checkpoint."""
        for lo, flat, n in self.pieces:
            if lo >= b:
                break
            x, y = max(a, lo), min(b, lo + n)
            if x < y:
                yield x, y, flat + (x - lo)

    @property
    def covered(self) -> int:
        """Elements of the shard the checkpoint holds."""
        return sum(n for _, _, n in self.pieces)
