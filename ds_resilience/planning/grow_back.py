"""Growing back: the re-gridded survivors and the relaunched workers re-form the first grid.

A live re-grid (:mod:`.live_regrid`) leaves a job that lost a stage on a smaller grid. When the lost
workers come back (relaunched, or a replacement node's), the survivors and the joiners can re-form
the job's first grid at an iteration boundary (issue 46, part 2). This module is that step's pure
half, the same value on every participant:

1. **the plan** (:func:`plan_grow_back`): a :class:`~.live_regrid.LiveRegridPlan` whose grid is the
   first one (its ``dp x pp``, layer partition and micro-batches per pipeline), every rank back at
   its first position (so the rank table, the snapshot owners and the plan table's failure sets are
   the first grid's again), the layers each rank lacks sent by the small grid's holders (spread over
   them; nothing comes from the snapshots: the small grid holds every layer, and a joiner holds
   nothing), and the micro-batch map from the small grid's numbering to the first grid's: composed
   with the map the shrink left (``ds_regrid._compose``), the identity, so every pipeline trains
   its first micro-batches again;
2. **the decision** (:func:`decide_grow`): growing pays when its pause is shorter than what the
   iterations left save at the first grid's speed, ``pause < left x (small - full)``; the value
   carries its inputs for the log, as the shrink's ``regrid_pays`` does. Its figures:
   :func:`full_grid_time` (the small grid's measured iteration scaled by 1F1B's estimate of the two
   grids on the layers' costs, as ``ds_regrid.regrid_pays_for`` scales the fault-free time) and
   :func:`busiest_receiver_bytes` (what the pause is priced on: ``sim.regrid_cost.RegridCost.pause_s``
   takes the busiest receiver's bytes).

Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..errors import PlanningError
from ..topology import Topology
from .live_regrid import GridChoice, LiveRegridPlan, microbatch_map, one_f_one_b_time
from .regrid import Position, name_sources

__all__ = ["GrowDecision", "busiest_receiver_bytes", "decide_grow", "full_grid_time", "plan_grow_back"]


def _bounds(bounds: Sequence[int], pp: int, name: str) -> tuple[int, ...]:
    out = tuple(int(b) for b in bounds)
    if len(out) != pp + 1 or out[0] != 0 or any(b >= c for b, c in zip(out, out[1:])):
        raise PlanningError(f"{name} bounds {list(out)} are not {pp} non-empty increasing ranges")
    return out


def plan_grow_back(current: Topology, current_bounds: Sequence[int], current_microbatches: int,
                   original: Topology, original_bounds: Sequence[int], original_microbatches: int,
                   joiners: Iterable[int], *, idle: Iterable[int] = (),
                   layer_bytes: Sequence[float] | None = None,
                   layer_cost: Sequence[float] | None = None) -> LiveRegridPlan:
    """The grow back from the re-gridded ``current`` grid to ``original`` (module docstring).

    Args:
        current: the small grid (its rank table names the survivors by their first ranks), no
            failures in it (a failure while it runs is recovered first).
        current_bounds, current_microbatches: its layer partition and micro-batches per pipeline.
        original: the first grid, whose ranks every participant takes back.
        original_bounds, original_microbatches: its layer partition and micro-batches per pipeline.
        joiners: the relaunched ranks (they hold no state).
        idle: survivors the shrink left without a position (they hold no state either).
        layer_bytes: each layer's state in bytes (default 1 each).
        layer_cost: per-layer time of one micro-batch, for the first grid's predicted time.

    Raises:
        PlanningError: tensor parallelism, a failure in ``current``, participants that are not the
            first grid's ranks exactly, bounds over different layers, or another global batch.
    """
    if current.tp != 1 or original.tp != 1:
        raise PlanningError("growing back a tensor-parallel job is not supported (tp must be 1)")
    if current.failed:
        raise PlanningError(f"the small grid has failed workers {sorted(map(str, current.failed))}: recover them first")
    now = _bounds(current_bounds, current.pp, "current")
    first = _bounds(original_bounds, original.pp, "original")
    if now[-1] != first[-1]:
        raise PlanningError(f"the small grid cuts {now[-1]} layers, the first grid {first[-1]}")
    if current.dp * current_microbatches != original.dp * original_microbatches:
        raise PlanningError(f"the small grid's global batch is {current.dp} x {current_microbatches} micro-batches, "
                            f"the first grid's {original.dp} x {original_microbatches}")
    layers = first[-1]
    weights = tuple(float(b) for b in layer_bytes) if layer_bytes is not None else (1.0,) * layers
    if len(weights) != layers:
        raise PlanningError(f"{len(weights)} layer sizes for {layers} layers")
    placed = [current.rank(w) for w in current.workers()]
    joining, spare = sorted(set(joiners)), sorted(set(idle))
    everyone = placed + joining + spare
    wanted = sorted(original.rank(w) for w in original.workers())
    if len(set(everyone)) != len(everyone) or sorted(everyone) != wanted:
        raise PlanningError(f"growing back needs every rank of the first grid once: {wanted}; the small grid has "
                            f"{sorted(placed)}, joiners {joining}, idle {spare}")
    held: dict[int, list[int]] = {r: [] for r in everyone}
    for w in current.workers():
        held[current.rank(w)] = list(range(now[w.stage], now[w.stage + 1]))
    positions: dict[int, Position] = {}
    for r in everyone:
        w = original.coord(r)[0]
        positions[r] = Position(w.pipeline, w.stage, first[w.stage], first[w.stage + 1])
    moves = name_sources(positions, held, weights)
    if any(m.source is None for m in moves):  # pragma: no cover - the small grid holds every layer
        raise PlanningError("a layer is held by nobody in the small grid")
    cost = list(layer_cost) if layer_cost is not None else [1.0] * layers
    if len(cost) != layers:
        raise PlanningError(f"{len(cost)} layer costs for {layers} layers")
    grid = GridChoice(dp=original.dp, pp=original.pp, bounds=first, microbatches=original_microbatches,
                      predicted=one_f_one_b_time(first, original_microbatches, cost))
    return LiveRegridPlan(grid=grid, positions=positions, idle=(), fetches={}, lost_layers={}, moves=moves,
                          microbatches=microbatch_map(current.dp, current_microbatches, original.dp),
                          layer_bytes=weights)


@dataclass(frozen=True)
class GrowDecision:
    """Whether growing back pays, with the inputs it was decided on (logged as one JSON line).

    Attributes:
        small_s: the small grid's iteration time (measured, or predicted).
        full_s: the first grid's iteration time.
        pause_s: the grow's pause (moves, rebuild, the joiners' start-up not already overlapped).
        iterations_left: iterations the job still trains (``None``: not known, taken as many).
        pays: ``pause_s < iterations_left x (small_s - full_s)``; with ``iterations_left`` unknown,
            ``full_s < small_s``.
    """

    small_s: float
    full_s: float
    pause_s: float
    iterations_left: int | None
    pays: bool

    @property
    def saved_s(self) -> float | None:
        """What growing saves net of its pause (``None`` when the iterations left are unknown)."""
        if self.iterations_left is None:
            return None
        return self.iterations_left * (self.small_s - self.full_s) - self.pause_s

    def to_dict(self) -> dict[str, Any]:
        return {"small_s": self.small_s, "full_s": self.full_s, "pause_s": self.pause_s,
                "iterations_left": self.iterations_left, "saved_s": self.saved_s, "pays": self.pays}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def decide_grow(small_s: float, full_s: float, pause_s: float, iterations_left: int | None) -> GrowDecision:
    """Whether the survivors should grow back now (see :class:`GrowDecision`).

    Raises:
        PlanningError: a negative or non-finite time, or negative iterations left.
    """
    for name, value in (("small_s", small_s), ("full_s", full_s), ("pause_s", pause_s)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
            raise PlanningError(f"{name} must be a finite time >= 0, got {value!r}")
    if iterations_left is not None and (isinstance(iterations_left, bool) or not isinstance(iterations_left, int)
                                        or iterations_left < 0):
        raise PlanningError(f"iterations_left must be an integer >= 0 or None, got {iterations_left!r}")
    if iterations_left is None:
        pays = full_s < small_s
    else:
        pays = pause_s < iterations_left * (small_s - full_s)
    return GrowDecision(small_s=float(small_s), full_s=float(full_s), pause_s=float(pause_s),
                        iterations_left=iterations_left, pays=pays)


def busiest_receiver_bytes(plan: LiveRegridPlan) -> float:
    """The most bytes any one rank receives under ``plan`` (the receives run in parallel, so the
    busiest receiver bounds the transfer; 0 when nothing moves)."""
    got: dict[Any, float] = {}
    for m in plan.moves:
        got[m.to] = got.get(m.to, 0.0) + m.nbytes
    return max(got.values(), default=0.0)


def full_grid_time(small_s: float, current_bounds: Sequence[int], current_microbatches: int,
                   plan: LiveRegridPlan, layer_cost: Sequence[float] | None = None) -> float:
    """The first grid's iteration time predicted from the small grid's measured ``small_s``: scaled
    by 1F1B's estimate of the two grids (``(M + pp - 1) x`` the slowest stage) on ``layer_cost``
    (default: the plan's layer bytes, which stand in for time as in the shrink's partition).

    Raises:
        PlanningError: a negative time, bounds over another layer count, or a zero estimate.
    """
    if not 0 <= small_s < float("inf"):
        raise PlanningError(f"small_s must be a finite time >= 0, got {small_s!r}")
    cost = list(layer_cost) if layer_cost is not None else list(plan.layer_bytes)
    now = tuple(int(b) for b in current_bounds)
    if now[-1] != plan.grid.bounds[-1] or len(cost) != now[-1]:
        raise PlanningError(f"the small grid's bounds {list(now)} and {len(cost)} layer costs do not fit the "
                            f"first grid's {list(plan.grid.bounds)}")
    small = one_f_one_b_time(now, current_microbatches, cost)
    if small <= 0:
        raise PlanningError("the small grid's estimated iteration is 0: give layer costs")
    return small_s * one_f_one_b_time(plan.grid.bounds, plan.grid.microbatches, cost) / small
