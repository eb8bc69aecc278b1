"""Plans for a slow worker: a partial failure, planned as one.

A worker at a fraction ``v`` of its speed (found by the engine's detector, runtime/stragglers.py)
holds its whole pipeline back: every iteration runs at its pace. ReCycle's re-routing moves a dead
worker's micro-batches to its data-parallel peers of the same stage; for a slow worker the planner
moves *some* of them: every stage's micro-batches are dealt to its workers in proportion to their
speeds (:func:`~.reroute.weighted_assignment`), listed with each worker's durations divided by its
speed, and replayed the same way. Same micro-batches, each run once, and the same gradients
summed: the math of the fault-free run. What it gives (:class:`SlowPlan`): the iteration time of
the fault-free schedule run with the slow worker (un-adapted), the plan's (adapted; never above the
un-adapted, as the unweighted placement is one of its candidates), the fault-free one, and the
work bound (each stage's work over its workers' summed speeds). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import ActionKind, Schedule, TiedGroups, check_tied, validate
from ..ir.timeline import iteration_time
from ..topology import Topology, Worker
from .memory import resolve_cap
from .planner import _gc_paused, _list_candidates, plan
from .reroute import reroute_assignment, weighted_assignment

__all__ = ["SlowPlan", "plan_slow", "work_bound"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowPlan:
    """A plan for slow workers (see the module docstring); times in the cost model's unit.

    Attributes:
        speeds: the slow workers and their speeds.
        schedule: the adapted schedule (every worker's actions).
        loads: per worker index, the micro-batches it runs per iteration.
        iteration_time: the adapted schedule's, replayed with the speeds.
        unadapted_time: the fault-free plan's schedule replayed with the speeds.
        healthy_time: the fault-free plan's, at full speed.
        bound: the work bound with the speeds.
    """

    speeds: tuple[tuple[Worker, float], ...]
    schedule: Schedule
    loads: tuple[int, ...]
    iteration_time: float
    unadapted_time: float
    healthy_time: float
    bound: float

    @property
    def recovered(self) -> float:
        """How far the plan goes from the un-adapted time toward the bound (1: all the way)."""
        gap = self.unadapted_time - self.bound
        return 1.0 if gap <= 0 else (self.unadapted_time - self.iteration_time) / gap


def work_bound(dp: int, pp: int, microbatches: int, cost: CostModel, speeds: Mapping[Worker, float]) -> float:
    """No iteration is shorter than its busiest stage's work over that stage's summed speeds."""
    out = 0.0
    for s, c in enumerate(cost.stages(pp)):
        capacity = sum(float(speeds.get(Worker(pipeline=p, stage=s), 1.0)) for p in range(dp))
        out = max(out, dp * microbatches * (c.t_f + c.t_b + c.t_w) / capacity)
    return out


def plan_slow(dp: int, pp: int, microbatches: int, speeds: Mapping[Worker, float], *, cost: CostModel | None = None,
              variant: str = "recycle", memory_cap: float | str | None = None, tied: TiedGroups = ()) -> SlowPlan:
    """The plan for ``speeds`` (slow workers and their fractions of full speed, in (0, 1)), within
    the memory cap (default: fault-free 1F1B's peak, as :func:`~.planner.plan`).

    Raises:
        PlanningError: a worker out of the grid, a speed outside (0, 1], or bad options.
    """
    if variant not in ("adaptive", "decoupled", "recycle"):
        raise PlanningError(f"variant {variant!r}; allowed for a slow worker: adaptive, decoupled, recycle")
    cost = cost or CostModel.unit()
    cost.check_stages(pp)
    tied = check_tied(tied, pp)
    topology = Topology(dp=dp, pp=pp)
    weighted = weighted_assignment(topology, microbatches, speeds)  # checks the workers and speeds
    per_worker = tuple(float(speeds.get(topology.worker(i), 1.0)) for i in range(dp * pp))
    with _gc_paused():
        healthy = plan(dp, pp, microbatches, cost=cost, variant=variant, memory_cap=memory_cap, tied=tied)
        cap = resolve_cap(dp, pp, microbatches, cost, memory_cap, tied, split_backward=variant != "adaptive")
        unadapted = iteration_time(healthy.schedule, cost, variant, per_worker)
        own = reroute_assignment(topology, microbatches)  # nobody moves: the un-adapted placement, re-listed
        schedule, value = _list_candidates(topology, microbatches, cost, variant, cap, tied, (),
                                           assignments=[weighted, own], speeds=per_worker)
    if unadapted < value:  # the fault-free schedule itself is a candidate
        schedule, value = healthy.schedule, unadapted
    validate(schedule)
    loads = tuple(sum(1 for a in actions if a.kind is ActionKind.F) for actions in schedule.workers)
    return SlowPlan(speeds=tuple(sorted(speeds.items())), schedule=schedule, loads=loads, iteration_time=value,
                    unadapted_time=unadapted, healthy_time=healthy.iteration_time,
                    bound=work_bound(dp, pp, microbatches, cost, speeds))
