"""The gradient reduce of one rank on a :class:`~ds_resilience.ir.layout.PipelineLayout`.

On a rectangular grid a stage's replicas hold the same layers and REDUCE_GRAD sums over them. On a
template layout, pipelines cut the model at different layers, so the reduce runs per *segment* (a
layer range no pipeline splits) over its holders, one rank per pipeline, in descending layer order
(the order the backward produces them). Tied weights (an embedding shared by the first and last
layers) are left out of their segments' reduces and summed once over the holders of every copy,
as the executor's TIED_REDUCE does: each copy then holds the gradient over every use and every
micro-batch, so the copies step identically. Sums, not means: the loss is normalised by the global
micro-batch count, whatever the layout.

Groups are created in ascending segment order on every rank (then the tied groups in index
order): two ranks that share several segments meet them in the same order, so the creation
rendezvous cannot deadlock.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from ..comm.groups import Group
from ..errors import ResilienceError
from ..ir.layout import PipelineLayout

__all__ = ["SegmentReducer"]

GroupFactory = Callable[[Sequence[int], str], Group]


def _sum_into(group: Group | None, tensors: list[torch.Tensor]) -> None:
    """One flat all-reduce (sum) of the gradients of ``tensors`` over ``group``."""
    if not tensors or group is None:
        return
    for p in tensors:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    group.all_reduce_flat([p.grad for p in tensors])


class SegmentReducer:
    """``me``'s reduces on ``layout``.

    Args:
        layout: the layout every rank runs.
        me: this rank (a rank of the layout).
        params: layer -> this rank's parameters of that layer, tied copies left out.
        tied: tied group index -> this rank's copy of its parameters (only groups it holds).
        make_group: creates the group of the given ranks under the given name (every member calls
            it with the same name), e.g. ``lambda ranks, name: new_group(ranks, name=name, ...)``.
        name: a prefix unique to this layout's generation (group names must not repeat).

    Raises:
        ResilienceError: ``params`` names a layer ``me`` does not hold, or misses one it holds, or
            ``tied`` names a group ``me`` holds no copy of.
    """

    def __init__(self, layout: PipelineLayout, me: int, params: Mapping[int, Sequence[torch.Tensor]], *,
                 make_group: GroupFactory, tied: Mapping[int, Sequence[torch.Tensor]] | None = None,
                 name: str = "layout") -> None:
        mine = set(layout.layers_of(me))
        if set(params) != mine:
            raise ResilienceError(f"rank {me} holds layers {sorted(mine)} on this layout; parameters were given "
                                  f"for {sorted(params)}")
        tied = dict(tied or {})
        for g in tied:
            if me not in layout.tied_holders(g):
                raise ResilienceError(f"rank {me} holds no copy of tied group {g} (layers {layout.tied[g]})")
        self.layout, self.me = layout, me
        self.segments: list[tuple[int, Group | None, list[torch.Tensor]]] = []
        for seg in layout.segments():  # ascending on every rank: see the module docstring
            if me not in seg.holders:
                continue
            group = make_group(seg.holders, f"{name}-seg{seg.first}-{seg.last}") if len(seg.holders) > 1 else None
            self.segments.append((seg.first, group, [p for layer in seg.layers for p in params[layer]]))
        self.segments.sort(key=lambda s: -s[0])  # reduced in descending layer order
        self.tied: list[tuple[Group, list[torch.Tensor]]] = []
        for g in sorted(tied):
            holders = layout.tied_holders(g)
            self.tied.append((make_group(holders, f"{name}-tied{g}"), list(tied[g])))

    def reduce(self) -> None:
        """Sum every gradient this rank holds over its holders: segments, then tied groups."""
        for _, group, tensors in self.segments:
            _sum_into(group, tensors)
        for group, tensors in self.tied:
            _sum_into(group, tensors)
