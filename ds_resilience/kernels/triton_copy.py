"""The copy kernel in Triton: chunk -> contiguous buffer, with the checksum in the same pass.

One program walks its share of the chunk in a grid-stride loop (at most ``max_programs`` programs,
so a copy can be kept off most SMs while training runs), loads ``BLOCK`` elements, stores them at
their row-major position in the destination and, when asked, adds their checksum contributions
(``checksum.py``) to two int64 lane accumulators. Each program writes its two partial sums to a
small int64 buffer; the host adds them.

Layout handling: the caller (``copy.py``) reinterprets both tensors as same-width integers
(int8/16/32/64: bits are copied, never converted) and passes a source layout collapsed to at most 4
dims with element strides; ``CONTIG`` specializes the dense case (no index arithmetic). Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors.

The kernel is decorated with ``triton.jit`` on first use (not at import) and cached per interpreter
mode, so the ``TRITON_INTERPRET`` value in force at the first call decides how it runs. Importing
this module imports triton; ``copy.py`` imports it only when the Triton backend is used.
"""

from __future__ import annotations


import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from ..accelerator import guard as device_guard
from .checksum import DeferredChecksum, combine, pack
from .layout import ChunkLayout

__all__ = ["DEFAULT_BLOCK", "MAX_DIMS", "interpreting", "triton_copy_planned"]

