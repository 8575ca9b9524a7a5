"""optimizer_server.piece_map on its own: what a piece map accepts, its wire form, and
how it splits a local range (the server's SAVE.pieces and LOAD.pieces read through it)."""
from __future__ import annotations

import pytest

from zero_offload.server.piece_map import MAX_PIECES, PieceMap, PieceMapError

pytestmark = pytest.mark.timeout(60)


def test_a_piece_map_round_trips_and_splits_local_ranges():
    """Two pieces with a hole between them locally and another rank's rows between them
    in the flat space: bytes and back, and split() of ranges that start and end inside
    pieces and in the hole.  (Mutation: split() without clipping to [a, b) returns whole
    pieces.)"""
    pm = PieceMap.build([(0, 100, 10), (12, 300, 5)], numel=20, flat_numel=400)
    assert PieceMap.from_bytes(pm.to_bytes(), 20, 400) == pm
    assert len(pm.to_bytes()) == 48
    assert list(pm.split(0, 20)) == [(0, 10, 100), (12, 17, 300)]
    assert list(pm.split(5, 14)) == [(5, 10, 105), (12, 14, 300)]
    assert list(pm.split(10, 12)) == []
    assert pm.covered == 15
    assert PieceMap.contiguous(30, 20, 40).pieces == ((0, 30, 10),)  # past the flat space: padding
    assert PieceMap.contiguous(50, 20, 40).pieces == ()


@pytest.mark.parametrize("pieces, match", [
    ([(0, 0, 0)], "empty or outside"),
    ([(15, 0, 10)], "empty or outside"),               # past the shard
    ([(0, 395, 10)], "empty or outside"),              # past the flat space
    ([(0, 0, 10), (5, 50, 3)], "overlaps or precedes"),  # overlapping in the shard
    ([(5, 0, 3), (0, 50, 3)], "overlaps or precedes"),   # not by local_lo
    ([(0, 0, 10), (10, 5, 3)], "overlap in the flat space"),
])
def test_a_piece_map_that_does_not_fit_is_refused_naming_the_piece(pieces, match):
    """What a worker could claim that would make a server write outside its rows or
    outside the file.  (Mutation: dropping the flat-space overlap check lets two pieces
    write the same bytes.)"""
    with pytest.raises(PieceMapError, match=match):
        PieceMap.build(pieces, numel=20, flat_numel=400)


def test_a_piece_map_is_bounded_on_the_wire():
    """At most MAX_PIECES pieces and whole 24-byte pieces: the bytes a peer can claim are
    bounded before anything is built from them."""
    with pytest.raises(PieceMapError, match="whole number of 24-byte pieces"):
        PieceMap.from_bytes(b"\0" * 25, 10, 10)
    with pytest.raises(PieceMapError, match=f"at most {MAX_PIECES}"):
        PieceMap.from_bytes(b"\0" * 24 * (MAX_PIECES + 1), 10, 10)
    many = [(i, i, 1) for i in range(MAX_PIECES + 1)]
    with pytest.raises(PieceMapError, match=f"at most {MAX_PIECES}"):
        PieceMap.build(many, MAX_PIECES + 1, MAX_PIECES + 1)
