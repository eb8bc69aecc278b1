"""A template instantiation as a :class:`~ds_resilience.ir.layout.PipelineLayout`, and its iteration time.

:func:`layout_of` turns an instantiation (and, after a re-grid, the survivors' new positions from
:func:`~.regrid.plan_regrid`) into a layout: pipelines of the same template and micro-batch count
form one group.

:func:`layout_iteration_time` rates a layout with the same replay as every other plan, plus what a
layout adds: each group's schedule (fused 1F1B for ``adaptive``, the decoupled generator for
``decoupled``, on the group's stage costs) is replayed on its own; a rank's gradients are ready when
its last backward ends; the segment reduces then run in descending layer order, each over its
holders in every group (a collective starts when its last holder is ready and free), tied groups
over the holders of every copy; a rank steps when its last reduce ends. The iteration is the
latest step. One iteration with every rank stepping after its own reduces: the staggered
optimizer's steady state across heterogeneous pipelines is not modelled (``recycle`` is refused).
Pure Python.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import ActionKind, replay
from ..ir.layout import PipelineGroup, PipelineLayout
from .generators import decoupled, one_f_one_b
from .layers import LayerProfile
from .regrid import Position
from .templates import Instantiation, Link, Template, stage_cost_model

__all__ = ["layout_of", "layout_iteration_time", "LAYOUT_VARIANTS"]

LAYOUT_VARIANTS = ("adaptive", "decoupled")
_COMPUTE = (ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW)


def layout_of(choice: Instantiation, templates: Mapping[int, Template], *,
              assignment: Mapping[Hashable, Position] | None = None,
              tied: tuple[tuple[int, ...], ...] = ()) -> PipelineLayout:
    """The layout of ``choice``: ranks numbered position by position (pipeline by pipeline, stage by
    stage), or, with ``assignment`` (a re-grid plan's: rank -> new position), those ranks.

    Raises:
        PlanningError: an assignment that leaves a position empty or names a missing one.
    """
    rank_at: dict[tuple[int, int], Hashable] = {}
    if assignment is None:
        r = 0
        for q, use in enumerate(choice.pipelines):
            for k in range(use.nodes):
                rank_at[(q, k)] = r
                r += 1
    else:
        for rank, pos in assignment.items():
            rank_at[(pos.pipeline, pos.stage)] = rank
    groups: dict[tuple[int, int], list[int]] = {}
    for q, use in enumerate(choice.pipelines):
        groups.setdefault((use.nodes, use.microbatches), []).append(q)
    out = []
    for (nodes, m), members in groups.items():
        missing = [(q, k) for q in members for k in range(nodes) if (q, k) not in rank_at]
        if missing:
            raise PlanningError(f"the assignment leaves positions (pipeline, stage) {missing[:4]} empty")
        ranks = tuple(tuple(rank_at[(q, k)] for k in range(nodes)) for q in members)
        out.append(PipelineGroup(bounds=templates[nodes].bounds, pipelines=len(members), microbatches=m, ranks=ranks))
    return PipelineLayout(layers=templates[choice.pipelines[0].nodes].bounds[-1], groups=tuple(out), tied=tied,
                          tolerance=choice.tolerance)


def _ready_times(group: PipelineGroup, cost: CostModel, variant: str) -> dict[int, float]:
    """When each rank of ``group`` holds all its gradients (its last backward's end), in the
    replay of the group's own schedule."""
    dp, pp, m = group.pipelines, group.stages, group.microbatches
    schedule = one_f_one_b(dp, pp, m) if variant == "adaptive" else decoupled(dp, pp, m, cost)
    result = replay(schedule, cost)
    if result.blocked:
        raise PlanningError(f"the {variant} schedule of group {group.pipelines}x{group.stages} deadlocks")
    ready = {}
    for w, actions in enumerate(schedule.workers):
        stage, q = divmod(w, dp)
        ready[group.ranks[q][stage]] = max((e for a, e in zip(actions, result.ends[w]) if a.kind in _COMPUTE),
                                           default=0.0)
    return ready


def layout_iteration_time(layout: PipelineLayout, profile: LayerProfile, *, variant: str = "adaptive",
                          link: Link = Link(), reduce_link: Link = Link(), step_time: float = 0.0) -> float:
    """One iteration of ``layout`` (see the module docstring): ``link`` rates stage-to-stage
    messages; ``reduce_link`` a ring all-reduce of a segment's ``param_bytes`` over its holders
    (``2 (n - 1) / n`` of the bytes each way); ``step_time`` a rank's optimizer step.

    Raises:
        PlanningError: an unknown variant, or a layout whose layer count is not the profile's.
    """
    if variant not in LAYOUT_VARIANTS:
        raise PlanningError(f"layout variant {variant!r}; allowed: {', '.join(LAYOUT_VARIANTS)}")
    if layout.layers != profile.num_layers:
        raise PlanningError(f"the layout has {layout.layers} layers, the profile {profile.num_layers}")
    ready: dict[int, float] = {}
    for group in layout.groups:
        ready.update(_ready_times(group, stage_cost_model(profile, group.bounds, link), variant))
    free = dict.fromkeys(ready, 0.0)
    done = dict.fromkeys(ready, 0.0)

    def collective(holders: Sequence[int], nbytes: float) -> None:
        n = len(holders)
        start = max(max(ready[h], free[h]) for h in holders)
        end = start + (reduce_link.time(2 * (n - 1) / n * nbytes) if n > 1 else 0.0)
        for h in holders:
            free[h] = done[h] = end

    for seg in layout.reduce_order():
        collective(seg.holders, sum(profile.param_bytes[i] for i in seg.layers))
    for g, layers in enumerate(layout.tied):
        collective(layout.tied_holders(g), profile.param_bytes[layers[0]])
    return max(done[r] for r in done) + step_time
