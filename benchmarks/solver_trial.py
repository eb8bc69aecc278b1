"""Solver trial: the same re-routed pipeline-scheduling instance in CP-SAT, HiGHS and CBC.

    .venv/bin/python benchmarks/solver_trial.py [--time-limit 20] [--threads 1] [--horizon work|greedy]

The problem the planner's optimizer will solve: minimise the iteration makespan of a pipeline
schedule in which a failed worker's micro-batches run on a surviving peer of the same stage.
Tasks F, B, W per (pipeline, stage, micro-batch), each on a fixed worker; precedences
F(s) -> F(s+1), F(last) -> B(last), B(s+1) -> B(s), B -> W; no two tasks overlap on a worker;
unit durations, free communication (no activation cap here).

Formulations (the same tasks, precedences and horizon for all three):

* CP-SAT: one interval variable per task, ``AddNoOverlap`` per worker, integer starts.
* HiGHS (highspy) and CBC (PuLP): continuous starts, one binary per pair of tasks on a worker with
  big-M disjunctions (pairs already ordered by a precedence chain, F < B < W of one micro-batch,
  get no binary). The big-M is the horizon.

The horizon (and big-M) is by default the sum of all durations, a valid bound that needs no
heuristic (``--horizon greedy`` uses the list scheduler's makespan instead; on these instances it
already equals the optimum, which leaves the MILPs no slack to find any incumbent). The greedy list
scheduler's makespan and a simple lower bound (the peer's doubled load plus its earliest start) are
printed as a reference row. Each run is a fresh process (ortools 9.15 and highspy 1.15 each bundle
an incompatible ``libhighs.so.1`` and cannot be loaded into one interpreter) with a wall-clock
limit; "optimal" means the solver proved it, "feasible" that it stopped at the limit with an
incumbent (with its best bound where the API exposes one). Pure CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_resilience.costs import CostModel  # noqa: E402
from ds_resilience.planning import list_schedule  # noqa: E402

Task = tuple[str, int, int, int]  # (kind, pipeline, stage, microbatch)


@dataclass(frozen=True)
class Instance:
    name: str
    dp: int
    pp: int
    mbs: int
    failed: tuple[int, int]  # (pipeline, stage)

    @property
    def peer(self) -> tuple[int, int]:
        """The survivor that takes the failed worker's micro-batches: pipeline 0 (or 1) of that stage."""
        p, s = self.failed
        return (0 if p != 0 else 1, s)

    def worker(self, p: int, s: int) -> tuple[int, int]:
        return self.peer if (p, s) == self.failed else (p, s)


def build(inst: Instance) -> tuple[dict[Task, int], dict[Task, tuple[int, int]], list[tuple[Task, Task]]]:
    """Durations, worker of each task, and precedence pairs (a before b)."""
    dur: dict[Task, int] = {}
    where: dict[Task, tuple[int, int]] = {}
    prec: list[tuple[Task, Task]] = []
    last = inst.pp - 1
    for p in range(inst.dp):
        for s in range(inst.pp):
            for m in range(inst.mbs):
                for k in "FBW":
                    dur[(k, p, s, m)] = 1
                    where[(k, p, s, m)] = inst.worker(p, s)
                if s < last:
                    prec.append((("F", p, s, m), ("F", p, s + 1, m)))
                    prec.append((("B", p, s + 1, m), ("B", p, s, m)))
                else:
                    prec.append((("F", p, s, m), ("B", p, s, m)))
                prec.append((("B", p, s, m), ("W", p, s, m)))
    return dur, where, prec


def by_worker(where: dict[Task, tuple[int, int]]) -> dict[tuple[int, int], list[Task]]:
    out: dict[tuple[int, int], list[Task]] = {}
    for t, w in where.items():
        out.setdefault(w, []).append(t)
    return out


def disjunctive_pairs(where: dict[Task, tuple[int, int]]) -> list[tuple[Task, Task]]:
    """Pairs on one worker whose order is not already fixed (F < B < W of one micro-batch is)."""
    return [
        (a, b)
        for tasks in by_worker(where).values()
        for a, b in combinations(sorted(tasks), 2)
        if a[1:] != b[1:]
    ]


