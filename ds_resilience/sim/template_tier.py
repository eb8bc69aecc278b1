"""The re-grid tier on pipeline templates (Oobleck, SOSP'23) for the failure-trace simulator.

When re-routing cannot cover a failure set (a stage lost every replica), or a smaller layout would
repay its pause, ds_resilience may re-grid the survivors onto *templates*: pipelines that may
differ in depth and stage boundaries (:mod:`ds_resilience.planning.templates`), every layer held by
at least ``tolerance + 1`` of them, the global batch split whole over them. This module turns a live
node count into such a layout and its seconds per iteration.

Rated as every other plan is: each pipeline of the instantiation is planned by the real planner
(``recycle``: decoupled backward, staggered optimizer) on its template's stage costs, in the same
layer units as :class:`~.models.PlanCache` and scaled by its fitted per-layer time, and the layout
runs at its slowest pipeline. Which templates and how many micro-batches each runs is the
instantiation's choice (1F1B's closed form, exact for it); the planner's rating of that choice is
the figure the simulator uses. Not modelled: the per-segment gradient reduce across pipelines of
different templates (no link costs anywhere in the simulator's cost model).

Memory: a stage holds 16 bytes per parameter (weights, gradients, Adam) of its layers within 80% of
a GPU, the rule :attr:`~.models.ModelProfile.min_stages` applies to rectangular grids; templates
span the same depths as the rectangular grids (``min_stages`` to ``max_stages``).

In a layout, pipelines of the same template re-route around a lost node as a rectangular grid
does (:class:`TemplateLayout`); nothing is re-routed across pipelines of different templates.
Pure Python.
"""

from __future__ import annotations

import math

from ..errors import PlanningError
from ..planning.layers import LayerProfile
from ..planning.templates import Instantiation, Template, instantiate, plan_templates
from ..topology import Worker
from .models import PlanCache, Slots

__all__ = ["TemplateLayout", "TemplateTier"]


class TemplateLayout(Slots):
    """The nodes of one template instantiation, in the shape of :class:`~.models.Grid` the policies use.

    Pipelines of the same template form a group whose same-position stages hold the same layers:
    a node lost from a group is re-routed around inside it (its data-parallel peers there take its
    micro-batches, as on a rectangular grid); a group that loses every replica of a stage leaves the
    layout uncovered (the policy changes layout again). A re-joining node fills a hole.
    """

    def __init__(self, tier: TemplateTier, choice: Instantiation, nodes: list[str]) -> None:
        used = sum(p.nodes for p in choice.pipelines)
        if used > len(nodes):
            raise PlanningError(f"a layout of {used} nodes cannot run on {len(nodes)}")
        self.tier = tier
        it = iter(nodes[:used])
        # group: template nodes -> (pipelines, the most micro-batches any of them runs)
        self.groups = {n: (count, max(p.microbatches for p in choice.pipelines if p.nodes == n))
                       for n, count in sorted(choice.counts.items())}
        self.slot: dict[tuple[int, int, int], str | None] = {
            (n, q, s): next(it) for n, (count, _) in self.groups.items() for q in range(count) for s in range(n)}
        self.pp = min(self.groups)  # the fewest nodes that still run something

    def group_holes(self, n: int) -> frozenset[Worker]:
        """The holes of the group of ``n``-node pipelines, as failed workers of its grid."""
        return frozenset(Worker(pipeline=q, stage=s) for (g, q, s), node in self.slot.items() if g == n and node is None)

    def covered(self) -> bool:
        return all(any(self.slot[(n, q, s)] is not None for q in range(count))
                   for n, (count, _) in self.groups.items() for s in range(n))

    def fill(self, node: str) -> bool:
        """Put ``node`` into the first hole; False if there is none."""
        holes = self.holes()
        if not holes:
            return False
        self.slot[holes[0]] = node
        return True

    def seconds(self) -> float:
        """Seconds per iteration: the slowest group's plan (``inf`` when uncovered)."""
        if not self.covered():
            return math.inf
        return max(self.tier.group_seconds(n, count, m, self.group_holes(n)) for n, (count, m) in self.groups.items())

    def describe(self) -> str:
        return "templates " + " + ".join(f"{count}x{n}" for n, (count, _) in sorted(self.groups.items(), reverse=True))


class TemplateTier:
    """Templates for one model, and the best layout (with its seconds per iteration) for a node count."""

    def __init__(self, cache: PlanCache, *, tolerance: int = 1) -> None:
        model = cache.profile
        self.cache, self.tolerance = cache, tolerance
        per_layer_state = model.params_billion * 1e9 * 16.0 / model.layers
        self.profile = LayerProfile.uniform(model.layers, t_f=1.0, t_b=model.backward_ratio, t_w=model.weight_ratio,
                                            param_bytes=per_layer_state, name=model.name)
        cap = 0.8 * model.gpu_memory_gb * 1e9
        # from min_stages, as the rectangular grids: a one-stage "pipeline" would be pure data
        # parallelism, whose gradient all-reduce the simulator does not price
        self.templates: dict[int, Template] = plan_templates(
            self.profile, model.min_stages, max(model.min_stages, min(model.layers, model.max_stages)), memory_cap=cap)
        self._best: dict[int, tuple[float, Instantiation | None]] = {}
        self._pipeline: dict[tuple[int, int], float] = {}
        self._groups: dict[tuple, float] = {}

    def pipeline_units(self, nodes: int, microbatches: int) -> float:
        """One pipeline of the ``nodes``-template with ``microbatches``: the planner's iteration, layer units."""
        key = (nodes, microbatches)
        if key not in self._pipeline:
            from ..planning.planner import plan

            cost = self.templates[nodes].cost_model(self.profile)
            self._pipeline[key] = plan(1, nodes, microbatches, cost=cost, variant=self.cache.variant).iteration_time
        return self._pipeline[key]

    def group_seconds(self, nodes: int, count: int, microbatches: int, failed: frozenset[Worker]) -> float:
        """``count`` pipelines of the ``nodes``-template with ``failed`` holes re-routed: the planner's
        plan, seconds (with no hole: one pipeline's plan, as the pipelines run independently)."""
        if not failed:
            return self.pipeline_units(nodes, microbatches) * self.cache.layer_ms / 1000.0
        from ..planning.normalize import normalize
        from ..planning.planner import plan

        norm = normalize(count, nodes, failed)
        key = (norm.key, microbatches)
        if key not in self._groups:
            cost = self.templates[nodes].cost_model(self.profile)
            self._groups[key] = plan(count, nodes, microbatches, norm.canonical, cost=cost,
                                     variant=self.cache.variant).iteration_time
        return self._groups[key] * self.cache.layer_ms / 1000.0

    def best(self, nodes: int) -> tuple[float, Instantiation | None]:
        """Seconds per iteration of the best instantiation on ``nodes`` live nodes (``inf``, None: none)."""
        if nodes not in self._best:
            try:
                choice = instantiate(self.templates, nodes, self.cache.profile.total_microbatches,
                                     tolerance=self.tolerance)
            except PlanningError:
                self._best[nodes] = (math.inf, None)
            else:
                units = max(self.pipeline_units(p.nodes, p.microbatches) for p in choice.pipelines)
                self._best[nodes] = (units * self.cache.layer_ms / 1000.0, choice)
        return self._best[nodes]

    def layout(self, live: list[str]) -> TemplateLayout | None:
        """The best layout on the ``live`` nodes, or None when no instantiation fits."""
        _, choice = self.best(len(live))
        return None if choice is None else TemplateLayout(self, choice, live)
