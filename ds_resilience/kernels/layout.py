"""What both copy backends share: the error type and a source chunk's collapsed layout.

:mod:`.copy` (the dispatcher) plans a chunk's layout with :func:`plan_layout`; the Triton kernel
(:mod:`.triton_copy`) takes the planned :class:`ChunkLayout`. Both import this module and neither
imports the other at module level (``copy.py`` loads ``triton_copy`` lazily, only when the Triton
backend runs). Importing this module imports nothing heavy (torch only for type checking).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ResilienceError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ChunkLayout", "CopyKernelError", "plan_layout"]


class CopyKernelError(ResilienceError, ValueError):
    """Bad arguments to :func:`~.copy.copy_chunk` (destination size, layout, devices) or a bad backend."""


@dataclass(frozen=True)
class ChunkLayout:
    """A source chunk as the kernels see it.

    Attributes:
        numel: elements to copy.
        elem_size: bytes per element (the width of the integer view the kernels use).
        sizes: collapsed sizes, outermost first (``()`` for a 0- or 1-element chunk).
        strides: element strides matching ``sizes``.
    """

    numel: int
    elem_size: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.strides):
            raise CopyKernelError(f"layout: {len(self.sizes)} sizes but {len(self.strides)} strides")

    @property
    def contiguous(self) -> bool:
        """Dense row-major: one dim of stride 1 (or nothing to index)."""
        return len(self.sizes) == 0 or (len(self.sizes) == 1 and self.strides[0] == 1)

    @property
    def nbytes(self) -> int:
        return self.numel * self.elem_size


def plan_layout(src: torch.Tensor) -> ChunkLayout:
    """Collapse ``src``'s sizes and strides: drop size-1 dims, merge dims that are dense together."""
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(reversed(src.shape), reversed(src.stride())):
        if size == 1:
            continue
        if sizes and stride == strides[0] * sizes[0]:
            sizes[0] *= size  # this dim steps over exactly the (merged) inner block: same run
        else:
            sizes.insert(0, int(size))
            strides.insert(0, int(stride))
    if src.numel() <= 1:
        sizes, strides = [], []
    return ChunkLayout(numel=src.numel(), elem_size=src.element_size(), sizes=tuple(sizes), strides=tuple(strides))
