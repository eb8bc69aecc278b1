"""The ReCycle planner: the best schedule for one failure set, in three variants.

* ``adaptive``  re-routing only: fused backward, one global optimizer barrier per iteration;
* ``decoupled`` plus the decoupled backward (B now, W deferred into idle time);
* ``recycle``   plus the staggered optimizer: each stage steps when its own gradients are reduced and
  its next iteration may start right after. Its iteration time is the steady-state period of the
  schedule repeated :data:`STEADY_ITERATIONS` times, not one iteration's makespan.

The heuristic (list scheduling over a few memory splits) always answers in milliseconds; the CP-SAT
solver (:mod:`.cpsat`), warm-started from it, may improve one-iteration variants within a time
limit. Whatever produced it, a plan's schedule is validated and its claimed iteration time is the
timeline simulator's replay of it: the simulator is the judge. Pure Python (plus OR-Tools).
"""

from __future__ import annotations

import time
from functools import lru_cache
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import Schedule, replay, validate
from ..sim import iteration_ends, memory_peaks, steady_period
from ..topology import Topology, Worker, format_worker, parse_worker
from .bounds import lower_bound
from .generators import decoupled, one_f_one_b
from .list_scheduler import list_schedule
from .lowering import lower
from .reroute import reroute_assignment

__all__ = [
    "VARIANTS",
    "SOLVERS",
    "STEADY_ITERATIONS",
    "SolverReport",
    "Plan",
    "plan",
    "iteration_time",
    "default_memory_cap",
]

VARIANTS = ("adaptive", "decoupled", "recycle")
SOLVERS = ("heuristic", "cpsat")
STEADY_ITERATIONS = 4
"""Iterations replayed to measure the staggered optimizer's steady-state period (the period is
averaged over the second half)."""


_LARGE_GRID = 2048
"""Above this many (pipeline, stage, micro-batch) items the heuristic tries one memory split only."""


def default_memory_cap(pp: int) -> int:
    """Micro-batch states (activations between F and B, plus pending W) a worker may hold.

    ``2 * pp``: twice what 1F1B holds on its first stage. The fault-free decoupled schedule holds
    at most ``pp + 1``; re-routed micro-batches and deferred W need the rest.
    """
    return 2 * pp


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverReport:
    """How the plan was found. ``gap`` is the relative optimality gap (0 = proven optimal)."""

    name: str
    status: str
    gap: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "gap": self.gap, "seconds": self.seconds}


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A validated schedule for one failure set, with its figures.

    Times are in the cost model's unit. ``schedule`` covers one iteration; for ``recycle`` it is
    meant to be repeated with the staggered optimizer.
    """

    dp: int
    pp: int
    microbatches: int
    failed: tuple[Worker, ...]
    variant: str
    schedule: Schedule
    iteration_time: float
    fault_free_iteration_time: float
    best_fault_free_iteration_time: float
    lower_bound: float
    memory_cap: int
    peak_activations: tuple[int, ...]
    peak_pending_w: tuple[int, ...]
    peak_state: tuple[int, ...]
    solver: SolverReport
    cost_name: str = "unit"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def degradation(self) -> float:
        """Iteration time over fault-free 1F1B's (what DeepSpeed runs today), minus 1."""
        return self.iteration_time / self.fault_free_iteration_time - 1.0

    @property
    def degradation_vs_best(self) -> float:
        """Iteration time over the best fault-free schedule's (decoupled, same optimizer), minus 1."""
        return self.iteration_time / self.best_fault_free_iteration_time - 1.0

    @property
    def gap_to_bound(self) -> float:
        """Iteration time over the lower bound, minus 1 (0 = provably optimal)."""
        return self.iteration_time / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0


    def to_dict(self, *, with_schedule: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dp": self.dp,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "failed": [format_worker(w) for w in self.failed],
            "variant": self.variant,
            "cost_model": self.cost_name,
            "fault_free_iteration_time": self.fault_free_iteration_time,
            "best_fault_free_iteration_time": self.best_fault_free_iteration_time,
            "iteration_time": self.iteration_time,
            "degradation": self.degradation,
            "degradation_vs_best": self.degradation_vs_best,
            "lower_bound": self.lower_bound,
            "gap_to_bound": self.gap_to_bound,
            "memory_cap": self.memory_cap,
            "peak_activations": list(self.peak_activations),
            "peak_pending_w": list(self.peak_pending_w),
            "peak_state": list(self.peak_state),
            "solver": self.solver.to_dict(),
        }
        out.update(self.extra)
        if with_schedule:
            out["schedule"] = self.schedule.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        known = {
            "dp", "pp", "microbatches", "failed", "variant", "cost_model", "fault_free_iteration_time",
            "best_fault_free_iteration_time", "iteration_time", "degradation", "degradation_vs_best",
            "lower_bound", "gap_to_bound", "memory_cap", "peak_activations", "peak_pending_w", "peak_state", "solver",
            "schedule",
        }
        return cls(
            dp=data["dp"],
            pp=data["pp"],
            microbatches=data["microbatches"],
            failed=tuple(parse_worker(w) for w in data["failed"]),
            variant=data["variant"],
            schedule=Schedule.from_dict(data["schedule"]),
            iteration_time=data["iteration_time"],
            fault_free_iteration_time=data["fault_free_iteration_time"],
            best_fault_free_iteration_time=data["best_fault_free_iteration_time"],
            lower_bound=data["lower_bound"],
            memory_cap=data["memory_cap"],
            peak_activations=tuple(data["peak_activations"]),
            peak_pending_w=tuple(data["peak_pending_w"]),
            peak_state=tuple(data["peak_state"]),
            solver=SolverReport(**data["solver"]),
            cost_name=data.get("cost_model", "unit"),
            extra={k: v for k, v in data.items() if k not in known},
        )


