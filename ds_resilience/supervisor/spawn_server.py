"""Imported first by the agent's fork server (``supervisor/spawn.py``): the server dies with the
process that started it.

Without this, the server outlives a SIGKILLed agent until its last worker lets go of the agent's
'alive' pipe, and under load its own interpreter shutdown (torch and DeepSpeed loaded) takes
seconds more, during which the workers' orphan check (their parent changed) cannot fire. With
``PR_SET_PDEATHSIG`` the kernel SIGKILLs the server the moment its parent exits; its workers
(forks, which do not inherit the setting) see their parent change at their next heartbeat.
Does nothing outside a multiprocessing fork server, or off Linux.
"""

from __future__ import annotations

import ctypes
import signal
import sys

__all__: list[str] = []

PR_SET_PDEATHSIG = 1


def _in_a_fork_server() -> bool:
    return sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules


if sys.platform.startswith("linux") and _in_a_fork_server():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - no prctl: the pipe's EOF still ends it
        pass
