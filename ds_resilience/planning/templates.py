"""Pipeline templates (Oobleck, SOSP'23) and their instantiation on the surviving nodes.

A *template* for ``n`` nodes is the best split of the model's ``L`` layers into ``n`` contiguous
stages, one per node: the smallest bottleneck (a stage's F + B + W time per micro-batch) such that
every stage fits its node's memory. Memory is checked, which Oobleck's planner does not do: stage
``k`` of ``n`` holds its layers' weights and optimizer state plus 1F1B's in-flight activations,
``n - k`` micro-batches of them.

Optimal by construction: for a bottleneck ``T``, placing each stage's layers greedily as far as
``T`` and the memory allow needs the fewest stages (an exchange argument: the greedy boundary after
``k`` stages is never behind any feasible partition's, since a suffix of a feasible stage is
feasible at the same position), and a partition with fewer than ``n`` stages splits into one of
``n`` (a part of a stage is feasible where it lands: later positions hold fewer in-flight
activations). So the template's bottleneck is the smallest candidate segment time whose greedy
placement needs at most ``n`` stages, found by bisection over the sorted segment times: O(L^2 log L)
per template. The tests check it against brute force.

An *instantiation* for ``N`` surviving nodes and tolerance ``f`` picks how many pipelines of each
template to run (at most ``N`` nodes, at least ``f + 1`` pipelines, so every layer is held ``f +
1`` times) and how many of the global batch's micro-batches each pipeline runs (at least one each,
all of them in total: the global batch and the loss normalisation do not change). The iteration
time is the slowest pipeline's, ``t(m) = sum of stage times + boundary messages + (m - 1) x
bottleneck`` for 1F1B; the choice minimizes it exactly: bisection over the candidate times, each
tested by a knapsack over (nodes used, pipelines) that maximizes the micro-batches the pipelines can
run within it. :meth:`Template.replayed_time` gives the figure from the schedule replay every other
plan is rated with: the same on even stages, within a few percent on uneven ones (the replay
overlaps some messages and fill that the closed form counts in full). Pure Python.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..costs import CostModel
from ..errors import PlanningError
from .layers import LayerProfile

__all__ = ["Link", "Template", "Instantiation", "PipelineUse", "plan_templates", "instantiate", "partition",
           "stage_cost_model"]


@dataclass(frozen=True)
class Link:
    """The network between neighbouring stages: per-message latency and bytes per time unit."""

    latency: float = 0.0
    bandwidth: float | None = None

    def time(self, nbytes: float) -> float:
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


def stage_cost_model(profile: LayerProfile, bounds: Sequence[int], link: Link = Link()) -> CostModel:
    """The stage-level cost model of the partition of ``profile``'s layers at ``bounds``."""
    b, n = bounds, len(bounds) - 1
    per = {name: [sum(getattr(profile, name)[b[k]:b[k + 1]]) for k in range(n)] for name in ("t_f", "t_b", "t_w")}
    out = [profile.output_bytes[b[k + 1] - 1] for k in range(n)]
    return CostModel(name=f"template{n}", activation_bytes=out, p2p_latency=link.latency,
                     p2p_bandwidth=link.bandwidth, **per)


class _Prefix:
    """Prefix sums of a profile: O(1) segment time and memory."""

    def __init__(self, profile: LayerProfile) -> None:
        n = profile.num_layers
        self.n = n
        t = [profile.t_f[i] + profile.t_b[i] + profile.t_w[i] for i in range(n)]
        self.time = list(itertools.accumulate(t, initial=0.0))
        self.static = list(itertools.accumulate((profile.param_bytes[i] + profile.optimizer_bytes[i]
                                                 for i in range(n)), initial=0.0))
        self.act = list(itertools.accumulate(profile.activation_bytes, initial=0.0))

    def seg_time(self, i: int, j: int) -> float:
        return self.time[j] - self.time[i]

    def seg_memory(self, i: int, j: int, inflight: int) -> float:
        return self.static[j] - self.static[i] + inflight * (self.act[j] - self.act[i])


@dataclass(frozen=True)
class Template:
    """The best ``nodes``-stage partition: stage ``k`` holds layers ``bounds[k]:bounds[k + 1]``."""

    nodes: int
    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    fill: float  # the stage times' sum plus the boundary messages on 1F1B's critical path, minus one bottleneck

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    def iteration_time(self, microbatches: int) -> float:
        """1F1B's iteration time with ``microbatches`` micro-batches (the planner's model)."""
        return self.fill + microbatches * self.bottleneck

    def cost_model(self, profile: LayerProfile, link: Link = Link()) -> CostModel:
        """The stage-level cost model of this partition (what the schedule replay rates)."""
        return stage_cost_model(profile, self.bounds, link)

    def replayed_time(self, microbatches: int, profile: LayerProfile, link: Link = Link()) -> float:
        """The iteration time from the schedule replay (fault-free 1F1B on this partition)."""
        from .planner import one_f_one_b_time

        return one_f_one_b_time(1, self.nodes, microbatches, self.cost_model(profile, link))

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "bounds": list(self.bounds), "stage_times": list(self.stage_times),
                "stage_memory": list(self.stage_memory), "bottleneck": self.bottleneck, "fill": self.fill}


