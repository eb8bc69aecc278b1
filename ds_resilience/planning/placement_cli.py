"""``ds-resilience placement``: where the in-memory checkpoint replicas go, and the odds of recovering.

    ds-resilience placement --machines N --replicas m --failures k [--json]

Prints Gemini's placement (groups, each machine's holders) and the exact probability that every
checkpoint survives in some alive machine's memory when 0..k machines fail at random. ``--json``
prints one object: ``machines``, ``replicas``, ``kind`` ("group" or "mixed"), ``groups``,
``holders`` (per machine), ``failures`` (k), ``probability`` (for k) and ``probabilities``
(0..k). Wire it with :func:`add_parser` (it sets ``handler=run``). Pure Python, no torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .placement import place, recovery_probabilities

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``placement`` subcommand to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "placement",
        help="in-memory checkpoint placement (Gemini) and the probability of recovering from memory",
        description="Gemini's group (or mixed) placement of in-memory checkpoint replicas, and the exact "
        "probability that every checkpoint survives in memory when machines fail at random.",
    )
    p.add_argument("--machines", type=int, required=True, metavar="N", help="machines (N >= 1)")
    p.add_argument("--replicas", type=int, default=2, metavar="M",
                   help="copies of each checkpoint, the own one included, 1..N (default 2)")
    p.add_argument("--failures", type=int, metavar="K",
                   help="report failures 0..K, K in 0..N (default: the replica count, capped at N)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``placement``; errors (ConfigError, PlanningError) propagate to the CLI's handler."""
    placement = place(args.machines, args.replicas)
    k = args.failures if args.failures is not None else min(placement.replicas, placement.machines)
    probs = recovery_probabilities(placement, k)
    if args.json:
        report = placement.to_dict()
        report.update(failures=k, probability=probs[k], probabilities=list(probs))
        print(json.dumps(report))
        return 0
    n, m = placement.machines, placement.replicas
    if placement.kind == "group":
        count = len(placement.groups)
        how = f"group placement: {count} group{'s' * (count != 1)} of {m}"
    else:
        ring = max(len(g) for g in placement.groups)
        full = len(placement.groups) - 1
        how = (f"mixed placement ({m} does not divide {n}): {full} group{'s' * (full != 1)} of {m}"
               f" and a ring group of {ring}" if full else f"mixed placement: one ring group of {ring}")
    print(f"{n} machines, {m} replicas per checkpoint (own copy included); {how}")
    print("groups: " + " ".join("[" + ", ".join(map(str, g)) + "]" for g in placement.groups))
    print("holders (machine: machines storing its checkpoint):")
    width = len(str(n - 1))
    for i, hs in enumerate(placement.holders):
        print(f"  {i:>{width}}: {', '.join(map(str, hs))}")
    print("probability of recovering every checkpoint from memory:")
    for failures, pr in enumerate(probs):
        print(f"  {failures} failed: {pr:.6f}")
    return 0
