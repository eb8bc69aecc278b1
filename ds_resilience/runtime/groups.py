"""Process groups of one membership generation: all survivors, and each stage's survivors.

Each group is a standalone gloo process group over a ``PrefixStore`` named by a session id, the
generation and its members, so a later generation never meets an earlier one's keys or pairs
(``dist.new_group`` names groups by their ranks alone, which collides when a member set recurs,
e.g. the same worker failing twice). Groups keep the original global ranks at their interface:
:class:`Group` translates to group-local ranks. Only the members construct a group; a dead rank is
never waited for.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ..topology import Topology, Worker

__all__ = ["Group", "GenerationGroups", "build_groups", "new_group"]


class Group:
    """A gloo process group addressed by global ranks.

    Args:
        pg: the backend process group.
        ranks: its members' global ranks, in group-rank order.
        timeout_s: how long each operation waits.
    """

    def __init__(self, pg: dist.ProcessGroup, ranks: Sequence[int], timeout_s: float, me: int) -> None:
        self.pg = pg
        self.me = me
        self.ranks = tuple(ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.timeout = timedelta(seconds=timeout_s)

    def __len__(self) -> int:
        return len(self.ranks)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over the members."""
        self.pg.allreduce([tensor]).wait(self.timeout)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        return self.pg.send([tensor], self.index[dst], tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        return self.pg.recv([tensor], self.index[src], tag)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))


def new_group(ranks: Sequence[int], *, name: str, timeout_s: float, store: dist.Store | None = None,
              me: int | None = None) -> Group:
    """Create the group ``ranks`` (call on every member); ``name`` must be unique per creation.

    ``store`` defaults to the default process group's store; under the agent it is the agent's.
    """
    me = dist.get_rank() if me is None else me
    ranks = sorted(ranks)
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of group {name} {ranks}")
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    prefix = f"dsr/{name}/{'-'.join(map(str, ranks))}"
    pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, base), ranks.index(me), len(ranks), timedelta(seconds=timeout_s))
    return Group(pg, ranks, timeout_s, me)


@dataclass(frozen=True)
class GenerationGroups:
    """The groups one surviving worker uses in one generation.

    Attributes:
        generation: membership epoch these groups belong to.
        world: all surviving workers (messages, global norm, loss aggregation, agreement).
        stage: this worker's stage's surviving replicas (gradient reduce).
    """

    generation: int
    world: Group
    stage: Group


def build_groups(topology: Topology, me: Worker, *, session: str, generation: int = 0, timeout_s: float = 60.0,
                 store: dist.Store | None = None) -> GenerationGroups:
    """Create the surviving world group and ``me``'s stage group for ``generation``."""
    world_ranks = [topology.rank(w) for w in topology.alive_workers()]
    stage_ranks = [topology.rank(w) for w in topology.stage_peers(me.stage)]
    name = f"{session}/g{generation}"
    rank = topology.rank(me)
    world = new_group(world_ranks, name=f"{name}/world", timeout_s=timeout_s, store=store, me=rank)
    stage = new_group(stage_ranks, name=f"{name}/stage{me.stage}", timeout_s=timeout_s, store=store, me=rank)
    return GenerationGroups(generation=generation, world=world, stage=stage)
