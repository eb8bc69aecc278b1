"""SIGTERM and SIGINT in a worker under the agent: a request for a graceful stop, not a death.

A SLURM job step's processes all receive the scheduler's SIGTERM (preemption, the time limit), and a
Ctrl-C reaches every process of the terminal's process group: the agent and each worker. A worker
that died of it would take its in-memory state with it. Instead, :func:`install` makes the first
such signal ask the agent to stop the job gracefully (``Coordinator.request_stop``: the heartbeat
thread posts it to the store): the agent publishes a ``stop`` epoch, and every worker saves its
stage and exits, as when the agent itself received the signal. A second signal acts as it would
have (the handlers in place before are restored).
"""

from __future__ import annotations

import signal
import threading
from typing import Any, Callable

from ..logs import get_logger

__all__ = ["STOP_SIGNALS", "install"]

log = get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install(request: Callable[[str], None], rank: int) -> Callable[[], None]:
    """Route SIGTERM and SIGINT to ``request(reason)`` once; returns a function that restores the
    previous handlers. Outside the main thread (signals cannot be handled there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous: dict[int, Any] = {}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        previous.clear()

    def on_signal(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        restore()  # a second signal: what it did before
        log.warning("rank %d received %s: asking the agent to stop the job gracefully (the stages save and exit; "
                    "send it again to end this worker at once)", rank, name)
        request(f"rank {rank} received {name}")

    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, on_signal)
    return restore
