"""Checkpoint bytes at the disk's speed, and saves that run while training goes on.

Importable without torch.  Three pieces:

- ``crc32_combine``: the CRC-32 of two byte strings laid end to end from each one's
  CRC and the second's length (zlib's algorithm), so pieces written or read out of
  order by several threads still give the one whole-file checksum the manifest keeps.
- ``parallel_read`` / ``file_crc`` / ``range_crc``: large preads (``IO_CHUNK_BYTES``) on a few threads
  (``IO_THREADS``); os.preadv and zlib.crc32 release the GIL, so the threads overlap.
- ``SaveJob``: one shard file written by ``IO_THREADS`` writer threads, chunk by chunk
  of the shard's elements (``SAVE_CHUNK`` elements of every array: a chunk is a set
  of byte ranges of the file), while the update thread may already change the state.

The save's contract (background or not, the bytes are the same): the file holds
the state as it was when the job was made.  Every chunk is first copied out of the
live arrays at memory speed, then written from that private copy, so the disk never
holds the update back.  A writer thread copies the chunk it claims into its own
buffer; before the update thread overwrites elements [lo, hi) of any saved array it
calls ``ensure(lo, hi)``, which copies each chunk there that nobody has yet into a
snapshot buffer (the snapshot: host RAM for the chunks the update reaches before the
writers, at most the file's size, freed as they are written) and waits only for a
copy in progress.  Chunk states:

    PENDING --(a writer claims it)--> COPYING --(copied)--> WRITING --(written)--> WRITTEN
    PENDING --(ensure)--> COPYING --(copied)--> SNAPSHOT --(a writer)--> WRITING --> WRITTEN

Without room for a snapshot (``snapshot=False``, decided when the job is made)
ensure() writes the chunk to the file itself instead, from the live arrays (COPYING
stands for that write), and the update waits for the disk as it goes.

The writes' bulk goes through O_DIRECT (``pwrite_range``; no page cache between the
buffers and the disk), and a job's buffers come from and go back to the shard's
``BufferPool`` (touched memory, lent to the kernel between saves).

Fsync policy (docs/checkpoint.md): the data file is fsync'd once, after its last
chunk; then it is renamed into place, the manifest written (tmp, fsync, rename) and
the directory fsync'd.  A crash at any point leaves no complete manifest, so the
save does not count and the previous checkpoint stays ``latest``.
"""
from __future__ import annotations

import enum
import mmap
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .atomic import EXCL_FLAGS, atomic_write, temp_name

IO_THREADS = 4                 # concurrent preads/pwrites: a fast NVMe needs several in flight
IO_CHUNK_BYTES = 16 << 20      # one pread or pwrite: large enough for the disk's sequential speed
# one checksum read: each thread holds a buffer of it while a LOAD verifies, when host RAM
# is tightest (IO_THREADS x 1 MiB in all), and 1 MiB reads still run at the disk's speed
CRC_CHUNK_BYTES = 1 << 20
SAVE_CHUNK = 1 << 22           # elements per save chunk (a multiple of every int8 block: 256)
FILE_MODE = 0o600              # checkpoint files: the owner's, like the segments


# ----------------------------------------------------------------------------- CRC-32 combine
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial, both as reflected bit strings (zlib's multmodp;
    a must not be 0)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31: x, x^2, x^4, ...
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial: one product per set bit of n, so combining a
    piece of any length costs about 0.1 ms in Python (a GF(2) matrix power cost 1 ms
    per new length, and an FSDP2 checkpoint's pieces have hundreds of lengths)."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) (zlib's
    crc32_combine: crc1 shifted past len2 bytes, i.e. times x^(8 len2), plus crc2)."""
    if len2 <= 0:
        return crc1
    return (_multmodp(_x2nmodp(len2, 3), crc1) ^ crc2) & 0xFFFFFFFF


def zeros_crc(n: int) -> int:
    """CRC-32 of n zero bytes (a file's holes: ftruncate'd and never written): runs of
    zeros doubled, one combine per bit of n (a hole of GBs costs microseconds)."""
    crc, run, run_len = 0, zlib.crc32(b"\0"), 1
    while n:
        if n & 1:
            crc = crc32_combine(crc, run, run_len)
        run, run_len = crc32_combine(run, run, run_len), 2 * run_len
        n >>= 1
    return crc


def combine_disjoint(crcs: list[int], size: int) -> int:
    """The CRC-32 of a file of `size` bytes whose writers wrote disjoint ranges of it,
    from each writer's CRC of the file as if only its ranges held data (zeros elsewhere:
    combine_pieces(its pieces, size)).  CRC-32 is affine over GF(2): for equal lengths
    crc(x ^ y) = crc(x) ^ crc(y) ^ crc(zeros), and the file is the XOR of the writers'
    masked files, so each writer sends one number, whatever its pieces."""
    crc = 0
    for c in crcs:
        crc ^= c
    if len(crcs) % 2 == 0:
        crc ^= zeros_crc(size)
    return crc


def combine_pieces(pieces: list[tuple[int, int, int]], size: int | None = None) -> int:
    """The CRC of a file from (offset, length, crc) pieces.  Without size they must tile
    it exactly; with the file's size, the bytes no piece covers are zeros (the holes an
    ftruncate'd file keeps where nobody wrote), and only an overlap (two writers of one
    range) or a piece past the end raises."""
    crc, pos = 0, 0
    for off, n, c in sorted(pieces):
        if off < pos or (off > pos and size is None):
            raise ValueError(f"pieces do not tile the file: a gap or overlap at byte {pos}")
        crc = crc32_combine(crc, zeros_crc(off - pos), off - pos)
        crc = crc32_combine(crc, c, n)
        pos = off + n
    if size is None:
        return crc
    if pos > size:
        raise ValueError(f"a piece ends at byte {pos}, past the file's {size} bytes")
    return crc32_combine(crc, zeros_crc(size - pos), size - pos)


# ----------------------------------------------------------------------------- reads
def _pread_exact(fd: int, view: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise OSError(f"unexpected end of file {name} after {got} of {len(view)} bytes at offset {offset}")
        got += k


def _libc_function(name: str, *argtypes: str):
    """libc's `name` through ctypes (which lets go of the GIL for the call), its
    arguments the ctypes types named; None where this system's libc has none."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        f = getattr(libc, name)
        f.argtypes = tuple(getattr(ctypes, t) for t in argtypes)
        return f
    except (OSError, AttributeError):
        return None