def _greedy(pre: _Prefix, nodes: int, limit: float, cap: float | None) -> list[int] | None:
    """Stage boundaries placing each stage as far as ``limit`` and ``cap`` allow; ``None`` if more
    than ``nodes`` stages are needed (or a single layer fits nowhere)."""
    bounds = [0]
    i, k = 0, 0
    while i < pre.n:
        if k >= nodes:
            return None
        j = i
        inflight = nodes - k
        while j < pre.n and pre.seg_time(i, j + 1) <= limit + 1e-12 and (
                cap is None or pre.seg_memory(i, j + 1, inflight) <= cap + 1e-9):
            j += 1
        if j == i:
            return None
        bounds.append(j)
        i, k = j, k + 1
    return bounds


def _split_to(pre: _Prefix, bounds: list[int], nodes: int) -> list[int]:
    """Split stages (the slowest first, at its most balanced point) until there are ``nodes``."""
    bounds = list(bounds)
    while len(bounds) - 1 < nodes:
        candidates = [k for k in range(len(bounds) - 1) if bounds[k + 1] - bounds[k] > 1]
        k = max(candidates, key=lambda s: (pre.seg_time(bounds[s], bounds[s + 1]), -s))
        a, c = bounds[k], bounds[k + 1]
        b = min(range(a + 1, c), key=lambda x: (max(pre.seg_time(a, x), pre.seg_time(x, c)), x))
        bounds.insert(k + 1, b)
    return bounds


def partition(profile: LayerProfile, nodes: int, *, memory_cap: float | None = None, link: Link = Link(),
              _pre: _Prefix | None = None, _candidates: list[float] | None = None) -> Template | None:
    """The best template for ``nodes`` nodes, or ``None`` when none fits the memory (or ``nodes``
    exceeds the layer count)."""
    pre = _pre or _Prefix(profile)
    if nodes < 1 or nodes > pre.n:
        return None
    cands = _candidates if _candidates is not None else _segment_times(pre)
    lo = bisect.bisect_left(cands, pre.time[pre.n] / nodes - 1e-12)  # no bottleneck is below the mean
    hi = len(cands) - 1
    if _greedy(pre, nodes, cands[hi], memory_cap) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(pre, nodes, cands[mid], memory_cap) is not None:
            hi = mid
        else:
            lo = mid + 1
    bounds = _split_to(pre, _greedy(pre, nodes, cands[lo], memory_cap), nodes)
    times = tuple(pre.seg_time(bounds[k], bounds[k + 1]) for k in range(nodes))
    memory = tuple(pre.seg_memory(bounds[k], bounds[k + 1], nodes - k) for k in range(nodes))
    messages = sum(2 * link.time(profile.output_bytes[bounds[k + 1] - 1]) for k in range(nodes - 1))
    return Template(nodes=nodes, bounds=tuple(bounds), stage_times=times, stage_memory=memory,
                    fill=sum(times) + messages - max(times))


def _segment_times(pre: _Prefix) -> list[float]:
    return sorted({pre.seg_time(i, j) for i in range(pre.n) for j in range(i + 1, pre.n + 1)})


def plan_templates(profile: LayerProfile, min_nodes: int, max_nodes: int, *, memory_cap: float | None = None,
                   link: Link = Link()) -> dict[int, Template]:
    """The template for every node count in ``min_nodes..max_nodes`` that has one (fits the
    memory, at most one stage per layer)."""
    if not 1 <= min_nodes <= max_nodes:
        raise PlanningError(f"template range {min_nodes}..{max_nodes}: need 1 <= min_nodes <= max_nodes")
    pre = _Prefix(profile)
    cands = _segment_times(pre)
    out = {}
    for n in range(min_nodes, min(max_nodes, pre.n) + 1):
        t = partition(profile, n, memory_cap=memory_cap, link=link, _pre=pre, _candidates=cands)
        if t is not None:
            out[n] = t
    if not out:
        raise PlanningError(f"no template for {min_nodes}..{max_nodes} nodes fits memory_cap={memory_cap} "
                            f"({profile.num_layers} layers)")
    return out


@dataclass(frozen=True)
class PipelineUse:
    """One pipeline of an instantiation: its template's node count and its micro-batches."""

    nodes: int
    microbatches: int
    time: float