def greedy(inst: Instance) -> float:
    """Makespan of the project's list scheduler on the same placement (the horizon)."""
    index = lambda p, s: s * inst.dp + p  # noqa: E731
    assignment = {
        (p, s, m): index(*inst.worker(p, s)) for p in range(inst.dp) for s in range(inst.pp) for m in range(inst.mbs)
    }
    n = inst.dp * inst.pp
    result = list_schedule(
        dp=inst.dp, pp=inst.pp, microbatches=inst.mbs, cost=CostModel.unit(), assignment=assignment,
        split_backward=True, act_caps=[inst.pp * inst.mbs * 2] * n, w_caps=[None] * n,
    )
    return result.makespan


# --- solvers: each returns (makespan, status, best bound) -----------------------------------
def solve_cpsat(inst: Instance, horizon: int, limit: float, threads: int):
    from ortools.sat.python import cp_model

    dur, where, prec = build(inst)
    m = cp_model.CpModel()
    start = {t: m.NewIntVar(0, horizon - d, f"s{t}") for t, d in dur.items()}
    ivs = {t: m.NewFixedSizeIntervalVar(start[t], d, f"i{t}") for t, d in dur.items()}
    for a, b in prec:
        m.Add(start[a] + dur[a] <= start[b])
    for tasks in by_worker(where).values():
        m.AddNoOverlap([ivs[t] for t in tasks])
    cmax = m.NewIntVar(0, horizon, "cmax")
    for t, d in dur.items():
        m.Add(cmax >= start[t] + d)
    m.Minimize(cmax)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = limit
    solver.parameters.num_workers = threads
    code = solver.Solve(m)
    status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible"}.get(code, solver.StatusName(code).lower())
    value = solver.ObjectiveValue() if code in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    return value, status, solver.BestObjectiveBound()


def solve_highs(inst: Instance, horizon: int, limit: float, threads: int):
    import highspy

    dur, where, prec = build(inst)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(limit))
    h.setOptionValue("threads", threads)
    start = {t: h.addVariable(lb=0, ub=horizon - d) for t, d in dur.items()}
    cmax = h.addVariable(lb=0, ub=horizon)
    for a, b in prec:
        h.addConstr(start[a] + dur[a] <= start[b])
    for a, b in disjunctive_pairs(where):
        y = h.addBinary()  # y = 1: a before b
        h.addConstr(start[a] + dur[a] - start[b] - horizon * (1 - y) <= 0)
        h.addConstr(start[b] + dur[b] - start[a] - horizon * y <= 0)
    for t, d in dur.items():
        h.addConstr(start[t] + d <= cmax)
    h.minimize(cmax)
    ms = h.getModelStatus()
    info = h.getInfo()
    has_sol = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if ms == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif has_sol:
        status = "feasible"
    elif ms == highspy.HighsModelStatus.kTimeLimit:
        status = "no incumbent"
    else:
        status = h.modelStatusToString(ms).lower()
    return (info.objective_function_value if has_sol else None), status, info.mip_dual_bound


def solve_cbc(inst: Instance, horizon: int, limit: float, threads: int):
    import pulp

    dur, where, prec = build(inst)
    prob = pulp.LpProblem("pipeline", pulp.LpMinimize)
    start = {t: pulp.LpVariable(f"s_{'_'.join(map(str, t))}", 0, horizon - d) for t, d in dur.items()}
    cmax = pulp.LpVariable("cmax", 0, horizon)
    prob += cmax
    for a, b in prec:
        prob += start[a] + dur[a] <= start[b]
    for i, (a, b) in enumerate(disjunctive_pairs(where)):
        y = pulp.LpVariable(f"y{i}", cat="Binary")
        prob += start[a] + dur[a] <= start[b] + horizon * (1 - y)
        prob += start[b] + dur[b] <= start[a] + horizon * y
    for t, d in dur.items():
        prob += start[t] + d <= cmax
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, threads=threads)
    prob.solve(solver)
    value = pulp.value(prob.objective) if prob.sol_status in (1, 2) else None
    # PuLP reports "Optimal" with sol_status 1 only when CBC proved it; 2 = stopped with a solution.
    fallback = "no incumbent" if prob.sol_status == 0 else pulp.LpStatus[prob.status].lower()
    status = {1: "optimal", 2: "feasible"}.get(prob.sol_status, fallback)
    return value, status, None  # PuLP exposes no bound from CBC


SOLVERS = {"CP-SAT (ortools)": solve_cpsat, "HiGHS (highspy)": solve_highs, "CBC (PuLP)": solve_cbc}
INSTANCES = (
    Instance(name="2x3 mb4 fail(1,1)", dp=2, pp=3, mbs=4, failed=(1, 1)),
    Instance(name="3x4 mb6 fail(1,3)", dp=3, pp=4, mbs=6, failed=(1, 3)),
)


