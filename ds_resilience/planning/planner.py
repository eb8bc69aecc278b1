"""The ReCycle planner: the best schedule for one failure set, in three variants.

* ``adaptive``  re-routing only: fused backward, one global optimizer barrier per iteration;
* ``decoupled`` plus the decoupled backward (B now, W deferred into idle time);
* ``recycle``   plus the staggered optimizer: each stage steps when its own gradients are reduced and
  its next iteration may start right after. Its iteration time is the steady-state period of the
  schedule repeated :data:`STEADY_ITERATIONS` times, not one iteration's makespan.

Tied weights (``tied``, e.g. ``((0, 3),)`` for an embedding shared by the first and the last of 4
stages): every plan ends each surviving tied-stage worker's iteration with REDUCE_GRAD, then one
TIED_REDUCE per group holding its stage, then OPT_STEP; a re-routed survivor simply contributes the
gradients of the micro-batches it ran for its dead peer. Decision for the staggered optimizer: the
stages of a tied group cannot step before the group's reduce, so the last stage's step waits for
the first stage's final backward, and the first stage's step waits for the last stage's final W.
The replay measures this exactly, so plans and the simulator include it. What it costs: the last
stage can no longer run its deferred W's while the first stage starts the next iteration, so the
steady-state period is at least ``pp - 1`` forwards (plus links) plus the last stage's whole
iteration of work (:func:`~.bounds.tied_cycle_bound`, part of ``lower_bound``; the heuristic meets
it in the cases measured). With unit costs that bound lies ``(pp - 1) / (3 M)`` above the work
bound; measured: 3 x 4 x 6 fault-free 19 -> 21 (+10.5 %), one failure on the last stage 27 -> 30,
on another stage no change; 2 x 4 x 16 fault-free 48 -> 51 (+6 %). It shrinks as M grows.

The heuristic (list scheduling over a few memory splits) always answers in milliseconds; the CP-SAT
solver (:mod:`.cpsat`), warm-started from it, may improve one-iteration variants within a time
limit. Whatever produced it, a plan's schedule is validated and its claimed iteration time is the
timeline simulator's replay of it: the simulator is the judge. Python (plus OR-Tools); the list
scheduler's loop, the replay's and the validator's checks run in C where it builds (:mod:`..ir.native`),
the C list scheduler's tasks are lowered as arrays (:mod:`.lowering_arrays`), and Python's garbage
collector is paused during a plan. The fault-free figures every plan carries (1F1B's time and peak,
the best fault-free schedule's time) are computed on one pipeline, which gives the whole grid's
figures bit for bit (:func:`_best_fault_free_time`).
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import lru_cache
from typing import Iterable

from ..costs import CostModel
from ..errors import MemoryCapError, PlanningError, ScheduleError
from ..ir import Schedule, TiedGroups, check_tied, native, validate
from ..ir.timeline import STEADY_ITERATIONS, iteration_time, memory_peaks
from ..topology import Topology, Worker
from ..vocab import SOLVERS, VARIANT_CHOICES, VARIANTS
from .bounds import lower_bound
from .generators import check_grid, decoupled_candidates, one_f_one_b
from .list_scheduler import list_schedule
from .lowering import lower
from .lowering_arrays import lower_arrays
from .memory import fault_free_peak, resolve_cap, worker_peaks
from .plan import Plan, SolverReport
from .reroute import reroute_assignment
from .stage_mix import as_split, fusable_stages, fuse, fused_in, prefer_mixed, split_margin

__all__ = [
    "VARIANTS",
    "SOLVERS",
    "STEADY_ITERATIONS",
    "SolverReport",
    "Plan",
    "plan",
    "iteration_time",
    "one_f_one_b_time",
    "resolve_cap",
]

_LARGE_GRID = 2048
"""Above this many (pipeline, stage, micro-batch) items the heuristic tries one memory split only."""


@contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for the block (back on after, if it was on).

    A plan builds hundreds of thousands of small immutable objects (actions, tuples) and no
    reference cycles; each allocation burst made the collector scan every live object again. At
    D=64 x P=16 x M=64 that scanning was half of the plan's time. Nothing is leaked: the objects are
    freed by reference counting, and the collector runs normally after the plan."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _check_variant(variant: str, solver: str) -> None:
    if variant not in VARIANT_CHOICES:
        raise PlanningError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANT_CHOICES)}")
    if solver not in SOLVERS:
        raise PlanningError(f"unknown solver {solver!r}; allowed: {', '.join(SOLVERS)}")


@lru_cache(maxsize=256)
def one_f_one_b_time(dp: int, pp: int, microbatches: int, cost: CostModel, *, tied: TiedGroups = (),
                     one_pipeline: bool = True) -> float:
    """Iteration time of fault-free 1F1B (what DeepSpeed runs today) on the grid; cached.

    The one cache of this figure: every :class:`Plan` carries it (``fault_free_iteration_time``) and
    the failure-trace simulator's ``PlanCache`` asks for it here. ``tied``: the model's tied groups.
    Replayed on one pipeline (``one_pipeline``, the default; ``False``: the whole grid), which gives
    the same figure bit for bit: see :func:`_best_fault_free_time`.
    """
    check_grid(dp, pp, microbatches)
    return iteration_time(one_f_one_b(1 if one_pipeline else dp, pp, microbatches, tied=tied), cost, "adaptive")


@lru_cache(maxsize=64)
def _best_fault_free_time(
    dp: int, pp: int, microbatches: int, cost: CostModel, variant: str, tied: TiedGroups, memory_cap: float,
    one_pipeline: bool = True,
) -> float:
    """The best fault-free schedule under ``variant``'s rules and ``memory_cap``: the fault-free
    decoupled generator's (staggered optimizer for ``recycle``) if it fits the cap, the heuristic's
    own schedules for the empty failure set, and 1F1B if it fits. The same rules as the plans it is
    compared with (steady state for ``recycle``), so a degradation against it is a real one.
    Both the fully split and the mixed schedules count, whichever :func:`.stage_mix.prefer_mixed`
    would run: the best is the fastest replay, never one the margin chose for robustness.

    Computed on one pipeline (``one_pipeline``, the default; ``False``: the whole ``dp x pp`` grid,
    the reference). Fault-free, every pipeline is a copy of the first: it runs its own micro-batches
    on its own workers, its only messages are to its own neighbours (each pair of workers has its
    own link), and the list scheduler's choices on a worker depend on its own pipeline's arrivals
    only, under the same caps (taken from the whole grid's, see :func:`_list_candidates`). The
    pipelines meet only in collectives (REDUCE_GRAD of a stage, TIED_REDUCE, a global OPT_STEP, the
    step check's norms), whose durations do not depend on ``dp`` and whose members all arrive at
    the same instant, computed by the same double operations. So one pipeline's schedules have the
    same peaks and replay to the same times, bit for bit, for ``1 / dp`` of the work: at D=64, P=16,
    M=64, about 2,000 actions per worker grid instead of 130,000 (``tests/unit/planning/
    test_fault_free_symmetry.py`` holds the two paths equal over a grid of shapes and cost models)."""
    grid = 1 if one_pipeline else dp
    times = []
    for schedule in decoupled_candidates(grid, pp, microbatches, cost, tied=tied):
        if schedule is None:
            continue
        if variant == "recycle":
            schedule = replace(schedule, optimizer="staggered")
        if max(worker_peaks(schedule, cost)) <= memory_cap + 1e-9:
            times.append(iteration_time(schedule, cost, variant))
    if fault_free_peak(dp, pp, microbatches, cost, tied, one_pipeline=one_pipeline) <= memory_cap + 1e-9:
        times.append(one_f_one_b_time(dp, pp, microbatches, cost, tied=tied, one_pipeline=one_pipeline))
    candidates = _heuristic_candidates(Topology(dp=dp, pp=pp), microbatches, cost, variant, memory_cap, tied,
                                       one_pipeline=one_pipeline)
    times.extend(t for _, t in candidates)
    return min(times)


def _choose(candidates: list[tuple[Schedule, float]], cost: CostModel) -> tuple[Schedule, float]:
    """The fully split candidate, or the mixed one (second, if any) where :func:`.stage_mix.prefer_mixed`
    says so under ``cost``'s margin: one rule for the heuristic's candidates and for the solver's."""
    if len(candidates) == 2 and prefer_mixed(candidates[1][1], candidates[0][1], split_margin(cost)):
        return candidates[1]
    return candidates[0]


def _heuristic_candidates(
    topology: Topology, microbatches: int, cost: CostModel, variant: str, memory_cap: float, tied: TiedGroups = (),
    *, one_pipeline: bool = False,
) -> list[tuple[Schedule, float]]:
    """The heuristic's candidates: the best list schedule over a few splits of the memory cap
    between activations and pending W (as fractions of the pending W's that fit: all, three
    quarters, half, and at most ``pp``), each timed under ``cost``, fully split; then, where
    ``variant`` may fuse costly stages (:func:`.stage_mix.fusable_stages`), the same with those
    stages fused (the mixed one). :func:`_choose` picks between them. ``one_pipeline``: see
    :func:`_list_candidates`."""
    out = [_list_candidates(topology, microbatches, cost, variant, memory_cap, tied, (), one_pipeline)]
    costly = fusable_stages(cost, topology.pp, variant)
    if costly:
        out.append(_list_candidates(topology, microbatches, cost, variant, memory_cap, tied, costly, one_pipeline))
    return out


def _solved(
    topology: Topology, microbatches: int, cost: CostModel, variant: str, memory_cap: float,
    candidates: list[tuple[Schedule, float]], time_limit_s: float,
) -> tuple[list[tuple[Schedule, float]], SolverReport]:
    """CP-SAT (:mod:`.cpsat`) on each of the heuristic's candidates, warm-started from it, within its
    own family: the fully split schedules, and the mixed ones, searched as split schedules under
    :func:`.stage_mix.as_split` and fused back. So :func:`_choose` applies the same margin to the
    solver's schedules as to the heuristic's (a split found slightly faster does not displace a
    mixed plan the margin kept). The time limit is shared between the families. The report is
    ``optimal`` only when every family's search is."""
    from .cpsat import improve

    stages = [(), fusable_stages(cost, topology.pp, variant)][: len(candidates)]
    out, reports = [], []
    for (schedule, value), fused in zip(candidates, stages):
        model = as_split(cost, fused, topology.pp)
        improved = improve(topology, microbatches, model, variant=variant, incumbent=schedule, memory_cap=memory_cap,
                           time_limit_s=time_limit_s / len(candidates))
        reports.append(improved.report)
        if improved.schedule is not None:
            found = fuse(improved.schedule, fused)
            if max(worker_peaks(found, cost)) <= memory_cap + 1e-9:
                v2 = iteration_time(found, cost, variant)
                if v2 < value - 1e-9:
                    schedule, value = found, v2
        out.append((schedule, value))
    if len(reports) == 1:
        return out, reports[0]
    optimal = all(r.status == "optimal" for r in reports)
    gaps = [r.gap for r in reports if r.gap is not None]
    return out, SolverReport(name="cpsat", status="optimal" if optimal else "feasible",
                             gap=0.0 if optimal else (max(gaps) if gaps else None),
                             seconds=sum(r.seconds for r in reports))


def _list_candidates(
    topology: Topology, microbatches: int, cost: CostModel, variant: str, memory_cap: float, tied: TiedGroups,
    fused: tuple[int, ...], one_pipeline: bool = False, assignments: list[dict] | None = None,
    speeds: tuple[float, ...] | None = None,
) -> tuple[Schedule, float]:
    """:func:`_heuristic_candidates`' candidate with the stages ``fused`` run fused: listed as split stages
    under :func:`.stage_mix.as_split` (a W there lasts nothing and runs at once), then fused back.

    ``one_pipeline`` (fault-free ``topology`` only): the caps and the candidate splits are the whole
    grid's (they depend on ``dp``: the pending-W cap of a stage with weightless W's, and the
    one-split rule of large grids), then only the first pipeline is listed and timed. The schedule
    returned is that one pipeline's; its time is the whole grid's (:func:`_best_fault_free_time`).

    ``assignments``: the placements to list (default: the re-routings of ``topology``'s failures);
    ``speeds``: per worker, the fraction of its compute speed (stragglers: planning/stragglers.py),
    listed and timed in Python (the C loops have no per-worker speed)."""
    real, cost = cost, as_split(cost, fused, topology.pp)
    dp, pp = topology.dp, topology.pp
    n = dp * pp
    one_pipeline = one_pipeline and dp > 1
    if one_pipeline and topology.failed:
        raise PlanningError("internal error: one pipeline stands for the grid only without a failure")
    given = assignments is not None
    if assignments is None:
        assignments = [reroute_assignment(Topology(dp=1, pp=pp) if one_pipeline else topology, microbatches)]
    if topology.failed and dp * pp * microbatches <= _LARGE_GRID and not given:
        other = reroute_assignment(topology, microbatches, ties="last")
        if other != assignments[0]:
            assignments.append(other)
    failed = frozenset(topology.worker_index(w) for w in topology.failed)
    split = variant != "adaptive"
    optimizer = "staggered" if variant == "recycle" else "global"
    per_stage = cost.memory_weights(pp)
    weights = [per_stage[w // dp] for w in range(n)]
    act_caps = [max(1, int(memory_cap // max(a, 1e-300) + 1e-9)) for a, _ in weights]
    fit_w = [max(1, int(memory_cap // w_w + 1e-9)) if w_w > 0 else microbatches * dp for _, w_w in weights]
    fit_w = [1 if w // dp in fused else f for w, f in enumerate(fit_w)]  # a fused stage's W follows its B
    candidates: list[tuple[int | None, ...]]
    if not split:
        candidates = [(None,) * n]
    elif dp * pp * microbatches > _LARGE_GRID:
        candidates = [tuple(fit_w)]  # one list schedule: large tables stay fast
    else:  # distinct ones, in this order
        candidates = list(dict.fromkeys([tuple(fit_w), *(tuple(max(1, int(f * x)) for f in fit_w) for x in (0.75, 0.5)),
                                         tuple(min(pp, f) for f in fit_w)]))
    if one_pipeline:  # the whole grid's caps, on its first pipeline (every other is its copy)
        act_caps, weights = _first_pipeline(act_caps, dp, pp), _first_pipeline(weights, dp, pp)
        candidates = [tuple(_first_pipeline(list(c), dp, pp)) for c in candidates]
        dp, n = 1, pp
    best: tuple[Schedule, float] | None = None
    for assignment, w_caps in ((a, c) for a in assignments for c in candidates):
        listing = dict(dp=dp, pp=pp, microbatches=microbatches, cost=cost, assignment=assignment,
                       split_backward=split, act_caps=act_caps, w_caps=list(w_caps), mem_caps=[memory_cap] * n,
                       mem_weights=weights)
        lowering = dict(dp=dp, pp=pp, microbatches=microbatches, failed=failed, optimizer=optimizer,
                        name=f"{variant}-heuristic", tied=tied)
        # the C list scheduler's tasks lowered as arrays (lowering_arrays), else the same in Python
        raw = native.list_orders(**listing, start_times=None, raw=True) if speeds is None else None
        schedule = lower_arrays(raw[0], **lowering) if raw is not None else None
        if schedule is None:
            schedule = lower(list_schedule(**listing, speeds=speeds).orders, **lowering)
        schedule = fuse(schedule, fused)
        value = iteration_time(schedule, real, variant, speeds)
        if best is None or value < best[1] - 1e-9:
            best = (schedule, value)
    assert best is not None
    return best


def _first_pipeline(values: list, dp: int, pp: int) -> list:
    """Of per-worker ``values`` of a ``dp x pp`` grid (stage-major), the first pipeline's."""
    return [values[s * dp] for s in range(pp)]


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
    memory_cap: float | str | None = None,
    tied: TiedGroups = (),
) -> Plan:
    """Plan one failure set.

    Args:
        dp, pp, microbatches: the grid (micro-batches per pipeline).
        failed: failed workers; empty for the fault-free plan.
        cost: the cost model (unit costs by default).
        variant: one of :data:`VARIANTS`, or ``"auto"``: all three, and the fastest the cost model
            predicts within the memory cap (ties to the simpler one: fused before decoupled before
            staggered); its ``extra["variant_choice"]`` holds every variant's predicted time (or
            why it could not be planned).
        solver: ``heuristic`` (list scheduling only) or ``cpsat`` (warm-started optimization).
        time_limit_s: the solver's time limit.
        memory_cap: the memory a worker's micro-batch states may take, in the cost model's memory
            unit (bytes with a profiled model, else states), or a size such as ``"24GiB"``;
            default: fault-free 1F1B's peak (:func:`~.memory.resolve_cap`).
        tied: the model's tied groups (sorted stage tuples, e.g. ``((0, 3),)``): every surviving
            worker of a group's stages runs its TIED_REDUCE after REDUCE_GRAD, before OPT_STEP
            (see the module docstring for what it costs the staggered optimizer).

    Raises:
        PlanningError: out-of-range workers, a stage with no surviving replica, bad tied groups,
            or bad options.
    """
    with _gc_paused():
        return _plan(dp, pp, microbatches, failed, cost=cost, variant=variant, solver=solver,
                     time_limit_s=time_limit_s, memory_cap=memory_cap, tied=tied)


def _plan(dp: int, pp: int, microbatches: int, failed: Iterable[Worker], *, cost: CostModel | None, variant: str,
          solver: str, time_limit_s: float, memory_cap: float | str | None, tied: TiedGroups) -> Plan:
    """:func:`plan`'s body (with the garbage collector paused around it)."""
    _check_variant(variant, solver)
    if variant == "auto":
        return _best_variant(dp, pp, microbatches, tuple(failed), cost=cost, solver=solver, time_limit_s=time_limit_s,
                             memory_cap=memory_cap, tied=tied)
    cost = cost or CostModel.unit()
    cost.check_stages(pp)
    try:
        tied = check_tied(tied, pp)
    except ScheduleError as exc:
        raise PlanningError(f"bad tied groups: {exc}") from exc
    try:
        topology = Topology(dp=dp, pp=pp).without(failed)
    except Exception as exc:  # TopologyError names the pipeline or stage
        raise PlanningError(f"bad failure set: {exc}") from exc
    cap = resolve_cap(dp, pp, microbatches, cost, memory_cap, tied, split_backward=variant != "adaptive")
    started = time.perf_counter()
    candidates = _heuristic_candidates(topology, microbatches, cost, variant, cap, tied)
    schedule, value = _choose(candidates, cost)
    bound = lower_bound(topology, microbatches, cost, variant=variant, tied=tied, memory_cap=cap)
    report = SolverReport(name="heuristic", status="feasible", gap=None, seconds=0.0)
    if solver == "cpsat" and value > bound + 1e-9:
        candidates, report = _solved(topology, microbatches, cost, variant, cap, candidates, time_limit_s)
        schedule, value = _choose(candidates, cost)
        if len(candidates) == 2 and value > min(t for _, t in candidates) + 1e-9:
            report = replace(report, status="feasible")  # the margin kept the slower family
    if value <= bound + 1e-9:
        report = replace(report, status="optimal", gap=0.0)
    report = replace(report, seconds=time.perf_counter() - started)
    validate(schedule, replayed=True)  # iteration_time() replayed it to completion
    acts, pending, state = memory_peaks(schedule)
    peaks = worker_peaks(schedule, cost)
    if max(peaks) > cap + 1e-9:  # the list scheduler and the solver both hold the cap: a bug if not
        raise PlanningError(f"internal error: plan peaks at {max(peaks)} over the memory cap {cap}")
    base = one_f_one_b_time(dp, pp, microbatches, cost, tied=tied)
    # a re-routed schedule is also a valid fault-free one (the failed worker idles), so the best
    # fault-free figure is never above the plan itself: degradation_vs_best is never negative
    best = min(_best_fault_free_time(dp, pp, microbatches, cost, variant, tied, cap), value)
    # a split variant's plan that runs some stages fused (stage_mix) says which; only the fusable
    # stages can be (a split variant's list schedule emits no BW), so without them there is no scan
    fused = fused_in(schedule) if fusable_stages(cost, pp, variant) else []
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
        memory_unit=cost.memory_unit,
        peak_memory=peaks,
        peak_activations=acts,
        peak_pending_w=pending,
        peak_state=state,
        solver=report,
        cost_name=cost.name,
        extra={"fused_stages": fused} if fused else {},
    )


def _best_variant(dp: int, pp: int, microbatches: int, failed: tuple[Worker, ...], *, solver: str,
                  **options) -> Plan:
    """``variant="auto"``: every variant planned, the fastest kept (see :func:`plan`).

    With CP-SAT, each variant is first planned by the heuristic; then, from the fastest heuristic
    plan on, a variant goes to CP-SAT only if its lower bound leaves room to beat (or, for a
    simpler variant, to tie) the best plan found so far. A variant ruled out by its bound keeps
    the heuristic's figure in ``variant_choice``: CP-SAT could not have made it the choice, so the
    plan chosen is the one an exhaustive search with the same solver would choose, for the cost
    of one CP-SAT run where the bound separates the variants (instead of three)."""
    choice: dict[str, float | str] = {}
    plans: dict[str, Plan] = {}
    errors = []
    for v in VARIANTS:
        try:
            plans[v] = plan(dp, pp, microbatches, failed, variant=v, solver="heuristic", **options)
        except MemoryCapError as exc:  # only the memory cap rules a variant out; the rest is the set's
            choice[v] = f"not planned: {exc}"
            errors.append(str(exc))
    if not plans:
        raise PlanningError("no variant fits the memory cap: " + "; ".join(errors))
    rank = {v: k for k, v in enumerate(VARIANTS)}  # ties go to the simpler variant

    def better(a: str, b: str) -> bool:
        ta, tb = plans[a].iteration_time, plans[b].iteration_time
        return ta < tb - 1e-12 or (abs(ta - tb) <= 1e-12 and rank[a] < rank[b])

    best: str | None = None
    solved = []
    for v in sorted(plans, key=lambda v: (plans[v].iteration_time, rank[v])):
        heuristic = plans[v]
        if solver != "heuristic" and heuristic.iteration_time > heuristic.lower_bound + 1e-9:
            incumbent = plans[best].iteration_time if best is not None else float("inf")
            room = heuristic.lower_bound < incumbent - 1e-12 or (
                heuristic.lower_bound <= incumbent + 1e-12 and rank[v] < rank[best])
            if room:
                plans[v] = plan(dp, pp, microbatches, failed, variant=v, solver=solver, **options)
                solved.append(v)
        if best is None or better(v, best):
            best = v
    for v, p in plans.items():
        choice[v] = p.iteration_time
    chosen = plans[best]
    extra = {**chosen.extra, "variant_choice": {v: choice[v] for v in VARIANTS if v in choice}}
    if solver != "heuristic":
        extra["variant_solved"] = solved  # the variants CP-SAT searched (the rest: bound >= best)
    return replace(chosen, extra=extra)
