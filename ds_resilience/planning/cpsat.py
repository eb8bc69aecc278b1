"""Optimizing solver: one iteration's schedule as a CP-SAT model, warm-started by the heuristic.

Variables: the start of every F, B and W (or fused BW) of every (pipeline, stage, micro-batch);
for a failed worker's micro-batches, also which surviving peer of the stage runs them (the three
passes run on the same peer). Constraints:

* precedence along the pipeline with the link time (latency + activation transfer): F(s) -> F(s+1),
  F(last) -> B(last), B(s+1) -> B(s), and B -> W on the same worker;
* no overlap of two tasks on one worker;
* memory: on each worker, the micro-batches between their F's start and their W's end (activations,
  then pending W state) fit ``memory_cap``, a cumulative constraint in which each weighs the larger
  of its stage's activation and pending-W memory (states or bytes, as the cost model counts; byte
  demands are rounded up and the capacity down, so the solver never overshoots the cap);
* the objective is the makespan of the compute (the reduce, tied-reduce and optimizer tail is
  added after it by lowering, with the incumbent's tied groups, and measured by the replay).

Times are scaled to integers. The heuristic's schedule is given as a hint, so the solver starts
from a feasible point; the caller keeps whichever schedule the simulator rates better. Used for the
one-iteration variants (``adaptive`` and ``decoupled``): the staggered variant's objective is a
steady-state period, which the heuristic reaches the work bound on in the cases measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Action, ActionKind, Schedule
from ..ir.timeline import simulate
from ..topology import Topology
from .lowering import lower
from .plan import SolverReport

__all__ = ["Improved", "improve"]

Key = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Improved:
    """The solver's schedule (``None`` if it found nothing) and its report."""

    schedule: Schedule | None
    report: SolverReport


def _scale(cost: CostModel, pp: int) -> float:
    values = [cost.p2p_latency + cost.transfer_time(cost.stage(s).activation_bytes) for s in range(pp)]
    for s in range(pp):
        c = cost.stage(s)
        values += [c.t_f, c.t_b, c.t_w, c.t_bw]
    for factor in (1, 10, 100, 1000):
        if all(abs(v * factor - round(v * factor)) < 1e-9 for v in values):
            return factor
    # measured times (a profile, in seconds): the shortest positive one becomes 1000 units, so
    # rounding moves nothing by more than 0.05% of it
    smallest = min((v for v in values if v > 0), default=1.0)
    return max(1000, 1000 / smallest)


