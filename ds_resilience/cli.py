"""``ds-resilience``: the command line.

Subcommands import what they need lazily, so ``ds-resilience plan`` never loads torch and answers
in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .errors import ResilienceError

__all__ = ["main", "build_parser"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_grid(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=_positive_int, required=True, help="pipelines (data-parallel degree)")
    p.add_argument("--pp", type=_positive_int, required=True, help="pipeline stages")
    p.add_argument("--microbatches", "-m", type=_positive_int, required=True, help="micro-batches per pipeline")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON (default: unit costs t_F = t_B = t_W = 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-resilience",
        description="Plan, simulate and run fault-tolerant hybrid-parallel training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="build, check and measure a pipeline schedule")
    _add_grid(plan)
    plan.add_argument("--schedule", choices=("1f1b", "decoupled"), default="1f1b", help="fault-free schedule")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the grid")
    plan.add_argument("--png", metavar="FILE", help="also write a Gantt chart")
    plan.set_defaults(handler=_cmd_plan)
    return parser


def _load_cost(path: str | None):
    from .costs import CostModel

    return CostModel.load(path) if path else CostModel.unit()


def _cmd_plan(args: argparse.Namespace) -> int:
    from .planning import generate
    from .sim import simulate

    cost = _load_cost(args.cost)
    cost.check_stages(args.pp)
    schedule = generate(args.schedule, args.dp, args.pp, args.microbatches, cost)
    timeline = simulate(schedule, cost)
    report = {
        "dp": args.dp,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "schedule_name": schedule.name,
        "cost_model": cost.name,
        "makespan": timeline.makespan,
        "iteration_time": timeline.iteration_time,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_activations": timeline.stage_peak_activations(args.dp, args.pp),
        "peak_pending_w": [
            max(timeline.peak_pending_w[s * args.dp:(s + 1) * args.dp]) for s in range(args.pp)
        ],
        "schedule": [" ".join(str(a) for a in actions) for actions in schedule.workers],
    }
    if args.png:
        from .sim.gantt import render_gantt

        render_gantt(schedule, timeline, args.png, title=f"{schedule.name} dp={args.dp} pp={args.pp} m={args.microbatches}", cost=cost)
        report["png"] = args.png
    if args.json:
        print(json.dumps(report))
        return 0
    from .ir import format_grid

    print(format_grid(schedule, timeline.starts, timeline.ends))
    print(
        f"schedule={schedule.name} dp={args.dp} pp={args.pp} microbatches={args.microbatches} cost={cost.name}\n"
        f"makespan={timeline.makespan:g} bubble_ratio={timeline.bubble_ratio:.3f} "
        f"peak_activations={report['peak_activations']} peak_pending_w={report['peak_pending_w']}"
    )
    if args.png:
        print(f"wrote {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ds-resilience``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ResilienceError as exc:
        print(f"ds-resilience {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
