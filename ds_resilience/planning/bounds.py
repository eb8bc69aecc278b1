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
  - every bound adds the reduce and optimizer time at the end.

``c`` is the link latency plus the activation transfer time. With unit costs and the reference
case (3 x 4, 6 micro-batches, one failure at stage s) this gives 27 + 2s (a), 27 + s (b) and 27 (c).
Pure Python.
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..topology import Topology

__all__ = ["work_bound", "critical_path_bound", "lower_bound"]


def _link(cost: CostModel, stage: int) -> float:
    return cost.p2p_latency + cost.transfer_time(cost.stage(stage).activation_bytes)


def _loads(topology: Topology, microbatches: int) -> list[int]:
    loads = []
    for s in range(topology.pp):
        n = len(topology.stage_peers(s))
        loads.append(math.ceil(topology.dp * microbatches / n) if n else 0)
    return loads


def work_bound(topology: Topology, microbatches: int, cost: CostModel) -> float:
    """Busiest replica's compute per iteration (plus its reduce and optimizer step)."""
    best = 0.0
    for s, load in enumerate(_loads(topology, microbatches)):
        c = cost.stage(s)
        best = max(best, load * (c.t_f + c.t_b + c.t_w) + c.t_reduce + c.t_opt)
    return best


def critical_path_bound(topology: Topology, microbatches: int, cost: CostModel, *, split_backward: bool) -> float:
    """One iteration with a global optimizer barrier: the bound of the module docstring."""
    loads = _loads(topology, microbatches)
    finish = max(cost.stage(s).t_reduce + cost.stage(s).t_opt for s in range(topology.pp))
    best = 0.0
    for s, load in enumerate(loads):
        c = cost.stage(s)
        head = sum(cost.stage(j).t_f + _link(cost, j) for j in range(s))
        work = load * (c.t_f + c.t_b + c.t_w)
        if split_backward:
            chain = sum(_link(cost, j) + cost.stage(j).t_b for j in range(s))
            tail_start = head + work - load * c.t_w
            bound = max(head + work, tail_start + chain + (cost.stage(0).t_w if s > 0 else 0.0))
        else:
            bound = head + work + sum(_link(cost, j) + cost.stage(j).t_b + cost.stage(j).t_w for j in range(s))
        best = max(best, bound + finish)
    return best


def lower_bound(topology: Topology, microbatches: int, cost: CostModel, *, variant: str) -> float:
    """The bound that applies to ``variant`` (``adaptive``, ``decoupled`` or ``recycle``)."""
    work = work_bound(topology, microbatches, cost)
    if variant == "recycle":
        return work
    return max(work, critical_path_bound(topology, microbatches, cost, split_backward=variant == "decoupled"))
