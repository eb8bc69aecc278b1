"""py-cpuinfo's answer, asked once per machine.

DeepSpeed's op builder asks ``cpuinfo.get_cpu_info()`` for the CPU each time it JIT-loads a CPU op
(``cpu_arch`` and ``simd_width`` in ``cxx_args``: twice for one ``FusedAdam``), and every call runs
a Python subprocess that decodes ``cpuid``: 1.5-2 s of a core each on this project's CI machine,
about 3.5 s per worker that builds DeepSpeed's default optimizer, and a quarter of a 4-rank test
job's CPU time. The answer cannot change while the machine does, so :func:`memoize_cpu_info`
keeps it: in the process (the first answer), and on disk under ``$XDG_CACHE_HOME/ds_resilience``
(``~/.cache`` by default; ``DSR_CPUINFO_CACHE`` names another directory, ``""`` turns the file
off), keyed by a hash of ``/proc/cpuinfo``'s model and flags, the kernel and py-cpuinfo's
version, so the next process on the machine reads it. A fork server that called it with
``warm=True`` (``integrations/warm.py``) hands the answer to every worker it forks.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

__all__ = ["memoize_cpu_info"]

CACHE_VAR = "DSR_CPUINFO_CACHE"


def memoize_cpu_info(*, warm: bool = False) -> bool:
    """Make ``cpuinfo.get_cpu_info`` (the package's name, which DeepSpeed imports at each call)
    return the machine's answer, asked once (a copy each time). ``warm``: get it now. Returns
    whether py-cpuinfo is there. Idempotent."""
    try:
        import cpuinfo
    except ImportError:
        return False
    if not getattr(cpuinfo.get_cpu_info, "_dsr_memo", False):
        cpuinfo.get_cpu_info = _memo(cpuinfo.get_cpu_info, _cache_file(getattr(cpuinfo, "CPUINFO_VERSION_STRING", "")))
    if warm:
        cpuinfo.get_cpu_info()
    return True


def _memo(ask: Callable[[], dict[str, Any]], path: Path | None) -> Callable[[], dict[str, Any]]:
    answer: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if not answer:
            answer.append(_read(path) or _asked(ask, path))
        return copy.deepcopy(answer[0])  # a caller may change its copy

    get_cpu_info._dsr_memo = True  # type: ignore[attr-defined]
    return get_cpu_info


def _asked(ask: Callable[[], dict[str, Any]], path: Path | None) -> dict[str, Any]:
    info = ask()
    if path is not None and isinstance(info, dict):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(info))
            os.replace(tmp, path)  # whole or not at all, for a reader on another process
        except (OSError, TypeError, ValueError):
            pass  # no cache: the next process asks again
    return info


def _read(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "arch" in info else None


def _cache_file(version: str) -> Path | None:
    """This machine's cache file, or ``None`` (turned off, or no ``/proc/cpuinfo`` to key it by)."""
    where = os.environ.get(CACHE_VAR)
    if where == "":
        return None
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    wanted = sorted({ln for ln in lines if ln.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features",
                                                                        "CPU implementer", "CPU part")})
    key = hashlib.sha256("\n".join([*wanted, platform.machine(), platform.release(), version]).encode()).hexdigest()
    root = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_resilience"
    return root / f"cpuinfo-{key[:24]}.json"
