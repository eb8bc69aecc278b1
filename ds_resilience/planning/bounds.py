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
  - every bound adds, at the end, the reduce and the tied reduces (below) of the stage the path ends
    on (stage 0 for the gradient chains, stage s for ``head_s + work_s``), then the slowest stage's
    optimizer step (the global step starts when every worker has arrived).
* Tied groups: a worker of stage s runs, after its REDUCE_GRAD, one TIED_REDUCE per tied group g
  holding s, each a collective lasting ``d_g = max_{j in g} t_tied_reduce[j]`` during which it does
  nothing else, so ``tied_s = sum_{g holds s} d_g`` joins stage s's tail: in the work bound (busy time
  per iteration, valid for the steady-state period too) and after the stage a critical path ends on.
* Tied cycle (staggered optimizer, steady-state period): for stages ``a < b`` of one tied group g,
  nothing of iteration k+1 reaches stage b before stage a has stepped, which waits for iteration
  k's TIED_REDUCE(g), which waits for stage b's last compute of iteration k. So one period holds at
  least ``t_opt[a] + sum_{a<=j<b} (t_F[j] + c) + work_b + t_reduce[b] + d_g``: the stages of a tied
  group no longer overlap one iteration's tail with the next one's head.

* Memory (a cap ``C`` per worker, in the cost model's memory unit): once a replica's last B of an
  iteration has run it holds no activation, only pending W's, so at most
  ``D_s = min(L_s, C // w_s)`` of its W's (``w_s``: one pending W's memory) run after that B; the
  others run between its first F and its last B. In the decoupled critical path above, ``L_s t_W``
  becomes ``D_s t_W``.
* Fill (every variant; per iteration, so for the steady-state period too): a worker starts an
  iteration holding nothing (its previous W's ran before its step), and its first B waits for its
  first F plus the round trip below its stage, ``RT_s = sum_{j>s} (t_F[j] + t_B[j]) + 2 sum_{j>=s} c``
  (a fused B+W below for the fused backward). Until then it can only run forwards, at most
  ``N_s = C // a_s`` of them (``a_s``: one activation's memory), so it idles at least
  ``t_F[s] + RT_s - min(N_s, L_s) t_F[s]``, on top of its work. With unit costs and the reference
  case at a cap of 4 states this is 30 for a failure at stage 0 (27 + 3 idle) and 28 at stage 1.
* Stage-0 cycle (staggered optimizer, steady-state period), for each stage s > 0: stage 0's workers
  start iteration k+1 only after their step of iteration k, which follows their REDUCE_GRAD; so the
  busiest replica of stage s gets its first input at least ``t_opt[0] + head_s`` after that reduce,
  then runs ``L_s`` F's, ``L_s`` B's and at least ``L_s - D_s`` W's before its last B, whose gradient
  runs back through stages s-1..0 (``sum_{j<s} (c + t_B[j])``) and whose stage-0 W precedes stage 0's
  next reduce. One period holds at least ``t_opt[0] + head_s + L_s (t_F + t_B) + (L_s - D_s) t_W[s] +
  chain_s + t_W[0] + t_reduce[0] + tied_0``. Without a cap ``D_s = L_s`` and this rarely binds;
  under the memory fault-free 1F1B fits in it often does: with unit costs and the reference case at
  a cap of 4 states it is 26, 28 and 30 for a failure at stage 1, 2 and 3 (work bound 27).

``c`` is the link latency plus the activation transfer time. With unit costs and the reference
case (3 x 4, 6 micro-batches, one failure at stage s) this gives 27 + 2s (a), 27 + s (b) and 27 (c).
Pure Python.
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..ir import TiedGroups
from ..topology import Topology
from .memory import max_deferred_w
from .stage_mix import as_split, fusable_stages

__all__ = ["work_bound", "fill_bound", "critical_path_bound", "tied_cycle_bound", "stage0_cycle_bound", "lower_bound", "tied_times"]


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


def _per_mb(c, split_backward: bool) -> float:
    """One micro-batch's compute on a stage: F, then B and W, or the fused backward."""
    return c.t_f + (c.t_b + c.t_w if split_backward else c.t_bw)


def work_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, tied: TiedGroups = (), split_backward: bool = True
) -> float:
    """Busiest replica's compute per iteration (plus its reduce, tied reduces and optimizer step)."""
    best = 0.0
    extra = tied_times(topology.pp, cost, tied)
    for s, load in enumerate(_loads(topology, microbatches)):
        c = cost.stage(s)
        best = max(best, load * _per_mb(c, split_backward) + c.t_reduce + extra[s] + c.t_opt)
    return best


def fill_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, split_backward: bool, tied: TiedGroups = (),
    memory_cap: float | None = None,
) -> float:
    """The work bound plus the idle a memory cap forces before each iteration's first B (module
    docstring): never below :func:`work_bound`, equal to it when no stage's round trip outlasts its
    forwards."""
    pp = topology.pp
    loads = _loads(topology, microbatches)
    extra = tied_times(pp, cost, tied)
    weights = cost.memory_weights(pp)
    best = 0.0
    for s, load in enumerate(loads):
        c = cost.stage(s)
        if not load:  # no replica left: the work bound's term (no forwards, so no round trip to wait for)
            best = max(best, c.t_reduce + extra[s] + c.t_opt)
            continue
        below = range(s + 1, pp)
        trip = sum(cost.stage(j).t_f + (cost.stage(j).t_b if split_backward else cost.stage(j).t_bw) for j in below)
        trip += 2 * sum(_link(cost, j) for j in range(s, pp - 1))
        forwards = load
        if memory_cap is not None and weights[s][0] > 0:
            forwards = min(load, max(1, int(memory_cap // weights[s][0] + 1e-9)))
        idle = max(0.0, c.t_f + trip - forwards * c.t_f)
        best = max(best, load * _per_mb(c, split_backward) + idle + c.t_reduce + extra[s] + c.t_opt)
    return best


def _deferrable(cost: CostModel, pp: int, loads: list[int], memory_cap: float | None) -> list[int]:
    """Per stage, the most W's its busiest replica can defer past its last B (``D_s``)."""
    if memory_cap is None:
        return list(loads)
    weights = cost.memory_weights(pp)
    return [max_deferred_w(memory_cap, weights[s][1], load) for s, load in enumerate(loads)]


def critical_path_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, split_backward: bool, tied: TiedGroups = (),
    memory_cap: float | None = None,
) -> float:
    """One iteration with a global optimizer barrier: the bound of the module docstring."""
    loads = _loads(topology, microbatches)
    deferrable = _deferrable(cost, topology.pp, loads, memory_cap)
    # after the path, the stage it ends on reduces, then the global step waits for every worker,
    # and each steps its own stage: the slowest step closes the iteration
    step = max(cost.stage(s).t_opt for s in range(topology.pp))
    extra = tied_times(topology.pp, cost, tied)
    first = cost.stage(0)
    best = 0.0
    for s, load in enumerate(loads):
        c = cost.stage(s)
        head = sum(cost.stage(j).t_f + _link(cost, j) for j in range(s))
        work = load * _per_mb(c, split_backward)
        if split_backward:
            chain = sum(_link(cost, j) + cost.stage(j).t_b for j in range(s))
            tail_start = head + work - deferrable[s] * c.t_w
            # the first path ends on stage s, the second (the gradient chain) on stage 0
            bound = max(
                head + work + extra[s] + c.t_reduce,
                tail_start + chain + (first.t_w if s > 0 else 0.0) + extra[0] + first.t_reduce,
            )
        else:  # the gradient chain ends on stage 0 (for s = 0 too)
            bound = head + work + sum(_link(cost, j) + cost.stage(j).t_bw for j in range(s))
            bound += extra[0] + first.t_reduce
        best = max(best, bound + step)
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


def stage0_cycle_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, tied: TiedGroups = (), memory_cap: float | None = None
) -> float:
    """Steady-state period bound of the staggered optimizer from stage 0's step (module docstring)."""
    loads = _loads(topology, microbatches)
    deferrable = _deferrable(cost, topology.pp, loads, memory_cap)
    first = cost.stage(0)
    closing = first.t_opt + first.t_w + first.t_reduce + tied_times(topology.pp, cost, tied)[0]
    best = 0.0
    head = chain = 0.0
    for s in range(1, topology.pp):
        head += cost.stage(s - 1).t_f + _link(cost, s - 1)
        chain += _link(cost, s - 1) + cost.stage(s - 1).t_b
        c, load = cost.stage(s), loads[s]
        busy = load * (c.t_f + c.t_b) + (load - deferrable[s]) * c.t_w
        best = max(best, head + busy + chain + closing)
    return best


def lower_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, variant: str, tied: TiedGroups = (),
    memory_cap: float | None = None,
) -> float:
    """The bound that applies to ``variant`` (``adaptive``, ``decoupled`` or ``recycle``), with
    ``tied`` groups' reduces in the tails, under ``memory_cap`` (in ``cost.memory_unit``; ``None``:
    no cap). A split variant's plans may fuse the stages whose B + W costs more than their fused
    backward (:mod:`.stage_mix`); such a plan is a split one under ``as_split(cost, ...)``, so the
    bound is the smaller of the two models' split bounds."""
    costly = fusable_stages(cost, topology.pp, variant)
    if costly:
        mixed = as_split(cost, costly, topology.pp)
        return min(_variant_bound(topology, microbatches, c, variant=variant, tied=tied, memory_cap=memory_cap)
                   for c in (cost, mixed))
    return _variant_bound(topology, microbatches, cost, variant=variant, tied=tied, memory_cap=memory_cap)


def _variant_bound(
    topology: Topology, microbatches: int, cost: CostModel, *, variant: str, tied: TiedGroups,
    memory_cap: float | None,
) -> float:
    # the fill bound holds the work bound (its idle term is >= 0)
    work = fill_bound(topology, microbatches, cost, split_backward=variant != "adaptive", tied=tied,
                      memory_cap=memory_cap)
    if variant == "recycle":
        return max(work, tied_cycle_bound(topology, microbatches, cost, tied),
                   stage0_cycle_bound(topology, microbatches, cost, tied=tied, memory_cap=memory_cap))
    critical = critical_path_bound(topology, microbatches, cost, split_backward=variant == "decoupled", tied=tied,
                                   memory_cap=memory_cap)
    return max(work, critical)
