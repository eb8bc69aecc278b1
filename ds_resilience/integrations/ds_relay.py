"""A re-routed micro-batch's data, handed over by the surviving end of its pipeline.

``train_batch(data_iter)`` and ``eval_batch(data_iter)`` give a worker its own pipeline's items
only. When a worker at one end of a pipeline fails, the survivor that runs its micro-batches
receives them from the worker at the pipeline's other end, which reads the very same items from
its own iterator (``planning/data_relay.py``): at the start of each iteration (and of each
evaluation) every holder reads the items of its transfers and posts them, then every runner
receives its own, then the sends are waited for. Sends are posted before any receive, so no
worker waits on another that waits on it. An item is pickled whole (inputs and labels, tensors on
the host) and travels as one ``uint8`` tensor with its shape, on the ``data`` (training) or
``evaldata`` channel, apart from activations' and gradients' tags.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable

import torch

from ..comm.p2p import Messenger, message_tag
from ..errors import ResilienceError
from ..planning.data_relay import RelayPlan, relay_plan, unfed_pipelines
from ..topology import Topology
from .ds_data import EngineData

__all__ = ["TrainingRelay", "exchange", "pack", "starved", "unpack", "unserved_error"]


def _to_host(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    return value


def pack(item: Any) -> torch.Tensor:
    """One data item as a ``uint8`` tensor (tensors moved to the host first)."""
    buf = io.BytesIO()
    torch.save(_to_host(item), buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(tensor.cpu().numpy().tobytes()), weights_only=False)


def exchange(plan: RelayPlan, me: int, *, group, rank_of: Callable[[int], int], read: Callable[[int, int], Any],
             channel: str, dp: int, microbatches: int, timeout_s: float) -> dict[tuple[int, int], Any]:
    """Run this worker's part of ``plan``: send what it holds (``read(pipeline, microbatch)`` gives
    an item of its own pipeline), receive what it runs. Returns ``{(pipeline, microbatch): item}``.

    Raises:
        ResilienceError: the plan has micro-batches no surviving worker holds and this worker
            would run one of them (the caller checks ``plan.unserved`` against its sources first).
    """
    sends, receives = plan.sends(me), plan.receives(me)
    if not sends and not receives:
        return {}
    messenger = Messenger(group=group, timeout_s=timeout_s, dynamic=True)

    def tag(t) -> int:
        return message_tag(channel, t.pipeline, t.microbatch, 0, dp=dp, microbatches=microbatches)

    for t in sends:
        payload = pack(read(t.pipeline, t.microbatch)).to(group.device)
        messenger.send([payload], rank_of(t.runner), tag(t), channel)
    got: dict[tuple[int, int], Any] = {}
    for t in receives:
        (payload,) = messenger.recv(rank_of(t.holder), tag(t), channel)
        got[(t.pipeline, t.microbatch)] = unpack(payload)
    messenger.wait_sends()
    return got


def unserved_error(plan: RelayPlan, *, what: str, how: str) -> ResilienceError:
    pipelines = sorted({p for p, _, _ in plan.unserved})
    return ResilienceError(
        f"{what} of pipeline(s) {pipelines} run on other pipelines' workers, and those pipelines lost both their "
        f"first and last stage workers, the only ones that read their data_iter: {how}")


def starved(source: Any, survivors: Topology) -> str | None:
    """Why a failed set (``survivors``: the grid without it) leaves micro-batches no worker can load
    (``planning/recovery.py``'s ``unfed``): a pipeline lost both ends while its data comes from
    ``data_iter`` alone (``source``: the executor's batch source)."""
    if not isinstance(source, EngineData) or not source.relays:
        return None
    lost = unfed_pipelines(survivors)
    if not lost:
        return None
    return (f"pipeline(s) {list(lost)} lost both their first and last stage workers, the only readers of their "
            f"data_iter, and no addressable source (batch_source, a map-style training_data, "
            f"data_iter_factory) can give their micro-batches")


class TrainingRelay:
    """Other pipelines' training micro-batches this worker runs, from their pipelines' surviving
    ends: at the start of each iteration, before any other message (the relay plan is kept per
    generation).

    Args:
        me: this worker's index in the grid; rank_of: a worker index -> its global rank;
        dp, microbatches: the grid's data-parallel size and micro-batches per pipeline;
        timeout_s: ``detector.pg_timeout_s``.
    """

    def __init__(self, *, me: int, rank_of: Callable[[int], int], dp: int, microbatches: int, timeout_s: float) -> None:
        self.me, self.rank_of, self.dp, self.microbatches, self.timeout_s = me, rank_of, dp, microbatches, timeout_s
        self._for: tuple | None = None  # (schedule, topology, plan)

    def run(self, source: Any, generation: Any, actions: Any, step: int) -> None:
        """Receive this iteration's (``step``) relayed items into ``source`` (the executor's batch
        source; nothing to do unless it relays)."""
        if not isinstance(source, EngineData) or not source.relays:
            return
        cached = self._for
        if cached is None or cached[0] is not generation.schedule or cached[1] is not generation.topology:
            self._for = (generation.schedule, generation.topology,
                         relay_plan(generation.topology, generation.schedule.workers))
        plan = self._for[2]
        source.relayed, source.relayed_iteration = {}, None
        if not plan:
            return
        if plan.starves(actions):
            raise unserved_error(plan, what="micro-batches", how="pass batch_source=, a map-style training_data "
                                 "or data_iter_factory= to ds_resilience.initialize")
        source.relayed = exchange(plan, self.me, group=generation.groups.world, rank_of=self.rank_of,
                                  read=lambda p, m: source.iterator(p, step, m), channel="data",
                                  dp=self.dp, microbatches=self.microbatches, timeout_s=self.timeout_s)
        source.relayed_iteration = step
