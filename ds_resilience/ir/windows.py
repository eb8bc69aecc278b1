"""Replication windows: where in a worker's action list its network link is idle (Gemini's spans).

The in-memory checkpoint sends its replica chunks in the network's idle spans of the running
schedule. The timeline knows them: a worker's link is idle while none of the messages it sends or
receives is in flight. :func:`replication_windows` replays a schedule and returns, for one worker,
each of its compute actions during which that holds, with the idle time the action covers (in the
cost model's units). At run time the engine opens the replication gate for the measured duration of
those actions (the measured spans correct the model's), so chunks never compete with the pipeline's
own activation and gradient messages. Pure Python (layer L0).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import CostModel
from .action import ActionKind
from .schedule import Schedule
from .timeline import Span, merge_spans, simulate

__all__ = ["Window", "replication_windows", "idle_fraction"]


@dataclass(frozen=True, slots=True)
class Window:
    """Action ``index`` of the worker's list runs while its link is idle for ``idle`` time units
    (of the action's ``duration``)."""

    index: int
    duration: float
    idle: float


def _overlap(span: Span, busy: list[Span]) -> float:
    s, e = span
    return sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in busy)


def replication_windows(schedule: Schedule, worker: int, cost: CostModel | None = None) -> tuple[Window, ...]:
    """The compute actions of ``worker`` during which its link carries at most half their time.

    A link here is every directed link with ``worker`` at either end; an action qualifies when the
    messages in flight cover less than half of its span (so a chunk sent then mostly meets an idle
    wire). Returns an empty tuple for a failed worker.
    """
    if worker in schedule.failed:
        return ()
    timeline = simulate(schedule, cost)
    busy = merge_spans([span for (src, dst), spans in timeline.link_busy.items() if worker in (src, dst) for span in spans])
    out = []
    for index, action in enumerate(schedule.workers[worker]):
        if not (action.kind.is_compute or action.kind is ActionKind.OPT_STEP):
            continue
        span = (timeline.starts[worker][index], timeline.ends[worker][index])
        duration = span[1] - span[0]
        if duration <= 0:
            continue
        idle = duration - _overlap(span, busy)
        if idle >= duration / 2:
            out.append(Window(index, duration, idle))
    return tuple(out)


def idle_fraction(schedule: Schedule, worker: int, cost: CostModel | None = None) -> float:
    """Share of the iteration time the worker's windows cover (what replication may use at most)."""
    windows = replication_windows(schedule, worker, cost)
    total = simulate(schedule, cost).makespan
    return sum(w.idle for w in windows) / total if total > 0 else 0.0
