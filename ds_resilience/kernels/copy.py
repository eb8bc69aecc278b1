"""``copy_chunk``: copy a tensor chunk into a staging buffer, optionally checksumming it in the same pass.

The checkpoint engine stages every snapshot through pinned host sub-buffers (Gemini, 128 MB by
default). This module is the one entry point for that copy; it picks a backend once per process:

1. ``csrc``   - the CUDA extension ``ds_resilience.kernels._copy_cuda`` (``csrc/``), if it was built
   and a CUDA device is present: 16-byte vector accesses, a tail path, strides up to 8 dims natively.
2. ``triton`` - ``triton_copy.py``, if Triton imports and either CUDA is present or
   ``TRITON_INTERPRET=1`` (then it runs on CPU tensors, which is how CI tests it).
3. ``torch``  - ``Tensor.copy_`` plus :func:`~ds_resilience.kernels.checksum.checksum_reference`.

``DSR_COPY_BACKEND=csrc|triton|torch`` forces a backend (an unavailable one raises);
``DSR_COPY_MAX_BLOCKS=N`` caps the csrc kernel's grid (default: one block per SM), which trades
copy speed for SMs left to a concurrent training step. The choice is made on the first call (or
:func:`backend_name`) and logged once at INFO on the ``ds_resilience.kernels`` logger. A call whose
tensors the chosen backend cannot serve (CPU tensors under ``csrc``, a pageable host destination,
a strided source with a destination misaligned for its element size) runs on the torch path, with
a DEBUG log line.

Contract of :func:`copy_chunk`:

* ``src``: any dtype, contiguous or a strided view (offsets, transposes, slices, expanded dims).
* ``dst``: a **contiguous** tensor holding exactly ``src``'s bytes: either the same dtype and numel,
  or a raw ``uint8`` (or any dtype) buffer of ``src.numel() * src.element_size()`` bytes, e.g. a
  slice of a pinned sub-buffer. On CUDA ``dst`` may be device memory or pinned host memory (the
  kernels write it through its mapped device address). The bytes land in ``src``'s row-major order.
* Strides: the csrc kernel handles up to 8 collapsed dims natively, the Triton kernel up to 4;
  beyond that, or for element sizes other than 1, 2, 4 or 8 bytes, the dispatcher makes one
  contiguous copy of ``src`` first. The torch path lets ``copy_`` handle the strides.
* ``checksum=True`` returns the checksum defined in ``checksum.py`` (an int in ``[0, 2**64)``),
  computed over the copied bytes; this synchronizes with the device. ``checksum=False`` returns
  ``None`` and, on CUDA, is asynchronous like ``copy_(non_blocking=True)``: it runs on the current
  stream, so record an event before reading a pinned host destination.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

from .checksum import DeferredChecksum, checksum_reference, pack
from .layout import ChunkLayout, CopyKernelError, plan_layout

__all__ = [
    "BACKENDS",
    "ChunkLayout",
    "CopyKernelError",
    "available_backends",
    "backend_name",
    "copy_chunk",
    "copy_chunk_deferred",
    "copy_chunk_using",
    "plan_layout",
]

logger = logging.getLogger("ds_resilience.kernels")

BACKENDS = ("csrc", "triton", "torch")
_KERNEL_ELEM_SIZES = (1, 2, 4, 8)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CSRC_MAX_DIMS = 8


def _check(src: torch.Tensor, dst: torch.Tensor) -> None:
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise CopyKernelError(f"copy_chunk takes tensors, got {type(src).__name__} and {type(dst).__name__}")
    if not dst.is_contiguous():
        raise CopyKernelError(f"copy_chunk: dst must be contiguous (shape {tuple(dst.shape)}, stride {dst.stride()})")
    src_bytes = src.numel() * src.element_size()
    dst_bytes = dst.numel() * dst.element_size()
    if src_bytes != dst_bytes:
        raise CopyKernelError(
            f"copy_chunk: dst holds {dst_bytes} bytes but src has {src_bytes} "
            f"({src.numel()} x {src.dtype}); pass the same dtype and numel or a uint8 buffer of {src_bytes} bytes"
        )
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise CopyKernelError(f"copy_chunk: src on {src.device} but dst on {dst.device}")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D stride-1 view of a contiguous tensor (size-1 dims may carry any stride, which
    ``view(-1)`` keeps and ``view(dtype)`` then refuses)."""
    return t.as_strided((t.numel(),), (1,))


