"""Files that survive a machine crash once written: data, then fsync, then the rename, then the directory.

A rename alone is atomic but not durable: after a power loss the new name can point at a file whose
data never reached the disk. :func:`write_durably` and :func:`save_durably` write to a temporary name
beside the target, fsync it, rename it into place and fsync the directory, so a reader sees the old
file or the whole new one, also after a crash. Layer 0: the standard library (torch only in
:func:`save_durably`, lazily).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "fsync_file", "save_durably", "write_durably"]


def _fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    _fsync_path(path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes durable (on Linux also those written through a shared mapping of it)."""
    _fsync_path(path)


def _replace(tmp: str, path: str) -> None:
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_durably(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably."""
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    _replace(tmp, path)


def save_durably(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically and durably."""
    import torch

    path = os.fspath(path)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    _replace(tmp, path)
