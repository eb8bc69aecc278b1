"""The live re-grid plan: the grid the survivors re-form, who takes which position, what moves.

When a stage loses every replica (or failures pile up until re-routing is slower than a smaller
grid), the survivors can re-form a smaller ``dp' x pp'`` grid without a restart (issue 18,
part 4). This module is that decision as one pure value, :class:`LiveRegridPlan`, the same on
every survivor (same inputs), logged as one JSON line:

1. **the grid** (:func:`choose_grid`): among every ``dp' x pp'`` that fits the survivors, whose
   ``dp'`` divides the global batch's micro-batches (the global batch and its loss normalisation
   stay as they were), the one with the shortest predicted iteration (1F1B's
   ``(M' + pp' - 1) x`` the slowest stage's per-micro-batch time, from per-layer costs, or the
   caller's own ``time_of``: the profiled planner); ties go to fewer idle survivors, then fewer
   stages. Its layer partition comes from ``bounds_for(pp')`` (the engine's own partition method:
   DeepSpeed's ``partition_uniform`` by default, reproduced in :func:`uniform_bounds`);
2. **the micro-batches** (:func:`microbatch_map`): the old global batch, pipeline by pipeline, in
   order, dealt in contiguous blocks to the new pipelines, so every sample is trained once and the
   same samples make the same step;
3. **the positions** (:func:`~.regrid.plan_regrid`): the minimum-bytes assignment of survivors to
   positions (the Hungarian method), and for each layer a survivor lacks, the surviving holder it
   comes from;
4. **the snapshots**: a layer of a stage that lost every replica is held by no survivor; one
   survivor fetches the whole stage from the in-memory snapshots (of the stage's lowest dead rank,
   at the resume step: ZeRO-0 replicas are identical) and becomes its holder: the survivor whose
   new position needs most of that stage's layers, so the fetch itself covers as much as it can.

Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..errors import PlanningError
from ..topology import Topology
from .regrid import Move, Position, plan_regrid

__all__ = ["GridChoice", "LiveRegridPlan", "choose_grid", "lost_stage_sources", "microbatch_map", "plan_live_regrid",
           "regrid_pays", "uniform_bounds"]


def uniform_bounds(layers: int, parts: int) -> tuple[int, ...]:
    """DeepSpeed's ``partition_uniform``: ``parts`` ranges of ``layers // parts`` layers, the first
    ``layers % parts`` of them one longer (and one layer each, then empty ones, with fewer layers
    than parts). Stage ``k`` holds layers ``bounds[k]`` to ``bounds[k + 1] - 1``."""
    if parts < 1 or layers < 0:
        raise PlanningError(f"cannot cut {layers} layers into {parts} parts")
    if layers <= parts:
        return tuple(min(p, layers) for p in range(parts + 1))
    size, extra = divmod(layers, parts)
    bounds = [0]
    for p in range(parts):
        bounds.append(bounds[-1] + size + (1 if p < extra else 0))
    return tuple(bounds)


@dataclass(frozen=True)
class GridChoice:
    """A ``dp x pp`` grid with its layer partition, micro-batches per pipeline and predicted time."""

    dp: int
    pp: int
    bounds: tuple[int, ...]
    microbatches: int
    predicted: float

    @property
    def workers(self) -> int:
        return self.dp * self.pp


def one_f_one_b_time(bounds: Sequence[int], microbatches: int, layer_cost: Sequence[float]) -> float:
    """1F1B's iteration time in the slowest stage's per-micro-batch time: ``(M + pp - 1) x max``."""
    stage = [sum(layer_cost[bounds[k]:bounds[k + 1]]) for k in range(len(bounds) - 1)]
    return (microbatches + len(stage) - 1) * max(stage, default=0.0)


def choose_grid(survivors: int, layers: int, total_microbatches: int, *,
                bounds_for: Callable[[int], Sequence[int] | None] | None = None,
                layer_cost: Sequence[float] | None = None,
                time_of: Callable[[int, int, tuple[int, ...], int], float] | None = None,
                max_pp: int | None = None, layer_memory: Sequence[float] | None = None,
                memory_cap: float | None = None) -> GridChoice:
    """The grid the survivors re-form (see the module docstring).

    Args:
        survivors: how many workers are left.
        layers: the model's pipeline layers.
        total_microbatches: the global batch in micro-batches (old ``dp x M``).
        bounds_for: ``pp -> bounds`` (default :func:`uniform_bounds`); every stage must get a layer;
            ``None`` for a stage count no partition fits (a template planner's answer).
        layer_cost: per-layer time of one micro-batch's forward and backward (default 1 each).
        time_of: ``(dp, pp, bounds, M) -> iteration time``, replacing the 1F1B estimate.
        max_pp: the most stages a grid may have (default: no more than layers or survivors).
        layer_memory, memory_cap: a worker's memory per layer and what a worker may hold: a grid
            any of whose stages holds more is not considered (default: no limit).

    Raises:
        PlanningError: no grid fits (no survivor, no ``dp`` divides the micro-batches, or no
            partition fits the memory cap).
    """
    if survivors < 1:
        raise PlanningError("no survivor left to re-grid onto")
    if total_microbatches < 1:
        raise PlanningError(f"the global batch has {total_microbatches} micro-batches")
    cost = list(layer_cost) if layer_cost is not None else [1.0] * layers
    if len(cost) != layers:
        raise PlanningError(f"{len(cost)} layer costs for {layers} layers")
    cut = bounds_for or (lambda pp: uniform_bounds(layers, pp))
    memory = list(layer_memory) if layer_memory is not None else [0.0] * layers
    if len(memory) != layers:
        raise PlanningError(f"{len(memory)} layer memory sizes for {layers} layers")
    best: tuple[tuple[float, int, int], GridChoice] | None = None
    for pp in range(1, min(survivors, layers, max_pp or layers) + 1):
        got = cut(pp)
        if got is None:
            continue
        bounds = tuple(int(b) for b in got)
        if len(bounds) != pp + 1 or bounds[0] != 0 or bounds[-1] != layers or any(
                b >= c for b, c in zip(bounds, bounds[1:])):
            raise PlanningError(f"bounds_for({pp}) gave {list(bounds)}: {pp} non-empty ranges covering 0..{layers} wanted")
        if memory_cap is not None and max(sum(memory[a:b]) for a, b in zip(bounds, bounds[1:])) > memory_cap:
            continue  # a stage of this partition does not fit a worker
        for dp in range(survivors // pp, 0, -1):
            if total_microbatches % dp:
                continue
            m = total_microbatches // dp
            t = time_of(dp, pp, bounds, m) if time_of is not None else one_f_one_b_time(bounds, m, cost)
            key = (round(t, 9), survivors - dp * pp, pp)
            if best is None or key < best[0]:
                best = (key, GridChoice(dp=dp, pp=pp, bounds=bounds, microbatches=m, predicted=t))
            break  # the largest dp that divides is the fastest for this pp (fewer micro-batches each)
    if best is None:
        raise PlanningError(f"no dp x pp grid on {survivors} survivors both divides {total_microbatches} "
                            f"micro-batches and fits the memory cap {memory_cap}")
    return best[1]


def microbatch_map(old_dp: int, old_microbatches: int, new_dp: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each new pipeline, the old ``(pipeline, micro-batch)`` it trains, in order: the old global
    batch pipeline by pipeline, dealt in contiguous blocks.

    Raises:
        PlanningError: ``new_dp`` does not divide the global batch's micro-batches.
    """
    total = old_dp * old_microbatches
    if new_dp < 1 or total % new_dp:
        raise PlanningError(f"{new_dp} pipelines cannot share {total} micro-batches evenly "
                            f"(the global batch and its loss normalisation must stay as they are)")
    flat = [(p, i) for p in range(old_dp) for i in range(old_microbatches)]
    m = total // new_dp
    return tuple(tuple(flat[q * m:(q + 1) * m]) for q in range(new_dp))


@dataclass(frozen=True)
class LiveRegridPlan:
    """What every survivor does to re-form the grid (module docstring).

    Attributes:
        grid: the new grid, its partition and micro-batches per pipeline.
        positions: survivor rank -> its new position (pipeline, stage, layers).
        idle: survivors left without a position.
        fetches: lost stage -> ``(dead rank whose snapshot is read, survivor that fetches it)``.
        lost_layers: lost stage -> ``(first, last)``: the layers its snapshot holds.
        moves: the layers sent between survivors (``source`` a survivor rank; the fetchers hold
            their stage's layers once fetched).
        microbatches: per new pipeline, the old ``(pipeline, micro-batch)`` pairs it trains.
        layer_bytes: what each layer's state weighs (the costs the matching used).
    """

    grid: GridChoice
    positions: dict[int, Position]
    idle: tuple[int, ...]
    fetches: dict[int, tuple[int, int]]
    lost_layers: dict[int, tuple[int, int]]
    moves: tuple[Move, ...]
    microbatches: tuple[tuple[tuple[int, int], ...], ...]
    layer_bytes: tuple[float, ...] = field(repr=False)

    @property
    def bytes_moved(self) -> float:
        return sum(m.nbytes for m in self.moves)

    @property
    def bytes_fetched(self) -> float:
        return sum(sum(self.layer_bytes[a:b]) for a, b in self.lost_layers.values())

    def rank_table(self) -> dict[tuple[int, int], int]:
        """``(pipeline, stage)`` of the new grid -> the survivor's (old, global) rank."""
        return {(p.pipeline, p.stage): r for r, p in self.positions.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid": {"dp": self.grid.dp, "pp": self.grid.pp, "bounds": list(self.grid.bounds),
                     "microbatches": self.grid.microbatches, "predicted": self.grid.predicted},
            "positions": {str(r): [p.pipeline, p.stage, p.first, p.last] for r, p in sorted(self.positions.items())},
            "idle": list(self.idle),
            "fetches": {str(s): list(v) for s, v in sorted(self.fetches.items())},
            "bytes_fetched": self.bytes_fetched,
            "moves": [[m.layer, m.to, m.source, m.nbytes] for m in self.moves],
            "bytes_moved": self.bytes_moved,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def lost_stage_sources(topology: Topology, failed_ranks: Iterable[int]) -> dict[int, int]:
    """Each stage that lost every replica -> the dead rank whose snapshot it is fetched from (its
    lowest: ZeRO-0 replicas hold the same state)."""
    failed = set(failed_ranks)
    alive = {w.stage for w in topology.workers() if topology.rank(w) not in failed}
    out: dict[int, int] = {}
    for r in sorted(r for r in failed if topology.has_rank(r)):
        stage = topology.coord(r)[0].stage
        if stage not in alive:
            out.setdefault(stage, r)
    return out


def plan_live_regrid(topology: Topology, failed_ranks: Iterable[int], old_bounds: Sequence[int],
                     microbatches: int, *, layer_bytes: Sequence[float] | None = None,
                     bounds_for: Callable[[int], Sequence[int]] | None = None,
                     layer_cost: Sequence[float] | None = None,
                     time_of: Callable[[int, int, tuple[int, ...], int], float] | None = None,
                     memory_cap: float | None = None) -> LiveRegridPlan:
    """The re-grid of ``topology`` without ``failed_ranks`` (module docstring).

    Args:
        topology: the grid before (``tp == 1``: a worker is one rank).
        failed_ranks: the failed global ranks.
        old_bounds: the layer partition of ``topology`` (``pp + 1`` increasing bounds).
        microbatches: micro-batches per pipeline before (``M``).
        layer_bytes: each layer's state in bytes (default 1 each: the fewest layers moved).
        bounds_for, layer_cost, time_of: as for :func:`choose_grid`.
        memory_cap: the most bytes of layer state a worker may hold (default: no limit).

    Raises:
        PlanningError: tensor parallelism, bounds that do not fit the topology, or no grid.
    """
    if topology.tp != 1:
        raise PlanningError("a live re-grid of a tensor-parallel job is not supported (tp must be 1)")
    old_bounds = tuple(int(b) for b in old_bounds)
    if len(old_bounds) != topology.pp + 1 or old_bounds[0] != 0 or any(b >= c for b, c in zip(old_bounds, old_bounds[1:])):
        raise PlanningError(f"old bounds {list(old_bounds)} are not {topology.pp} non-empty increasing ranges")
    layers = old_bounds[-1]
    weights = tuple(float(b) for b in layer_bytes) if layer_bytes is not None else (1.0,) * layers
    if len(weights) != layers:
        raise PlanningError(f"{len(weights)} layer sizes for {layers} layers")
    failed = set(failed_ranks)
    alive = [topology.rank(w) for w in topology.workers() if topology.rank(w) not in failed]
    grid = choose_grid(len(alive), layers, topology.dp * microbatches, bounds_for=bounds_for,
                       layer_cost=layer_cost, time_of=time_of, layer_memory=weights, memory_cap=memory_cap)
    stage_of = {topology.rank(w): w.stage for w in topology.workers()}
    held = {r: list(range(old_bounds[stage_of[r]], old_bounds[stage_of[r] + 1])) for r in alive}
    targets = [Position(p, k, grid.bounds[k], grid.bounds[k + 1]) for p in range(grid.dp) for k in range(grid.pp)]
    first = plan_regrid(held, targets, weights)
    fetches: dict[int, tuple[int, int]] = {}
    lost_layers: dict[int, tuple[int, int]] = {}
    sources = lost_stage_sources(topology, failed)
    for s, dead in sorted(sources.items()):
        span = range(old_bounds[s], old_bounds[s + 1])
        lost_layers[s] = (span.start, span.stop)

        def need(r: int) -> float:
            pos = first.assignment.get(r)
            return sum(weights[i] for i in span if pos is not None and pos.first <= i < pos.last)

        receiver = min(alive, key=lambda r: (-need(r), r))
        fetches[s] = (dead, receiver)
        held[receiver] = sorted(set(held[receiver]) | set(span))
    plan = plan_regrid(held, targets, weights) if sources else first
    if any(m.source is None for m in plan.moves):
        raise PlanningError("a layer is held by no survivor and fetched by none")  # pragma: no cover - invariant
    return LiveRegridPlan(grid=grid, positions=dict(plan.assignment), idle=tuple(sorted(plan.idle)),
                          fetches=fetches, lost_layers=lost_layers, moves=plan.moves,
                          microbatches=microbatch_map(topology.dp, microbatches, grid.dp), layer_bytes=weights)


def regrid_pays(reroute_s: float | None, regrid_s: float, pause_s: float, horizon: int) -> bool:
    """Whether re-gridding beats re-routing over the next ``horizon`` iterations, its own pause
    included: ``horizon x regrid_s + pause_s < horizon x reroute_s``. ``reroute_s`` is ``None``
    when re-routing cannot cover the failures (a stage lost every replica): then it always pays."""
    if horizon < 1:
        raise PlanningError(f"the re-grid horizon must be >= 1 iteration, got {horizon}")
    if reroute_s is None:
        return True
    return horizon * regrid_s + pause_s < horizon * reroute_s