MAX_DIMS = 4
DEFAULT_BLOCK = 4096
_INTERPRETER_BLOCK = 1024
_DEFAULT_MAX_PROGRAMS_PER_SM = 4
_NUM_WARPS = 8
# Elements per launch: keeps the loop index (int32 when Triton types ``n`` as i32) far from
# overflow. Larger dense chunks run as several launches, their checksums combined; larger strided
# chunks go to the torch path (copy.py). Staging chunks (128 MB) never come close.
MAX_LAUNCH_ELEMENTS = 1 << 30


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _copy_kernel(
    src_ptr,
    dst_ptr,
    part_ptr,
    n,
    size1,
    size2,
    size3,
    stride0,
    stride1,
    stride2,
    stride3,
    nprog,
    CONTIG: tl.constexpr,
    ELEM: tl.constexpr,
    CHECKSUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Checksum arithmetic is int64 that never overflows: every contribution c < 2**32, and
    # (c * w) mod 2**32 is c * (w & 0xFFFF) + (((c * (w >> 16)) & 0xFFFF) << 16), both products
    # < 2**48 (checksum.mulmod32 is the same identity in torch).
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    acc2 = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = lanes.to(tl.int64) + start
        mask = offs < n
        if CONTIG:
            src_off = offs
        else:
            i3 = offs % size3
            rest = offs // size3
            i2 = rest % size2
            rest = rest // size2
            i1 = rest % size1
            i0 = rest // size1
            src_off = i0 * stride0 + i1 * stride1 + i2 * stride2 + i3 * stride3
        x = tl.load(src_ptr + src_off, mask=mask, other=0)
        tl.store(dst_ptr + offs, x, mask=mask)
        if CHECKSUM:
            v = x.to(tl.int64)
            if ELEM == 8:
                # element k holds words 2k (weight 2k+1) and 2k+1 (weight 2k+2)
                lo = v & 0xFFFFFFFF
                hi = (v >> 32) & 0xFFFFFFFF
                w_lo = (offs * 2 + 1) & 0xFFFFFFFF
                w_hi = (offs * 2 + 2) & 0xFFFFFFFF
                m_lo = (lo * (w_lo & 0xFFFF) + (((lo * (w_lo >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
                m_hi = (hi * (w_hi & 0xFFFF) + (((hi * (w_hi >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
                acc1 = (acc1 + lo + hi) & 0xFFFFFFFF
                acc2 = (acc2 + m_lo + m_hi) & 0xFFFFFFFF
            else:
                if ELEM == 4:
                    c = v & 0xFFFFFFFF
                    word = offs
                elif ELEM == 2:
                    c = (v & 0xFFFF) << ((offs & 1) * 16)
                    word = offs >> 1
                else:
                    c = (v & 0xFF) << ((offs & 3) * 8)
                    word = offs >> 2
                w = (word + 1) & 0xFFFFFFFF
                m = (c * (w & 0xFFFF) + (((c * (w >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF
                acc1 = (acc1 + c) & 0xFFFFFFFF
                acc2 = (acc2 + m) & 0xFFFFFFFF
    if CHECKSUM:
        tl.store(part_ptr + 2 * pid, tl.sum(acc1, axis=0) & 0xFFFFFFFF)
        tl.store(part_ptr + 2 * pid + 1, tl.sum(acc2, axis=0) & 0xFFFFFFFF)


@functools.lru_cache(maxsize=2)
def _build(interpret: bool) -> Any:
    """Decorate the kernel; ``interpret`` is the cache key (``triton.jit`` reads the env itself)."""
    del interpret
    return triton.jit(_copy_kernel)


def _default_max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return _DEFAULT_MAX_PROGRAMS_PER_SM * props.multi_processor_count
    return 1 << 30  # the interpreter: no reason to cap


def triton_copy_planned(
    src: torch.Tensor,
    dst: torch.Tensor,
    layout: ChunkLayout,
    *,
    checksum: bool,
    block: int | None = None,
    max_programs: int | None = None,
    deferred: bool = False,
) -> int | None | DeferredChecksum:
    """Run the kernel on a validated, planned copy (``copy.py`` does the checks and the layout).

    ``src`` and ``dst`` are already integer views of width ``layout.elem_size``; ``dst`` is 1-D
    contiguous with ``layout.numel`` elements. Returns the checksum (synchronizing) or ``None``;
    with ``deferred`` a :class:`~.checksum.DeferredChecksum` of the device sums (no synchronization).
    """
    n = layout.numel
    if n > MAX_LAUNCH_ELEMENTS:
        if not layout.contiguous:
            raise ValueError(f"triton copy: a strided chunk of {n} elements exceeds {MAX_LAUNCH_ELEMENTS}")
        total = None
        parts: list = []
        for start in range(0, n, MAX_LAUNCH_ELEMENTS):
            stop = min(n, start + MAX_LAUNCH_ELEMENTS)
            part = ChunkLayout(numel=stop - start, elem_size=layout.elem_size, sizes=(stop - start,), strides=(1,))
            value = triton_copy_planned(src[start:stop], dst[start:stop], part, checksum=checksum, block=block,
                                        max_programs=max_programs, deferred=deferred)
            if checksum and deferred:  # the segment's sums, at its byte offset in the chunk
                parts += [(kind, payload, start * layout.elem_size) for kind, payload, _ in value._parts]
            elif checksum:  # segment byte offsets are multiples of 4: MAX_LAUNCH_ELEMENTS is
                total = value if total is None else combine(total, value, start * layout.elem_size)
        return DeferredChecksum(parts) if checksum and deferred else total
    if len(layout.sizes) > MAX_DIMS:
        raise ValueError(f"triton copy takes at most {MAX_DIMS} collapsed dims, got {len(layout.sizes)}")
    if block is None:
        block = _INTERPRETER_BLOCK if interpreting() else DEFAULT_BLOCK
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    sizes = (1,) * (MAX_DIMS - len(layout.sizes)) + tuple(layout.sizes)
    strides = (0,) * (MAX_DIMS - len(layout.strides)) + tuple(layout.strides)
    cap = max_programs if max_programs is not None else _default_max_programs(src.device)
    nprog = max(1, min(-(-n // block), int(cap)))
    partials = torch.zeros(2 * nprog if checksum else 2, dtype=torch.int64, device=src.device)
    kernel = _build(interpreting())
    # the launch goes to the current device: on cuda:k (k > 0) it must be the tensors' own
    with device_guard(src.device):
        _launch(kernel, nprog, src, dst, partials, n, sizes, strides, layout, checksum, block)
    if not checksum:
        return None
    if deferred:
        return DeferredChecksum([("partials", partials, 0)])
    sums = partials.view(nprog, 2).sum(dim=0).tolist()  # each partial < 2**32: no int64 overflow
    return pack(sums[0], sums[1])


def _launch(kernel, nprog, src, dst, partials, n, sizes, strides, layout, checksum, block) -> None:
    kernel[(nprog,)](
        src,
        dst,
        partials,
        n,
        sizes[1],
        sizes[2],
        sizes[3],
        strides[0],
        strides[1],
        strides[2],
        strides[3],
        nprog,
        CONTIG=layout.contiguous,
        ELEM=layout.elem_size,
        CHECKSUM=checksum,
        BLOCK=block,
        num_warps=_NUM_WARPS,
    )