def improve(
    topology: Topology,
    microbatches: int,
    cost: CostModel,
    *,
    variant: str,
    incumbent: Schedule,
    memory_cap: float,
    time_limit_s: float,
) -> Improved:
    """Search for a schedule with a shorter makespan than ``incumbent`` (see the module docstring)."""
    from ortools.sat.python import cp_model

    started = time.perf_counter()
    dp, pp = topology.dp, topology.pp
    split = variant != "adaptive"
    scale = _scale(cost, pp)

    def q(x: float) -> int:
        return int(round(x * scale))

    link = [q(cost.p2p_latency + cost.transfer_time(cost.stage(s).activation_bytes)) for s in range(pp)]
    dur = {s: (q(cost.stage(s).t_f), q(cost.stage(s).t_b), q(cost.stage(s).t_w)) for s in range(pp)}
    fused = {s: q(cost.stage(s).t_bw) for s in range(pp)}  # the fused backward (t_fused, or B + W)
    horizon = q(simulate(incumbent, cost).makespan) + 1

    # Where the incumbent runs each micro-batch, and its start times, for the hint.
    hint_start: dict[tuple[str, Key], int] = {}
    hint_worker: dict[Key, int] = {}
    timeline = simulate(incumbent, cost)
    for w, actions in enumerate(incumbent.workers):
        for a, start in zip(actions, timeline.starts[w]):
            if a.kind.is_compute:
                code = "B" if a.kind is ActionKind.BW else a.kind.value
                hint_start[(code, a.key)] = q(start)  # type: ignore[index]
                hint_worker[a.key] = w  # type: ignore[index]

    model = cp_model.CpModel()
    tasks: dict[tuple, object] = {}
    fixed_worker: dict[Key, int] = {}  # micro-batches with a single possible worker
    per_worker: dict[int, list] = {w: [] for w in range(dp * pp)}
    memory: dict[int, list] = {w: [] for w in range(dp * pp)}
    ends = []
    for p in range(dp):
        for s in range(pp):
            tf, tb, tw = dur[s]
            tb_total = tb if split else fused[s]
            peers = [topology.worker_index(x) for x in topology.stage_peers(s)]
            home = s * dp + p
            choices = [home] if home in peers else peers
            for m in range(microbatches):
                key = (p, s, m)
                if len(choices) == 1:
                    fixed_worker[key] = choices[0]
                f = model.NewIntVar(0, horizon, f"F{key}")
                b = model.NewIntVar(0, horizon, f"B{key}")
                tasks[("F", key)] = f
                tasks[("B", key)] = b
                model.Add(b >= f + tf)
                last_end = b + tb_total
                if split:
                    wv = model.NewIntVar(0, horizon, f"W{key}")
                    tasks[("W", key)] = wv
                    model.Add(wv >= b + tb)
                    last_end = wv + tw
                end = model.NewIntVar(0, horizon, f"end{key}")
                model.Add(end == last_end)
                ends.append(end)
                span = model.NewIntVar(0, horizon, f"span{key}")
                model.Add(span == end - f)
                for w in choices:
                    lit = model.NewConstant(1) if len(choices) == 1 else model.NewBoolVar(f"on{key}_{w}")
                    if len(choices) > 1:
                        tasks[("on", key, w)] = lit
                        model.AddHint(lit, 1 if hint_worker.get(key) == w else 0)
                    per_worker[w].append(model.NewOptionalIntervalVar(f, tf, f + tf, lit, f"iF{key}{w}"))
                    per_worker[w].append(model.NewOptionalIntervalVar(b, tb_total, b + tb_total, lit, f"iB{key}{w}"))
                    if split:
                        wv = tasks[("W", key)]
                        per_worker[w].append(model.NewOptionalIntervalVar(wv, tw, wv + tw, lit, f"iW{key}{w}"))
                    memory[w].append(model.NewOptionalIntervalVar(f, span, end, lit, f"mem{key}{w}"))
                if len(choices) > 1:
                    model.AddExactlyOne(tasks[("on", key, w)] for w in choices)
    for p in range(dp):
        for m in range(microbatches):
            for s in range(pp - 1):
                model.Add(tasks[("F", (p, s + 1, m))] >= tasks[("F", (p, s, m))] + dur[s][0] + link[s])
                tb_total = dur[s + 1][1] if split else fused[s + 1]
                model.Add(tasks[("B", (p, s, m))] >= tasks[("B", (p, s + 1, m))] + tb_total + link[s])
    for w, intervals in per_worker.items():
        if intervals:
            model.AddNoOverlap(intervals)
    weights = cost.memory_weights(pp)
    grain = 1.0 if not cost.has_memory else memory_cap / 10_000  # bytes in 10,000ths of the cap
    capacity = int(memory_cap / grain + 1e-9)
    for w, intervals in memory.items():
        if intervals:
            demand = int(-(-max(weights[w // dp]) // grain))
            model.AddCumulative(intervals, [demand] * len(intervals), capacity)
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, ends)
    model.Minimize(makespan)
    for (code, key), start in hint_start.items():
        var = tasks.get((code, key))
        if var is not None:
            model.AddHint(var, start)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    seconds = time.perf_counter() - started
    name = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(
        status, "unknown"
    )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Improved(None, SolverReport(name="cpsat", status=name, gap=None, seconds=seconds))
    objective = solver.ObjectiveValue()
    bound = solver.BestObjectiveBound()
    gap = 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)

    # Per-worker order by start time (ties: F before B before W, then micro-batch).
    rank = {"F": 0, "B": 1, "W": 2}
    placed: dict[int, list[tuple[int, int, int, Action]]] = {w: [] for w in range(dp * pp)}
    for (code, *rest), var in tasks.items():
        if code == "on":
            continue
        key = rest[0]
        p, s, m = key
        if key in fixed_worker:
            w = fixed_worker[key]
        else:
            w = next(x for x in range(s * dp, (s + 1) * dp) if ("on", key, x) in tasks and solver.Value(tasks[("on", key, x)]))
        kind = {"F": ActionKind.F, "B": ActionKind.B if split else ActionKind.BW, "W": ActionKind.W}[code]
        placed[w].append((solver.Value(var), rank[code], m, Action(kind=kind, stage=s, microbatch=m, pipeline=p)))
    orders = [[a for *_, a in sorted(placed[w], key=lambda t: t[:3])] for w in range(dp * pp)]
    schedule = lower(
        orders,
        dp=dp,
        pp=pp,
        microbatches=microbatches,
        failed=frozenset(topology.worker_index(w) for w in topology.failed),
        optimizer=incumbent.optimizer,
        name=f"{variant}-cpsat",
        tied=incumbent.tied,
    )
    status_name = name if gap > 0 or name == "optimal" else "optimal"
    return Improved(schedule, SolverReport(name="cpsat", status=status_name, gap=gap, seconds=seconds))

