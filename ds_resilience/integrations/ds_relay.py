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
from ..planning.data_relay import RelayPlan

__all__ = ["exchange", "pack", "unpack", "unserved_error"]


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
