"""A JIT op build's lock file whose holder died: found, removed, and never waited on forever.

DeepSpeed loads its JIT ops (on CPU: FusedAdam and the shm comm op) through
``torch.utils.cpp_extension.load``, which takes a lock file, ``<extensions dir>/<op>/lock``, for the
build, and for the ninja check that follows it in every new process even when the op is built. A
process killed while it holds that file (a SIGKILLed worker, one the agent kills at a restart or
for a hang) leaves it behind, and every later load waits for it to go, forever
(``FileBaton.wait`` has no timeout): one killed worker hangs every job of the checkout after it.

The holder keeps the file open from the moment it creates it (``os.open(O_CREAT | O_EXCL)``) until
it releases it, so a lock is stale when no process has it open: that is read from
``/proc/<pid>/fd``, twice, a second apart (a release closes the file just before removing it).
Only a lock on a local filesystem is judged so: on a network filesystem shared by several nodes a
holder on another node is invisible here, and such a lock is reported, never removed.

:func:`clear_stale_locks` is what the agent calls before it starts workers on a node;
:func:`guard_build_locks` makes a worker's own wait give up on a lock whose holder died (the lock is
removed and the load goes on: with the op already built it imports it, else it fails with an
import error and the agent restarts the worker, whose load then builds it).

Pure Python (no torch at import).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping

__all__ = ["NETWORK_FILESYSTEMS", "clear_stale_locks", "extensions_root", "guard_build_locks", "holders",
           "is_stale", "on_network_filesystem"]

log = logging.getLogger(__name__)

NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs",
                                 "ceph", "cephfs", "afs", "9p", "virtiofs", "wekafs", "panfs"})
_TORCH_WAIT = None  # torch's own FileBaton.wait, once guard_build_locks replaced it
_RECHECK_S = 1.0  # a release closes the lock and removes it microseconds later: a second apart is sure


def extensions_root(env: Mapping[str, str] | None = None) -> Path:
    """Where ``torch.utils.cpp_extension`` builds: ``TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions`` (torch adds a ``py311_cpu``-like folder below it)."""
    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(env.get("XDG_CACHE_HOME") or Path(home) / ".cache") / "torch_extensions"


def _locks(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def holders(lock: Path | str) -> list[int]:
    """The pids that have ``lock`` open (those whose ``/proc/<pid>/fd`` this process may read)."""
    target = os.path.realpath(lock)
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def on_network_filesystem(path: Path | str) -> bool:
    """Whether ``path`` lies on a filesystem other machines may share (its mount's type)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, fstype = point, fields[2]
    except OSError:
        return True  # unknown: treat as shared, never remove
    return fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse.")


def is_stale(lock: Path | str, *, recheck_s: float = _RECHECK_S) -> bool:
    """Whether ``lock`` exists with no holder, twice ``recheck_s`` apart, on a local filesystem."""
    if not os.path.exists(lock) or on_network_filesystem(lock) or holders(lock):
        return False
    time.sleep(recheck_s)
    return os.path.exists(lock) and not holders(lock)


def _remove(lock: Path | str) -> bool:
    try:
        os.remove(lock)
        return True
    except FileNotFoundError:
        return False


def clear_stale_locks(root: Path | str | None = None, *, recheck_s: float = _RECHECK_S,
                      echo=None) -> list[Path]:
    """Remove every build lock under ``root`` (default :func:`extensions_root`) whose holder died;
    returns the removed ones. A lock on a network filesystem is named (``echo``, else the log) and
    kept."""
    root = extensions_root() if root is None else Path(root)
    say = echo or log.warning
    removed = []
    for lock in _locks(root):
        if on_network_filesystem(lock):
            if not holders(lock):
                say(f"[ds_resilience] {lock} is held by no process on this node, but it is on a network filesystem "
                    f"(a process on another node may be building): kept; if no build runs anywhere, remove it, "
                    f"or set TORCH_EXTENSIONS_DIR to a local folder")
            continue
        if is_stale(lock, recheck_s=recheck_s) and _remove(lock):
            say(f"[ds_resilience] removed {lock}: the process that built or checked this op died holding it "
                f"(every later load would have waited for it forever)")
            removed.append(lock)
    return removed


def _stale_aware_wait(self) -> None:
    """``FileBaton.wait`` that gives up on a lock whose holder died (checked every 2 s)."""
    check_every = 2.0
    started = last_check = time.monotonic()
    warned = False
    while os.path.exists(self.lock_file_path):
        time.sleep(self.wait_seconds)
        now = time.monotonic()
        if now - last_check >= check_every:
            last_check = now
            if is_stale(self.lock_file_path) and _remove(self.lock_file_path):
                log.warning("[ds_resilience] %s: its holder died; removed it after %.0f s (the op is loaded "
                            "as it was left: built, or it fails to import and the worker is restarted)",
                            self.lock_file_path, now - started)
                return
        warn_after = getattr(self, "warn_after_seconds", None)
        if warn_after is not None and not warned and now - started > warn_after:
            log.warning("waited on lock file %s for %.0f s", self.lock_file_path, warn_after)
            warned = True


def guard_build_locks() -> bool:
    """Make this process's JIT op loads give up on a lock whose holder died. Patches
    ``torch.utils.file_baton.FileBaton.wait`` when torch is already imported (it never imports
    torch itself); returns whether it is in place. Idempotent."""
    if "torch" not in sys.modules:
        return False
    from torch.utils import file_baton

    global _TORCH_WAIT
    if file_baton.FileBaton.wait is not _stale_aware_wait:
        _TORCH_WAIT = file_baton.FileBaton.wait
        file_baton.FileBaton.wait = _stale_aware_wait
    return True
