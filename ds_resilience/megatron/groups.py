"""The process groups of a Megatron rank's tensor-parallel plane, and the session name they share.

With tensor parallelism every tensor-parallel rank runs the resilient schedule in its *plane* (the
ranks of its tensor-parallel rank): :func:`plane_groups` builds that plane's groups for one
generation. :func:`agree_session` gives a job outside the agent one name for all its groups.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from .. import store_keys
from ..comm.groups import GenerationGroups, new_group
from ..topology import Topology, Worker
from .grid import PTDPGrid

__all__ = ["agree_session", "plane_groups"]

_SESSIONS = [0]


def agree_session(timeout_s: float) -> str:
    """A name every rank gives this job's groups: rank 0 draws it and publishes it in the default
    store (any backend: no collective on the default group, which may be NCCL)."""
    store = dist.distributed_c10d._get_default_store()
    key = store_keys.megatron_session(_SESSIONS[0])
    _SESSIONS[0] += 1
    if dist.get_rank() == 0:
        store.set(key, f"megatron-{uuid.uuid4().hex[:10]}")
    store.wait([key], timedelta(seconds=timeout_s))
    return store.get(key).decode()


def plane_groups(grid: PTDPGrid, topology: Topology, me: Worker, tp_rank: int, *, session: str, timeout_s: float,
                 tied: Sequence[Sequence[int]] = (), generation: int = 0,
                 device: torch.device | None = None, store: dist.Store | None = None) -> GenerationGroups:
    """The groups of ``me``'s tensor-parallel plane (every rank of tensor-parallel rank ``tp_rank``
    runs the schedule's copy of the grid): the stage's surviving replicas in the plane (gradient
    reduce, per tensor-parallel shard), the tied groups in the plane, and one world group of every
    surviving rank of every plane (messages within the plane, the global gradient norm over all
    shards). ``device``: a GPU makes them NCCL groups on it; ``store``: where they meet (default:
    the default group's; under the agent, the agent's)."""
    name = f"{session}/g{generation}"
    rank = grid.rank(me, tp_rank)
    world = new_group([r for w in topology.alive_workers() for r in grid.replica(w)], name=f"{name}/world",
                      timeout_s=timeout_s, me=rank, device=device, store=store)
    stage = new_group([grid.rank(w, tp_rank) for w in topology.stage_peers(me.stage)],
                      name=f"{name}/t{tp_rank}/stage{me.stage}", timeout_s=timeout_s, me=rank, device=device,
                      store=store)
    groups = {}
    for g, stages in enumerate(tied):  # in group order on every member
        if me.stage in stages:
            groups[g] = new_group([grid.rank(w, tp_rank) for s in stages for w in topology.stage_peers(s)],
                                  name=f"{name}/t{tp_rank}/tied{g}", timeout_s=timeout_s, me=rank, device=device,
                                  store=store)
    return GenerationGroups(generation=generation, world=world, stage=stage, tied=groups)
