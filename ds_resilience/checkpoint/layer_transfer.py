"""Move layers' training state to the survivors' new positions after a re-grid.

A re-grid plan (:func:`~ds_resilience.planning.regrid.plan_regrid`) names, for each layer a
survivor lacks at its new position, where it comes from: a surviving holder, or (``source`` is
``None``) the in-memory snapshots when no survivor holds it. :func:`transfer` carries out the moves
that concern one survivor over the one state transport (JSON header, raw payload, checksum; nothing
unpickled) and returns the state of every layer of its new position: the ones it kept, the ones it
received and the ones restored from the snapshots.

A layer's state is whatever tree the caller keeps per layer: its parameters, their optimizer state
(Adam's moments, fp32 master weights), anything :class:`~.staging.StagingPipeline` flattens. It
moves as it is, so training continues with the same optimizer state (Oobleck re-initialises it).

Order: every survivor walks the moves in one global order (by layer, then destination). The
earliest move not yet done always has both ends at it, so blocking sends (NCCL's rule) cannot
deadlock; a sender that is also a receiver simply takes its turns in that order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping

import torch

from ..comm.groups import Group
from ..comm.transport import TransportError, recv_header, recv_payload, send_message
from ..errors import ResilienceError
from ..planning.regrid import RegridPlan
from .layout import Layout, LayoutError, unflatten
from .staging import StagingPipeline

__all__ = ["LAYER_TAG", "TransferReport", "TransferError", "transfer"]

LAYER_TAG = (1 << 27) + 7


class TransferError(ResilienceError):
    """A move cannot be carried out: a layer the plan says this survivor holds is missing, or a
    message is not the layer it should be."""


@dataclass(frozen=True)
class TransferReport:
    """What one survivor's part of the re-grid moved."""

    sent_bytes: int
    received_bytes: int
    from_snapshots: tuple[int, ...]
    kept: tuple[int, ...]
    seconds: float


def _send(group: Group, dst: int, layer: int, tree: Any, timeout_s: float | None) -> int:
    staged = StagingPipeline().flatten(tree)
    send_message(group, dst, tag=LAYER_TAG, fields={"what": "layer_state", "layer": layer,
                                                    "layout": staged.layout.to_json().decode("utf-8")},
                 payload=staged.payload if staged.nbytes else None, checksum=staged.checksum, timeout_s=timeout_s)
    return staged.nbytes


def _recv(group: Group, src: int, layer: int, timeout_s: float | None) -> tuple[Any, int]:
    message = recv_header(group, src, tag=LAYER_TAG, timeout_s=timeout_s)
    payload = torch.empty(message.nbytes, dtype=torch.uint8)
    try:
        if message.kind != "state" or message.fields.get("what") != "layer_state":
            raise TransportError(f"rank {src} sent {message.kind!r} {sorted(message.fields)}, not a layer's state")
        if message.fields.get("layer") != layer:
            raise TransportError(f"rank {src} sent layer {message.fields.get('layer')!r}, expected layer {layer}")
        try:
            layout = Layout.from_json(message.fields.get("layout", ""))
        except LayoutError as exc:
            raise TransportError(f"layer {layer} from rank {src}: {exc}") from None
    except TransportError:
        recv_payload(group, message, payload, tag=LAYER_TAG, verify=False, timeout_s=timeout_s)  # stay in step
        raise
    recv_payload(group, message, payload, tag=LAYER_TAG, verify=True, timeout_s=timeout_s)
    return unflatten(layout, payload), message.nbytes


def transfer(plan: RegridPlan, me: Hashable, *, group: Group, rank_of: Mapping[Hashable, int],
             held: Mapping[int, Any], from_snapshot: Callable[[int], Any],
             timeout_s: float | None = None) -> tuple[dict[int, Any], TransferReport]:
    """Carry out ``me``'s part of ``plan``; returns ``{layer: state}`` for ``me``'s new position
    (empty for an idle survivor) and a :class:`TransferReport`.

    Args:
        plan: the re-grid plan every survivor computed (the same on all of them).
        me: this survivor's name in the plan; ``rank_of`` maps names to ranks of ``group``.
        held: the state of each layer ``me`` holds now.
        from_snapshot: the state of a layer no survivor holds (e.g. from the in-memory snapshots).
        timeout_s: each wait's limit (a dead peer is a :class:`~ds_resilience.comm.groups.CommError`).

    Raises:
        TransferError: ``held`` lacks a layer the plan sends from ``me``, or a layer of the new
            position arrives from nowhere.
    """
    started = time.perf_counter()
    out: dict[int, Any] = {}
    sent = received = 0
    restored = []
    for move in sorted(plan.moves, key=lambda m: (m.layer, str(m.to))):
        if move.source == me:
            if move.layer not in held:
                raise TransferError(f"the plan sends layer {move.layer} from {me!r}, which does not hold it "
                                    f"(holds {sorted(held)})")
            sent += _send(group, rank_of[move.to], move.layer, held[move.layer], timeout_s)
        elif move.to == me:
            if move.source is None:
                out[move.layer] = from_snapshot(move.layer)
                restored.append(move.layer)
            else:
                out[move.layer], n = _recv(group, rank_of[move.source], move.layer, timeout_s)
                received += n
    kept = []
    position = plan.assignment.get(me)
    for layer in position.layers() if position is not None else ():
        if layer not in out:
            if layer not in held:
                raise TransferError(f"layer {layer} of {me!r}'s new position is neither held nor moved by the plan")
            out[layer] = held[layer]
            kept.append(layer)
    report = TransferReport(sent_bytes=sent, received_bytes=received, from_snapshots=tuple(restored),
                            kept=tuple(kept), seconds=time.perf_counter() - started)
    return out, report
