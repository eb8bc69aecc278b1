"""Where a running job gets the schedule for a failure set: the plan table first, the planner second.

At start the engine builds (or loads from ``planner.cache_dir``) the plan table for every failure
set up to ``max_failures`` (and, with ``planner.all_coverable``, every set re-routing can cover),
in ``planner.workers`` processes. At a failure, :meth:`ScheduleProvider.schedule_for` answers from
the table when the set is in it (a lookup, milliseconds) and from the planner's heuristic otherwise
(deterministic, so every survivor computes the same schedule without talking); it reports which,
and how long it took.

A slow worker (:meth:`ScheduleProvider.schedule_for_slow`) is planned the same way: its measured
speed is snapped to the nearest of :data:`SLOW_LEVELS` within :data:`SLOW_SNAP` (a worker measured
at 0.46x and later at 0.52x keeps one plan), and one slow worker is planned as pipeline 0's worker of
its stage and relabelled to its pipeline (every replica of a stage is interchangeable). The slow
table (:meth:`ScheduleProvider.warm_slow_table`) plans one slow worker per stage at every level
ahead of time, off the training thread; a set it lacks is planned on demand. Either way the answer
is the same function of the speeds, so every rank computes the same schedule without talking.
Pure Python.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import ActionKind, Schedule, TiedGroups
from ..ir.timeline import iteration_time
from ..topology import Topology, Worker
from .generators import generate
from .normalize import relabel_schedule
from .planner import plan
from .stragglers import plan_slow
from .table import PlanTable, TableSpec, build_table

__all__ = ["SLOW_LEVELS", "SLOW_SNAP", "ScheduleChoice", "ScheduleProvider", "slow_level"]

SLOW_LEVELS = (0.25, 0.5, 0.75)
"""The speeds the slow table plans one slow worker per stage at."""
SLOW_SNAP = 0.05
"""A measured speed this close to a level is planned at that level."""


def slow_level(speed: float) -> float:
    """``speed`` snapped to the nearest of :data:`SLOW_LEVELS` within :data:`SLOW_SNAP`, else to
    hundredths (as the reporting rank posts it)."""
    nearest = min(SLOW_LEVELS, key=lambda level: abs(level - speed))
    return nearest if abs(nearest - speed) <= SLOW_SNAP + 1e-9 else round(float(speed), 2)


@dataclass(frozen=True)
class ScheduleChoice:
    """A schedule for a failure set, where it came from, and how long getting it took."""

    schedule: Schedule
    source: str  # "fault-free" | "table" | "planner"
    seconds: float
    figures: dict[str, Any] | None = None  # the plan's predicted times, bound and memory


class ScheduleProvider:
    """Schedules for one job's grid (see the module docstring).

    Args:
        topology: the full grid.
        microbatches: micro-batches per pipeline.
        cost: the cost model.
        schedule: the fault-free schedule's name (``1f1b`` or ``decoupled``).
        variant, solver, time_limit_s, memory_cap: planner options (``resilience.planner``).
        table: a built plan table, or ``None`` (every failure set is planned on demand).
        on_demand_solver: the solver for sets the table lacks (the heuristic by default: every
            survivor must compute the same schedule without talking).
        tied: the model's tied groups (sorted stage tuples, e.g. ``((0, 3),)``), passed to the
            fault-free generator, the planner and the plan table: every schedule it answers carries
            them and their TIED_REDUCEs.
    """

    def __init__(self, topology: Topology, microbatches: int, cost: CostModel, *, schedule: str, variant: str,
                 solver: str, time_limit_s: float, memory_cap: int | None, table: PlanTable | None = None,
                 on_demand_solver: str = "heuristic", tied: TiedGroups = ()) -> None:
        self.topology = topology
        self.microbatches = microbatches
        self.cost = cost
        self.schedule_name = schedule
        self.variant, self.solver, self.time_limit_s, self.memory_cap = variant, solver, time_limit_s, memory_cap
        self.table = table
        self.on_demand_solver = on_demand_solver
        self.table_summary: dict[str, Any] | None = None
        self.tied: TiedGroups = tuple(tuple(group) for group in tied)
        self._slow: dict[tuple[tuple[Worker, float], ...], ScheduleChoice] = {}  # schedule_for_slow's plans
        if table is not None and table.spec.tied != self.tied:
            raise PlanningError(f"plan table built for tied groups {table.spec.tied}, provider has {self.tied}")

    @classmethod
    def build(cls, topology: Topology, microbatches: int, cost: CostModel, *, schedule: str, variant: str,
              solver: str, time_limit_s: float, memory_cap: int | None, max_failures: int, all_coverable: bool,
              cache_dir: str | Path | None, workers: int, on_demand_solver: str = "heuristic",
              progress: bool | None = None, tied: TiedGroups = ()) -> "ScheduleProvider":
        """Build or load the plan table (``max_failures`` 0 and no ``all_coverable``: no table);
        ``progress``: as :func:`~.table.build_table`'s (a bar on rank 0's terminal by default)."""
        provider = cls(topology, microbatches, cost, schedule=schedule, variant=variant, solver=solver,
                       time_limit_s=time_limit_s, memory_cap=memory_cap, on_demand_solver=on_demand_solver,
                       tied=tied)
        if max_failures > 0 or all_coverable:
            spec = provider.table_spec(max_failures, all_coverable)
            provider.table, provider.table_summary = build_table(spec, cache_dir=cache_dir, workers=workers,
                                                                 progress=progress)
        return provider

    def table_spec(self, max_failures: int, all_coverable: bool) -> TableSpec:
        """The spec of this provider's plan table for that tolerance."""
        return TableSpec(dp=self.topology.dp, pp=self.topology.pp, microbatches=self.microbatches, cost=self.cost,
                         variant=self.variant, solver=self.solver, time_limit_s=self.time_limit_s,
                         memory_cap=self.memory_cap, max_failures=max_failures, all_coverable=all_coverable,
                         tied=self.tied)

    def adopt(self, table: PlanTable) -> None:
        """Answer from ``table`` (another rank's build of this provider's spec) from now on.

        Raises:
            PlanningError: ``table`` was built for another spec.
        """
        if self.table is not None and table.spec != self.table.spec:
            raise PlanningError("the plan table to adopt was built for another topology, cost model or options")
        if table.spec.cost != self.cost or table.spec.variant != self.variant or table.spec.tied != self.tied:
            raise PlanningError("the plan table to adopt was built with another cost model, variant or tied groups")
        self.table = table

    def covers(self, failed: Iterable[Worker]) -> bool:
        """Whether the plan table holds a schedule for ``failed``."""
        if self.table is None:
            return False
        try:
            self.table.lookup(failed)
            return True
        except PlanningError:
            return False

    def schedule_for(self, failed: Iterable[Worker], *, solver: str | None = None) -> ScheduleChoice:
        """The schedule for ``failed`` (workers of the full grid).

        ``solver`` overrides the on-demand solver (e.g. CP-SAT when one rank plans for everyone).

        Raises:
            PlanningError: a stage lost every replica.
        """
        failed = frozenset(failed)
        started = time.perf_counter()
        dp, pp = self.topology.dp, self.topology.pp
        if not failed:
            schedule = generate(self.schedule_name, dp, pp, self.microbatches, self.cost, tied=self.tied)
            return ScheduleChoice(schedule, "fault-free", time.perf_counter() - started)
        if self.table is not None:
            try:
                view = self.table.lookup(failed)
            except PlanningError:
                view = None
            if view is not None:
                schedule = view.schedule()
                return ScheduleChoice(schedule, "table", time.perf_counter() - started, view.figures)
        result = plan(dp, pp, self.microbatches, failed, cost=self.cost, variant=self.variant,
                      solver=solver or self.on_demand_solver, time_limit_s=self.time_limit_s,
                      memory_cap=self.memory_cap, tied=self.tied)
        return ScheduleChoice(result.schedule, "planner", time.perf_counter() - started,
                              result.to_dict(with_schedule=False))

    def schedule_for_slow(self, speeds: Mapping[Worker, float]) -> ScheduleChoice:
        """The schedule for slow workers of the full grid (``speeds``: each one's fraction of full
        speed, in (0, 1)): the weighted plan of :func:`~.stragglers.plan_slow` with this provider's
        cost model, variant, memory cap and tied groups (deterministic: every rank computes the same
        schedule without talking), from the on-demand planner. Its figures: ``iteration_time`` (the
        plan's, replayed with the speeds), ``unadapted_time`` (the running fault-free schedule
        replayed with them), ``fault_free_iteration_time`` (that schedule at full speed), ``bound``,
        ``loads`` (micro-batches per worker index) and ``speeds`` (``"p1s0": 0.5``), in the cost
        model's unit. No slow worker: the fault-free schedule. Speeds are snapped to
        :data:`SLOW_LEVELS` (:func:`slow_level`); one slow worker is planned as pipeline 0's of its
        stage and relabelled, from the slow table when :meth:`warm_slow_table` has planned it (the
        same schedule either way).

        Raises:
            PlanningError: a worker out of the grid or a speed outside (0, 1].
        """
        if not speeds:
            return self.schedule_for(())
        started = time.perf_counter()
        outside = [str(w) for w in speeds if not (0 <= w.pipeline < self.topology.dp and 0 <= w.stage < self.topology.pp)]
        if outside:
            raise PlanningError(f"slow worker(s) {', '.join(outside)} outside the {self.topology.dp}x{self.topology.pp} "
                                f"grid")
        speeds = {w: slow_level(s) for w, s in speeds.items()}
        key = tuple(sorted(speeds.items()))
        choice = self._slow.get(key)  # a worker slow again at the same speed: planned once
        if choice is None and len(speeds) == 1 and next(iter(speeds)).pipeline != 0:
            (worker, speed), = speeds.items()  # planned as pipeline 0's worker of its stage, relabelled
            base = self._planned_slow({Worker(pipeline=0, stage=worker.stage): speed})
            perm = list(range(self.topology.dp))
            perm[0], perm[worker.pipeline] = worker.pipeline, 0
            schedule = relabel_schedule(base.schedule, tuple(perm))
            figures = {**base.figures, "loads": _forwards(schedule), "speeds": {str(worker): speed}}
            choice = self._slow.setdefault(key, ScheduleChoice(schedule, base.source, base.seconds, figures))
        elif choice is None:
            choice = self._planned_slow(speeds)
        return ScheduleChoice(choice.schedule, choice.source, time.perf_counter() - started, choice.figures)

    def warm_slow_table(self, levels: Iterable[float] = SLOW_LEVELS) -> int:
        """Plan one slow worker per stage at each of ``levels`` ahead of time (the slow table; run it
        off the training thread: :meth:`schedule_for_slow` then answers these from it). Returns the
        number of plans made."""
        made = 0
        for stage in range(self.topology.pp):
            for level in levels:
                key = ((Worker(pipeline=0, stage=stage), slow_level(level)),)
                if key not in self._slow:
                    self._planned_slow(dict(key), source="slow-table")
                    made += 1
        return made

    def _planned_slow(self, speeds: Mapping[Worker, float], source: str = "slow-plan") -> ScheduleChoice:
        """The weighted plan for ``speeds`` (already snapped), made once per provider."""
        started = time.perf_counter()
        key = tuple(sorted(speeds.items()))
        cached = self._slow.get(key)
        if cached is not None:  # the slow table's, or a worker slow again at the same speed
            return cached
        dp, pp = self.topology.dp, self.topology.pp
        variant = self.variant if self.variant in ("adaptive", "decoupled", "recycle") else "recycle"
        healthy = generate(self.schedule_name, dp, pp, self.microbatches, self.cost, tied=self.tied)
        per_worker = [float(speeds.get(self.topology.worker(i), 1.0)) for i in range(dp * pp)]
        unadapted = iteration_time(healthy, self.cost, variant, per_worker)
        schedule, predicted, bound = healthy, unadapted, None
        # the configured variant's plan, and the fused backward's: a split backward holds each
        # deferred W's inputs, and under the fault-free 1F1B's memory cap the peer's extra
        # micro-batches may only fit fused (the example GPT's profile on CPU); each replayed the
        # way the engine runs it, the fastest taken (ties: the running schedule, then the first)
        for option in dict.fromkeys((variant, "adaptive")):
            slow = plan_slow(dp, pp, self.microbatches, speeds, cost=self.cost, variant=option,
                             memory_cap=self.memory_cap, tied=self.tied)
            bound = slow.bound
            value = slow.iteration_time if option == variant else iteration_time(slow.schedule, self.cost, variant,
                                                                                 per_worker)
            if value < predicted - 1e-12:
                schedule, predicted = slow.schedule, value
        figures = {"variant": variant, "iteration_time": predicted, "unadapted_time": unadapted,
                   "fault_free_iteration_time": iteration_time(healthy, self.cost, variant), "bound": bound,
                   "loads": _forwards(schedule),
                   "speeds": {str(w): s for w, s in sorted(speeds.items())}}
        choice = ScheduleChoice(schedule, source, time.perf_counter() - started, figures)
        return self._slow.setdefault(key, choice)  # a concurrent warm-up's plan is the same plan


def _forwards(schedule: Schedule) -> list[int]:
    """Micro-batches (forwards) per worker index."""
    return [sum(1 for a in actions if a.kind is ActionKind.F) for actions in schedule.workers]
