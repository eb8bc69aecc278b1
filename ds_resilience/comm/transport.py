"""The one transport for training state between two ranks: a JSON header, then raw bytes.

Snapshot replication, restore after a restart and the hand-over to a re-joining worker all move
state with it. A message travels on one :class:`~.groups.Group` under one tag, frames in order::

    frame    int64[4]               MAGIC, VERSION, header length n, 0
    header   uint8[n]               a UTF-8 JSON object (below)
    payload  uint8[<= chunk] ...    ceil(nbytes / chunk) frames, only when nbytes > 0

The header always has ``kind`` (``"state"``: a payload follows; ``"missing"``: the sender has
nothing to send; ``"bye"``: the stream ends), ``nbytes``, ``chunk`` and ``checksum`` (of the
payload, :mod:`ds_resilience.kernels.checksum`; ``None`` if not computed), plus the caller's own
fields (e.g. the snapshot's step and its layout as JSON). Headers are parsed as JSON and checked
field by field: nothing received is ever unpickled, so a peer cannot make this process run code.

One tag per direction and in-order frames: what gloo requires, and what NCCL's FIFO matching of a
pair's messages requires too. Every wait has an explicit timeout (the group's, or the caller's);
a timeout or a dead peer is a :class:`~.groups.CommError` that names what was awaited.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.checksum import checksum_reference
from .groups import CommError, Group

__all__ = ["KINDS", "MAX_HEADER_BYTES", "Message", "TransportError", "recv_header", "recv_payload", "send_message"]

MAGIC = 0x44535254  # "DSRT"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20
KINDS = ("state", "missing", "bye")
DEFAULT_CHUNK = 64 << 20


class TransportError(CommError):
    """A message's frame or header is malformed, or its payload does not match its checksum."""


@dataclass(frozen=True)
class Message:
    """A received header: ``kind``, ``nbytes``, ``chunk``, ``checksum`` and the caller's ``fields``."""

    kind: str
    nbytes: int
    chunk: int
    checksum: int | None
    fields: dict[str, Any]
    src: int