def load_bound(inst: Instance) -> int:
    """A simple valid lower bound: the peer's load plus its stage's earliest start (unit costs)."""
    _, s = inst.failed
    return s + 2 * inst.mbs * 3


def horizon_of(inst: Instance, mode: str) -> int:
    """The time horizon (and big-M): ``work`` = sum of all durations (a serial schedule, needs no
    heuristic); ``greedy`` = the list scheduler's makespan (tight; here it equals the optimum)."""
    if mode == "greedy":
        return int(greedy(inst))
    return sum(build(inst)[0].values())


def run_one(solver: str, instance: int, limit: float, threads: int, horizon_mode: str) -> None:
    """Child-process mode: solve one (solver, instance) pair and print one JSON line."""
    inst = INSTANCES[instance]
    horizon = horizon_of(inst, horizon_mode)
    t0 = time.perf_counter()
    value, status, bound = SOLVERS[solver](inst, horizon, limit, threads)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"value": value, "status": status, "bound": bound, "time": elapsed}))


def spawn(
    solver: str, instance: int, limit: float, threads: int, horizon: str
) -> tuple[float | None, str, float | None, float]:
    """Run one solver in a fresh interpreter (ortools and highspy both bundle an incompatible
    libhighs.so.1, so they cannot be loaded into one process)."""
    cmd = [sys.executable, __file__, "--one", solver, str(instance), "--time-limit", str(limit),
           "--threads", str(threads), "--horizon", horizon]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit + 60)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"error: {tail[:60]}", None, float("nan")
    r = json.loads(lines[-1])
    return r["value"], r["status"], r["bound"], r["time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solver run [20]")
    ap.add_argument("--threads", type=int, default=1, help="threads per solver [1, for a fair comparison]")
    ap.add_argument("--horizon", choices=("work", "greedy"), default="work",
                    help="big-M/horizon: sum of all durations [work] or the greedy makespan")
    ap.add_argument("--one", nargs=2, metavar=("SOLVER", "INSTANCE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run_one(args.one[0], int(args.one[1]), args.time_limit, args.threads, args.horizon)
        return
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, python {platform.python_version()}")
    print(f"time limit {args.time_limit:g}s per run, {args.threads} thread(s) per solver, "
          f"horizon/big-M = {args.horizon}, one fresh process per run; time = model build + solve\n")
    head = (f"{'instance':<20} {'solver':<17} {'vars(bin)':>10} {'makespan':>9} {'bound':>6} "
            f"{'status':<12} {'time s':>7}")
    print(head)
    print("-" * len(head))
    results: dict[str, list[tuple[float | None, str, float]]] = {name: [] for name in SOLVERS}
    for i, inst in enumerate(INSTANCES):
        g = greedy(inst)
        dur, where, _ = build(inst)
        nbin = len(disjunctive_pairs(where))
        print(f"{inst.name:<20} {'greedy (list)':<17} {'':>10} {g:>9g} {load_bound(inst):>6} {'heuristic':<12} {'':>7}")
        for name in SOLVERS:
            value, status, bound, elapsed = spawn(name, i, args.time_limit, args.threads, args.horizon)
            results[name].append((value, status, elapsed))
            shape = f"{len(dur) + 1}" if name.startswith("CP") else f"{len(dur) + 1}({nbin})"
            ms = "-" if value is None else f"{value:g}"
            bd = "-" if bound is None else f"{bound:.3g}"
            print(f"{'':<20} {name:<17} {shape:>10} {ms:>9} {bd:>6} {status:<12} {elapsed:>7.2f}", flush=True)
        print()
    # Recommendation: the solver that proves optimality on every instance, fastest in total.
    proven = {n: sum(r[2] for r in rs) for n, rs in results.items() if all(r[1] == "optimal" for r in rs)}
    if proven:
        best = min(proven, key=proven.get)
        others = ", ".join(
            f"{n}: {sum(r[1] == 'optimal' for r in rs)}/{len(rs)} proven in {sum(r[2] for r in rs):.1f}s"
            for n, rs in results.items() if n != best
        )
        print(f"recommendation: {best} -- proved every instance optimal in {proven[best]:.2f}s total ({others}).")
    else:
        print("recommendation: no solver proved every instance optimal within the limit; see the table.")


if __name__ == "__main__":
    main()
