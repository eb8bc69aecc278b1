"""Lower bounds on the iteration time of any schedule for a failure set.

For each stage s with ``n_s`` surviving replicas, the most loaded replica carries
``L_s = ceil(dp * M / n_s)`` micro-batches, i.e. ``work_s = L_s * (t_F + t_B + t_W)`` of compute.

* Work bound (all variants): ``max_s work_s`` plus the stage's reduce and optimizer time. This is
  the only bound the staggered optimizer's steady-state period must respect.
* Critical path, one iteration with one global optimizer barrier:
  - nothing reaches stage s before ``head_s = sum_{j<s} (t_F[j] + c)``;
  - fused backward (variant a): after the busiest replica's last backward, the gradient still runs
    through the stages before it, each a fused B+W: ``tail_s = sum_{j<s} (c + t_B[j] + t_W[j])``,
    so the iteration lasts at least ``head_s + work_s + tail_s``;
  - decoupled backward (variant b): the replica may defer its W past its last B, but at most all of
    them: at least ``head_s + work_s`` and ``head_s + work_s - L_s t_W[s] + sum_{j<s}(c + t_B[j]) + t_W[0]``.
  - every bound adds the reduce and optimizer time at the end, and the tied reduces (below) of the
    stage the path ends on: stage 0 for the gradient chains, stage s for ``head_s + work_s``.
* Tied groups: a worker of stage s runs, after its REDUCE_GRAD, one TIED_REDUCE per tied group g
  holding s, each a collective lasting ``d_g = max_{j in g} t_tied_reduce[j]`` during which it does
  nothing else, so ``tied_s = sum_{g holds s} d_g`` joins stage s's tail: in the work bound (busy time
  per iteration, valid for the steady-state period too) and after the stage a critical path ends on.
* Tied cycle (staggered optimizer, steady-state period): for stages ``a < b`` of one tied group g,
  nothing of iteration k+1 reaches stage b before stage a has stepped, which waits for iteration
  k's TIED_REDUCE(g), which waits for stage b's last compute of iteration k. So one period holds at
  least ``t_opt[a] + sum_{a<=j<b} (t_F[j] + c) + work_b + t_reduce[b] + d_g``: the stages of a tied
  group no longer overlap one iteration's tail with the next one's head.

``c`` is the link latency plus the activation transfer time. With unit costs and the reference
case (3 x 4, 6 micro-batches, one failure at stage s) this gives 27 + 2s (a), 27 + s (b) and 27 (c).
Pure Python.
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..ir import TiedGroups
from ..topology import Topology

__all__ = ["work_bound", "critical_path_bound", "tied_cycle_bound", "lower_bound", "tied_times"]


def _link(cost: CostModel, stage: int) -> float:
    return cost.p2p_latency + cost.transfer_time(cost.stage(stage).activation_bytes)


def _loads(topology: Topology, microbatches: int) -> list[int]:
    loads = []
    for s in range(topology.pp):
        n = len(topology.stage_peers(s))
        loads.append(math.ceil(topology.dp * microbatches / n) if n else 0)
    return loads


def tied_times(pp: int, cost: CostModel, tied: TiedGroups = ()) -> list[float]:
    """Per stage, the time its workers spend in TIED_REDUCEs per iteration (``tied_s``)."""
    out = [0.0] * pp
    for group in tied:
        d = cost.tied_reduce_time(group)
        for s in group:
            out[s] += d
    return out


def work_bound(topology: Topology, microbatches: int, cost: CostModel, *, tied: TiedGroups = ()) -> float:
    """Busiest replica's compute per iteration (plus its reduce, tied reduces and optimizer step)."""
    best = 0.0
    extra = tied_times(topology.pp, cost, tied)
    for s, load in enumerate(_loads(topology, microbatches)):
        c = cost.stage(s)
        best = max(best, load * (c.t_f + c.t_b + c.t_w) + c.t_reduce + extra[s] + c.t_opt)
    return best


def critical_path_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, split_backward: bool, tied: TiedGroups = ()
) -> float:
    """One iteration with a global optimizer barrier: the bound of the module docstring."""
    loads = _loads(topology, microbatches)
    finish = max(cost.stage(s).t_reduce + cost.stage(s).t_opt for s in range(topology.pp))
    extra = tied_times(topology.pp, cost, tied)
    best = 0.0
    for s, load in enumerate(loads):
        c = cost.stage(s)
        head = sum(cost.stage(j).t_f + _link(cost, j) for j in range(s))
        work = load * (c.t_f + c.t_b + c.t_w)
        if split_backward:
            chain = sum(_link(cost, j) + cost.stage(j).t_b for j in range(s))
            tail_start = head + work - load * c.t_w
            # the first path ends on stage s, the second (the gradient chain) on stage 0
            bound = max(
                head + work + extra[s], tail_start + chain + (cost.stage(0).t_w if s > 0 else 0.0) + extra[0]
            )
        else:  # the gradient chain ends on stage 0 (for s = 0 too)
            bound = head + work + sum(_link(cost, j) + cost.stage(j).t_b + cost.stage(j).t_w for j in range(s))
            bound += extra[0]
        best = max(best, bound + finish)
    return best


def tied_cycle_bound(topology: Topology, microbatches: int, cost: CostModel, tied: TiedGroups = ()) -> float:
    """Steady-state period bound of the staggered optimizer from tied groups (module docstring)."""
    loads = _loads(topology, microbatches)
    best = 0.0
    for group in tied:
        d = cost.tied_reduce_time(group)
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                c = cost.stage(b)
                fill = sum(cost.stage(j).t_f + _link(cost, j) for j in range(a, b))
                work = loads[b] * (c.t_f + c.t_b + c.t_w)
                best = max(best, cost.stage(a).t_opt + fill + work + c.t_reduce + d)
    return best


def lower_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, variant: str, tied: TiedGroups = ()
) -> float:
    """The bound that applies to ``variant`` (``adaptive``, ``decoupled`` or ``recycle``), with
    ``tied`` groups' reduces in the tails."""
    work = work_bound(topology, microbatches, cost, tied=tied)
    if variant == "recycle":
        return max(work, tied_cycle_bound(topology, microbatches, cost, tied))
    critical = critical_path_bound(topology, microbatches, cost, split_backward=variant == "decoupled", tied=tied)
    return max(work, critical)
