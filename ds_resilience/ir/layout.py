"""Layouts: which rank holds which layers, when pipelines differ in depth and stage boundaries.

A rectangular ``dp`` x ``pp`` grid is the special case of one template. After a re-grid onto
pipeline templates (Oobleck, SOSP'23) the job runs *groups*: each group is ``pipelines`` pipelines
of one template (the same stage boundaries ``bounds`` over the model's layers), each pipeline
running ``microbatches`` micro-batches. Within a group, same-position stages hold the same layers
(data-parallel peers, what re-routing works with); across groups the stage boundaries differ, so
the unit of the gradient reduce is the *segment*: a maximal layer range that no pipeline splits.

What a layout fixes, so that a step is the fault-free global step whatever the layout:

* **the gradient reduce** of each segment runs over its *holders*, one rank per pipeline
  (:meth:`PipelineLayout.segments`), issued in descending layer order
  (:meth:`PipelineLayout.reduce_order`) so that it overlaps the backward, which produces the last
  layers' gradients first;
* **tied weights** (a shared embedding at layers 0 and L-1) reduce over the holders of every
  copy (:meth:`PipelineLayout.tied_holders`);
* **samples**: the global batch's micro-batches are numbered once, group by group and pipeline by
  pipeline (:meth:`PipelineLayout.microbatch_ids`); the loss is normalised by their total, unchanged;
* **random streams** (dropout) are keyed by layer and global micro-batch, not by stage or pipeline
  (:func:`rng_key`), so a sample draws the same masks in whichever stage of whichever pipeline
  its layer runs.

Pure Python (layer L0).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from ..errors import ScheduleError

__all__ = ["PipelineGroup", "LayerSegment", "PipelineLayout", "PipelineLayoutError", "rng_key"]


class PipelineLayoutError(ScheduleError):
    """A layout that cannot run: bad boundaries, ranks, counts or tied layers."""


@dataclass(frozen=True, kw_only=True)
class PipelineGroup:
    """``pipelines`` pipelines of one template; ``ranks[q][k]`` holds stage ``k`` of pipeline ``q``,
    layers ``bounds[k]`` to ``bounds[k + 1] - 1``."""

    bounds: tuple[int, ...]
    pipelines: int
    microbatches: int
    ranks: tuple[tuple[int, ...], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_of_layer(self, layer: int) -> int:
        for k in range(self.stages):
            if self.bounds[k] <= layer < self.bounds[k + 1]:
                return k
        raise PipelineLayoutError(f"layer {layer} is outside this group's layers 0..{self.bounds[-1] - 1}")


@dataclass(frozen=True, kw_only=True)
class LayerSegment:
    """Layers ``first`` to ``last - 1``, held whole by each rank in ``holders`` (one per pipeline)."""

    first: int
    last: int
    holders: tuple[int, ...]

    @property
    def layers(self) -> range:
        return range(self.first, self.last)


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """The groups of one job over ``layers`` layers (see the module docstring).

    ``tied``: layer tuples whose weights are one tensor (e.g. ``((0, 23),)``); ``tolerance``: the
    failures it must survive, so every layer is held by at least ``tolerance + 1`` pipelines.

    Raises:
        PipelineLayoutError: naming the group, pipeline or layer that is wrong and what is allowed.
    """

    layers: int
    groups: tuple[PipelineGroup, ...]
    tied: tuple[tuple[int, ...], ...] = ()
    tolerance: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layers, int) or self.layers < 1:
            raise PipelineLayoutError(f"layers must be an integer >= 1, got {self.layers!r}")
        if not self.groups:
            raise PipelineLayoutError("a layout needs at least one group of pipelines")
        seen: dict[int, str] = {}
        for g, group in enumerate(self.groups):
            b = group.bounds
            if len(b) < 2 or b[0] != 0 or b[-1] != self.layers or any(x >= y for x, y in zip(b, b[1:])):
                raise PipelineLayoutError(f"group {g}: bounds {list(b)} must rise strictly from 0 to {self.layers}")
            if group.pipelines < 1 or group.microbatches < 1:
                raise PipelineLayoutError(f"group {g}: pipelines and microbatches must be >= 1, got "
                                  f"{group.pipelines} and {group.microbatches}")
            if len(group.ranks) != group.pipelines or any(len(r) != group.stages for r in group.ranks):
                raise PipelineLayoutError(f"group {g}: ranks must be {group.pipelines} pipelines x {group.stages} stages")
            for q, row in enumerate(group.ranks):
                for k, rank in enumerate(row):
                    where = f"group {g} pipeline {q} stage {k}"
                    if rank in seen:
                        raise PipelineLayoutError(f"rank {rank} holds two positions: {seen[rank]} and {where}")
                    seen[rank] = where
        if self.pipelines < self.tolerance + 1:
            raise PipelineLayoutError(f"{self.pipelines} pipelines hold each layer; tolerance {self.tolerance} "
                              f"needs at least {self.tolerance + 1}")
        for t in self.tied:
            if len(set(t)) < 2 or any(not 0 <= layer < self.layers for layer in t):
                raise PipelineLayoutError(f"tied layers {t}: need two or more distinct layers in 0..{self.layers - 1}")

    @property
    def pipelines(self) -> int:
        return sum(g.pipelines for g in self.groups)

    @property
    def microbatches(self) -> int:
        """The global batch in micro-batches (the loss is normalised by it)."""
        return sum(g.pipelines * g.microbatches for g in self.groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for g in self.groups for row in g.ranks for r in row))

    def position(self, rank: int) -> tuple[int, int, int]:
        """(group, pipeline, stage) of ``rank``."""
        for g, group in enumerate(self.groups):
            for q, row in enumerate(group.ranks):
                if rank in row:
                    return g, q, row.index(rank)
        raise PipelineLayoutError(f"rank {rank} holds nothing in this layout; ranks: {list(self.ranks)}")

    def layers_of(self, rank: int) -> range:
        g, _, k = self.position(rank)
        b = self.groups[g].bounds
        return range(b[k], b[k + 1])

    def segments(self) -> tuple[LayerSegment, ...]:
        """The layers cut at every group's stage boundaries, ascending, each with its holders."""
        cuts = sorted({x for g in self.groups for x in g.bounds})
        out = []
        for first, last in zip(cuts, cuts[1:]):
            holders = tuple(sorted(g.ranks[q][g.stage_of_layer(first)] for g in self.groups for q in range(g.pipelines)))
            out.append(LayerSegment(first=first, last=last, holders=holders))
        return tuple(out)

    def reduce_order(self, rank: int | None = None) -> tuple[LayerSegment, ...]:
        """The segments in the order their reduces are issued: descending layers (the backward's
        order); with ``rank``, only the segments it holds."""
        segs = sorted(self.segments(), key=lambda s: -s.first)
        return tuple(s for s in segs if rank is None or rank in s.holders)

    def tied_holders(self, index: int) -> tuple[int, ...]:
        """Every rank holding a copy of tied group ``index`` (its reduce runs over all of them)."""
        if not 0 <= index < len(self.tied):
            raise PipelineLayoutError(f"tied group {index} does not exist; the layout has {len(self.tied)}")
        layers = self.tied[index]
        return tuple(sorted({g.ranks[q][g.stage_of_layer(layer)] for layer in layers
                             for g in self.groups for q in range(g.pipelines)}))

    def microbatch_ids(self, group: int, pipeline: int) -> range:
        """The global micro-batch numbers pipeline ``pipeline`` of group ``group`` runs."""
        if not 0 <= group < len(self.groups) or not 0 <= pipeline < self.groups[group].pipelines:
            raise PipelineLayoutError(f"no pipeline {pipeline} in group {group}")
        start = sum(g.pipelines * g.microbatches for g in self.groups[:group])
        m = self.groups[group].microbatches
        return range(start + pipeline * m, start + (pipeline + 1) * m)

    def describe(self) -> str:
        return " + ".join(f"{g.pipelines}x{g.stages} (m={g.microbatches})" for g in self.groups)


def rng_key(seed: int, iteration: int, layer: int, microbatch: int) -> int:
    """The random stream of ``layer`` for global micro-batch ``microbatch`` in ``iteration``: a
    63-bit seed that depends on nothing else (not the stage, pipeline or rank that runs it)."""
    text = f"{seed}:{iteration}:{layer}:{microbatch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & (2**63 - 1)

