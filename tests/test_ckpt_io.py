"""optimizer_server.ckpt_io on its own: the CRC combine against zlib, a save job's file
against the plain concatenation of its arrays (with a guard that runs while it writes),
and parallel reads."""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from zero_offload.server.ckpt_io import (DIRECT_ALIGN, BufferPool, ChunkState, Part, SaveJob, chunk_buffer,
                                      combine_pieces, crc32_combine, file_crc, open_direct, parallel_read,
                                      pwrite_range, range_crc, write_file, zeros_crc)

pytestmark = pytest.mark.timeout(120)
SEED = 1203


def test_crc32_combine_equals_zlib_on_random_splits():
    rng = random.Random(SEED)
    print("seed", SEED)
    data = rng.randbytes(3_000_001)
    for _ in range(50):
        cut = rng.randrange(len(data) + 1)
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)
    cuts = sorted(rng.sample(range(1, len(data)), 200))
    bounds = [0, *cuts, len(data)]
    pieces = [(x, y - x, zlib.crc32(data[x:y])) for x, y in zip(bounds, bounds[1:])]
    rng.shuffle(pieces)  # written in any order
    assert combine_pieces(pieces) == zlib.crc32(data)
    with pytest.raises(ValueError, match="do not tile"):
        combine_pieces(pieces[1:])


def test_zeros_and_ranges_of_a_file(tmp_path):
    """zeros_crc (a file's holes) against zlib over real zeros, across its 1 MiB step;
    range_crc of any range, and the ranges that tile a file combined into file_crc's.
    (Mutation: zeros_crc returning crc32 of one step for every step misses past 1 MiB.)"""
    rng = random.Random(SEED)
    print("seed", SEED)
    for n in (0, 1, 4095, (1 << 20) - 1, 1 << 20, (1 << 20) + 3, 3 * (1 << 20) + 17):
        assert zeros_crc(n) == zlib.crc32(bytes(n)), n
    data = rng.randbytes(2_500_003)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    for _ in range(20):
        lo = rng.randrange(len(data) + 1)
        hi = rng.randrange(lo, len(data) + 1)
        assert range_crc(path, lo, hi) == (zlib.crc32(data[lo:hi]), len(data))
    thirds = [(len(data) * k // 3, len(data) * (k + 1) // 3) for k in range(3)]
    assert combine_pieces([(a, b - a, range_crc(path, a, b)[0]) for a, b in thirds]) == file_crc(path)[0]
    with pytest.raises(ValueError, match="not within"):
        range_crc(path, 10, len(data) + 1)


def test_a_files_checksum_from_the_pieces_written_into_it(tmp_path):
    """combine_pieces with the file's size, which FSDP2's save and load use instead of
    reading a file back: pieces written at random places of an ftruncate'd file, in any
    order, give the file's own CRC-32 with the holes counted as zeros (on a GPU, the
    parameter alignment leaves such holes; the CPU device's layout has none); overlapping
    pieces raise.  (Mutation: a hole skipped instead of counted as zeros fails this.)"""
    rng = random.Random(SEED)
    print("seed", SEED)
    size = 3_000_000
    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        f.truncate(size)
    cuts = sorted(rng.sample(range(size), 40))
    pieces = []
    fd = os.open(path, os.O_WRONLY)
    for a, b in zip(cuts[0::2], cuts[1::2]):  # every other span written, the rest holes
        data = rng.randbytes(b - a)
        os.pwrite(fd, data, a)
        pieces.append((a, b - a, zlib.crc32(data)))
    os.close(fd)
    rng.shuffle(pieces)
    assert combine_pieces(pieces, size) == zlib.crc32(path.read_bytes())
    a, n, c = pieces[0]
    with pytest.raises(ValueError, match="overlap"):
        combine_pieces(pieces + [(a + 1, n, c)], size)


def _parts(arrays):
    base, parts = 0, []
    for a in arrays:
        parts.append(Part(base, a.itemsize, a.size, 1, lambda x, y, _b, a=a: memoryview(a[x:y]).cast("B")))
        base += a.nbytes
    return parts, base


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "no-snapshot"])
@pytest.mark.parametrize("rate", [0.0, 2e6], ids=["full-speed", "slow-disk"])
def test_a_save_job_writes_the_arrays_as_they_were(tmp_path, snapshot, rate):
    """Chunks of 1000 elements on 2 writer threads while the caller overwrites the arrays
    behind ensure(): the file is the arrays' bytes before any overwrite, its CRC the
    combined one.  With a snapshot, ensure() copies a chunk nobody has reached (never
    writes it), and on a disk slower than the overwrites (2 MB/s here, 600 kB in all)
    the copies held host RAM; without one, ensure() writes the chunks itself.
    (Mutation: ensure() returning without copying a pending chunk fails the bytes.)"""
    rng = np.random.default_rng(SEED)
    n = 100_003
    arrays = [rng.standard_normal(n).astype(np.float32), rng.integers(0, 2**16, n).astype(np.uint16)]
    expect = b"".join(a.tobytes() for a in arrays)
    parts, total = _parts(arrays)
    got = {}
    path = tmp_path / "shard.bin"
    job = SaveJob(path, parts, n, total, finish=lambda crc: got.setdefault("crc", crc), threads=2, chunk=1000,
                  max_bytes_per_s=rate, snapshot=snapshot)
    for lo in range(n - 1000, -1, -7000):  # back to front, as a reversed STEP overwrites
        job.ensure(lo, lo + 1000)
        for a in arrays:
            a[lo:lo + 1000] = 0
    job.wait(60)
    st = job.status()
    assert all(s is ChunkState.WRITTEN for s in job.states)
    if snapshot:
        assert st["ensure_writes"] == 0
        if rate:
            assert 0 < st["snapshot_peak"] <= total, st
    else:
        assert st["snapshot_peak"] == 0 and (st["ensure_writes"] > 0 or not rate), st
    assert path.read_bytes() == expect
    assert got["crc"] == zlib.crc32(expect) == file_crc(path)[0]
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]  # no temporary left