# Linux; elsewhere the final fsync does it all
_SYNC_FILE_RANGE = _libc_function("sync_file_range", "c_int", "c_int64", "c_int64", "c_uint")
SYNC_FILE_RANGE_WRITE = 2


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    # start the disk writing this range now (asynchronously): otherwise the page cache
    # holds it all until the final fsync, and the disk idles while the writers convert
    # and checksum, then the CPU idles while the disk writes
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, len(view), SYNC_FILE_RANGE_WRITE)


# Direct I/O (O_DIRECT) moves a checkpoint's bytes between the disk and the process's own
# buffers with no copy through the page cache.  A buffered write costs the kernel a copy
# and, once the cache fills the free memory, page reclaim: on a 2-core VM that was
# 2-3 s of system CPU per GB, taken from the update beside the save, and the writes ran
# at a quarter of the disk's speed (BENCHMARKS.md bench_bg_save).  O_DIRECT needs the
# buffer, the file offset and the length aligned (DIRECT_ALIGN: a page, a multiple of
# every disk's logical block); the unaligned head and tail of a range go through the
# buffered descriptor (disjoint pages, so the two never share a cached page).  Where
# the file system refuses O_DIRECT (tmpfs), everything is buffered, the same bytes.
DIRECT_ALIGN = 4096
DIRECT_MIN_CHUNK = 256 << 10  # a save chunk's bytes below which its pieces are not aligned (the padding would show)


def open_direct(fd: int, flags: int) -> int:
    """A second descriptor of fd's file opened with O_DIRECT (through /proc/self/fd: the
    same inode, no path to race), or -1 where the system or the file system has none."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def _address(view) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def _direct_split(view, offset: int) -> tuple[int, int]:
    """(head, middle) byte counts: view[head:head + middle] may go through O_DIRECT (its
    address, file offset and length aligned); (0, 0) where the buffer's alignment does
    not match the file's."""
    head = -offset % DIRECT_ALIGN
    if len(view) < head + DIRECT_ALIGN or (_address(view) + head) % DIRECT_ALIGN:
        return 0, 0
    return head, (len(view) - head) // DIRECT_ALIGN * DIRECT_ALIGN


def pwrite_range(fd: int, direct_fd: int, view: memoryview, offset: int) -> int:
    """view's bytes at offset: its aligned middle through direct_fd (if >= 0), the rest
    (or all of it) through fd.  Returns the bytes written through direct_fd."""
    head, mid = _direct_split(view, offset) if direct_fd >= 0 else (0, 0)
    if not mid:
        _pwrite_all(fd, view, offset)
        return 0
    if head:
        _pwrite_all(fd, view[:head], offset)
    done = 0
    while done < mid:
        k = os.pwrite(direct_fd, view[head + done:head + mid], offset + head + done)
        done += k
        if k % DIRECT_ALIGN:  # a short write off the alignment: the rest buffered
            break
    if head + done < len(view):
        _pwrite_all(fd, view[head + done:], offset + head + done)
    return done


def write_file(path: Path, data, mode: int = FILE_MODE, threads: int = IO_THREADS) -> None:
    """data's bytes as the file path, crash-safe (optimizer_server.atomic.atomic_write: a
    random temporary name opened O_EXCL|O_NOFOLLOW, fsync, rename), in large pieces on
    several threads, their bulk through O_DIRECT where data's address allows it (a
    page-aligned buffer, such as chunk_buffer's)."""
    view = memoryview(data).cast("B")

    def write(f) -> None:
        fd = f.fileno()
        dfd = open_direct(fd, os.O_WRONLY)
        try:
            _each_span(lambda a, b: pwrite_range(fd, dfd, view[a:b], a), _spans(len(view), IO_CHUNK_BYTES),
                       threads, "ckpt-write")
        finally:
            _close_quietly(dfd)
    atomic_write(path, write, mode)


