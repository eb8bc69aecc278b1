"""``ds-resilience templates``: pipeline templates and the best way to run on N surviving nodes.

    ds-resilience templates --layers FILE|L --nodes N --microbatches M [--tolerance f]
        [--min-nodes a] [--max-nodes b] [--cost FILE] [--memory-cap SIZE] [--json] [--png FILE]

``--layers`` is a per-layer profile (``planning/layers.py``) or a layer count (identical unit
layers); ``--cost`` a cost model whose ``p2p_latency`` and ``p2p_bandwidth`` rate the messages
between stages; ``--memory-cap`` each node's memory (bytes, or a size such as ``24GiB``). Prints
each template (its stage boundaries and bottleneck), the instantiation (how many pipelines of
which template, the micro-batches of each, the predicted iteration time, from the planner's model
and from the schedule replay), the layout (its reduce segments, and one iteration with their
reduces coupling the pipelines) and the planning time. ``--png`` draws the chosen pipelines. Wire it
with :func:`add_parser` (it sets ``handler=run``). Pure Python (matplotlib for ``--png``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ..costs import CostModel, parse_size
from ..errors import ConfigError
from .layers import LayerProfile
from .layout_time import LAYOUT_VARIANTS, layout_iteration_time, layout_of
from .templates import Instantiation, Link, Template, instantiate, plan_templates

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "templates", help="pipeline templates (Oobleck) and their instantiation on N surviving nodes",
        description="Plan the best memory-feasible stage partition for every node count (a template), then "
                    "the fastest combination of templates and split of the global batch for N nodes.")
    p.add_argument("--layers", required=True, metavar="FILE|L", help="per-layer profile JSON, or a layer count")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="surviving nodes")
    p.add_argument("--microbatches", type=int, required=True, metavar="M", help="micro-batches per iteration (all pipelines)")
    p.add_argument("--tolerance", type=int, default=0, metavar="f", help="failures to survive: f + 1 pipelines (default 0)")
    p.add_argument("--min-nodes", type=int, default=None, help="smallest template (default 2, or 1 for N = 1)")
    p.add_argument("--max-nodes", type=int, default=None, help="largest template (default N)")
    p.add_argument("--cost", default=None, metavar="FILE", help="cost model JSON: its p2p latency and bandwidth")
    p.add_argument("--memory-cap", default=None, metavar="SIZE", help="memory per node, bytes or e.g. 24GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--png", default=None, metavar="FILE", help="draw the chosen pipelines")
    p.set_defaults(handler=run)
    return p


def _profile(value: str) -> LayerProfile:
    if value.isdigit():
        return LayerProfile.uniform(int(value))
    return LayerProfile.load(value)


def run(args: argparse.Namespace) -> int:
    profile = _profile(args.layers)
    link = Link()
    if args.cost:
        cost = CostModel.load(args.cost)
        link = Link(latency=cost.p2p_latency, bandwidth=cost.p2p_bandwidth)
    cap = None
    if args.memory_cap is not None:
        text = args.memory_cap
        try:
            cap, _ = parse_size(float(text) if text.replace(".", "", 1).isdigit() else text, what="--memory-cap")
        except ValueError as exc:
            raise ConfigError("--memory-cap", str(exc)) from exc
    lo = args.min_nodes if args.min_nodes is not None else min(2, args.nodes)
    hi = args.max_nodes if args.max_nodes is not None else args.nodes
    started = time.perf_counter()
    templates = plan_templates(profile, lo, hi, memory_cap=cap, link=link)
    planned = time.perf_counter() - started
    choice = instantiate(templates, args.nodes, args.microbatches, tolerance=args.tolerance)
    chosen = time.perf_counter() - started - planned
    replayed = max(templates[p.nodes].replayed_time(p.microbatches, profile, link) for p in choice.pipelines)
    layout = layout_of(choice, templates)
    coupled = {v: layout_iteration_time(layout, profile, variant=v, link=link, reduce_link=link) for v in LAYOUT_VARIANTS}
    if args.png:
        draw(choice, templates, profile, args.png)
    if args.json:
        print(json.dumps({"layers": profile.num_layers, "templates": [t.to_dict() for t in templates.values()],
                          "instantiation": choice.to_dict(), "replayed_iteration_time": replayed,
                          "layout": {"groups": [{"bounds": list(g.bounds), "pipelines": g.pipelines,
                                                 "microbatches": g.microbatches} for g in layout.groups],
                                     "segments": [[s.first, s.last, list(s.holders)] for s in layout.segments()]},
                          "layout_iteration_time": coupled,
                          "planning_s": planned, "instantiation_s": chosen}))
        return 0
    print(f"{profile.num_layers} layers, templates for {min(templates)}..{max(templates)} nodes "
          f"({len(templates)} fit{'' if cap is None else f' {cap:g} per node'}) in {planned * 1e3:.1f} ms")
    for t in templates.values():
        sizes = [b - a for a, b in zip(t.bounds, t.bounds[1:])]
        print(f"  {t.nodes:3d} nodes: layers per stage {sizes}, bottleneck {t.bottleneck:.4g}")
    counts = ", ".join(f"{c} x {n}-node" for n, c in sorted(choice.counts.items(), reverse=True))
    print(f"{args.nodes} nodes, {args.microbatches} micro-batches, tolerance {args.tolerance}: {counts} pipelines"
          f"{f', {choice.idle_nodes} idle' if choice.idle_nodes else ''} (in {chosen * 1e3:.1f} ms)")
    for i, p in enumerate(choice.pipelines):
        print(f"  pipeline {i}: {p.nodes} nodes, {p.microbatches} micro-batches, {p.time:.4g}")
    print(f"iteration time {choice.iteration_time:.4g} (schedule replay {replayed:.4g}), "
          f"throughput {choice.throughput:.4g} micro-batches per time unit")
    cuts = sorted({x for g in layout.groups for x in g.bounds})
    print(f"layout: {layout.describe()}; {len(cuts) - 1} reduce segments (cut at {cuts[1:-1]}), reduced in "
          f"descending layer order over one holder per pipeline; one iteration with those reduces "
          f"(at the link's bandwidth): fused {coupled['adaptive']:.4g}, decoupled {coupled['decoupled']:.4g}")
    return 0


def draw(choice: Instantiation, templates: dict[int, Template], profile: LayerProfile, path: str) -> None:
    """One row per pipeline: its stages as boxes over the layers they hold, and its time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(choice.pipelines)
    fig, ax = plt.subplots(figsize=(10, 0.6 * rows + 1.5))
    cmap = plt.get_cmap("tab20")
    for r, p in enumerate(choice.pipelines):
        t = templates[p.nodes]
        for k, (a, b) in enumerate(zip(t.bounds, t.bounds[1:])):
            ax.barh(r, b - a, left=a, color=cmap(k % 20), edgecolor="black", linewidth=0.5)
        ax.text(profile.num_layers + 0.5, r, f"{p.nodes} nodes, {p.microbatches} mb, {p.time:.3g}", va="center",
                fontsize=8)
    ax.set_yticks(range(rows), [f"pipeline {r}" for r in range(rows)])
    ax.set_xlim(0, profile.num_layers * 1.35)
    ax.set_xlabel("layer")
    ax.invert_yaxis()
    ax.set_title(f"{choice.nodes} nodes, {choice.microbatches} micro-batches, tolerance {choice.tolerance}: "
                 f"iteration {choice.iteration_time:.4g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
