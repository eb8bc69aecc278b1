"""Hang detection by progress: a worker whose main thread stopped advancing stops beating.

A heartbeat thread that is alive says nothing about the main thread: stuck in a kernel, a device
synchronisation or a communication library's wait on a peer that will never answer, a worker still
beats. Here the main thread advances a counter at every action of the schedule, and marks the
spans in which it waits for another worker (a receive, a collective, the step check): a wait on a
peer is not this worker's hang (if the peer hangs, the peer is the one that stops). When the main
thread has been *running* one action for longer than ``stall_timeout_s`` without advancing, the
heartbeat thread stops beating; the agent sees the silence, declares a hang and SIGKILLs the worker,
and its peers recover as from any death. The timer runs only inside a training iteration's actions
(the user's own code between iterations, evaluation or a checkpoint save, is not timed).

On a GPU the host enqueues kernels and returns; the stall then shows at the next synchronisation
(an event wait, a receive's data), which the runtime reaches inside an action and times the same
way. Pure Python.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["Progress"]


class Progress:
    """The main thread's progress, read by the heartbeat thread.

    Args:
        stall_timeout_s: how long one action may run (outside waits on peers) before the worker
            counts as hung; ``None``: never.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, stall_timeout_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_timeout_s is not None and not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 or None, got {stall_timeout_s!r}")
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self.count = 0
        self._since = clock()
        self._active = 0
        self._waiting = 0
        self.where = ""  # the action the main thread runs (for the log)

    def advance(self, where: str | None = None) -> None:
        """The main thread moved on (one action started or finished); ``where``: what it runs now."""
        with self._lock:
            self.count += 1
            self._since = self._clock()
            if where is not None:
                self.where = where

    @contextmanager
    def active(self) -> Iterator[None]:
        """The span that is timed: a training iteration's actions."""
        self.advance()
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
            self.advance()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait on other workers: not timed (their own progress is)."""
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
            self.advance()

    def stalled_for(self) -> float:
        """Seconds the main thread has been running one action without advancing (0 outside the
        timed span or inside a wait)."""
        with self._lock:
            if not self._active or self._waiting:
                return 0.0
            return self._clock() - self._since

    def stalled(self) -> bool:
        return self.stall_timeout_s is not None and self.stalled_for() > self.stall_timeout_s
