"""Timeline simulator: replay a schedule under a cost model and measure it.

Returns the makespan, per-worker busy and idle spans, per-link network busy and idle spans (the
windows the checkpoint interleaver fills), the bubble ratio, peak in-flight activations and pending
W per worker, and, for staggered schedules, the steady-state iteration period.

:func:`iteration_time` is the one definition of a schedule's iteration time: the planner rates its
plans with it and :func:`simulate` fills :attr:`Timeline.iteration_time` with the same rule
(:func:`replayed_iteration_time`). Pure Python (layer L0, next to the IR it replays).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..costs import CostModel
from ..errors import PlanningError, ScheduleError
from .action import ActionKind
from .render import format_steps
from .native import peaks as native_peaks
from .native import replay_times
from .replay import replay
from .schedule import Schedule

__all__ = [
    "STEADY_ITERATIONS",
    "Span",
    "Timeline",
    "simulate",
    "merge_spans",
    "complement",
    "iteration_ends",
    "steady_period",
    "memory_peaks",
    "replayed_iteration_time",
    "iteration_time",
]

Span = tuple[float, float]

_BUSY_KINDS = frozenset({ActionKind.OPT_STEP, ActionKind.REDUCE_GRAD, ActionKind.TIED_REDUCE})
"""Non-compute actions that count as busy time (the optimizer tail's reduces and step)."""

STEADY_ITERATIONS = 4
"""Iterations replayed to measure the staggered optimizer's steady-state period (the period is
averaged over the second half)."""


def merge_spans(spans: list[Span]) -> list[Span]:
    """Union of intervals, sorted and non-overlapping (zero-length spans dropped)."""
    out: list[Span] = []
    for s, e in sorted(x for x in spans if x[1] > x[0]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def complement(busy: list[Span], start: float, end: float) -> list[Span]:
    """The gaps of ``busy`` (merged) within ``[start, end]``."""
    gaps, cursor = [], start
    for s, e in busy:
        if s > cursor:
            gaps.append((cursor, min(s, end)))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))
    return [g for g in gaps if g[1] > g[0]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """What the replay of one schedule measured.

    Attributes:
        makespan: time from the first action to the last (all iterations).
        iteration_time: ``makespan / iterations`` for one iteration; for several, the steady-state
            period (time between the last two iterations' ends, averaged over the tail).
        starts, ends: per worker, per action.
        busy, idle: per surviving worker, merged compute, reduce (REDUCE_GRAD, TIED_REDUCE) and
            optimizer spans, and their gaps within [0, makespan].
        link_busy, link_idle: per directed link (src, dst) that carried messages.
        bubble_ratio: idle compute time over (surviving workers x makespan).
        peak_activations: per worker, the most micro-batches between F and B at any time.
        peak_pending_w: per worker, the most B's whose W had not run yet.
        peak_state: per worker, the most micro-batch states (activations and pending W) held at once.
    """

    makespan: float
    iteration_time: float
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    busy: dict[int, list[Span]]
    idle: dict[int, list[Span]]
    link_busy: dict[tuple[int, int], list[Span]]
    link_idle: dict[tuple[int, int], list[Span]]
    bubble_ratio: float
    peak_activations: tuple[int, ...]
    peak_pending_w: tuple[int, ...]
    peak_state: tuple[int, ...]

    def stage_peak_activations(self, dp: int, pp: int) -> list[int]:
        """Peak in-flight activations per stage (max over its workers)."""
        return [max(self.peak_activations[s * dp:(s + 1) * dp]) for s in range(pp)]


def memory_peaks(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Per worker: peak activations (F to B), peak pending W (B to W), and peak of their sum.

    Counted in action order, which is what a worker holds whatever the timing.
    """
    fast = native_peaks(schedule, [(1.0, 1.0)] * schedule.pp)
    if fast is not None:
        return fast[1], fast[2], fast[3]
    acts, pend, state = [], [], []
    for actions in schedule.workers:
        a = p = peak_a = peak_p = peak_s = 0
        for x in actions:
            kind = x.kind
            if kind is ActionKind.F:
                a += 1
            elif kind is ActionKind.BW:
                a -= 1
            elif kind is ActionKind.B:
                a -= 1
                p += 1
            elif kind is ActionKind.W:
                p -= 1
            else:
                continue
            peak_a, peak_p, peak_s = max(peak_a, a), max(peak_p, p), max(peak_s, a + p)
        acts.append(peak_a)
        pend.append(peak_p)
        state.append(peak_s)
    return tuple(acts), tuple(pend), tuple(state)


def iteration_ends(schedule: Schedule, ends: tuple[tuple[float, ...], ...], repeat: int = 1) -> list[float]:
    """End time of each iteration: the last OPT_STEP of that iteration over all workers."""
    per_iter = [0.0] * (schedule.iterations * repeat)
    for w, actions in enumerate(schedule.workers):
        k = 0
        for a, e in zip(actions * repeat, ends[w]):
            if a.kind is ActionKind.OPT_STEP:
                per_iter[k] = max(per_iter[k], e)
                k += 1
    return per_iter


def steady_period(ends_per_iteration: list[float]) -> float:
    """Average time between iteration ends over the second half of the iterations."""
    k = len(ends_per_iteration)
    if k == 1:
        return ends_per_iteration[0]
    half = max(1, k // 2)
    return (ends_per_iteration[-1] - ends_per_iteration[half - 1]) / (k - half)


def replayed_iteration_time(
    schedule: Schedule, ends: tuple[tuple[float, ...], ...], makespan: float, repeat: int = 1
) -> float:
    """Iteration time of a replay of ``schedule`` run ``repeat`` times back to back.

    One iteration in all: its makespan. Several: the steady-state period
    (:func:`steady_period` of the :func:`iteration_ends`).
    """
    if schedule.iterations * repeat == 1:
        return makespan
    return steady_period(iteration_ends(schedule, ends, repeat))


def iteration_time(schedule: Schedule, cost: CostModel, variant: str, speeds: Sequence[float] | None = None) -> float:
    """The iteration time the timeline replay gives ``schedule`` under ``variant``'s semantics.

    ``recycle``: the steady-state period of :data:`STEADY_ITERATIONS` back-to-back iterations with
    the staggered optimizer; otherwise one iteration's makespan. With a step check (clipping or
    fp16, ``cost.step_check``) the expected time over its modes: the barrier, or the speculative
    steps that hold, wait or roll back, weighted by their fractions (:meth:`CostModel.step_mix`).
    The same rule as :attr:`Timeline.iteration_time` of ``simulate(schedule, cost, repeat=...)``,
    without measuring the spans. ``speeds``: per worker, the fraction of its compute speed (a
    straggler's below 1; the Python replay then).

    Raises:
        PlanningError: the schedule deadlocks in the replay.
    """
    repeat = STEADY_ITERATIONS if variant == "recycle" else 1
    total = 0.0
    for mode, weight in cost.step_mix():
        # the C loop where it applies (it has no per-worker speed)
        fast = replay_times(schedule, cost, repeat=repeat, mode=mode) if speeds is None else None
        if fast is not None:
            if fast.blocked:
                raise PlanningError(f"{variant} schedule deadlocks" + (" when repeated" if repeat > 1 else ""))
            ends = fast.iteration_ends
            total += weight * (fast.makespan if len(ends) == 1 else steady_period(ends))
            continue
        result = replay(schedule, cost, repeat=repeat, mode=mode, speeds=speeds)
        if result.blocked:
            raise PlanningError(f"{variant} schedule deadlocks" + (" when repeated" if repeat > 1 else ""))
        total += weight * replayed_iteration_time(schedule, result.ends, result.makespan, repeat)
    return total


def simulate(
    schedule: Schedule, cost: CostModel | None = None, *, ckpt_chunk_bytes: float = 0.0, repeat: int = 1
) -> Timeline:
    """Replay ``schedule`` under ``cost`` (unit costs by default) and measure it.

    ``repeat`` runs each worker's list that many times back to back (steady state); the spans then
    cover all repetitions and ``iteration_time`` is the steady-state period. With a step check
    (``cost.step_check``) the spans are those of its most frequent mode and ``iteration_time`` the
    expected time over its modes (as :func:`iteration_time`).

    Raises:
        ScheduleError: the schedule deadlocks (validate it first for a precise message).
    """
    cost = cost or CostModel.unit()
    cost.check_stages(schedule.pp)
    mix = cost.step_mix()
    runs = {mode: replay(schedule, cost, ckpt_chunk_bytes=ckpt_chunk_bytes, repeat=repeat, mode=mode)
            for mode, _ in mix}
    r = runs[max(mix, key=lambda m: m[1])[0]]
    for run in runs.values():
        if run.blocked:
            r = run
    if r.blocked:
        w, i = min(r.blocked.items())
        raise ScheduleError(
            f"schedule deadlocks in replay at worker {w} step {i}\n{format_steps(schedule, mark=(w, i))}",
            worker=w,
            step=i,
        )
    makespan = r.makespan
    busy: dict[int, list[Span]] = {}
    idle: dict[int, list[Span]] = {}
    total_idle = 0.0
    alive = list(schedule.alive())
    for w in alive:
        spans = [
            (s, e)
            for a, s, e in zip(schedule.workers[w] * repeat, r.starts[w], r.ends[w])
            if a.kind.is_compute or a.kind in _BUSY_KINDS
        ]
        busy[w] = merge_spans(spans)
        idle[w] = complement(busy[w], 0.0, makespan)
        total_idle += sum(e - s for s, e in idle[w])
    link_spans: dict[tuple[int, int], list[Span]] = {}
    for t in r.transfers:
        link_spans.setdefault((t.src, t.dst), []).append((t.start, t.end))
    link_busy = {k: merge_spans(v) for k, v in link_spans.items()}
    link_idle = {k: complement(v, 0.0, makespan) for k, v in link_busy.items()}
    bubble = total_idle / (len(alive) * makespan) if alive and makespan > 0 else 0.0
    acts, pend, state = memory_peaks(schedule)
    return Timeline(
        makespan=makespan,
        iteration_time=sum(weight * replayed_iteration_time(schedule, runs[mode].ends, runs[mode].makespan, repeat)
                           for mode, weight in mix),
        starts=r.starts,
        ends=r.ends,
        busy=busy,
        idle=idle,
        link_busy=link_busy,
        link_idle=link_idle,
        bubble_ratio=bubble,
        peak_activations=acts,
        peak_pending_w=pend,
        peak_state=state,
    )
