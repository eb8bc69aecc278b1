"""Which surviving worker hands a re-routed micro-batch's data to the worker that runs it.

In DeepSpeed's pipeline engine a pipeline's first and last stages both read every micro-batch from
that pipeline's ``data_iter`` (the first for its inputs, the last for its labels). When a worker at
one end of pipeline ``p`` fails, the survivor that runs its share of ``p``'s micro-batches (a
data-parallel peer of the same stage, in another pipeline) has no way to read ``p``'s iterator,
but the worker at ``p``'s other end reads exactly those items: it is the *holder*, and it sends
each item to the *runner* at the start of the iteration. Only a pipeline that lost both ends (with
one stage: its only worker) has no holder; its micro-batches need an addressable source
(``batch_source``, a map-style ``training_data`` or ``data_iter_factory``).

Pure: the plan is a function of the grid and the action lists, the same on every survivor, so
holders and runners agree on every transfer and on its order (a pair's transfers are posted in the
plan's order on both sides, which NCCL's in-order matching needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..ir import Action, ActionKind
from ..topology import Topology, Worker

__all__ = ["RelayPlan", "Transfer", "can_lose_both_ends", "relay_plan", "unfed_pipelines"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Micro-batch ``microbatch`` of pipeline ``pipeline``: ``holder`` (a worker index) reads it from
    its iterator and sends it to ``runner``, which runs it at stage ``stage``."""

    pipeline: int
    microbatch: int
    stage: int
    holder: int
    runner: int


@dataclass(frozen=True, slots=True)
class RelayPlan:
    transfers: tuple[Transfer, ...] = ()
    unserved: tuple[tuple[int, int, int], ...] = ()
    """(pipeline, micro-batch, stage) that runs on another pipeline's worker and whose pipeline has
    no surviving end: only an addressable source can give it."""

    def sends(self, index: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.holder == index)

    def receives(self, index: int) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.runner == index)

    def starves(self, actions: Sequence[Action]) -> bool:
        """Whether ``actions`` (one worker's) run a micro-batch in :attr:`unserved`."""
        unserved = set(self.unserved)
        return any(a.kind is ActionKind.F and (a.pipeline, a.microbatch, a.stage) in unserved for a in actions)

    def __bool__(self) -> bool:
        return bool(self.transfers or self.unserved)


def _holder(topology: Topology, pipeline: int, stage: int) -> Worker | None:
    """The surviving end of ``pipeline`` that reads its items: the one at ``stage`` first, else the
    other end (``None``: both ends failed)."""
    last = topology.pp - 1
    for s in (stage, last if stage == 0 else 0):
        w = Worker(pipeline=pipeline, stage=s)
        if topology.is_alive(w):
            return w
    return None


def relay_plan(topology: Topology, workers: Sequence[Sequence[Action]]) -> RelayPlan:
    """The transfers of one iteration (training: the schedule's action lists; evaluation:
    :func:`~ds_resilience.planning.inference.inference_actions`), ordered by runner, pipeline and
    micro-batch. A runner that needs one item at both ends (one stage) receives it once."""
    last = topology.pp - 1
    needs: dict[tuple[int, int, int], int] = {}  # (runner, pipeline, microbatch) -> stage
    for index, actions in enumerate(workers):
        if not actions:
            continue
        mine = topology.worker(index).pipeline
        for a in actions:
            if a.kind is ActionKind.F and a.stage in (0, last) and a.pipeline != mine:
                needs.setdefault((index, a.pipeline, a.microbatch), a.stage)
    transfers, unserved = [], []
    for (runner, pipeline, microbatch), stage in sorted(needs.items()):
        holder = _holder(topology, pipeline, stage)
        if holder is None:
            unserved.append((pipeline, microbatch, stage))
        else:
            transfers.append(Transfer(pipeline, microbatch, stage, topology.worker_index(holder), runner))
    return RelayPlan(tuple(transfers), tuple(sorted(set(unserved))))


def unfed_pipelines(topology: Topology) -> tuple[int, ...]:
    """Pipelines whose first and last stage workers both failed (one stage: its worker failed)."""
    last = topology.pp - 1
    return tuple(p for p in range(topology.dp)
                 if not topology.is_alive(Worker(pipeline=p, stage=0))
                 and not topology.is_alive(Worker(pipeline=p, stage=last)))


def can_lose_both_ends(num_stages: int, max_failures: int) -> bool:
    """Whether a failure set within the tolerance can take both ends of a pipeline: one failure
    with a single stage (first and last are one worker), two otherwise."""
    return max_failures >= (1 if num_stages == 1 else 2)
