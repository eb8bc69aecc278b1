"""Re-grid planning: which survivor takes which position of a template grid, and what moves.

After an instantiation (:mod:`.templates`) every pipeline of the new grid has positions, one per
stage, each holding a contiguous range of layers. Survivors hold the layers of their old stage.
:func:`plan_regrid` assigns positions to survivors so that the bytes they must receive (weights,
optimizer state) are the fewest (a minimum-cost matching, the Hungarian method: :func:`assign`),
then names, for each layer a survivor lacks, the surviving holder it comes from, spreading the
sends over the holders (in parallel) or ``None`` when no survivor holds it (it comes from the
in-memory snapshots). This is the planning half of issue 18's part 4; the transfer and the new
groups are not built yet. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from ..errors import PlanningError
from .templates import Instantiation, Template

__all__ = ["Position", "RegridPlan", "Move", "assign", "name_sources", "positions", "plan_regrid"]


@dataclass(frozen=True)
class Position:
    """Stage ``stage`` of pipeline ``pipeline`` of the new grid: layers ``first`` to ``last - 1``."""

    pipeline: int
    stage: int
    first: int
    last: int

    def layers(self) -> range:
        return range(self.first, self.last)


@dataclass(frozen=True)
class Move:
    """Layer ``layer`` goes to ``to`` from survivor ``source`` (``None``: from the snapshots)."""

    layer: int
    to: Hashable
    source: Hashable | None
    nbytes: float


@dataclass(frozen=True)
class RegridPlan:
    assignment: dict[Hashable, Position]
    idle: tuple[Hashable, ...]
    moves: tuple[Move, ...]

    @property
    def bytes_moved(self) -> float:
        return sum(m.nbytes for m in self.moves)

    @property
    def bytes_from_snapshots(self) -> float:
        return sum(m.nbytes for m in self.moves if m.source is None)

    def busiest_sender(self) -> float:
        """The most bytes any one survivor sends (what bounds the transfer time when sends run
        in parallel)."""
        sent: dict[Hashable, float] = {}
        for m in self.moves:
            if m.source is not None:
                sent[m.source] = sent.get(m.source, 0.0) + m.nbytes
        return max(sent.values(), default=0.0)


def positions(choice: Instantiation, templates: Mapping[int, Template]) -> list[Position]:
    """Every position of the instantiation's grid, pipeline by pipeline, stage by stage."""
    out = []
    for p, use in enumerate(choice.pipelines):
        b = templates[use.nodes].bounds
        out.extend(Position(p, k, b[k], b[k + 1]) for k in range(use.nodes))
    return out


def assign(cost: Sequence[Sequence[float]]) -> list[int]:
    """The minimum-cost assignment of every row to a distinct column (rows <= columns): the
    Hungarian method with potentials, O(rows^2 x columns). Returns the column of each row."""
    n = len(cost)
    m = len(cost[0]) if n else 0
    if n > m:
        raise PlanningError(f"cannot assign {n} rows to {m} columns")
    inf = math.inf
    u = [0.0] * (n + 1)
    v = [0.0] * (m + 1)
    match = [0] * (m + 1)  # column -> row (1-based), 0 = free
    way = [0] * (m + 1)
    for i in range(1, n + 1):
        match[0] = i
        j0 = 0
        minv = [inf] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = match[j0], inf, 0
            row = cost[i0 - 1]
            for j in range(1, m + 1):
                if not used[j]:
                    cur = row[j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    out = [0] * n
    for j in range(1, m + 1):
        if match[j]:
            out[match[j] - 1] = j - 1
    return out


def plan_regrid(held: Mapping[Hashable, Sequence[int]], targets: Sequence[Position],
                layer_bytes: Sequence[float]) -> RegridPlan:
    """Assign ``targets`` to the survivors in ``held`` (survivor -> the layers it holds now) with the
    fewest bytes received, and name each move's source.

    Raises:
        PlanningError: more positions than survivors, or a position naming a layer out of range.
    """
    survivors = list(held)
    if len(targets) > len(survivors):
        raise PlanningError(f"{len(targets)} positions for {len(survivors)} survivors")
    layers = len(layer_bytes)
    for t in targets:
        if not 0 <= t.first < t.last <= layers:
            raise PlanningError(f"position {t} names layers outside 0..{layers - 1}")
    have = {s: set(held[s]) for s in survivors}

    def lacking(s: Hashable, t: Position) -> float:
        return sum(layer_bytes[i] for i in t.layers() if i not in have[s])

    # positions as rows, survivors as columns: every position gets a survivor, extra survivors idle
    cost = [[lacking(s, t) for s in survivors] for t in targets]
    cols = assign(cost) if targets else []
    assignment = {survivors[c]: t for t, c in zip(targets, cols)}
    idle = tuple(s for s in survivors if s not in assignment)
    return RegridPlan(assignment=assignment, idle=idle, moves=name_sources(assignment, have, layer_bytes))


def name_sources(assignment: Mapping[Hashable, Position], held: Mapping[Hashable, Sequence[int]],
                 layer_bytes: Sequence[float]) -> tuple[Move, ...]:
    """For each layer a worker's position needs and it does not hold, the move that brings it: from
    the holder (in ``held``) that has sent the fewest bytes so far (the sends spread over the
    holders), ``None`` when nobody holds it. Positions in (pipeline, stage) order."""
    have = {s: set(v) for s, v in held.items()}
    holders: dict[int, list[Hashable]] = {}
    for s in have:
        for i in have[s]:
            holders.setdefault(i, []).append(s)
    sent: dict[Hashable, float] = {s: 0.0 for s in have}
    moves = []
    for s, t in sorted(assignment.items(), key=lambda kv: (kv[1].pipeline, kv[1].stage)):
        for i in t.layers():
            if i in have.get(s, ()):
                continue
            options = holders.get(i, [])
            source = min(options, key=lambda h: (sent[h], str(h))) if options else None
            if source is not None:
                sent[source] += layer_bytes[i]
            moves.append(Move(layer=i, to=s, source=source, nbytes=layer_bytes[i]))
    return tuple(moves)
