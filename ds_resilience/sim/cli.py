"""``ds-resilience simulate``: replay a failure trace against ds_resilience and the baselines.

    ds-resilience simulate (--trace FILE | --mtbf 30m [--seed S]) --model NAME
                           [--systems all|a,b] [--slow [--slow-seed S] [--slow-gap 30m]
                           [--slow-duration 30m] [--slow-speeds 0.5,0.75] [--slow-die 0]]
                           [--json] [--png FILE]

Prints a table of average throughput (samples/s) and the time breakdown per system; ``--json``
prints ``{"model": ..., "trace": {...}, "systems": {name: {"throughput": ..., "breakdown": {...}}}}``.
Wire it with :func:`add_parser` (it sets ``handler=run``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..logs import progress_bar
from .jobsim import BREAKDOWN_KEYS, Result
from .models import PlanCache, list_models, load_model
from .systems import REGRID_TIERS, SYSTEMS, simulate_system
from .traces import SLOW_DURATION, SLOW_GAP, SLOW_SPEEDS, SimulationError, Trace, add_slow_events, load_trace, poisson_trace

__all__ = ["add_parser", "run", "parse_systems"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser("simulate", help="replay a failure trace: ds_resilience against Bamboo, Varuna, Oobleck, ...")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="trace file: 'ms,add|remove,node' csv or 'date, time, live' samples")
    source.add_argument("--mtbf", metavar="DURATION", help="generate Poisson failures with this mean gap (e.g. 30m, 6h)")
    p.add_argument("--seed", type=int, default=0, help="with --mtbf: random seed (default 0)")
    p.add_argument("--nodes", type=int, help="with --mtbf: nodes at the start (default: the model's cluster)")
    p.add_argument("--failures", type=int, help="with --mtbf: number of failures (default nodes/2, unless --duration)")
    p.add_argument("--duration", metavar="DURATION", help="with --mtbf: length of the job (e.g. 24h)")
    p.add_argument("--repair", metavar="DURATION", help="with --mtbf: failed nodes return after this mean time")
    known = ", ".join(list_models()) or "see configs/models"
    p.add_argument("--model", required=True, help=f"model profile name ({known}) or a profile .json path")
    p.add_argument("--cost", metavar="FILE",
                   help="a cost model (e.g. from ds-resilience profile): its measured B and W to F ratios replace "
                        "the model profile's backward_ratio and weight_ratio")
    p.add_argument("--systems", default="all", help=f"'all' or a comma list of: {', '.join(SYSTEMS)}")
    p.add_argument("--checkpoint-interval", type=int, default=10, metavar="N",
                   help="checkpoint_restart (and ReCycle's persistent checkpoint): every N iterations (default 10)")
    p.add_argument("--healthy", choices=("planned", "1f1b"), default="planned",
                   help="ds_resilience's schedule with no failure: the planner's plan (default) or DeepSpeed 1F1B")
    p.add_argument("--regrid", choices=REGRID_TIERS, default="templates",
                   help="ds_resilience beyond re-routing: restart every worker from the in-memory snapshots "
                        "(restart), re-grid the survivors onto a dp x pp grid (grid), or onto a grid or pipeline "
                        "templates (templates, default)")
    p.add_argument("--slow", action="store_true",
                   help="add seeded fail-slow episodes to the trace (a model calibrated to FALCON's 1.34x; "
                        "see docs/simulator.md)")
    p.add_argument("--slow-seed", type=int, default=0, help="with --slow: random seed (default 0)")
    p.add_argument("--slow-gap", default=SLOW_GAP, metavar="DURATION",
                   help=f"with --slow: mean gap between onsets, cluster-wide (default {SLOW_GAP})")
    p.add_argument("--slow-duration", default=SLOW_DURATION, metavar="DURATION",
                   help=f"with --slow: mean length of an episode (default {SLOW_DURATION})")
    p.add_argument("--slow-speeds", default=",".join(f"{v:g}" for v in SLOW_SPEEDS), metavar="V,V",
                   help="with --slow: speeds drawn uniformly, fractions in (0, 1) (default %(default)s)")
    p.add_argument("--slow-die", type=float, default=0.0, metavar="P",
                   help="with --slow: probability that an episode ends in the node's removal (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", metavar="FILE", help="also write a throughput-over-time plot")
    p.set_defaults(handler=run)
    return p


def parse_systems(text: str) -> tuple[str, ...]:
    """``"all"`` or a comma list of :data:`~.systems.SYSTEMS` (order kept, duplicates dropped)."""
    if text.strip() == "all":
        return SYSTEMS
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    bad = [n for n in names if n not in SYSTEMS]
    if bad or not names:
        raise SimulationError(f"unknown systems {bad or [text]}; allowed: all, {', '.join(SYSTEMS)}")
    return names


def _trace(args: argparse.Namespace, nodes: int) -> Trace:
    if args.trace:
        trace = load_trace(args.trace)
    else:
        trace = poisson_trace(args.mtbf, seed=args.seed, nodes=args.nodes or nodes, failures=args.failures,
                              duration=args.duration, repair=args.repair)
    if not getattr(args, "slow", False):
        return trace
    try:
        speeds = tuple(float(v) for v in args.slow_speeds.split(","))
    except ValueError:
        raise SimulationError(f"--slow-speeds {args.slow_speeds!r} must be comma-separated numbers in (0, 1)") from None
    return add_slow_events(trace, seed=args.slow_seed, mean_gap=args.slow_gap, mean_duration=args.slow_duration,
                           speeds=speeds, die_fraction=args.slow_die)


def _report(trace: Trace, model_name: str, results: dict[str, Result], png: str | None) -> dict[str, Any]:
    counts = trace.live_counts()
    return {
        "model": model_name,
        "trace": {
            "name": trace.name,
            "hours": trace.end_s / 3600.0,
            "removals": trace.removals,
            "slowdowns": trace.slowdowns,
            "additions": trace.additions,
            "initial_nodes": counts[0][1],
            "max_nodes": trace.max_nodes,
        },
        "systems": {name: r.to_dict() for name, r in results.items()},
        **({"png": png} if png else {}),
    }


def _table(report: dict[str, Any]) -> str:
    t = report["trace"]
    lines = [
        f"model {report['model']} on trace {t['name']}: {t['initial_nodes']} nodes at first, "
        f"{t['removals']} removals, {t['additions']} additions, {t['slowdowns']} slowdowns, {t['hours']:.2f} h",
        f"{'system':<20}{'samples/s':>11}{'vs best':>9}  " + "".join(f"{k:>11}" for k in BREAKDOWN_KEYS),
    ]
    systems = report["systems"]
    best = max((s["throughput"] for s in systems.values()), default=0.0)
    for name, s in systems.items():
        wall = sum(s["breakdown"].values()) or 1.0
        ratio = f"{s['throughput'] / best:.2f}x" if best > 0 else "-"
        shares = "".join(f"{100 * s['breakdown'][k] / wall:>10.1f}%" for k in BREAKDOWN_KEYS)
        value = f"{s['throughput']:.2f}" if s["throughput"] > 0 else "0 (n/a)"
        lines.append(f"{name:<20}{value:>11}{ratio:>9}  {shares}")
    lines.append("breakdown: share of each system's window (first iteration to the trace's end)")
    return "\n".join(lines)


def with_measured_ratios(model, path: str):
    """The model profile with a cost model's B and W times relative to F (summed over its stages):
    the simulator plans every grid in layer units, so a per-stage profile enters as these ratios."""
    from dataclasses import replace

    from ..costs import CostModel

    cost = CostModel.load(path)
    pp = max(len(cost.t_f), len(cost.t_b), len(cost.t_w))
    stages = cost.stages(pp)
    forward = sum(c.t_f for c in stages)
    return replace(model, backward_ratio=sum(c.t_b for c in stages) / forward,
                   weight_ratio=sum(c.t_w for c in stages) / forward)


def run(args: argparse.Namespace) -> int:
    """Run the ``simulate`` subcommand; returns the exit code (errors raise :class:`SimulationError`)."""
    if args.checkpoint_interval < 1:
        raise SimulationError(f"--checkpoint-interval must be >= 1 iterations, got {args.checkpoint_interval}")
    if args.nodes is not None and args.nodes < 1:
        raise SimulationError(f"--nodes must be >= 1, got {args.nodes}")
    model = load_model(args.model)
    if args.cost:
        model = with_measured_ratios(model, args.cost)
    systems = parse_systems(args.systems)
    trace = _trace(args, model.nodes)
    cache = PlanCache(model)
    results = {}
    with progress_bar(len(systems), f"simulating {trace.name}", unit="system") as bar:  # a terminal's only
        for s in systems:
            bar.set_postfix_str(s, refresh=False)
            results[s] = simulate_system(trace, model, s, cache=cache, checkpoint_interval=args.checkpoint_interval,
                                         healthy=args.healthy, regrid=args.regrid)
            bar.update()
    if args.png:
        from .plot import plot_throughput

        plot_throughput(list(results.values()), trace, args.png, title=f"{model.name} on {trace.name}")
    report = _report(trace, model.name, results, args.png)
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report))
        if args.png:
            print(f"wrote {args.png}")
    return 0
