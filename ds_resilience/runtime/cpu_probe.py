"""py-cpuinfo's answer, asked once per process.

DeepSpeed's op builder asks ``cpuinfo.get_cpu_info()`` for the CPU each time it JIT-loads a CPU op
(``cpu_arch`` and ``simd_width`` in ``cxx_args``: twice for one ``FusedAdam``), and every call runs
a Python subprocess that decodes ``cpuid``: 1.5-2 s of a core each on this project's CI machine,
about 3.5 s per worker that builds DeepSpeed's default optimizer, and a quarter of a 4-rank test
job's CPU time. The answer cannot change while the process lives, so :func:`memoize_cpu_info`
keeps the first one; a fork server that called it with ``warm=True``
(``integrations/warm.py``) hands the answer to every worker it forks.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

__all__ = ["memoize_cpu_info"]


def memoize_cpu_info(*, warm: bool = False) -> bool:
    """Make ``cpuinfo.get_cpu_info`` (the package's name, which DeepSpeed imports at each call)
    return its first answer (a copy each time). ``warm``: ask now. Returns whether py-cpuinfo is
    there. Idempotent."""
    try:
        import cpuinfo
    except ImportError:
        return False
    if not getattr(cpuinfo.get_cpu_info, "_dsr_memo", False):
        cpuinfo.get_cpu_info = _memo(cpuinfo.get_cpu_info)
    if warm:
        cpuinfo.get_cpu_info()
    return True


def _memo(ask: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    answer: list[dict[str, Any]] = []

    def get_cpu_info() -> dict[str, Any]:
        if not answer:
            answer.append(ask())
        return copy.deepcopy(answer[0])  # a caller may change its copy

    get_cpu_info._dsr_memo = True  # type: ignore[attr-defined]
    return get_cpu_info