# --------------------------------------------------------------------------------------- backends
def _torch_copy(src: torch.Tensor, dst: torch.Tensor, checksum: bool, deferred: bool = False):
    """``Tensor.copy_`` (non-blocking where the devices differ) plus the reference checksum of ``src``."""
    if src.numel():
        non_blocking = src.device != dst.device
        if dst.dtype == src.dtype:
            _flat(dst).view(src.shape).copy_(src, non_blocking=non_blocking)
        elif dst.data_ptr() % src.element_size() == 0:
            _flat(dst).view(torch.uint8).view(src.dtype).view(src.shape).copy_(src, non_blocking=non_blocking)
        else:  # misaligned raw buffer: move bytes
            _flat(dst).view(torch.uint8).copy_(_flat(src.contiguous()).view(torch.uint8), non_blocking=non_blocking)
    if not checksum:
        return None
    value = checksum_reference(src)  # synchronizes: the torch path has no device-side sums to defer
    return DeferredChecksum.ready(value) if deferred else value


def _kernel_views(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ChunkLayout] | None:
    """Integer views and a layout the kernels can take, or ``None`` when only the torch path can."""
    layout = plan_layout(src)
    dst_flat = _flat(dst).view(torch.uint8)
    if layout.contiguous:
        # Dense: copy as the widest integer the byte count and both addresses allow. The checksum is
        # defined on bytes, so the width changes nothing but speed.
        src_bytes = src.as_strided((layout.numel,), (1,)).view(torch.uint8)  # same storage offset
        nbytes = layout.nbytes
        for width in (8, 4, 2, 1):
            if nbytes % width == 0 and src.data_ptr() % width == 0 and dst.data_ptr() % width == 0:
                flat = ChunkLayout(numel=nbytes // width, elem_size=width, sizes=(nbytes // width,), strides=(1,))
                dtype = _INT_OF_SIZE[width]
                return src_bytes.view(dtype), dst_flat.view(dtype), flat
    if layout.elem_size not in _KERNEL_ELEM_SIZES:
        return None
    if dst.data_ptr() % layout.elem_size:
        return None
    dtype = _INT_OF_SIZE[layout.elem_size]
    return src.view(dtype), dst_flat.view(dtype), layout


def _prepare(src: torch.Tensor, dst: torch.Tensor, max_dims: int):
    """Kernel views of (src, dst); one contiguous copy of ``src`` first when its collapsed layout has
    more than ``max_dims`` dims or its element size is not 1, 2, 4 or 8 bytes."""
    views = _kernel_views(src, dst)
    odd_element = views is None and src.element_size() not in _KERNEL_ELEM_SIZES
    if odd_element or (views is not None and len(views[2].sizes) > max_dims):
        views = _kernel_views(src.contiguous(), dst)
    return views


def _device_ok(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """src on CUDA; dst on the same device or in pinned host memory."""
    if not src.is_cuda:
        return False
    if dst.is_cuda:
        return dst.device == src.device
    return dst.device.type == "cpu" and dst.is_pinned()


def _triton_copy(src: torch.Tensor, dst: torch.Tensor, checksum: bool, deferred: bool = False):
    from . import triton_copy

    if triton_copy.interpreting():
        usable = src.device.type == "cpu" and dst.device.type == "cpu"
    else:
        usable = _device_ok(src, dst)
    views = _prepare(src, dst, triton_copy.MAX_DIMS) if usable else None
    if views is not None and not views[2].contiguous and views[2].numel > triton_copy.MAX_LAUNCH_ELEMENTS:
        views = None
    if views is None:
        logger.debug("copy_chunk: triton cannot serve src=%s dst=%s; torch path", src.device, dst.device)
        return _torch_copy(src, dst, checksum, deferred)
    s, d, layout = views
    return triton_copy.triton_copy_planned(s, d, layout, checksum=checksum, deferred=deferred)


def _max_blocks_from_env() -> int:
    raw = os.environ.get("DSR_COPY_MAX_BLOCKS", "0")
    try:
        value = int(raw)
    except ValueError:
        raise CopyKernelError(f"DSR_COPY_MAX_BLOCKS must be an integer, got {raw!r}") from None
    return max(0, value)


def _csrc_copy(src: torch.Tensor, dst: torch.Tensor, checksum: bool, deferred: bool = False, *,
               max_blocks: int | None = None):
    views = _prepare(src, dst, CSRC_MAX_DIMS) if _device_ok(src, dst) else None
    if views is None:
        logger.debug("copy_chunk: csrc cannot serve src=%s dst=%s; torch path", src.device, dst.device)
        return _torch_copy(src, dst, checksum, deferred)
    s, d, layout = views
    ext = _load_extension()
    out = torch.empty(2, dtype=torch.int32, device=src.device) if checksum else None
    blocks = _max_blocks_from_env() if max_blocks is None else max_blocks
    if layout.contiguous:
        ext.copy_contiguous(s, d, out, blocks)
    else:
        ext.copy_strided(s, d, list(layout.sizes), list(layout.strides), out, blocks)
    if out is None:
        return None
    if deferred:
        return DeferredChecksum([("pair32", out, 0)])
    s1, s2 = out.tolist()
    return pack(s1, s2)


def _load_extension():
    from . import _copy_cuda  # type: ignore[attr-defined]  # built from csrc/ by setup.py

    return _copy_cuda


_IMPLEMENTATIONS: dict[str, Callable[..., int | None | DeferredChecksum]] = {
    "csrc": _csrc_copy,
    "triton": _triton_copy,
    "torch": _torch_copy,
}


def _why_unavailable(name: str) -> str | None:
    """``None`` if backend ``name`` can run in this process, else the reason."""
    if name == "torch":
        return None
    if name == "csrc":
        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            _load_extension()
        except ImportError as exc:
            return f"extension not built ({exc})"
        return None
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"triton not importable ({exc})"
        from .triton_copy import interpreting

        if not torch.cuda.is_available() and not interpreting():
            return "no CUDA device and TRITON_INTERPRET is not set"
        return None
    raise CopyKernelError(f"unknown copy backend {name!r}; allowed: {', '.join(BACKENDS)}")


def available_backends() -> tuple[str, ...]:
    """The backends that can run here, in dispatch order (``torch`` always)."""
    return tuple(name for name in BACKENDS if _why_unavailable(name) is None)


@functools.lru_cache(maxsize=1)
def _selected() -> str:
    forced = os.environ.get("DSR_COPY_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise CopyKernelError(f"DSR_COPY_BACKEND={forced!r}; allowed: {', '.join(BACKENDS)}")
        reason = _why_unavailable(forced)
        if reason is not None:
            raise CopyKernelError(f"DSR_COPY_BACKEND={forced}: backend unavailable: {reason}")
        logger.info("ds_resilience copy kernel: backend %s (forced by DSR_COPY_BACKEND)", forced)
        return forced
    skipped = []
    for name in BACKENDS:
        reason = _why_unavailable(name)
        if reason is None:
            note = f"; skipped {'; '.join(skipped)}" if skipped else ""
            logger.info("ds_resilience copy kernel: backend %s%s", name, note)
            return name
        skipped.append(f"{name}: {reason}")
    raise AssertionError("unreachable: the torch backend is always available")  # pragma: no cover


def backend_name() -> str:
    """The backend :func:`copy_chunk` uses in this process: ``"csrc"``, ``"triton"`` or ``"torch"``."""
    return _selected()


def _reset_backend_choice() -> None:
    """Forget the choice (tests only: the next call chooses and logs again)."""
    _selected.cache_clear()


def copy_chunk(src: torch.Tensor, dst: torch.Tensor, *, checksum: bool = False) -> int | None:
    """Copy ``src`` (any layout) into the contiguous ``dst``; return its checksum if asked.

    See the module docstring for the contract (dst forms, devices, streams, synchronization).
    """
    _check(src, dst)
    backend = _selected()
    if src.numel() == 0:
        return pack(0, 0) if checksum else None
    return _IMPLEMENTATIONS[backend](src, dst, checksum)


def copy_chunk_deferred(src: torch.Tensor, dst: torch.Tensor) -> DeferredChecksum:
    """:func:`copy_chunk` with the checksum left on the device: no synchronization here; read it
    with ``.value()`` once the stream it ran on is done (one synchronization for many chunks)."""
    _check(src, dst)
    if src.numel() == 0:
        return DeferredChecksum.ready(pack(0, 0))
    return _IMPLEMENTATIONS[_selected()](src, dst, True, True)


def copy_chunk_using(backend: str, src: torch.Tensor, dst: torch.Tensor, *, checksum: bool = False) -> int | None:
    """:func:`copy_chunk` through a named backend, bypassing the process-wide choice (tests, benchmarks)."""
    if backend not in _IMPLEMENTATIONS:
        raise CopyKernelError(f"unknown copy backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    reason = _why_unavailable(backend)
    if reason is not None:
        raise CopyKernelError(f"copy backend {backend} unavailable: {reason}")
    _check(src, dst)
    if src.numel() == 0:
        return pack(0, 0) if checksum else None
    return _IMPLEMENTATIONS[backend](src, dst, checksum)
