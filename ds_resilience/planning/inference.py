"""Forward-only schedules for evaluation, fault-free or re-routed around failed workers.

``eval_batch`` runs every pipeline's evaluation micro-batches through the stages: micro-batch m of
pipeline p at stage s runs on the worker the re-routing assignment gives it (its own worker, or a
surviving data-parallel peer of the stage when its own worker failed, exactly as in training), so
the dead worker's share of the evaluation runs on its peers and the result is the fault-free one.

Each worker runs its items in (micro-batch, pipeline) order: receive the activation (except on the
first stage), forward, send the output to whoever runs the next stage of that micro-batch (except
on the last stage). Activations only flow down the stages, so no order of these lists deadlocks.
Pure Python.
"""

from __future__ import annotations

from ..ir import Action, ActionKind
from ..topology import Topology
from .reroute import reroute_assignment

__all__ = ["inference_actions"]


def inference_actions(topology: Topology, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per worker index (``stage * dp + pipeline``), the forward-only actions of one evaluation.

    Failed workers get an empty list.

    Raises:
        PlanningError: a stage has no surviving replica.
    """
    dp, pp = topology.dp, topology.pp
    where = reroute_assignment(topology, microbatches)
    lists: list[list[Action]] = [[] for _ in range(dp * pp)]
    for m in range(microbatches):
        for s in range(pp):
            for p in range(dp):
                w = where[(p, s, m)]
                if s > 0:
                    lists[w].append(Action(kind=ActionKind.RECV_ACT, stage=s, microbatch=m, pipeline=p,
                                           peer=where[(p, s - 1, m)]))
                lists[w].append(Action(kind=ActionKind.F, stage=s, microbatch=m, pipeline=p))
                if s < pp - 1:
                    lists[w].append(Action(kind=ActionKind.SEND_ACT, stage=s, microbatch=m, pipeline=p,
                                           peer=where[(p, s + 1, m)]))
    return tuple(tuple(x) for x in lists)