def _int(value: Any, name: str, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TransportError(f"{what}: header field {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def send_message(group: Group, dst: int, *, tag: int, kind: str = "state", fields: dict[str, Any] | None = None,
                 payload: torch.Tensor | None = None, checksum: int | None = None, chunk_bytes: int = DEFAULT_CHUNK,
                 before_chunk: Callable[[], bool] | None = None, on_chunk: Callable[[int, float], None] | None = None,
                 timeout_s: float | None = None) -> bool:
    """Send one message to ``dst`` (blocking, every frame bounded by the timeout).

    Args:
        fields: the caller's JSON-able header fields (must not reuse the reserved names).
        payload: a uint8 CPU tensor (a view of a snapshot's shared-memory file, say), or ``None``.
        checksum: the payload's checksum, sent for the receiver to verify.
        before_chunk: called before each payload frame; ``False`` stops sending (the message is
            then incomplete: the receiver's wait fails or it is released by a poison).
        on_chunk: ``on_chunk(bytes, seconds)`` after each payload frame.
    Returns:
        ``True`` when every frame was sent.
    """
    if kind not in KINDS:
        raise TransportError(f"unknown message kind {kind!r}; allowed: {', '.join(KINDS)}")
    what = f"sending a {kind} message to rank {dst}"
    nbytes = 0 if payload is None else payload.numel()
    if payload is not None and (payload.dtype != torch.uint8 or payload.dim() != 1):
        raise TransportError(f"{what}: the payload must be a flat uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    chunk = max(64, int(chunk_bytes))
    header = dict(fields or {})
    reserved = {"kind", "nbytes", "chunk", "checksum"} & set(header)
    if reserved:
        raise TransportError(f"{what}: header fields {sorted(reserved)} are reserved")
    header.update(kind=kind, nbytes=nbytes, chunk=chunk, checksum=checksum)
    data = json.dumps(header, sort_keys=True, allow_nan=False).encode("utf-8")
    if len(data) > MAX_HEADER_BYTES:
        raise TransportError(f"{what}: header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    frame = torch.tensor([MAGIC, VERSION, len(data), 0], dtype=torch.int64)
    group.wait(group.isend(frame, dst, tag), f"{what}: frame", timeout_s)
    group.wait(group.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag), f"{what}: header", timeout_s)
    for start in range(0, nbytes, chunk):
        if before_chunk is not None and not before_chunk():
            return False
        t0 = time.perf_counter()
        group.wait(group.isend(payload[start : start + chunk], dst, tag), f"{what}: payload at byte {start}", timeout_s)
        if on_chunk is not None:
            on_chunk(min(chunk, nbytes - start), time.perf_counter() - t0)
    return True


def recv_header(group: Group, src: int, *, tag: int, timeout_s: float | None = None,
                max_payload: int | None = None) -> Message:
    """Receive and check the next message's frame and header from ``src``.

    Raises:
        TransportError: bad magic or version, an oversized or non-JSON header, a bad field.
        CommError: the wait timed out or the peer went away.
    """
    what = f"message from rank {src}"
    frame = torch.zeros(4, dtype=torch.int64)
    group.wait(group.irecv(frame, src, tag), f"waiting for a {what}", timeout_s)
    magic, version, length, _ = (int(v) for v in frame.tolist())
    if magic != MAGIC or version != VERSION:
        raise TransportError(f"{what}: not a ds_resilience transport frame (magic {magic:#x}, version {version})")
    if not 0 < length <= MAX_HEADER_BYTES:
        raise TransportError(f"{what}: header length {length} outside 1..{MAX_HEADER_BYTES}")
    raw = torch.empty(length, dtype=torch.uint8)
    group.wait(group.irecv(raw, src, tag), f"{what}: header", timeout_s)
    try:
        header = json.loads(bytes(raw.numpy()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TransportError(f"{what}: the header is not JSON ({exc}); refused") from None
    if not isinstance(header, dict):
        raise TransportError(f"{what}: the header must be a JSON object, got {type(header).__name__}")
    kind = header.pop("kind", None)
    if kind not in KINDS:
        raise TransportError(f"{what}: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
    nbytes = _int(header.pop("nbytes", None), "nbytes", what)
    if max_payload is not None and nbytes > max_payload:
        raise TransportError(f"{what}: payload of {nbytes} bytes exceeds the limit {max_payload}")
    chunk = _int(header.pop("chunk", None), "chunk", what, 1)
    checksum = header.pop("checksum", None)
    if checksum is not None:
        checksum = _int(checksum, "checksum", what)
    if kind != "state" and nbytes:
        raise TransportError(f"{what}: a {kind!r} message carries no payload, header says {nbytes} bytes")
    return Message(kind=kind, nbytes=nbytes, chunk=chunk, checksum=checksum, fields=header, src=src)


def recv_payload(group: Group, message: Message, into: torch.Tensor, *, tag: int, verify: bool = True,
                 timeout_s: float | None = None) -> None:
    """Receive ``message``'s payload into ``into`` (a uint8 CPU tensor of ``message.nbytes``).

    With ``verify`` and a checksum in the header, the bytes are checked after the last frame.

    Raises:
        TransportError: the size does not match, or the bytes do not match the checksum.
        CommError: a wait timed out or the peer went away.
    """
    what = f"message from rank {message.src}"
    if into.dtype != torch.uint8 or into.numel() != message.nbytes:
        raise TransportError(f"{what}: receive buffer of {into.numel()} {into.dtype} for {message.nbytes} bytes")
    for start in range(0, message.nbytes, message.chunk):
        piece = into[start : start + message.chunk]
        group.wait(group.irecv(piece, message.src, tag), f"{what}: payload at byte {start}", timeout_s)
    if verify and message.checksum is not None:
        actual = checksum_reference(into) if message.nbytes else 0
        if actual != message.checksum:
            raise TransportError(f"{what}: payload checksum {actual:#018x} != sent {message.checksum:#018x}")
