"""Point-to-point messages between any two global ranks, across pipelines.

DeepSpeed's own p2p asserts that both ends are adjacent stages of one pipeline; after a failure,
stage s-1 of pipeline p talks to stage s of pipeline p'. Here a message is one small header
(count, dtypes, shapes, requires-grad flags) and one payload per tensor, sent with ``isend`` under
a tag derived from the message's identity. Under NCCL's matching (the group's ``matching`` is
``"fifo"``: tags ignored, a pair's messages matched in posting order) the same code is correct
because every schedule receives a pair's messages in their send order (validator rule 7), and a
channel's header, sent before its first message, is received before it too.

Sends never block the sender (the runtime's execution model); :meth:`Messenger.wait_sends` waits
for the posted ones, with a timeout, at the end of an iteration. :meth:`Messenger.post` posts a
receive ahead of its wait: the runtime does so where :func:`ds_resilience.ir.pairs.early_posts`
says, so that under NCCL both sides of a pair issue their operations in the same order.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import ResilienceError
from ..polling import Backoff
from .groups import CommError, Group

__all__ = ["CommError", "Messenger", "Posted", "message_tag", "DTYPES"]

DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool, torch.uint8,
)
_HEADER = 64  # int64 slots: [count, (dtype, requires_grad, ndim, dims... up to 6) per tensor]
_MAX_TENSORS = 6
_MAX_DIMS = 6
_CHANNELS = {"act": 0, "grad": 1, "ctl": 2, "eval": 3, "data": 4, "evaldata": 5}  # data: a relayed micro-batch
_EVAL_TAG_BASE = 1 << 25  # evaluation messages: far from any training tag
_META_TAG_BASE = 1 << 28
_META_TAG_SPAN = 1 << 20


def message_tag(channel: str, pipeline: int, microbatch: int, part: int, *, dp: int, microbatches: int) -> int:
    """A tag unique per (channel, pipeline, micro-batch, part) within an iteration."""
    base = (_CHANNELS[channel] * dp + pipeline) * microbatches + microbatch
    offset = _EVAL_TAG_BASE if channel in ("eval", "evaldata") else 0
    return offset + base * (2 * _MAX_TENSORS + 2) + part


def _encode(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ResilienceError(f"a stage may pass at most {_MAX_TENSORS} tensors, got {len(tensors)}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = len(tensors)
    pos = 1
    for t in tensors:
        if t.dtype not in DTYPES:
            raise ResilienceError(f"cannot send dtype {t.dtype}; supported: {DTYPES}")
        if t.dim() > _MAX_DIMS:
            raise ResilienceError(f"cannot send a {t.dim()}-d tensor; at most {_MAX_DIMS} dims")
        header[pos] = DTYPES.index(t.dtype)
        header[pos + 1] = int(t.requires_grad)
        header[pos + 2] = t.dim()
        for i, d in enumerate(t.shape):
            header[pos + 3 + i] = d
        pos += 3 + _MAX_DIMS
    return header


def _decode(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    count = int(header[0])
    out, pos = [], 1
    for _ in range(count):
        dtype = DTYPES[int(header[pos])]
        requires_grad = bool(header[pos + 1])
        ndim = int(header[pos + 2])
        shape = tuple(int(x) for x in header[pos + 3: pos + 3 + ndim])
        out.append((dtype, requires_grad, shape))
        pos += 3 + _MAX_DIMS
    return out


@dataclass
class Posted:
    """A receive posted ahead of its wait (:meth:`Messenger.post`)."""

    src: int
    tag: int
    channel: str
    buffers: list
    works: list


@dataclass
class Messenger:
    """Sends and receives tensors between global ranks on one :class:`~.groups.Group`.

    With static shapes (the default) the header (count, dtypes, shapes) goes once per channel (a
    kind of message between one pair of ranks, e.g. activations from rank 3 to rank 6), on a tag of
    its own, and every message after that is payload only; a shape that changes on a channel raises
    a :class:`~ds_resilience.errors.ResilienceError` rather than corrupting the receiver. With
    ``dynamic=True`` (DeepSpeed's ``PipelineModule(dynamic_shape=True)``) the header travels with
    every message, on the message's own tag (part 0, the payload uses parts 1..), so the shape
    travels with the tensor whatever order the messages of a pair are posted in.

    Under NCCL's matching (the group's ``matching`` is ``"fifo"``) a channel's header does not
    travel on the pair's stream at all: the sender puts it in the group's store once, and the
    receiver reads it there, so a receive can be posted early (it needs the shapes) even before
    the channel's first message (:meth:`post`).

    Args:
        group: the group (global ranks at its interface).
        timeout_s: how long :meth:`recv` and :meth:`wait_sends` wait before :class:`CommError`.
        dynamic: shapes may change from one message to the next.
    """

    group: Group
    timeout_s: float = 300.0
    dynamic: bool = False
    _pending: list = field(default_factory=list)
    _sent_meta: dict = field(default_factory=dict)
    _recv_meta: dict = field(default_factory=dict)

    @property
    def _store_headers(self) -> bool:
        return self.group.matching == "fifo" and getattr(self.group, "meta_store", None) is not None

    @staticmethod
    def _meta_key(channel: str, src: int, dst: int) -> str:
        return f"{channel}/{src}>{dst}"

    def _header_from(self, key: str) -> torch.Tensor:
        """A header the sender put in the group's store (waits for it, bounded by the store's timeout)."""
        store, deadline, backoff = self.group.meta_store, time.monotonic() + self.timeout_s, Backoff()
        try:
            while not store.check([key]):  # polled: a poisoned group (a failure) ends the wait at once
                if self.group.poisoned:
                    raise CommError(f"{self.group.name}: released while waiting for the header {key}")
                if time.monotonic() > deadline:
                    raise CommError(f"{self.group.name}: the header {key} did not appear within {self.timeout_s:.0f}s")
                backoff.sleep()
            raw = store.get(key)
        except RuntimeError as exc:
            raise CommError(f"{self.group.name}: reading the header {key}: {exc}") from exc
        if len(raw) != _HEADER * 8:
            raise CommError(f"{self.group.name}: header {key} has {len(raw)} bytes, expected {_HEADER * 8}")
        return torch.frombuffer(bytearray(raw), dtype=torch.int64).clone()

    @staticmethod
    def _meta_tag(channel: str) -> int:
        return _META_TAG_BASE + zlib.crc32(channel.encode()) % _META_TAG_SPAN

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int, channel: str = "msg") -> None:
        """Post the tensors to ``dst`` without waiting; they are kept alive until delivered."""
        header = _encode(tensors)
        key = (channel, dst)
        works = []
        known = self._sent_meta.get(key)
        if self.dynamic:
            works.append(self.group.isend(header, dst, tag))
        elif known is None:
            self._sent_meta[key] = header
            if self._store_headers:
                self.group.meta_store.set(self._meta_key(channel, self.group.me, dst), bytes(header.numpy().tobytes()))
            else:
                works.append(self.group.isend(header, dst, self._meta_tag(channel)))
        elif not torch.equal(known, header):
            raise ResilienceError(
                f"channel {channel!r} to rank {dst}: tensor shapes or dtypes changed from {_decode(known)} "
                f"to {_decode(header)}; shapes must be static per channel"
            )
        payload = [t.detach().contiguous() for t in tensors]
        for i, t in enumerate(payload):
            works.append(self.group.isend(t, dst, tag + 1 + i))
        self._pending.append((works, header, payload))

    def post(self, src: int, tag: int, channel: str = "msg") -> "Posted | None":
        """Post the receive of ``src``'s next message on ``channel`` now, to wait for it later with
        ``recv(..., posted=...)``; ``None`` (post it at the wait) while the channel's shapes are not
        known yet (its first message, or ``dynamic``)."""
        meta = None if self.dynamic else self._recv_meta.get((channel, src))
        if meta is None and not self.dynamic and self._store_headers:
            key = self._meta_key(channel, src, self.group.me)
            if self.group.meta_store.check([key]):  # published already: no wait
                meta = self._recv_meta[(channel, src)] = _decode(self._header_from(key))
        if meta is None:
            return None
        buffers, works = [], []
        for i, (dtype, requires_grad, shape) in enumerate(meta):
            buf = torch.empty(shape, dtype=dtype, device=self.group.device)
            works.append(self.group.irecv(buf, src, tag + 1 + i))
            buffers.append((buf, requires_grad))
        return Posted(src=src, tag=tag, channel=channel, buffers=buffers, works=works)

    def recv(self, src: int, tag: int, channel: str = "msg", posted: "Posted | None" = None) -> list[torch.Tensor]:
        """Receive the tensors ``src`` sent under ``tag`` on ``channel`` (blocking, with the timeout);
        ``posted``: the receive :meth:`post` issued for this message."""
        if posted is not None:
            if (posted.src, posted.tag, posted.channel) != (src, tag, channel):
                raise ResilienceError(f"a receive posted for {posted.channel} from rank {posted.src} tag {posted.tag} "
                                      f"was waited for as {channel} from rank {src} tag {tag}")
            out = []
            for i, ((buf, requires_grad), work) in enumerate(zip(posted.buffers, posted.works)):
                self._wait(work, f"{channel} tensor {i} from rank {src} tag {tag} (posted early)")
                out.append(buf.requires_grad_(requires_grad))
            return out
        key = (channel, src)
        meta = self._recv_meta.get(key)
        if self.dynamic:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            self._wait(self.group.irecv(header, src, tag), f"{channel} header from rank {src} tag {tag}")
            meta = _decode(header)
        elif meta is None and self._store_headers:
            meta = self._recv_meta[key] = _decode(self._header_from(self._meta_key(channel, src, self.group.me)))
        elif meta is None:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            self._wait(self.group.irecv(header, src, self._meta_tag(channel)), f"{channel} header from rank {src}")
            meta = self._recv_meta[key] = _decode(header)
        tensors = []
        for i, (dtype, requires_grad, shape) in enumerate(meta):
            buf = torch.empty(shape, dtype=dtype, device=self.group.device)
            self._wait(self.group.irecv(buf, src, tag + 1 + i), f"{channel} tensor {i} from rank {src} tag {tag}")
            buf.requires_grad_(requires_grad)
            tensors.append(buf)
        return tensors

    def wait_sends(self) -> None:
        """Wait for every posted send to complete."""
        pending, self._pending = self._pending, []
        for works, _header, _payload in pending:
            for work in works:
                self._wait(work, "a posted send")

    def drop_pending(self) -> None:
        """Forget posted sends without waiting (their group is being abandoned after a failure)."""
        self._pending = []

    @property
    def pending_sends(self) -> int:
        return len(self._pending)

    def _wait(self, work, what: str) -> None:
        self.group.wait(work, what, self.timeout_s)