def test_parallel_read_reads_every_byte(tmp_path):
    data = np.random.default_rng(SEED).integers(0, 255, (40 << 20) + 5, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    out = np.empty(data.size - 3, np.uint8)
    parallel_read(tmp_path / "f", 3, out)
    assert np.array_equal(out, data[3:])


def test_a_file_read_once_hands_every_byte_to_its_region(save_dir, monkeypatch):
    """read_file_verified (a one-pass LOAD): a file of 13 blocks and 5 bytes (64 KiB
    blocks), regions whose bounds fall inside blocks and on them, on 4 threads, through
    O_DIRECT on the disk and buffered on tmpfs: every region's array is its bytes, the
    blocks cover the file once and their CRCs combine into zlib's of the whole file.
    (Mutations: a region's part of a block taken at the block's start, not at the
    region's offset in it; the last, short block dropped: each fails.)"""
    from zero_offload.server import ckpt_io
    monkeypatch.setattr(ckpt_io, "IO_CHUNK_BYTES", 64 << 10)
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    size = 13 * (64 << 10) + 5
    data = rng.integers(0, 255, size, dtype=np.uint8)
    (save_dir / "f").write_bytes(data.tobytes())
    cuts = sorted({0, size, 64 << 10, 3 * (64 << 10) + 1, *map(int, rng.integers(1, size, 6))})
    outs = [np.zeros(b - a, np.uint8) for a, b in zip(cuts, cuts[1:])]

    def into(out):
        return lambda a, b, raw: np.copyto(out[a:b], raw)
    pieces = ckpt_io.read_file_verified(save_dir / "f", size, [(a, b - a, into(out)) for (a, b), out in
                                                               zip(zip(cuts, cuts[1:]), outs)], threads=4)
    for (a, b), out in zip(zip(cuts, cuts[1:]), outs):
        assert np.array_equal(out, data[a:b]), (a, b)
    assert sorted((a, n) for a, n, _ in pieces) == [(a, min(64 << 10, size - a)) for a in range(0, size, 64 << 10)]
    assert combine_pieces(pieces, size=size) == zlib.crc32(data.tobytes())


def test_touching_ahead_commits_pages_and_keeps_what_a_reader_wrote():
    """touch_ahead runs beside a one-pass LOAD's readers: every page it reaches is
    committed (resident), and bytes a reader already wrote stay; a set stop ends it before
    it touches anything.  (Mutation: committing by writing a zero per page: the reader's
    byte is lost.)"""
    from zero_offload.server import ckpt_io
    if ckpt_io._MADVISE is None:
        pytest.skip("no libc madvise here")
    a, b = chunk_buffer(8 << 20), chunk_buffer(8 << 20)
    a[4096 * 3] = b[0] = 7  # pages the readers filled first
    stopped = threading.Event()
    stopped.set()
    ckpt_io.touch_ahead([[a, b]], stopped, step=1 << 20)
    before = _resident_kib()
    ckpt_io.touch_ahead([[a, b]], threading.Event(), step=1 << 20)
    assert a[4096 * 3] == 7 and b[0] == 7
    assert _resident_kib() - before >= 12 << 10  # 16 MiB, less the pages already touched


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


@pytest.mark.parametrize("writers", [2, 3])
def test_placed_save_jobs_fill_one_shared_file_and_their_crcs_join(tmp_path, writers):
    """FSDP2's save on one machine: `writers` save jobs (one per rank), each with a piece
    map that puts its rows of three "parameters" between the others' (and leaves an
    alignment hole in its local space, and one in the file), write into one shared file
    that the first of them makes, while the caller overwrites their arrays behind
    ensure(); the file is the interleaving of the arrays as they were, zeros in the
    holes, and combine_disjoint of the jobs' masked CRCs is the file's own CRC-32.
    (Mutations: combine_disjoint without the zeros' CRC for an even count fails the
    2-writer case; _placed ignoring the map writes the local layout instead.)"""
    from zero_offload.server.ckpt_io import combine_disjoint
    from zero_offload.server.piece_map import PieceMap
    rng = np.random.default_rng(SEED + writers)
    print("seed", SEED + writers)
    rows = [5000, 7001, 3]       # three parameters' element counts, each cut in `writers` row ranges
    flat, at = [], 0
    for n in rows:               # the shared flat space: each parameter's elements, then a 13-element hole
        flat.append(at)
        at += n + 13
    flat_numel = at
    cuts = [[n * r // writers for r in range(writers + 1)] for n in rows]
    expect = np.zeros(flat_numel, np.float32)
    jobs, arrays, results = [], [], [{} for _ in range(writers)]
    path = tmp_path / "shard.bin"
    for r in range(writers):
        pieces, local = [], 0
        for j, n in enumerate(rows):
            a, b = cuts[j][r], cuts[j][r + 1]
            if b > a:
                pieces.append((local, flat[j] + a, b - a))
            local += (b - a) + 2   # two elements of alignment padding after each piece
        x = rng.standard_normal(local).astype(np.float32)
        for lo, f, n in pieces:
            expect[f:f + n] = x[lo:lo + n]
        pm = PieceMap.build(pieces, local, flat_numel)
        arrays.append(x)
        parts = [Part(0, 4, local, 1, lambda s, e, _b, x=x: memoryview(x[s:e]).cast("B"))]
        jobs.append(SaveJob(path, parts, local, local * 4, finish=lambda crc, r=r: results[r].setdefault("crc", crc),
                            threads=2, chunk=700, snapshot=True, pieces=pm, file_size=4 * flat_numel))
    for job, x in zip(jobs, arrays):
        for lo in range(0, x.size, 1500):
            job.ensure(lo, lo + 1500)
            x[lo:lo + 1500] = -1
    for job in jobs:
        job.wait(60)
    data = path.read_bytes()
    assert data == expect.tobytes()
    assert combine_disjoint([res["crc"] for res in results], len(data)) == zlib.crc32(data)
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


# ----------------------------------------------------------------------------- direct I/O, the buffer pool
def _direct_ok(d) -> bool:
    """Whether d's file system takes O_DIRECT (tmpfs does not: everything is buffered there)."""
    probe = d / ".direct-probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        dfd = open_direct(fd, os.O_WRONLY)
        if dfd >= 0:
            os.close(dfd)
        return dfd >= 0
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture(params=["disk", "tmpfs"])
def save_dir(request, tmp_path):
    if request.param == "disk":
        yield tmp_path
        return
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) here")
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="zo-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_save_job_writes_its_bulk_with_o_direct_and_the_same_bytes(save_dir):
    """Three arrays whose file offsets are not page-aligned (1,000,003 elements), chunks
    of 65,536 elements on 2 writers while the caller overwrites behind ensure(): the file
    is the arrays as they were, and where the file system takes O_DIRECT at least 90% of
    its bytes went that way (each piece placed in its buffer at its file offset's
    alignment); on tmpfs none did, the same bytes.
    (Mutation: _copy_chunk without the alignment shift: the second and third arrays go
    buffered, 33% direct: fails; pwrite_range writing the middle one page off: the bytes.)"""
    rng = np.random.default_rng(SEED)
    n = 1_000_003
    arrays = [rng.standard_normal(n).astype(np.float32), rng.integers(0, 2**16, n).astype(np.uint16),
              rng.standard_normal(n).astype(np.float32)]
    expect = b"".join(a.tobytes() for a in arrays)
    parts, total = _parts(arrays)
    got = {}
    path = save_dir / "shard.bin"
    job = SaveJob(path, parts, n, total, finish=lambda crc: got.setdefault("crc", crc), threads=2, chunk=1 << 16)
    for lo in range(n - (n % (1 << 16)), -1, -(1 << 16)):
        job.ensure(lo, lo + (1 << 16))
        for a in arrays:
            a[lo:lo + (1 << 16)] = 0
    job.wait(60)
    st = job.status()
    assert path.read_bytes() == expect
    assert got["crc"] == zlib.crc32(expect)
    if _direct_ok(save_dir):
        assert st["direct_bytes"] >= 0.9 * total, st
    else:
        assert st["direct_bytes"] == 0, st
    assert [p.name for p in save_dir.iterdir()] == ["shard.bin"]


def test_a_placed_save_job_writes_its_bulk_with_o_direct(save_dir):
    """FSDP2's save: two jobs (two ranks) each place their rows of two parameters in one
    shared file, at flat offsets off any page (a 1,000,003-element parameter cut in two,
    and a second one after it), in chunks of 65,536 elements on 2 writers while the
    caller overwrites behind ensure(): the file is the rows as they were, and on the disk
    at least 90% of each job's bytes went through O_DIRECT (each run of the map placed in
    its buffer at its own file offset's alignment); on tmpfs none, the same bytes.
    (Mutation: the buffer aligned to the unplaced offset, as before: a placed run's bytes
    go buffered, 50% and less direct: fails.)"""
    from zero_offload.server.piece_map import PieceMap
    rng = np.random.default_rng(SEED)
    print("seed", SEED)
    rows = [1_000_003, 333_331]
    flat = [0, rows[0] + 5]                      # the second parameter after a 5-element hole
    flat_numel = flat[1] + rows[1]
    expect = np.zeros(flat_numel, np.float32)
    path, jobs, arrays, crcs = save_dir / "shard.bin", [], [], []
    for r in range(2):
        pieces, local = [], 0
        for j, n in enumerate(rows):
            a, b = n * r // 2, n * (r + 1) // 2
            pieces.append((local, flat[j] + a, b - a))
            local += b - a
        x = rng.standard_normal(local).astype(np.float32)
        for lo, f, n in pieces:
            expect[f:f + n] = x[lo:lo + n]
        parts = [Part(0, 4, local, 1, lambda s, e, _b, x=x: memoryview(x[s:e]).cast("B"))]
        arrays.append(x)
        jobs.append(SaveJob(path, parts, local, local * 4, finish=crcs.append, threads=2, chunk=1 << 16,
                            pieces=PieceMap.build(pieces, local, flat_numel), file_size=4 * flat_numel))
    for job, x in zip(jobs, arrays):
        for lo in range(0, x.size, 1 << 16):
            job.ensure(lo, lo + (1 << 16))
            x[lo:lo + (1 << 16)] = 0
    for job in jobs:
        job.wait(60)
    assert path.read_bytes() == expect.tobytes()
    for job, x in zip(jobs, arrays):
        st = job.status()
        if _direct_ok(save_dir):
            assert st["direct_bytes"] >= 0.9 * x.nbytes, st
        else:
            assert st["direct_bytes"] == 0, st


def test_pwrite_range_puts_every_byte_where_it_belongs(tmp_path):
    """Random ranges of a page-aligned buffer at random file offsets (some congruent
    with their address modulo a page, so that their middles go through O_DIRECT, some
    not): the file equals the same writes into a bytearray.
    (Mutation: the tail written at the head's offset fails.)"""
    rnd = random.Random(SEED)
    size = 8 << 20
    src = chunk_buffer(size)
    src[:] = np.frombuffer(rnd.randbytes(size), np.uint8)
    ref = bytearray(size)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    dfd = open_direct(fd, os.O_WRONLY)
    direct = 0
    try:
        os.ftruncate(fd, size)
        for i in range(40):
            n = rnd.randrange(1, 3 * DIRECT_ALIGN + 5000) if i % 3 else rnd.randrange(DIRECT_ALIGN, 1 << 20)
            a = rnd.randrange(0, size - n)
            off = a if i % 2 else rnd.randrange(0, size - n)  # i odd: offset == address modulo a page
            direct += pwrite_range(fd, dfd, memoryview(src[a:a + n]), off)
            ref[off:off + n] = src[a:a + n].tobytes()
    finally:
        if dfd >= 0:
            os.close(dfd)
        os.close(fd)
    assert path.read_bytes() == bytes(ref)
    assert (direct > 0) == _direct_ok(tmp_path)


def test_write_file_writes_aligned_and_unaligned_data_whole(save_dir):
    """write_file: a page-aligned buffer (O_DIRECT where allowed) and a plain bytes object
    (buffered) both give the file of their bytes, 0600, no temporary left."""
    rnd = random.Random(SEED)
    aligned = chunk_buffer((40 << 20) + 123)
    aligned[:] = np.frombuffer(rnd.randbytes(aligned.nbytes), np.uint8)
    plain = rnd.randbytes(3 << 20)
    for name, data in (("a.bin", aligned), ("b.bin", plain)):
        write_file(save_dir / name, data)
        assert (save_dir / name).read_bytes() == bytes(memoryview(data).cast("B"))
        assert (os.stat(save_dir / name).st_mode & 0o777) == 0o600
    assert sorted(p.name for p in save_dir.iterdir()) == ["a.bin", "b.bin"]


def test_a_later_save_reuses_the_pools_buffers(tmp_path):
    """Two save jobs of one shard share a BufferPool: every buffer the first made is in the
    pool after it (lent to the kernel with MADV_FREE), and the second takes its buffers
    from there before making any; both files are the arrays' bytes.
    (Mutation: give() keeping nothing, or take() returning None: fails.)"""
    rng = np.random.default_rng(SEED)
    n = 1 << 20
    arrays = [rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)]
    pool = BufferPool()
    jobs = []
    for k in range(2):
        expect = b"".join(a.tobytes() for a in arrays)
        parts, total = _parts(arrays)
        path = tmp_path / f"shard{k}.bin"
        job = SaveJob(path, parts, n, total, finish=lambda crc: {}, threads=1, chunk=1 << 16, pool=pool)
        job.ensure(0, n)  # the update reaches everything at once: a snapshot of each chunk not yet claimed
        for a in arrays:
            a += 1.0
        job.wait(60)
        assert path.read_bytes() == expect
        st = job.status()
        jobs.append(st)
        assert pool.nbytes >= (st["buffers_made"] + st["buffers_reused"]) * job.chunk_bytes > 0, st
    assert jobs[0]["buffers_reused"] == 0 < jobs[0]["buffers_made"]
    assert jobs[1]["buffers_reused"] >= min(jobs[0]["buffers_made"], jobs[1]["buffers_made"] + jobs[1]["buffers_reused"])
    assert jobs[1]["buffers_reused"] > 0


def test_a_pool_fills_itself_while_there_is_room_and_stops_at_clear():
    """BufferPool.fill tops the pool up to a count of touched buffers on a thread of its
    own; it adds nothing unless room() (what admission would give a snapshot) holds all
    of them, and a clear() in the middle ends it.  (Mutations: fill ignoring room(), or clear() not ending it: fails.)"""
    pool = BufferPool()
    pool.fill(5, 1 << 20, room=lambda: 1 << 40).join(30)
    assert pool.nbytes == 5 << 20
    pool.fill(8, 1 << 20, room=lambda: (8 << 20) - 1).join(30)  # 8 buffers would not be admitted
    assert pool.nbytes == 5 << 20
    calls = []

    def room():
        calls.append(1)
        if len(calls) == 3:
            pool.clear()  # the shard goes away while its pool fills
        return 1 << 40
    pool.fill(8, 1 << 20, room=room).join(30)
    assert pool.nbytes == 0 and len(calls) == 3  # the buffer made meanwhile not given to the cleared pool


@pytest.mark.parametrize("background", [True, False], ids=["background", "blocking"])
def test_a_save_job_tops_its_pool_up_and_runs_idle_only_beside_training(tmp_path, background):
    """After a save job the shard's pool holds a whole snapshot (every chunk and every
    writer's buffer), so the next background save copies into touched memory; a
    background job's writers run in SCHED_IDLE, a blocking one's do not (nothing else
    runs then, and other processes would starve them).  (Mutations: no fill at the
    job's end; the writers' idle policy not set, or set for a blocking save: fails.)"""
    rng = np.random.default_rng(SEED)
    n = 1 << 18
    arrays = [rng.standard_normal(n).astype(np.float32)]
    parts, total = _parts(arrays)
    pool = BufferPool()
    job = SaveJob(tmp_path / "s.bin", parts, n, total, finish=lambda crc: {}, threads=2, chunk=1 << 14, pool=pool,
                  max_bytes_per_s=4e6, background=background,  # ~0.25 s of writing: the writers are seen alive
                  pool_room=lambda: 1 << 40)
    writers = [t for t in threading.enumerate() if t.name.startswith("ckpt-save-")]
    assert len(writers) == 2
    policies = set()
    for t in writers:
        for _ in range(200):  # each thread sets its own policy as it starts
            pol = os.sched_getscheduler(t.native_id)
            if pol == os.SCHED_IDLE or not background:
                break
            time.sleep(0.01)
        policies.add(pol)
    job.wait(60)
    assert policies == ({os.SCHED_IDLE} if background else {os.SCHED_OTHER})
    assert (tmp_path / "s.bin").read_bytes() == arrays[0].tobytes()
    job.fill_thread.join(30)
    assert pool.nbytes == (job.n_chunks + 2) * job.chunk_bytes
