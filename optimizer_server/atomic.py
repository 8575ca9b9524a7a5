"""Crash-safe file writes: temporary file, fsync, rename, fsync of the directory.

A reader (or a crash at any point) sees the old file or the whole new one, never
a part.  A failed write (ENOSPC, EROFS) removes its temporary file and raises.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, IO


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
