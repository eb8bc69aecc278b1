"""Copy a training state's tensors into one contiguous byte payload through staging sub-buffers.

A state is any nesting of ``dict`` / ``list`` / ``tuple`` holding tensors and plain values
(``layout.py`` says which). :meth:`plan` walks it once and assigns every tensor a byte range of
the payload (its :class:`~.layout.Layout` travels and is stored as JSON); :meth:`write` copies the tensors
there chunk by chunk through ``num_sub_buffers`` staging sub-buffers of ``gpu_buffer_mb /
num_sub_buffers`` MB each, used round-robin, with :func:`ds_resilience.kernels.copy_chunk`
(``checksum=True``); the chunk checksums are folded into one whole-payload checksum with
:func:`ds_resilience.kernels.checksum.combine`, so the payload is never read twice.

Alignment (what makes ``combine`` valid): every tensor starts at a multiple of :data:`ALIGN` (64)
bytes and chunks are whole multiples of 64 bytes except a tensor's last one, so every chunk starts
at a 4-byte-aligned payload offset. The padding between tensors is zero, and zero words add nothing
to either checksum sum, so ``combine(total, chunk, chunk_offset)`` equals the checksum of the payload
up to the chunk's end; the final value equals ``checksum_reference(payload)``.

Devices: CUDA tensors are copied on a dedicated copy stream, ordered after the training stream's
work up to the call (or after the ``ready`` event the caller recorded at capture), into a device
sub-buffer by the copy kernel (checksum in the same pass, left on the device), and drained to the
host payload on a drain stream, so the drain of chunk ``i`` overlaps the copy of chunk ``i + 1``; a
sub-buffer is reused only after its drain event. A host payload that is not pinned is registered
with CUDA (page-locked) for the call, so the drains are truly asynchronous (the in-memory store
page-locks its file mappings once and keeps them: :func:`register_host`); the call waits for the device once, at its end, and
then reads every chunk's checksum. A CPU tensor is copied straight into the payload, one sub-buffer-sized chunk at a time
(``stage_cpu=True`` forces the staged path on CPU too, sequentially, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..accelerator import for_device, on_device
from ..kernels import copy_chunk
from ..kernels.copy import copy_chunk_deferred
from ..kernels.checksum import combine
from .layout import ALIGN, Layout, TensorMeta, plan_layout, unflatten

__all__ = ["ALIGN", "Layout", "StagedState", "StagingPipeline", "TensorMeta", "register_host", "unflatten",
           "unregister_host"]


def register_host(out: torch.Tensor, device: torch.device) -> tuple[Any, int] | None:
    """Page-lock ``out``'s memory for ``device``'s accelerator (``cudaHostRegister`` on CUDA) so
    device-to-host copies into it are asynchronous; ``None`` if it refuses (the copies then still
    work, synchronously)."""
    ptr, nbytes = out.data_ptr(), out.numel()
    if not nbytes:
        return None
    acc = for_device(device)
    try:
        ok = acc.register_host_memory(ptr, nbytes)
    except (RuntimeError, NotImplementedError, AttributeError):  # DeepSpeed's raises on an error code
        ok = False
    return (acc, ptr) if ok is not False else None


def unregister_host(registered: tuple[Any, int]) -> None:
    acc, ptr = registered
    acc.unregister_host_memory(ptr)


@dataclass(frozen=True)
class StagedState:
    """Result of :meth:`StagingPipeline.flatten`: layout, payload (uint8 CPU tensor) and checksum."""

    layout: Layout
    payload: torch.Tensor
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


class StagingPipeline:
    """Copies a state's tensors into a payload through round-robin staging sub-buffers.

    Args:
        gpu_buffer_mb: total staging memory (Gemini's reserved GPU buffer, 128 MB by default).
        num_sub_buffers: how many sub-buffers it is split into (chunk size = their size, rounded
            down to a multiple of :data:`ALIGN` bytes).
        stage_cpu: also route CPU tensors through (CPU) sub-buffers instead of copying them
            straight into the payload; same bytes and checksum, one more copy.
    """

    def __init__(self, gpu_buffer_mb: float = 128, num_sub_buffers: int = 4, *, stage_cpu: bool = False) -> None:
        if num_sub_buffers < 1:
            raise ValueError(f"num_sub_buffers must be >= 1, got {num_sub_buffers}")
        sub = int(gpu_buffer_mb * (1 << 20)) // num_sub_buffers // ALIGN * ALIGN
        if sub < ALIGN:
            raise ValueError(f"gpu_buffer_mb={gpu_buffer_mb} over {num_sub_buffers} sub-buffers is under {ALIGN} bytes each")
        self.sub_buffer_bytes = sub
        self.num_sub_buffers = num_sub_buffers
        self.stage_cpu = stage_cpu
        self.chunks_copied = 0  # a counter for tests and logs
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}
        self._side: dict[torch.device, Any] = {}

    # ----------------------------------------------------------------------------------- planning
    def plan(self, state: Any) -> tuple[Layout, list[torch.Tensor]]:
        """The layout of ``state`` and its tensors in payload order (nothing is copied)."""
        return plan_layout(state)

    def flatten(self, state: Any) -> StagedState:
        """Plan and write ``state`` into a new zeroed CPU payload (pinned when an accelerator is in use)."""
        layout, leaves = self.plan(state)
        pin = any(on_device(t) for t in leaves)
        payload = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        return StagedState(layout, payload, self.write(layout, leaves, payload))

    # ------------------------------------------------------------------------------------ copying
    def _subs(self, device: torch.device) -> list[torch.Tensor]:
        if device not in self._buffers:
            self._buffers[device] = [torch.empty(self.sub_buffer_bytes, dtype=torch.uint8, device=device)
                                     for _ in range(self.num_sub_buffers)]
        return self._buffers[device]

    def write(self, layout: Layout, leaves: list[torch.Tensor], out: torch.Tensor, *, checksum: bool = True,
              ready: Any = None) -> int | None:
        """Copy ``leaves`` into ``out`` (a uint8 CPU tensor of ``layout.nbytes`` bytes whose padding
        is zero, e.g. fresh or a new file mapping) and return the whole-payload checksum (``None``
        with ``checksum=False``: a plain copy, the checksum left to the caller). ``ready``: a CUDA
        event recorded when the state was captured (default: the current stream's work so far)."""
        if out.dtype != torch.uint8 or out.numel() != layout.nbytes or out.device.type != "cpu":
            raise ValueError(f"out must be a CPU uint8 tensor of {layout.nbytes} bytes")
        total = 0
        pending: list[Any] = [None] * self.num_sub_buffers  # drain events of CUDA sub-buffers
        deferred: list[tuple[Any, int]] = []  # CUDA chunks' checksums, read after the one wait
        devices = list(dict.fromkeys(t.device for t in leaves if on_device(t)))
        registered = register_host(out, devices[0]) if devices and not out.is_pinned() else None
        try:
            for device in devices:  # the copy stream starts after the captured state is final
                streams = self._streams(device)
                if ready is not None:
                    streams[0].wait_event(ready)
                else:
                    streams[0].wait_stream(for_device(device).current_stream(device.index))
            total = self._write_chunks(layout, leaves, out, checksum, pending, deferred)
            for event in pending:
                if event is not None:
                    event.synchronize()  # the drains end last: one wait for the whole snapshot
        finally:
            if registered is not None:
                unregister_host(registered)
        for value, offset in deferred:
            total = combine(total, value.value(), offset)
        return total if checksum else None

    def _write_chunks(self, layout: Layout, leaves: list[torch.Tensor], out: torch.Tensor, checksum: bool,
                      pending: list[Any], deferred: list[tuple[Any, int]]) -> int:
        total = 0
        slot = 0
        step = self.sub_buffer_bytes
        for meta, tensor in zip(layout.tensors, leaves):
            if meta.nbytes == 0:
                continue
            flat = tensor.contiguous().reshape(-1)
            elems = step // tensor.element_size()
            for start in range(0, flat.numel(), elems):
                src = flat[start : start + elems]
                nb = src.numel() * src.element_size()
                offset = meta.offset + start * tensor.element_size()
                dst = out[offset : offset + nb]
                if on_device(src):
                    cs = self._copy_cuda(src, dst, slot, pending, checksum)
                    if cs is not None:
                        deferred.append((cs, offset))
                    cs = None
                elif self.stage_cpu:
                    buf = self._subs(src.device)[slot][:nb]
                    cs = copy_chunk(src, buf, checksum=checksum)
                    dst.copy_(buf)
                else:
                    cs = copy_chunk(src, dst, checksum=checksum)
                slot = (slot + 1) % self.num_sub_buffers
                self.chunks_copied += 1
                if checksum and cs is not None:
                    total = combine(total, int(cs), offset)  # offset % 4 == 0 by construction
        return total

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        """The device's copy stream and drain stream (created once)."""
        if device not in self._side:
            acc = for_device(device)
            self._side[device] = (acc.Stream(device=device), acc.Stream(device=device))
        return self._side[device]

    def _copy_cuda(self, src: torch.Tensor, dst: torch.Tensor, slot: int, pending: list[Any], checksum: bool = True):
        """Copy one chunk into device sub-buffer ``slot`` on the copy stream (the checksum stays on
        the device), then drain it to ``dst`` on the drain stream; the next chunk's copy overlaps
        this drain. Returns the chunk's :class:`~ds_resilience.kernels.checksum.DeferredChecksum`."""
        device = src.device
        acc = for_device(device)
        buf = self._subs(device)[slot][: dst.numel()]
        copy, drain = self._streams(device)
        with acc.device(device.index):
            if pending[slot] is not None:
                copy.wait_event(pending[slot])  # the previous drain out of this sub-buffer is done
            with acc.stream(copy):
                cs = copy_chunk_deferred(src, buf) if checksum else copy_chunk(src, buf)
                copied = acc.Event()
                copied.record(copy)
            drain.wait_event(copied)
            with acc.stream(drain):
                dst.copy_(buf, non_blocking=True)
                event = acc.Event()
                event.record(drain)
        pending[slot] = event
        return cs if checksum else None