def _close_quietly(fd: int) -> int:
    """Close fd if open (>= 0), ignoring an error (a cleanup path); -1, the closed value."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    return -1


def _spans(total: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(total, a + step)) for a in range(0, total, step)]


def _each_span(fn: Callable[[int, int], object], spans: list, threads: int, name: str) -> list:
    """[fn(a, b) for each span], on up to `threads` threads (preads, pwrites and zlib.crc32
    release the GIL, so they overlap), in the spans' order."""
    if len(spans) <= 1 or threads <= 1:
        return [fn(a, b) for a, b in spans]
    with ThreadPoolExecutor(min(threads, len(spans)), thread_name_prefix=name) as ex:
        return list(ex.map(lambda s: fn(*s), spans))


def parallel_read(path: Path, offset: int, out: np.ndarray, threads: int = IO_THREADS) -> None:
    """out's bytes = the file's bytes [offset, offset + out.nbytes), read in large
    pieces on several threads."""
    view = memoryview(out).cast("B")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        _each_span(lambda a, b: _pread_exact(fd, view[a:b], offset + a, str(path)),
                   _spans(len(view), IO_CHUNK_BYTES), threads, "ckpt-read")
    finally:
        os.close(fd)


Sink = Callable[[int, int, np.ndarray], None]


def read_file_verified(path: Path, size: int, regions: list[tuple[int, int, Sink]],
                       threads: int = IO_THREADS) -> list:
    """A whole file of `size` bytes read once, in IO_CHUNK_BYTES blocks on several threads,
    each block checksummed on the thread that read it and then handed out: regions are
    (file offset, nbytes, sink), and sink(a, b, raw) receives the region's bytes [a, b)
    (counted from its offset) as a uint8 view of the block, to copy or convert where the
    state will live.  Returns the blocks' [(file offset, length, CRC-32)] for
    combine_pieces, which the caller compares before it uses what the sinks wrote.

    The blocks go through O_DIRECT into each thread's page-aligned buffer where the file
    system allows it: a buffered read costs the kernel a page-cache page per 4 KiB, a
    copy and later the reclaim, which on a 2-core VM was 0.5-1.5 s of system CPU per GB
    read and held a LOAD to 1.0-2.0 GB/s where O_DIRECT read at 2.3-2.6 (BENCHMARKS.md
    bench_load).  Where it does not (tmpfs), the same blocks are read buffered."""
    if IO_CHUNK_BYTES % DIRECT_ALIGN:
        raise ValueError("IO_CHUNK_BYTES must be a multiple of DIRECT_ALIGN")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    dfd = open_direct(fd, os.O_RDONLY)
    local = threading.local()

    def block(a: int, b: int) -> tuple[int, int, int]:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = chunk_buffer(IO_CHUNK_BYTES)
        n = b - a
        got = 0
        if dfd >= 0:  # the whole aligned length: a read that ends at the end of the file is short
            whole = -(-n // DIRECT_ALIGN) * DIRECT_ALIGN
            try:
                got = os.preadv(dfd, [memoryview(buf)[:whole]], a)
            except OSError:
                got = 0  # this file system refused it after all: buffered below
        if got < n:
            _pread_exact(fd, memoryview(buf)[got:n], a + got, str(path))
        raw = buf[:n]
        crc = zlib.crc32(raw)
        for base, nbytes, sink in regions:
            lo, hi = max(a, base), min(b, base + nbytes)
            if lo < hi:
                sink(lo - base, hi - base, raw[lo - a:hi - a])
        return a, n, crc
    try:
        return _each_span(block, _spans(size, IO_CHUNK_BYTES), threads, "ckpt-read")
    finally:
        _close_quietly(dfd)
        os.close(fd)


def parallel_copy(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    """dst[:] = src (1-D, one dtype) on up to `threads` threads (numpy's copy releases
    the GIL): a memory-bound copy of GBs that one thread would run at a fraction of the
    machine's bandwidth."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"parallel_copy of {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
    step = max(1, IO_CHUNK_BYTES // max(1, src.itemsize))
    _each_span(lambda a, b: np.copyto(dst[a:b], src[a:b]), _spans(src.size, step), max(1, threads), "ckpt-copy")


def file_crc(path: Path, threads: int = IO_THREADS) -> tuple[int, int]:
    """(CRC-32, size) of a whole file, its pieces read and checksummed on several threads
    (each thread one reused buffer)."""
    return range_crc(path, 0, None, threads)


def range_crc(path: Path, lo: int, hi: int | None, threads: int = IO_THREADS) -> tuple[int, int]:
    """(CRC-32 of bytes [lo, hi), the file's size); hi None: to the end.  Several ranks
    can check one file together, each a range, their CRCs combined (crc32_combine)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        hi = size if hi is None else hi
        if not 0 <= lo <= hi <= size:
            raise ValueError(f"bytes [{lo}, {hi}) of {path} are not within its {size} bytes")
        spans = [(lo + a, lo + b) for a, b in _spans(hi - lo, CRC_CHUNK_BYTES)]
        local = threading.local()

        def piece(a: int, b: int) -> tuple[int, int, int]:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = bytearray(CRC_CHUNK_BYTES)
            v = memoryview(buf)[:b - a]
            _pread_exact(fd, v, a, str(path))
            return a, b - a, zlib.crc32(v)
        pieces = _each_span(piece, spans, threads, "ckpt-crc")
        return combine_pieces([(a - lo, n, c) for a, n, c in pieces]), size
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the save job
@dataclass
class Part:
    """One region of the file: elements [0, numel) of one array at byte `base`.
    get(a, b, scratch) returns the bytes of elements [a, b) (a view of the live
    array, or a conversion into scratch); `per` is elements per item (int8 scales:
    one fp32 per QBLOCK elements)."""
    base: int
    itemsize: int
    numel: int            # items in the file region
    per: int              # elements of the shard per item
    get: Callable[[int, int, np.ndarray | None], memoryview]
    scratch_bytes: int = 0  # a conversion's buffer per chunk (0: a view, no buffer)


def chunk_buffer(nbytes: int, touch: bool = False) -> np.ndarray:
    """A fresh uint8 buffer for one chunk's copy, on transparent huge pages where the
    kernel offers them (madvise): a snapshot fills GBs of fresh memory inside an update,
    and 4 KiB first touches ran at 0.7-2 GB/s where 2 MiB pages ran at 5-8 (a 2-core
    VM, BENCHMARKS.md bench_bg_save).  touch: every page written once (committed), for a
    buffer made ahead of the copy that will need it."""
    if nbytes <= 0:
        return np.empty(0, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no THP here: 4 KiB pages, slower first touches, the same bytes
    buf = np.frombuffer(m, np.uint8)
    if touch:
        buf[::4096] = 0  # one write per page commits it (a huge page takes one per 2 MiB too)
    return buf


_MADVISE = _libc_function("madvise", "c_void_p", "c_size_t", "c_int")
MADV_POPULATE_WRITE = 23    # Linux 5.14: fault pages in writable without writing them


def touch_ahead(groups: list[list[np.ndarray]], stop: threading.Event, step: int = 32 << 20) -> None:
    """Commit fresh arrays' pages in the order a reader will write them (each group's
    arrays side by side, `step` bytes of each at a time; the groups one after another),
    until stop is set: on a thread of its own beside a read into them (a one-pass LOAD),
    the first touches (the kernel zeroing each page, and on a VM the host backing it,
    0.5-2 GB/s for memory not used recently) are paid while the readers wait for the
    disk.  madvise(MADV_POPULATE_WRITE) commits a page without writing it, so a page the
    reader filled first keeps its bytes; where the kernel has none (before 5.14), nothing
    is done and the reader pays the touches itself."""
    if _MADVISE is None:
        return
    for group in groups:
        views = [a.view(np.uint8) for a in group if a is not None and a.nbytes]
        for at in range(0, max((v.size for v in views), default=0), step):
            for v in views:
                if stop.is_set():
                    return
                part = v[at:at + step]
                if part.size:
                    lo = part.ctypes.data // DIRECT_ALIGN * DIRECT_ALIGN
                    if _MADVISE(lo, part.ctypes.data + part.size - lo, MADV_POPULATE_WRITE):
                        return  # EINVAL: an older kernel; the reader touches them


def lend_back(buf: np.ndarray) -> None:
    """A chunk_buffer (or a view of one) kept for later but idle: madvise(MADV_FREE), so
    the kernel counts it in MemAvailable and may take its pages under memory pressure
    (then fresh again at their next write); otherwise the next write finds them touched.
    Elsewhere (no MADV_FREE, another kind of buffer) it stays as it is."""
    base = buf
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    m = getattr(base, "obj", base)  # np.frombuffer(mmap) keeps a memoryview of the mmap
    if buf.nbytes and isinstance(m, mmap.mmap) and hasattr(mmap, "MADV_FREE"):
        try:
            m.madvise(mmap.MADV_FREE)
        except OSError:
            pass  # kept as it is: counted as used until it is written again


class BufferPool:
    """Chunk buffers kept from one save to the next, idle ones lent back to the kernel.

    Fresh memory's first touch is a save's main cost in RAM bandwidth (the kernel zeroes
    every page; on a VM the host backs it too): 0.5-3 GB/s against 10-20 GB/s for a copy
    into touched pages (BENCHMARKS.md bench_bg_save).  A save job takes its writers' and
    its snapshot's buffers here first and gives them back when it ends; given back, they
    are madvise(MADV_FREE)'d: the kernel counts them in MemAvailable (admission, the
    worker's RAM checks and other processes see them as free) and may take any of them
    under memory pressure, in which case that page is fresh again on its next write;
    otherwise the next save writes them at memory speed.  Holds buffers of one size
    (a shard's chunk); thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self._generation = 0  # clear() ends a fill() in progress

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)

    def take(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            return self._bufs.pop() if self._bufs and self._bufs[-1].nbytes == nbytes else None

    def give(self, bufs: list) -> None:
        for b in bufs:
            lend_back(b)
        with self._lock:
            if self._bufs and bufs and self._bufs[0].nbytes != bufs[0].nbytes:
                self._bufs = []  # another chunk size: the old ones go
            self._bufs += [b for b in bufs if b.nbytes]

    def clear(self) -> None:
        with self._lock:
            self._bufs = []
            self._generation += 1

    def fill(self, count: int, nbytes: int, room: Callable[[], int]) -> threading.Thread:
        """Top the pool up to `count` buffers of `nbytes`, touched and lent back, on a
        lowest-priority thread: after a shard's first save, so that its next background
        save finds every snapshot buffer touched (a whole file's worth: its first update
        copies most of the state at memory speed, where fresh pages would cost 0.5-3 GB/s).
        Lent back (MADV_FREE), they count as available, so this costs no admission room.
        It fills only while room() (the bytes admission would give a snapshot now; its
        MemAvailable counts the pool's lent-back buffers) holds all `count` of them:
        where a whole snapshot would not be admitted, a background save takes none, and
        touched buffers would only push the page cache out (1.5e9 parameters with bf16
        state on 24 GiB).  clear() ends it."""
        def run() -> None:
            lower_this_threads_priority(idle=True)
            with self._lock:
                gen = self._generation
            while True:
                with self._lock:
                    if (gen != self._generation or len(self._bufs) >= count
                            or (self._bufs and self._bufs[0].nbytes != nbytes)):
                        return
                if room() < count * nbytes:
                    return
                buf = chunk_buffer(nbytes, touch=True)
                with self._lock:
                    if gen != self._generation:
                        return
                self.give([buf])
        t = threading.Thread(target=run, name="ckpt-pool-fill", daemon=True)
        t.start()
        return t


# A save's threads run at the lowest CPU priority: on a host with few cores the writes
# (checksums, the kernel's copies) would otherwise take cores from the update and the
# training process beside them.  Those of a background save (and whatever else runs
# beside training: the pool's fill, the worker's copies) run in SCHED_IDLE too, so that
# they use only what is idle; a blocking save's are not idle (training waits for them,
# and other processes on the host would starve them).
BACKGROUND_NICE = 19


def lower_this_threads_priority(nice: int = BACKGROUND_NICE, idle: bool = False) -> None:
    """Linux: this thread alone (its tid) at `nice`; idle: in SCHED_IDLE as well (it runs
    only where no other thread wants the core, and a waking training thread takes the
    core from it at once, which nice 19 does not do: BENCHMARKS.md, bench_bg_save).
    Elsewhere nothing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass
    if idle:
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass


class ChunkState(enum.Enum):
    PENDING = 0    # only the live arrays hold its bytes
    COPYING = 1    # being read out of the live arrays (by a writer, or by ensure())
    SNAPSHOT = 2   # copied by ensure() into a snapshot buffer: waits for a writer
    WRITING = 3    # being written from a private copy: the live arrays are free
    WRITTEN = 4


class SaveJob:
    """Write one shard file from live arrays: see the module docstring.

    Made by the update thread (nothing updates the state while it is made), it
    writes on its own threads until done; ``ensure`` is the update thread's guard,
    ``wait`` blocks until the file is complete (or failed), ``cancel`` stops it and
    removes the temporary file.  ``finish(crc)`` is called on a writer thread after
    the last chunk, with the file fsync'd and renamed into place.  snapshot: ensure()
    copies chunks into host RAM (up to the file's size) instead of writing them.

    pieces (a piece_map.PieceMap): the file is a checkpoint's shared file of
    `file_size` bytes, which several jobs (one per rank) write at once: the first to
    open it makes it at that size; each part's elements go where the map puts them in
    it (parts' bases are the shared layout's), in place (no temporary, no rename: the
    file lies in the checkpoint's temporary directory), and ``finish`` gets the CRC of
    the file as if only this job's bytes were in it (combine_disjoint joins the
    writers').

    direct: the aligned bulk of every write goes through O_DIRECT where the file system
    allows it (see DIRECT_ALIGN): no page cache between the copies and the disk.
    background: training runs beside it, so its threads use only idle CPU (SCHED_IDLE).
    pool_room: what admission would give a snapshot now; given, the pool is topped up
    to a whole snapshot after the job where that admits it (BufferPool.fill)."""

    def __init__(self, path: Path, parts: list[Part], numel: int, total_bytes: int,
                 finish: Callable[[int], dict], threads: int = IO_THREADS, chunk: int = SAVE_CHUNK,
                 max_bytes_per_s: float = 0.0, snapshot: bool = True, on_done: Callable[[], None] | None = None,
                 pieces=None, file_size: int = 0, direct: bool = True, pool: BufferPool | None = None,
                 background: bool = False, pool_room: Callable[[], int] | None = None):
        self.path = Path(path)
        self.pool_room = pool_room  # after the job, the pool is topped up while this admits it (BufferPool.fill)
        self.background = background  # its threads in SCHED_IDLE: training goes on beside them
        self.place = pieces
        self.pool = pool if pool is not None else BufferPool()
        self.file_size = file_size
        self.max_bytes_per_s = max_bytes_per_s  # 0: as fast as the disk takes them (ServerConfig)
        self._paced = 0  # bytes counted against that cap so far
        self.snapshot = snapshot
        self.parts = parts
        self.numel = numel
        self.total_bytes = total_bytes
        self.chunk = chunk
        self.n_chunks = max(1, -(-numel // chunk))
        self.states = [ChunkState.PENDING] * self.n_chunks
        self._copies: dict[int, tuple[np.ndarray, list]] = {}  # SNAPSHOT chunks: (buffer, pieces)
        self._free: list[np.ndarray] = []  # snapshot buffers a writer is done with, for ensure() to reuse
        self._harvested = False  # the job's buffers have gone back to the pool (_complete)
        self.fill_thread: threading.Thread | None = None  # the pool's top-up after the job (BufferPool.fill)
        self.snapshot_bytes = 0       # host RAM the snapshot buffers hold now
        self.snapshot_peak = 0        # ... at most (what the save cost in RAM beyond the writers' buffers)
        self.crcs: list[tuple[int, int, int]] = []
        self.bytes_done = 0
        self.error: BaseException | None = None
        self.result: dict | None = None
        self.started = time.monotonic()
        self.seconds = 0.0
        self.waited_s = 0.0          # the update thread's time in ensure() (what the save cost training)
        self.ensure_writes = 0       # chunks ensure() wrote to the file itself (no snapshot)
        self.direct_bytes = 0        # bytes written through O_DIRECT (the rest went through the page cache)
        self.buffers_made = 0        # chunk buffers this job allocated fresh ...
        self.buffers_reused = 0      # ... and took from the pool (touched by an earlier save)
        self._finish = finish
        self._on_done = on_done  # called once the job has ended, however (the server's RAM reservation)
        self._cancelled = False
        self._next = 0
        self._cv = threading.Condition()
        self._done = threading.Event()
        # a chunk's bytes; in a chunk large enough for O_DIRECT to matter, each run (a part's
        # piece, or each of the runs a piece map splits it into) shifted to match its file
        # offset's alignment (at most a page per run more)
        self.chunk_bytes = max((self._chunk_size(c) for c in range(self.n_chunks)), default=0)
        self.align = DIRECT_ALIGN if self.chunk_bytes >= DIRECT_MIN_CHUNK else 1
        runs = max((sum(len(self._runs(self.parts[i], ia, ib)) for i, ia, ib in self._ranges(c))
                    for c in range(self.n_chunks)), default=0)
        self.chunk_bytes += runs * (self.align - 1)
        if pieces is not None:
            if any(p.per != 1 for p in parts):
                raise ValueError("a piece map places elements, not int8 blocks: int8 state cannot be placed")
            self.tmp = None
            # every rank's server opens the one shared file; whichever comes first makes it
            # (an ftruncate to the same size by another leaves what is written alone)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                              FILE_MODE)
            size = os.fstat(self.fd).st_size
            if size not in (0, file_size):
                os.close(self.fd)
                raise OSError(f"checkpoint file {self.path} has {size} bytes, the shared layout {file_size}")
            if size == 0:
                os.ftruncate(self.fd, file_size)
            total_bytes = file_size  # fallocate'd below (by each writer: the blocks once)
        else:
            self.tmp = temp_name(self.path)  # random, opened O_EXCL|O_NOFOLLOW (optimizer_server.atomic)
            self.fd = os.open(self.tmp, EXCL_FLAGS, FILE_MODE)
        self.direct_fd = -1
        try:
            if total_bytes:
                os.posix_fallocate(self.fd, 0, total_bytes)  # a full disk fails here, not midway
            self.direct_fd = open_direct(self.fd, os.O_WRONLY) if direct else -1
        except BaseException:
            self._remove_tmp()
            raise
        self._writers = [threading.Thread(target=self._writer, name=f"ckpt-save-{i}", daemon=True)
                         for i in range(max(1, threads))]
        self._alive = len(self._writers)
        for t in self._writers:
            t.start()
        if snapshot:
            threading.Thread(target=self._prefault, name="ckpt-prefault", daemon=True).start()

    # -- states ----------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        return self.done and self.error is not None

    def _ranges(self, c: int):
        """(part index, first item, end item) of chunk c's pieces, one per part it covers."""
        a, b = c * self.chunk, min(self.numel, (c + 1) * self.chunk)
        for i, part in enumerate(self.parts):
            ia, ib = a // part.per, min(part.numel, -(-b // part.per))
            if ib > ia:
                yield i, ia, ib

    def _chunk_size(self, c: int) -> int:
        return sum((ib - ia) * self.parts[i].itemsize for i, ia, ib in self._ranges(c))

    def _claim_next(self) -> int | None:
        """The next chunk for a writer: a snapshot first (it holds RAM), else the lowest
        pending one (COPYING now, the caller's); None once every chunk is being written
        or written.  While ensure() still copies one, a writer stays for it."""
        with self._cv:
            while True:
                if self._cancelled or self.error is not None:
                    return None
                for c in self._copies:
                    if self.states[c] is ChunkState.SNAPSHOT:
                        self.states[c] = ChunkState.WRITING
                        return c
                while self._next < self.n_chunks and self.states[self._next] is not ChunkState.PENDING:
                    self._next += 1
                if self._next < self.n_chunks:
                    c = self._next
                    self.states[c] = ChunkState.COPYING
                    return c
                if not any(st is ChunkState.COPYING for st in self.states):
                    return None
                self._cv.wait(0.05)

    def _copy_chunk(self, c: int, buf: np.ndarray) -> list:
        """Chunk c's bytes out of the live arrays into buf (a memcpy, or a conversion such
        as the exact master's join written straight there): [(file offset, view of buf)]."""
        pieces, at = [], 0
        for i, ia, ib in self._ranges(c):
            part = self.parts[i]
            for x, y, off in self._runs(part, ia, ib):
                n = (y - x) * part.itemsize
                # where its address matches its file offset modulo DIRECT_ALIGN, so that the
                # bulk of it can be written with O_DIRECT (chunk_bytes leaves room for this)
                at += (off - at) % self.align
                dst = buf[at:at + n]
                got = np.frombuffer(part.get(x, y, dst if part.scratch_bytes else None), np.uint8)
                if not np.may_share_memory(got, dst):
                    dst[:] = got
                pieces.append((off, dst))
                at += n
        return pieces

    def _runs(self, part: Part, ia: int, ib: int) -> list:
        """[(first item, end item, file offset)] of part's items [ia, ib): one run, or, with
        a piece map, the runs it puts in the shared file (an FSDP2 rank's rows)."""
        if self.place is None:
            return [(ia, ib, part.base + ia * part.itemsize)]
        return [(x, y, part.base + f * part.itemsize) for x, y, f in self.place.split(ia, ib)]

    def _placed(self, part: Part, ia: int, view) -> list:
        """[(file offset, bytes)] of part's items from ia on (view: their bytes)."""
        k = part.itemsize
        return [(off, view[(x - ia) * k:(y - ia) * k]) for x, y, off in self._runs(part, ia, ia + len(view) // k)]

    def _write_pieces(self, c: int, pieces: list) -> None:
        """pwrite chunk c's private copy, then WRITTEN."""
        done = []
        direct = 0
        for off, view in pieces:
            mv = memoryview(view)
            direct += pwrite_range(self.fd, self.direct_fd, mv, off)
            done.append((off, len(mv), zlib.crc32(mv)))
        if self.max_bytes_per_s:
            self._pace(sum(n for _, n, _ in done))
        with self._cv:
            self.direct_bytes += direct
            self.crcs.extend(done)
            self.bytes_done += sum(n for _, n, _ in done)
            self.states[c] = ChunkState.WRITTEN
            self._cv.notify_all()

    def _write_live(self, c: int, scratch: dict) -> None:
        """No snapshot: chunk c straight from the live arrays (a conversion into scratch)."""
        pieces = []
        for i, ia, ib in self._ranges(c):
            part = self.parts[i]
            buf = None
            if part.scratch_bytes:
                buf = scratch.get(i)
                if buf is None:
                    buf = scratch[i] = np.empty(part.scratch_bytes, np.uint8)
            pieces += self._placed(part, ia, np.frombuffer(part.get(ia, ib, buf), np.uint8))
        self._write_pieces(c, pieces)

    def _pace(self, nbytes: int) -> None:
        """The cap on the save's bandwidth: a chunk is written when the bytes so far, this
        one included, are due at the capped rate since the start (like a disk that slow:
        the chunk stays WRITING meanwhile; the update, which needs only its copy, goes on)."""
        with self._cv:
            self._paced += nbytes
            due = self.started + self._paced / self.max_bytes_per_s
        while not self._cancelled and (delay := due - time.monotonic()) > 0:
            time.sleep(min(delay, 0.1))

    def _prefault(self) -> None:
        """Snapshot buffers made ready before the update needs them: fresh memory's first
        touches (the kernel zeroing each page, and on some VMs the host backing it) are
        the snapshot's main cost, and they are paid here, at the lowest priority, while
        the server waits for the next STEP (the worker's forward and backward), not
        inside the update.  As many as there are chunks no writer has claimed, less
        those the writers are about to take; each goes to _free, where ensure() looks first."""
        lower_this_threads_priority(idle=True)
        made = 0
        while not self.done and not self._cancelled and self.error is None:
            with self._cv:
                pending = sum(st is ChunkState.PENDING for st in self.states)
                if made >= pending - len(self._writers) or len(self._free) >= pending:
                    return
            buf = self._snapshot_buffer()
            buf[::4096] = 0  # one write per page commits it (a huge page takes one per 2 MiB too)
            with self._cv:
                if not self._harvested:
                    self._free.append(buf)
                    buf = None
            if buf is not None:  # the job ended meanwhile: the buffer goes to the pool, not lost
                self.pool.give([buf])
                return
            made += 1

    def _snapshot_buffer(self) -> np.ndarray:
        """A new snapshot buffer of one chunk, counted (the prefault thread and the update
        thread both make them)."""
        buf = self._buffer()
        with self._cv:
            self.snapshot_bytes += buf.nbytes
            self.snapshot_peak = max(self.snapshot_peak, self.snapshot_bytes)
        return buf

    def _buffer(self) -> np.ndarray:
        """One chunk's buffer: a pooled one (touched before) if there is one, else fresh."""
        buf = self.pool.take(self.chunk_bytes)
        with self._cv:
            if buf is None:
                self.buffers_made += 1
            else:
                self.buffers_reused += 1
        return buf if buf is not None else chunk_buffer(self.chunk_bytes)

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()

    def _writer(self) -> None:
        lower_this_threads_priority(idle=self.background)
        own = self._buffer()  # this writer's copy of the chunk it writes
        try:
            while (c := self._claim_next()) is not None:
                with self._cv:
                    snap = self._copies.pop(c, None)
                if snap is not None:  # ensure() copied it: write that copy, then recycle its buffer
                    buf, pieces = snap
                    self._write_pieces(c, pieces)
                    with self._cv:
                        self._free.append(buf)
                    continue
                pieces = self._copy_chunk(c, own)
                with self._cv:  # the live arrays are free: an ensure() waiting on it goes on
                    self.states[c] = ChunkState.WRITING
                    self._cv.notify_all()
                self._write_pieces(c, pieces)
        except BaseException as e:  # noqa: BLE001 - recorded, raised by wait()
            self._fail(e)
        finally:
            self.pool.give([own])
            with self._cv:
                self._alive -= 1
                last = self._alive == 0
                self._cv.notify_all()
            if last:
                self._complete()

    def _complete(self) -> None:
        """The last writer: wait for chunks ensure() still writes, then publish or clean up."""
        try:
            with self._cv:
                while (self.error is None and not self._cancelled
                       and any(s is not ChunkState.WRITTEN for s in self.states)):
                    self._cv.wait(0.1)
            if self.error is None and not self._cancelled:
                self.direct_fd = _close_quietly(self.direct_fd)
                os.fsync(self.fd)
                os.close(self.fd)
                self.fd = -1
                if self.place is not None:  # in place: this job's bytes, holes as zeros
                    crc = combine_pieces(self.crcs, size=self.file_size)
                else:
                    os.replace(self.tmp, self.path)
                    crc = combine_pieces(self.crcs) if self.total_bytes else 0
                self.result = self._finish(crc)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
        finally:
            if self.error is not None or self._cancelled:
                self._remove_tmp()
            elif self.fd >= 0:
                self.direct_fd = _close_quietly(self.direct_fd)
                os.close(self.fd)
                self.fd = -1
            self.seconds = time.monotonic() - self.started
            with self._cv:
                self._harvested = True  # from now on a prefaulted buffer goes straight to the pool
                spare = self._free + [buf for buf, _ in self._copies.values()]
                self._copies.clear()
                self._free.clear()
            self.pool.give(spare)
            self.snapshot_bytes = 0
            # the live arrays' views go: a LOAD that replaces the state frees the old one
            # (this job, the shard's last, would keep it resident until the next save)
            self.parts = []
            if not self._cancelled and self.pool_room is not None:  # the next snapshot finds them touched
                self.fill_thread = self.pool.fill(self.n_chunks + len(self._writers), self.chunk_bytes,
                                                  self.pool_room)
            if self._on_done is not None:
                try:
                    self._on_done()
                except Exception:  # noqa: BLE001 - bookkeeping; the save's own outcome stands
                    pass
            self._done.set()
            with self._cv:
                self._cv.notify_all()

    def _remove_tmp(self) -> None:
        self.direct_fd = _close_quietly(self.direct_fd)
        self.fd = _close_quietly(self.fd)
        if self.tmp is None:
            return  # the shared file is its maker's (the checkpoint's directory goes if the save fails)
        try:
            os.unlink(self.tmp)
        except OSError:
            pass

    # -- the update thread -----------------------------------------------------
    def ensure(self, lo: int, hi: int) -> None:
        """Return once elements [lo, hi) of every saved array may be overwritten: each
        chunk there copied (a snapshot of the ones nobody has copied yet, made here, on
        the caller's thread) or written; without a snapshot, written here."""
        if hi <= lo or self.done:
            return
        t0 = time.perf_counter()
        scratch: dict = {}
        for c in range(lo // self.chunk, min(self.n_chunks, -(-hi // self.chunk))):
            with self._cv:
                while self.states[c] is ChunkState.COPYING and self.error is None and not self._cancelled:
                    self._cv.wait(0.05)
                if self.states[c] is not ChunkState.PENDING or self.error is not None or self._cancelled:
                    continue  # copied or written (or the save failed: nothing is owed to it any more)
                self.states[c] = ChunkState.COPYING
                buf = self._free.pop() if self.snapshot and self._free else None
            try:
                if not self.snapshot:
                    self.ensure_writes += 1
                    self._write_live(c, scratch)
                    continue
                if buf is None:
                    buf = self._snapshot_buffer()
                pieces = self._copy_chunk(c, buf)
                with self._cv:
                    self._copies[c] = (buf, pieces)
                    self.states[c] = ChunkState.SNAPSHOT
                    self._cv.notify_all()
            except BaseException as e:  # noqa: BLE001 - the save fails, the update goes on
                self._fail(e)
        self.waited_s += time.perf_counter() - t0

    def wait(self, timeout_s: float | None = None) -> dict:
        """Block until the file is complete; its result, or the error that stopped it."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"checkpoint save to {self.path} still running after {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        if self._cancelled:
            raise OSError(f"the save to {self.path} was cancelled")
        return self.result

    def cancel(self) -> None:
        """Stop the writers (the shard is going away) and remove the temporary file."""
        with self._cv:
            self._cancelled = True
            self._cv.notify_all()
        self._done.wait(60.0)

    def status(self) -> dict:
        state = "writing" if not self.done else ("failed" if self.error is not None else "done")
        return {"state": state, "bytes_done": self.bytes_done, "bytes_total": self.total_bytes,
                "error": "" if self.error is None else f"{type(self.error).__name__}: {self.error}",
                "seconds": self.seconds if self.done else time.monotonic() - self.started,
                "waited_s": self.waited_s, "snapshot": self.snapshot, "snapshot_peak": self.snapshot_peak,
                "ensure_writes": self.ensure_writes, "direct_bytes": self.direct_bytes,
                "buffers_made": self.buffers_made, "buffers_reused": self.buffers_reused}