def iteration_time(schedule: Schedule, cost: CostModel, variant: str) -> float:
    """The iteration time the timeline replay gives ``schedule`` under ``variant``'s semantics.

    ``recycle``: the steady-state period of :data:`STEADY_ITERATIONS` back-to-back iterations with
    the staggered optimizer; otherwise one iteration's makespan.
    """
    if variant == "recycle":
        result = replay(schedule, cost, repeat=STEADY_ITERATIONS)
        if result.blocked:
            raise PlanningError(f"{variant} schedule deadlocks when repeated")
        return steady_period(iteration_ends(schedule, result.ends, STEADY_ITERATIONS))
    result = replay(schedule, cost)
    if result.blocked:
        raise PlanningError(f"{variant} schedule deadlocks")
    return result.makespan


def _check_variant(variant: str, solver: str) -> None:
    if variant not in VARIANTS:
        raise PlanningError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
    if solver not in SOLVERS:
        raise PlanningError(f"unknown solver {solver!r}; allowed: {', '.join(SOLVERS)}")


@lru_cache(maxsize=64)
def _fault_free_times(dp: int, pp: int, microbatches: int, cost: CostModel, variant: str) -> tuple[float, float]:
    base = iteration_time(one_f_one_b(dp, pp, microbatches), cost, "adaptive")
    best = decoupled(dp, pp, microbatches, cost)
    if variant == "recycle":
        best = replace(best, optimizer="staggered")
    best_time = iteration_time(best, cost, variant)
    return base, min(base, best_time)


