"""fsync helpers for the checkpoint tiers' files: a rename is atomic but not durable until the
directory holding it is synced, and a file's bytes are not on the disk until it is."""

from __future__ import annotations

import os

__all__ = ["fsync_dir", "fsync_file"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes durable (on Linux also those written through a shared mapping of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
