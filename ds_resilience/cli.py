"""``ds-resilience``: the command line.

Subcommands import what they need lazily, so ``ds-resilience plan`` never loads torch and answers
in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from .argtypes import memory_cap, positive_int
from .errors import ResilienceError
from .vocab import SCHEDULES, SOLVERS, VARIANT_CHOICES, VARIANTS

__all__ = ["main", "build_parser"]


_MEMORY_CAP = memory_cap("--memory-cap")


def _tied_group(text: str) -> tuple[int, ...]:
    """``--tied 0,3``: one tied group, the stages holding copies of one tied module (sorted here)."""
    try:
        stages = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stages like 0,3, got {text!r}") from None
    if len(set(stages)) < 2 or min(stages) < 0:
        raise argparse.ArgumentTypeError(f"a tied group needs at least 2 distinct stages >= 0, got {text!r}")
    return tuple(sorted(set(stages)))


def _add_grid(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", type=positive_int, required=True, help="pipelines (data-parallel degree)")
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline stages")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True, help="micro-batches per pipeline")
    p.add_argument("--cost", metavar="FILE", help="cost model JSON (default: unit costs t_F = t_B = t_W = 1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-resilience",
        description="Plan, simulate and run fault-tolerant hybrid-parallel training.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser("plan", help="build, check and measure a pipeline schedule")
    _add_grid(plan)
    plan.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="fault-free schedule")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of the grid")
    plan.add_argument("--png", metavar="FILE", help="also write a Gantt chart")
    plan.add_argument("--fail", metavar="P:S[,P:S]", help="failed workers: plan the re-routed schedule")
    plan.add_argument(
        "--variant",
        choices=VARIANT_CHOICES,
        default="recycle",
        help="with --fail: re-routing only / + decoupled backward / + staggered optimizer (default)",
    )
    plan.add_argument("--solver", choices=SOLVERS, default="cpsat", help="with --fail (default cpsat)")
    plan.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds (default 10)")
    plan.add_argument("--memory-cap", type=_MEMORY_CAP, metavar="CAP",
                      help="memory per worker for micro-batch states: a number in the cost model's unit (bytes "
                           "with memory figures, else states) or a size such as 24GiB (default: fault-free "
                           "1F1B's peak)")
    plan.add_argument(
        "--tied",
        metavar="S,S[,S]",
        type=_tied_group,
        action="append",
        default=[],
        help="stages sharing a tied module (e.g. 0,3 for tied embeddings); repeat for several groups",
    )
    plan.set_defaults(handler=_cmd_plan)

    table = sub.add_parser("plan-table", help="precompute plans for every normalized failure set")
    _add_grid(table)
    table.add_argument("--max-failures", type=int, default=1, help="tolerance: failures per set (default 1)")
    table.add_argument("--all-coverable", action="store_true", help="also every set leaving each stage a replica")
    table.add_argument("--variant", choices=VARIANT_CHOICES, default="recycle")
    table.add_argument("--solver", choices=SOLVERS, default="heuristic")
    table.add_argument("--time-limit", type=float, default=10.0)
    table.add_argument("--memory-cap", type=_MEMORY_CAP, metavar="CAP", help="as for plan")
    table.add_argument("--workers", type=int, default=0, help="parallel processes (default: CPU count)")
    table.add_argument("--out", metavar="DIR", default=".plan_cache", help="cache directory (default .plan_cache)")
    table.add_argument("--json", action="store_true")
    table.add_argument("--tied", metavar="S,S[,S]", type=_tied_group, action="append", default=[],
                       help="stages sharing a tied module (e.g. 0,3); repeat for several groups")
    table.set_defaults(handler=_cmd_plan_table)

    from .planning import placement_cli, templates_cli
    from .sim import cli as sim_cli

    sim_cli.add_parser(sub)
    placement_cli.add_parser(sub)
    templates_cli.add_parser(sub)
    sub.add_parser("run", help="launch workers under the failure-handling agent (deepspeed launcher arguments)")
    sub.add_parser("profile", help="measure the job's costs on its own ranks and write the cost-model JSON "
                                   "(--out FILE [--profile-steps K] then the run arguments)")
    sub.add_parser("demo", help="train the example GPT, kill a worker mid-run, keep training, compare")
    return parser


def _load_cost(path: str | None):
    from .costs import CostModel

    return CostModel.load(path) if path else CostModel.unit()


def _parse_failed(text: str | None):
    from .topology import parse_worker

    if not text:
        return []
    return [parse_worker(part) for part in text.split(",") if part.strip()]


def _cmd_plan(args: argparse.Namespace) -> int:
    from .ir import simulate
    from .planning import generate

    cost = _load_cost(args.cost)
    cost.check_stages(args.pp)
    failed = _parse_failed(args.fail)
    tied = tuple(args.tied)
    plan_report: dict = {}
    if failed:
        from .planning.planner import plan

        result = plan(
            args.dp,
            args.pp,
            args.microbatches,
            failed,
            cost=cost,
            variant=args.variant,
            solver=args.solver,
            time_limit_s=args.time_limit,
            memory_cap=args.memory_cap,
            tied=tied,
        )
        schedule = result.schedule
        plan_report = result.to_dict(with_schedule=False)
    else:
        schedule = generate(args.schedule, args.dp, args.pp, args.microbatches, cost, tied=tied)
    timeline = simulate(schedule, cost)
    report = {
        "dp": args.dp,
        "pp": args.pp,
        "microbatches": args.microbatches,
        "schedule_name": schedule.name,
        "cost_model": cost.name,
        "tied": [list(group) for group in schedule.tied],
        "makespan": timeline.makespan,
        "iteration_time": timeline.iteration_time,
        "bubble_ratio": timeline.bubble_ratio,
        "peak_activations": timeline.stage_peak_activations(args.dp, args.pp),
        "peak_pending_w": [
            max(timeline.peak_pending_w[s * args.dp:(s + 1) * args.dp]) for s in range(args.pp)
        ],
        "schedule": [" ".join(str(a) for a in actions) for actions in schedule.workers],
    }
    report.update(plan_report)
    if args.png:
        from .ir.gantt import render_gantt

        render_gantt(schedule, timeline, args.png, title=f"{schedule.name} dp={args.dp} pp={args.pp} m={args.microbatches}", cost=cost)
        report["png"] = args.png
    if args.json:
        print(json.dumps(report))
        return 0
    from .costs import format_memory
    from .ir import format_grid, format_tied

    print(format_grid(schedule, timeline.starts, timeline.ends))
    tied_text = f" tied={format_tied(schedule.tied)}" if schedule.tied else ""
    print(
        f"schedule={schedule.name} dp={args.dp} pp={args.pp} microbatches={args.microbatches} cost={cost.name}"
        f"{tied_text}\n"
        f"makespan={timeline.makespan:g} bubble_ratio={timeline.bubble_ratio:.3f} "
        f"peak_activations={report['peak_activations']} peak_pending_w={report['peak_pending_w']}"
    )
    if plan_report:
        solver = plan_report["solver"]
        gap = "n/a" if solver["gap"] is None else f"{solver['gap']:.1%}"
        print(
            f"failed={','.join(plan_report['failed'])} variant={plan_report['variant']} "
            f"iteration_time={plan_report['iteration_time']:g} (fault-free 1F1B {plan_report['fault_free_iteration_time']:g}, "
            f"best fault-free {plan_report['best_fault_free_iteration_time']:g})\n"
            f"degradation={plan_report['degradation']:.1%} degradation_vs_best={plan_report['degradation_vs_best']:.1%} "
            f"lower_bound={plan_report['lower_bound']:g} gap_to_bound={plan_report['gap_to_bound']:.1%} "
            f"solver={solver['name']} status={solver['status']} gap={gap} seconds={solver['seconds']:.2f}\n"
            f"memory_cap={format_memory(plan_report['memory_cap'], plan_report['memory_unit'])} "
            f"peak per worker: {', '.join(format_memory(x, plan_report['memory_unit']) for x in plan_report['peak_memory'])}"
        )
    if args.png:
        print(f"wrote {args.png}")
    return 0


def _cmd_plan_table(args: argparse.Namespace) -> int:
    from .planning.table import TableSpec, build_table

    cost = _load_cost(args.cost)
    cost.check_stages(args.pp)
    if args.max_failures < 0:
        raise SystemExit("ds-resilience plan-table: --max-failures must be >= 0")
    spec = TableSpec(
        dp=args.dp,
        pp=args.pp,
        microbatches=args.microbatches,
        cost=cost,
        variant=args.variant,
        solver=args.solver,
        time_limit_s=args.time_limit,
        memory_cap=args.memory_cap,
        max_failures=args.max_failures,
        all_coverable=args.all_coverable,
        tied=tuple(args.tied),
    )
    table, summary = build_table(spec, cache_dir=args.out, workers=args.workers, progress=not args.json)
    if args.json:
        print(json.dumps(summary))
    else:
        how = "loaded from cache" if summary["cached"] else f"computed with {args.workers or 'all'} workers"
        print(
            f"{summary['plans']} plans ({summary['uncoverable']} uncoverable sets recorded) "
            f"in {summary['seconds']:.2f}s, {how}: {summary['path']}"
        )
    return 0


def _profile(argv: list[str]) -> int:
    """``ds-resilience profile --out FILE [--profile-steps K] <run arguments>``: run the job under the
    agent for its profile iterations (``integrations/ds_profile.py``), write the cost model, and stop.
    The profile's own options come first; everything after them goes to ``ds-resilience run``."""
    import os

    parser = argparse.ArgumentParser(prog="ds-resilience profile", description=_profile.__doc__)
    parser.add_argument("--out", required=True, metavar="FILE", help="where the cost-model JSON goes")
    parser.add_argument("--profile-steps", type=positive_int, default=3,
                        help="iterations of each kind, fused 1F1B and decoupled (default 3; one more with the memory hook)")
    own = []
    while argv and argv[0] in ("--out", "--profile-steps") and len(argv) >= 2:
        own, argv = own + argv[:2], argv[2:]
    args = parser.parse_args(own)
    if not argv:
        parser.error("the run arguments are missing, e.g. --num_gpus 4 train.py --deepspeed_config ds.json")
    out = Path(args.out).resolve()
    steps = args.profile_steps
    os.environ.update({"DSR_PROFILE_OUT": str(out), "DSR_PROFILE_STEPS": str(steps), "DSR_PROFILE_EXIT": "1"})
    from .supervisor.cli import main_run

    code = main_run(argv)
    if code == 0 and not out.exists():
        print(f"ds-resilience profile: error: the job ended without writing {out} (did it run "
              f"{2 * steps + 1} iterations without a failure?)", file=sys.stderr)
        return 2
    if code == 0:
        print(f"ds-resilience profile: wrote {out}; plan with it through resilience.cost_model or --cost")
    return code


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """The full parser of every subcommand, by name, in ``ds-resilience --help``'s order (the
    documentation's CLI reference is rendered from it, so it cannot drift from the code).

    ``run``, ``profile`` and ``demo`` are registered on the main parser without arguments and parse
    their own argv: ``run``'s parser is ``supervisor.cli.build_parser()``; ``profile``'s and
    ``demo``'s are built inside the function that parses with them, so they are caught at their
    ``parse_args`` call (which raises before anything runs) and returned. Imports nothing heavy
    (no torch).
    """
    from typing import Any

    from . import demo
    from .supervisor import cli as run_cli

    class _Caught(Exception):
        def __init__(self, parser: argparse.ArgumentParser) -> None:
            super().__init__(parser.prog)
            self.parser = parser

    def catch(entry: Any, argv: list[str]) -> argparse.ArgumentParser:
        original = argparse.ArgumentParser.parse_args

        def raise_parser(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
            raise _Caught(self)

        argparse.ArgumentParser.parse_args = raise_parser  # type: ignore[method-assign]
        try:
            entry(argv)
        except _Caught as caught:
            return caught.parser
        finally:
            argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        raise RuntimeError(f"{entry!r} returned without parsing its arguments")

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    own = {"run": run_cli.build_parser, "profile": lambda: catch(_profile, []), "demo": lambda: catch(demo.main, [])}
    return {name: own[name]() if name in own else parser for name, parser in sub.choices.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ds-resilience``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":  # the launcher parses its own (deepspeed-style) arguments
        from .supervisor.cli import main_run

        return main_run(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "profile":
        return _profile(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ResilienceError as exc:
        print(f"ds-resilience {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