@dataclass(frozen=True)
class Instantiation:
    """How ``nodes`` surviving nodes run the job: the pipelines, their micro-batches, the time."""

    nodes: int
    microbatches: int
    tolerance: int
    pipelines: tuple[PipelineUse, ...]
    iteration_time: float
    idle_nodes: int
    counts: dict[int, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Micro-batches per time unit."""
        return self.microbatches / self.iteration_time

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "microbatches": self.microbatches, "tolerance": self.tolerance,
                "iteration_time": self.iteration_time, "throughput": self.throughput, "idle_nodes": self.idle_nodes,
                "counts": {str(k): v for k, v in sorted(self.counts.items())},
                "pipelines": [{"nodes": p.nodes, "microbatches": p.microbatches, "time": p.time}
                              for p in self.pipelines]}


def _capacity(t: Template, limit: float, most: int) -> int:
    """The most micro-batches ``t`` runs within ``limit`` (0: not even one)."""
    if t.iteration_time(1) > limit + 1e-9:
        return 0
    return min(most, int(math.floor((limit - t.fill) / t.bottleneck + 1e-9)))


def _knapsack(templates: Sequence[Template], nodes: int, need: int, limit: float
              ) -> tuple[int, list[int]] | None:
    """The most micro-batches pipelines of ``templates`` run within ``limit`` on at most ``nodes``
    nodes with at least ``need`` pipelines, and the node counts of those pipelines."""
    caps = [(t.nodes, _capacity(t, limit, 10**12)) for t in templates]
    caps = [(n, c) for n, c in caps if c > 0]
    neg = -1
    best = [[neg] * (need + 1) for _ in range(nodes + 1)]  # [nodes used][pipelines, capped at need]
    pick: dict[tuple[int, int], tuple[int, int, int]] = {}
    best[0][0] = 0
    for used in range(nodes + 1):
        for p in range(need + 1):
            value = best[used][p]
            if value == neg:
                continue
            for n, c in caps:
                u, q = used + n, min(need, p + 1)
                if u <= nodes and value + c > best[u][q]:
                    best[u][q] = value + c
                    pick[(u, q)] = (used, p, n)
    end = max((best[u][need], u) for u in range(nodes + 1))
    if end[0] == neg:
        return None
    total, u = end
    q, sizes = need, []
    while u > 0:
        pu, pq, n = pick[(u, q)]
        sizes.append(n)
        u, q = pu, pq
    return total, sorted(sizes, reverse=True)


def instantiate(templates: dict[int, Template] | Sequence[Template], nodes: int, microbatches: int, *,
                tolerance: int = 0) -> Instantiation:
    """The fastest way to run ``microbatches`` micro-batches per iteration on ``nodes`` nodes with
    every layer in at least ``tolerance + 1`` pipelines (see the module docstring).

    Raises:
        PlanningError: no combination of templates fits (too few nodes or micro-batches).
    """
    temps = sorted(templates.values() if isinstance(templates, dict) else templates, key=lambda t: t.nodes)
    need = tolerance + 1
    if tolerance < 0:
        raise PlanningError(f"tolerance must be >= 0, got {tolerance}")
    if microbatches < need:
        raise PlanningError(f"{microbatches} micro-batches cannot keep {need} pipelines busy (one each at least)")
    if not temps or need * temps[0].nodes > nodes:
        smallest = temps[0].nodes if temps else None
        raise PlanningError(f"{nodes} nodes cannot hold {need} pipelines (the smallest template has {smallest} nodes)")
    times = sorted({t.iteration_time(m) for t in temps for m in range(1, microbatches + 1)})
    lo, hi = 0, len(times) - 1

    def enough(limit: float) -> tuple[int, list[int]] | None:
        found = _knapsack(temps, nodes, need, limit)
        return found if found is not None and found[0] >= microbatches else None

    if enough(times[hi]) is None:
        raise PlanningError(f"no combination of templates runs {microbatches} micro-batches on {nodes} nodes")
    while lo < hi:
        mid = (lo + hi) // 2
        if enough(times[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    limit = times[lo]
    _, sizes = enough(limit)
    by_nodes = {t.nodes: t for t in temps}
    share = [_capacity(by_nodes[n], limit, microbatches) for n in sizes]
    extra = sum(share) - microbatches
    while extra > 0:  # hand back micro-batches from the slowest pipelines, one each at least;
        more = [i for i in range(len(sizes)) if share[i] > 1]
        if more:
            k = max(more, key=lambda i: (by_nodes[sizes[i]].iteration_time(share[i]), -i))
            share[k] -= 1
        else:  # more pipelines than micro-batches: the surplus ones (beyond f + 1) leave their nodes idle
            k = max(range(len(sizes)), key=lambda i: (sizes[i], i))
            del sizes[k], share[k]
        extra -= 1
    uses = tuple(PipelineUse(nodes=n, microbatches=m, time=by_nodes[n].iteration_time(m)) for n, m in zip(sizes, share))
    counts: dict[int, int] = {}
    for n in sizes:
        counts[n] = counts.get(n, 0) + 1
    return Instantiation(nodes=nodes, microbatches=microbatches, tolerance=tolerance, pipelines=uses,
                         iteration_time=max(u.time for u in uses), idle_nodes=nodes - sum(sizes), counts=counts)
