"""Megatron's tensor-parallel group, released by an epoch and renewed for the next generation.

megatron-core's layers run their tensor-parallel collectives (the row-parallel all-reduce, the
vocabulary-parallel gathers) on the group ``parallel_state`` made at ``initialize_model_parallel``,
which the engine's own per-generation groups do not replace. When an epoch interrupts an iteration,
one rank of a replica may leave it (its pipeline receive was released) while its tensor-parallel
partner is inside such an all-reduce, waiting for it for ever, and the first rank waits for the
partner's agreement on the resume step: a deadlock that only the store's timeout broke.

:class:`TensorParallelGroup` closes that window. On every epoch that interrupts work (the watcher
thread) it poisons the group as the engine poisons its own (a receive with a 1 ms timeout closes
each gloo pair, an NCCL communicator is aborted), so the partner's collective fails and it recovers
too. When a generation is adopted it builds a fresh group of the same ranks under a name of that
epoch (every partner adopts the same epochs), in the agent's store, once every partner has arrived there (an interruptible store wait, so
a partner that moves on to a newer epoch does not leave it connecting alone), and puts it wherever
the old one was: ``parallel_state``'s globals and the model's modules.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import store_keys
from ..epochs import SWITCH_KINDS
from ..comm.groups import poison_pg
from ..logs import get_logger

__all__ = ["TensorParallelGroup", "swap_group"]

log = get_logger(__name__)


def swap_group(model: Any, modules: Sequence[Any], old: Any, new: Any) -> int:
    """Replace every reference to the process group ``old`` by ``new``: attributes of ``model``'s
    modules (and of the plain objects they hold, e.g. a collection of process groups) and the
    module-level globals of ``modules``; returns how many were replaced."""
    swapped = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if value is old:
                setattr(module, name, new)
                swapped += 1
            elif not isinstance(value, (torch.nn.Module, torch.Tensor, dict, list, tuple)) and hasattr(value, "__dict__"):
                for inner, held in list(vars(value).items()):
                    if held is old:
                        setattr(value, inner, new)
                        swapped += 1
    for mod in modules:
        for name, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, name, new)
                swapped += 1
    return swapped


def _registered_group(ranks: Sequence[int], name: str, store: dist.Store, backend: str, timeout_s: float) -> Any:
    """A process group of ``ranks`` (this rank among them) that torch.distributed knows (so that
    ``dist.all_reduce(..., group=it)`` and megatron-core's helpers accept it), named ``name`` and
    meeting in ``store``, built by its members only."""
    from torch.distributed import distributed_c10d as c10d

    ranks = list(ranks)
    me = dist.get_rank()
    pg, _ = c10d._new_process_group_helper(len(ranks), ranks.index(me), ranks, backend, store, name,
                                           timeout=timedelta(seconds=timeout_s))
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


class TensorParallelGroup:
    """One rank's tensor-parallel group across generations (module docstring).

    Args:
        model: the rank's model chunk (its modules hold the group).
        ranks: the global ranks of the group (the replica's), in tensor-parallel order.
        coordinator: the worker's coordinator (the agent's store; interruptible waits).
        session: names the groups built here.
        timeout_s: the groups' timeout.
    """

    def __init__(self, model: Any, ranks: Sequence[int], coordinator: Any, *, session: str, timeout_s: float) -> None:
        from megatron.core import parallel_state

        self.model, self.ranks, self.coordinator = model, tuple(ranks), coordinator
        self.session, self.timeout_s = session, timeout_s
        self.modules = [parallel_state]
        self.current = parallel_state.get_tensor_model_parallel_group()
        self.backend = str(dist.get_backend(self.current))
        self.me = dist.get_rank()
        self._lock = threading.Lock()
        self.poisoned = False
        self.epoch = 0  # the epoch the current group was built for (0: megatron-core's own)
        self.renewed = 0

    def release(self, record: Any) -> None:
        """Watcher thread: an epoch latched; one that interrupts work poisons the group."""
        if getattr(record, "kind", None) in SWITCH_KINDS or self.poisoned or len(self.ranks) < 2:
            return
        with self._lock:  # the main thread may be swapping in the group of this very epoch
            if record.epoch <= self.epoch:  # a starved watcher, after the main thread built the group for it
                return
            self.poisoned = True
            pg = self.current
        poison_pg(pg, self.backend, [i for i, r in enumerate(self.ranks) if r != self.me])

    def renew(self, epoch: int) -> None:
        """Main thread, a generation of ``epoch`` adopted: a fresh group (once every partner is here;
        a newer epoch interrupts the wait), put where the old one was. Whether or not the watcher
        has poisoned the old one yet: a starved watcher may come after this, and then leaves the
        new group alone (:meth:`release`)."""
        if epoch <= self.epoch or len(self.ranks) < 2:
            return
        store = self.coordinator.store
        name = f"{self.session}/tp/{'-'.join(map(str, self.ranks))}/e{epoch}"
        store.set(store_keys.tp_arrive(epoch, self.me), "1")
        for rank in self.ranks:
            self.coordinator.wait_key(store_keys.tp_arrive(epoch, rank))
        new = _registered_group(self.ranks, name, store, self.backend, self.timeout_s)
        with self._lock:
            swapped = swap_group(self.model, self.modules, self.current, new)
            self.current, self.poisoned, self.epoch = new, False, epoch
        log.info("rank %d: tensor-parallel group %s renewed for epoch %d (%d references)", self.me, list(self.ranks),
                 epoch, swapped)
        self.renewed += 1
