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

Devices: a CUDA tensor is copied into a device sub-buffer on the current stream and drained to the
host payload on a side stream, so the drain of chunk ``i`` overlaps the copy of chunk ``i + 1``; a
sub-buffer is reused only after its drain event (pass a pinned ``out`` for truly asynchronous
drains). A CPU tensor is copied straight into the payload, one sub-buffer-sized chunk at a time
(``stage_cpu=True`` forces the staged path on CPU too, sequentially, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import copy_chunk
from ..kernels.checksum import combine
from .layout import ALIGN, Layout, TensorMeta, plan_layout, unflatten

__all__ = ["ALIGN", "Layout", "StagedState", "StagingPipeline", "TensorMeta", "unflatten"]


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
        """Plan and write ``state`` into a new zeroed CPU payload (pinned when CUDA is in use)."""
        layout, leaves = self.plan(state)
        pin = any(t.is_cuda for t in leaves)
        payload = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
        return StagedState(layout, payload, self.write(layout, leaves, payload))

    # ------------------------------------------------------------------------------------ copying
    def _subs(self, device: torch.device) -> list[torch.Tensor]:
        if device not in self._buffers:
            self._buffers[device] = [torch.empty(self.sub_buffer_bytes, dtype=torch.uint8, device=device)
                                     for _ in range(self.num_sub_buffers)]
        return self._buffers[device]

    def write(self, layout: Layout, leaves: list[torch.Tensor], out: torch.Tensor, *, checksum: bool = True) -> int | None:
        """Copy ``leaves`` into ``out`` (a uint8 CPU tensor of ``layout.nbytes`` bytes whose padding
        is zero, e.g. fresh or a new file mapping) and return the whole-payload checksum (``None``
        with ``checksum=False``: a plain copy, the checksum left to the caller)."""
        if out.dtype != torch.uint8 or out.numel() != layout.nbytes or out.device.type != "cpu":
            raise ValueError(f"out must be a CPU uint8 tensor of {layout.nbytes} bytes")
        total = 0
        pending: list[Any] = [None] * self.num_sub_buffers  # drain events of CUDA sub-buffers
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
                if src.is_cuda:
                    cs = self._copy_cuda(src, dst, slot, pending, checksum)
                elif self.stage_cpu:
                    buf = self._subs(src.device)[slot][:nb]
                    cs = copy_chunk(src, buf, checksum=checksum)
                    dst.copy_(buf)
                else:
                    cs = copy_chunk(src, dst, checksum=checksum)
                slot = (slot + 1) % self.num_sub_buffers
                self.chunks_copied += 1
                if checksum:
                    total = combine(total, int(cs), offset)  # offset % 4 == 0 by construction
        for event in pending:
            if event is not None:
                event.synchronize()
        return total if checksum else None

    def _copy_cuda(self, src: torch.Tensor, dst: torch.Tensor, slot: int, pending: list[Any], checksum: bool = True) -> int | None:
        """Copy one chunk into device sub-buffer ``slot`` (current stream, with checksum), then drain
        it to ``dst`` on the side stream; the next chunk's copy overlaps this drain."""
        device = src.device
        buf = self._subs(device)[slot][: dst.numel()]
        main = torch.cuda.current_stream(device)
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device=device)
        side = self._side[device]
        if pending[slot] is not None:
            main.wait_event(pending[slot])  # the previous drain out of this sub-buffer is done
        cs = copy_chunk(src, buf, checksum=checksum)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            dst.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        pending[slot] = event
        return None if cs is None else int(cs)
