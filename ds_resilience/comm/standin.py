"""A local stand-in default process group: every collective completes at once and moves no data.

A relaunched (re-joining) worker runs the user's script, whose ``deepspeed.init_distributed()``
would wait forever for a world that no longer meets. Initializing the default group first with
this backend makes that call go on at once (DeepSpeed keeps an initialized default group); the
engine is then built locally, and all real communication goes through ds_resilience's own groups
on the agent's store. Built on public torch.distributed mechanisms only: a Python
:class:`torch.distributed.ProcessGroup` registered with :meth:`torch.distributed.Backend.register_backend`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["BACKEND", "StandInGroup", "init_stand_in"]

BACKEND = "dsr_standin"

# the collective and point-to-point entry points of a ProcessGroup (torch 2.4 - 2.13): all no-ops here
_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "barrier", "allgather", "allgather_coalesced",
        "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single", "reduce", "reduce_scatter",
        "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "gather", "scatter", "alltoall", "alltoall_base",
        "send", "recv", "recv_anysource")


class _Done(dist.Work):
    """A work that has completed."""

    def __init__(self) -> None:
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(None)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _no_op(self: Any, *args: Any, **kwargs: Any) -> _Done:
    return _Done()


class StandInGroup(dist.ProcessGroup):
    """Rank ``rank`` of a group of ``size`` whose operations complete at once, leaving tensors as they are."""

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND


for _name in _OPS:
    setattr(StandInGroup, _name, _no_op)


def _create(*args: Any) -> StandInGroup:
    if len(args) == 4:  # (store, rank, size, timeout)
        _, rank, size, _ = args
    else:  # (common options, backend options): the extended API
        rank, size = args[0].group_rank, args[0].group_size
    return StandInGroup(rank, size)


def init_stand_in(rank: int, world_size: int) -> bool:
    """Initialize the default group as a stand-in of ``rank`` in ``world_size`` (returns whether
    it did; a default group already there is kept)."""
    if dist.is_initialized():
        return False
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    return True
