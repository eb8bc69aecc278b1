"""One hierarchy for every error ds_resilience raises on purpose.

Catch :class:`ResilienceError` to handle all of them. Each subclass names the layer that found the
problem; messages say what is wrong, where, and what is allowed.
"""

from __future__ import annotations

__all__ = [
    "ResilienceError",
    "ConfigError",
    "TopologyError",
    "ScheduleError",
    "PlanningError",
    "MemoryCapError",
    "CostModelError",
]


class ResilienceError(Exception):
    """Base class of every error raised by ds_resilience."""


class ConfigError(ResilienceError, ValueError):
    """A ``"resilience"`` config value is unknown, of the wrong type or out of range.

    Attributes:
        path: dotted key path of the offending entry, e.g. ``resilience.planner.solver``.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class TopologyError(ResilienceError, ValueError):
    """A topology, worker coordinate or global rank is invalid."""


class CostModelError(ResilienceError, ValueError):
    """A cost model file or value is invalid."""


class ScheduleError(ResilienceError):
    """A schedule violates an invariant; the message shows the per-worker grid with the step marked.

    Attributes:
        worker: global rank of the worker whose step is at fault (``None`` when global).
        step: index of the failing action in that worker's list (``None`` when not one step).
    """

    def __init__(self, message: str, *, worker: int | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.step = step


class PlanningError(ResilienceError, ValueError):
    """The planner cannot produce a schedule for the request (e.g. a stage lost every replica)."""


class MemoryCapError(PlanningError):
    """The memory cap cannot hold one micro-batch's state for the variant asked for (the planner's
    ``auto`` variant rules that variant out instead of failing)."""


class BackwardSplitError(ResilienceError, RuntimeError):
    """A B/W split was misused (W twice, unknown or duplicate key, W left pending) or is impossible."""
