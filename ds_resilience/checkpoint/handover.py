"""Hand a stage's state to another rank over the state transport (a re-joining worker's catch-up).

The donor flattens its :class:`~.state.StageState` through the staging pipeline into one payload
and a JSON layout and sends both as one transport message; the receiver checks the frame, the
header, the layout (JSON, field by field) and the payload checksum, then rebuilds the state. Nothing
is unpickled.
"""

from __future__ import annotations

import torch

from ..comm.groups import Group
from ..comm.transport import TransportError, recv_header, recv_payload, send_message
from .layout import Layout, LayoutError, unflatten
from .staging import StagingPipeline
from .state import StageState, StateMismatch

__all__ = ["HANDOVER_TAG", "recv_state", "send_state"]

HANDOVER_TAG = 1 << 27


def send_state(group: Group, dst: int, state: StageState, *, tag: int = HANDOVER_TAG,
               timeout_s: float | None = None) -> int:
    """Send ``state`` to ``dst`` (blocking); returns the bytes sent."""
    staged = StagingPipeline().flatten(state.to_tree())
    send_message(group, dst, tag=tag, fields={"what": "stage_state", "steps": state.steps,
                                              "layout": staged.layout.to_json().decode("utf-8")},
                 payload=staged.payload if staged.nbytes else None, checksum=staged.checksum, timeout_s=timeout_s)
    return staged.nbytes


def recv_state(group: Group, src: int, *, tag: int = HANDOVER_TAG, timeout_s: float | None = None,
               max_bytes: int | None = None) -> StageState:
    """Receive a :func:`send_state` from ``src`` and rebuild it.

    Raises:
        TransportError: a malformed frame, header or layout, or a payload that fails its checksum.
        StateMismatch: the payload is not a stage state of this version.
    """
    message = recv_header(group, src, tag=tag, timeout_s=timeout_s, max_payload=max_bytes)
    payload = torch.empty(message.nbytes, dtype=torch.uint8)
    layout_text = message.fields.get("layout")
    try:
        if message.kind != "state" or message.fields.get("what") != "stage_state" or not isinstance(layout_text, str):
            raise TransportError(f"rank {src} sent {message.kind!r} {sorted(message.fields)}, not a stage state")
        try:
            layout = Layout.from_json(layout_text)
        except LayoutError as exc:
            raise TransportError(f"stage state from rank {src}: {exc}") from None
        if layout.nbytes != message.nbytes:
            raise TransportError(f"stage state from rank {src}: {message.nbytes} bytes, its layout says {layout.nbytes}")
    except TransportError:
        recv_payload(group, message, payload, tag=tag, verify=False, timeout_s=timeout_s)  # the stream stays in step
        raise
    recv_payload(group, message, payload, tag=tag, verify=True, timeout_s=timeout_s)
    state = StageState.from_tree(unflatten(layout, payload))
    if state.steps != message.fields.get("steps"):
        raise StateMismatch(f"stage state from rank {src}: header says step {message.fields.get('steps')}, "
                            f"the state holds {state.steps}")
    return state
