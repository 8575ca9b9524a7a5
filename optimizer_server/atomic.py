"""Crash-safe file writes: temporary file, fsync, rename, fsync of the directory.

A reader (or a crash at any point) sees the old file or the whole new one, never
a part.  A failed write (ENOSPC, EROFS) removes its temporary file and raises.

The temporary file has a random name and is opened O_CREAT|O_EXCL|O_NOFOLLOW:
in a directory others can write, nobody can make it in advance (to read what we
write) or plant a symbolic link there (to make us overwrite a file of ours).
Files are 0600 unless the caller asks otherwise.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import IO, Callable

EXCL_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def temp_name(path: Path) -> Path:
    """A fresh, unguessable name beside path (hidden, same directory: rename is atomic)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], mode: int = 0o600, fsync: bool = True) -> None:
    path = Path(path)
    tmp = temp_name(path)
    fd = os.open(tmp, EXCL_FLAGS, mode)
    try:
        os.fchmod(fd, mode)  # the umask may narrow the mode, never widen it: say it exactly
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o600, fsync: bool = True) -> None:
    atomic_write(path, lambda f: f.write(data), mode, fsync)


def fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