def _heuristic(
    topology: Topology, microbatches: int, cost: CostModel, variant: str, memory_cap: int
) -> tuple[Schedule, float]:
    """Best list schedule over a few splits of the memory cap between activations and pending W."""
    dp, pp = topology.dp, topology.pp
    n = dp * pp
    assignment = reroute_assignment(topology, microbatches)
    failed = frozenset(topology.worker_index(w) for w in topology.failed)
    split = variant != "adaptive"
    optimizer = "staggered" if variant == "recycle" else "global"
    if not split:
        candidates: list[int | None] = [None]
    elif dp * pp * microbatches > _LARGE_GRID:
        candidates = [memory_cap]  # one list schedule: large tables stay fast
    else:
        candidates = sorted({memory_cap, max(1, memory_cap // 2), max(1, (3 * memory_cap) // 4), min(pp, memory_cap)})
    best: tuple[Schedule, float] | None = None
    for w_cap in candidates:
        result = list_schedule(
            dp=dp,
            pp=pp,
            microbatches=microbatches,
            cost=cost,
            assignment=assignment,
            split_backward=split,
            act_caps=[memory_cap] * n,
            w_caps=[w_cap] * n,
            mem_caps=[memory_cap] * n,
        )
        schedule = lower(
            result.orders,
            dp=dp,
            pp=pp,
            microbatches=microbatches,
            failed=failed,
            optimizer=optimizer,
            name=f"{variant}-heuristic",
        )
        value = iteration_time(schedule, cost, variant)
        if best is None or value < best[1] - 1e-9:
            best = (schedule, value)
    assert best is not None
    return best


def plan(
    dp: int,
    pp: int,
    microbatches: int,
    failed: Iterable[Worker] = (),
    *,
    cost: CostModel | None = None,
    variant: str = "recycle",
    solver: str = "heuristic",
    time_limit_s: float = 10.0,
    memory_cap: int | None = None,
) -> Plan:
    """Plan one failure set.

    Args:
        dp, pp, microbatches: the grid (micro-batches per pipeline).
        failed: failed workers; empty for the fault-free plan.
        cost: the cost model (unit costs by default).
        variant: one of :data:`VARIANTS`.
        solver: ``heuristic`` (list scheduling only) or ``cpsat`` (warm-started optimization).
        time_limit_s: the solver's time limit.
        memory_cap: micro-batch states per worker (default :func:`default_memory_cap`).

    Raises:
        PlanningError: out-of-range workers, a stage with no surviving replica, or bad options.
    """
    _check_variant(variant, solver)
    cost = cost or CostModel.unit()
    cost.check_stages(pp)
    try:
        topology = Topology(dp=dp, pp=pp).without(failed)
    except Exception as exc:  # TopologyError names the pipeline or stage
        raise PlanningError(f"bad failure set: {exc}") from exc
    cap = memory_cap if memory_cap is not None else default_memory_cap(pp)
    if cap < 1:
        raise PlanningError(f"memory_cap must be >= 1, got {cap}")
    started = time.perf_counter()
    schedule, value = _heuristic(topology, microbatches, cost, variant, cap)
    bound = lower_bound(topology, microbatches, cost, variant=variant)
    report = SolverReport(name="heuristic", status="feasible", gap=None, seconds=0.0)
    if solver == "cpsat" and value > bound + 1e-9:
        from .cpsat import improve

        improved = improve(
            topology, microbatches, cost, variant=variant, incumbent=schedule, memory_cap=cap, time_limit_s=time_limit_s
        )
        if improved.schedule is not None:
            v2 = iteration_time(improved.schedule, cost, variant)
            if v2 < value - 1e-9:
                schedule, value = improved.schedule, v2
        report = improved.report
    if value <= bound + 1e-9:
        report = replace(report, status="optimal", gap=0.0)
    report = replace(report, seconds=time.perf_counter() - started)
    validate(schedule, replayed=True)  # iteration_time() replayed it to completion
    acts, pending, state = memory_peaks(schedule)
    base, best = _fault_free_times(dp, pp, microbatches, cost, variant)
    return Plan(
        dp=dp,
        pp=pp,
        microbatches=microbatches,
        failed=tuple(sorted(topology.failed)),
        variant=variant,
        schedule=schedule.with_name(variant),
        iteration_time=value,
        fault_free_iteration_time=base,
        best_fault_free_iteration_time=best,
        lower_bound=bound,
        memory_cap=cap,
        peak_activations=acts,
        peak_pending_w=pending,
        peak_state=state,
        solver=report,
        cost_name=cost.name,
    )

