"""Polling with backoff: the waits on store keys (agreements, gradient norms, headers, epochs).

A wait that polls the store every millisecond costs its rank a store round trip per millisecond
and the store (the agent's process) one request per millisecond per waiting rank; most waits end
within a few milliseconds, some last seconds (a peer still computing, a recovery). :class:`Backoff`
sleeps ``start`` first and ``factor`` times longer each time after, up to ``cap``: a short wait
ends as soon as before, and a long one polls a few hundred times a second instead of a thousand
(it ends at most ``cap`` late, or half its length when shorter). Pure Python.
"""

from __future__ import annotations

import time

__all__ = ["Backoff"]


class Backoff:
    """``sleep()`` for the next poll of one wait (see the module docstring)."""

    __slots__ = ("delay", "cap", "factor")

    def __init__(self, start: float = 0.0005, cap: float = 0.005, factor: float = 1.5) -> None:
        if not 0 < start <= cap or factor < 1:
            raise ValueError(f"need 0 < start ({start}) <= cap ({cap}) and factor ({factor}) >= 1")
        self.delay, self.cap, self.factor = start, cap, factor

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * self.factor, self.cap)
