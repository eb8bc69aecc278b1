"""The chunk checksum: its one definition, a pure-Python oracle and a pure-torch reference.

Definition (``DSR-F32``, a Fletcher-style pair of 32-bit sums)
-------------------------------------------------------------
Take the bytes of a chunk in logical row-major order, i.e. exactly the bytes that
``copy_chunk`` writes into its destination, ``n`` bytes in all. Pad them with zero bytes to a
multiple of 4 and read them as little-endian unsigned 32-bit words ``w[0] .. w[m-1]``
(``m = ceil(n / 4)``). Then::

    S1 = sum(w[i]           for i in range(m))  mod 2**32
    S2 = sum((i + 1) * w[i] for i in range(m))  mod 2**32
    checksum = (S2 << 32) | S1                   # a Python int in [0, 2**64)

Why this one:

* **Exact and identical everywhere.** Only integer additions and multiplications modulo 2**32:
  CUDA gets it from wrapping ``uint32_t`` arithmetic, Triton and torch from ``int64`` arithmetic
  that never overflows (products are split into 16-bit halves, see :func:`mulmod32`). No floating
  point, no rounding, no dependence on the order of summation.
* **Blockwise and parallel.** Every word contributes ``w[i]`` to S1 and ``(i + 1) * w[i]`` to S2
  independently of the others, so any block of threads can sum its own words (knowing only their
  global index) and the partial sums are added in any order, even with atomics.
* **Per element, not per word.** Because the contributions are linear in the bit fields of a word, a
  1- or 2-byte element at byte position ``p`` contributes ``e << 8 * (p % 4)`` to word ``p // 4``,
  and an 8-byte element at element index ``k`` contributes its low and high halves to words
  ``2k`` and ``2k + 1``. Kernels that walk a strided source element by element therefore need no
  word assembly; kernels that copy 16-byte vectors add four words at a time.
* **Cheap but not blind.** S1 catches any change confined to one word; S2 (position-weighted, the
  Fletcher second sum) catches swapped or shifted words that S1 alone would miss. It is an
  integrity check for copies and replicas, not a cryptographic hash.
* **Composable.** The checksum of a concatenation follows from the parts' checksums when the first
  part's byte length is a multiple of 4 (:func:`combine`), so per-sub-buffer checksums compose
  into a whole-tensor checksum without reading the data again.

The checksum depends only on the bytes, never on the dtype: a chunk viewed as fp16, int32 or uint8
has one checksum. Every backend of :func:`ds_resilience.kernels.copy_chunk` must return
:func:`checksum_reference` of its source bit for bit; the tests hold the CUDA-free backends to
that, and the pure-Python :func:`checksum_of_bytes` holds the reference to this text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DeferredChecksum",
    "MASK32",
    "checksum_of_bytes",
    "checksum_reference",
    "combine",
    "mulmod32",
    "pack",
    "unpack",
]

MASK32 = 0xFFFFFFFF
# Words per step of the torch reference: bounds its temporary memory (about 6 int64 tensors of
# this many elements) and keeps every int64 sum far below 2**63.
_REFERENCE_WORDS_PER_STEP = 1 << 22


class DeferredChecksum:
    """A chunk's checksum whose sums may still be on the device: a copy kernel returns it without
    waiting, and :meth:`value` reads it once the device work is done (the staging path synchronizes
    once per snapshot, then reads every chunk's). Parts: ``("int", value, offset)``, ``("pair32",
    tensor[2] = S1, S2, offset)`` (the CUDA extension), ``("partials", tensor[n, 2], offset)`` (the
    Triton kernel's per-program sums); a part's offset is its byte offset in the chunk."""

    __slots__ = ("_parts",)

    def __init__(self, parts) -> None:
        self._parts = list(parts)

    @classmethod
    def ready(cls, value: int) -> "DeferredChecksum":
        return cls([("int", value, 0)])

    def value(self) -> int:
        total: int | None = None
        for kind, payload, offset in self._parts:
            if kind == "int":
                v = int(payload)
            elif kind == "pair32":
                s1, s2 = payload.tolist()
                v = pack(s1, s2)
            else:
                sums = payload.view(-1, 2).sum(dim=0).tolist()  # each partial < 2**32: no overflow
                v = pack(sums[0], sums[1])
            total = v if total is None else combine(total, v, offset)
        return pack(0, 0) if total is None else total


def pack(s1: int, s2: int) -> int:
    """The 64-bit checksum from its two 32-bit sums: ``(S2 << 32) | S1``."""
    return ((int(s2) & MASK32) << 32) | (int(s1) & MASK32)


def unpack(value: int) -> tuple[int, int]:
    """``(S1, S2)`` of a 64-bit checksum."""
    return value & MASK32, (value >> 32) & MASK32


def checksum_of_bytes(data: bytes | bytearray | memoryview) -> int:
    """The definition, literally, in pure Python (slow: for tests and small payloads)."""
    raw = bytes(data)
    raw += b"\x00" * (-len(raw) % 4)
    s1 = s2 = 0
    for i in range(len(raw) // 4):
        w = int.from_bytes(raw[4 * i : 4 * i + 4], "little")
        s1 += w
        s2 += (i + 1) * w
    return pack(s1, s2)


def combine(first: int, second: int, first_nbytes: int) -> int:
    """Checksum of ``A + B`` (concatenated bytes) from ``checksum(A)``, ``checksum(B)``, ``len(A)``.

    ``len(A)`` must be a multiple of 4 (word-aligned parts: sub-buffer chunks always are in
    practice); B's words move up by ``len(A) / 4`` positions, which adds ``len(A)/4 * S1(B)`` to S2.
    """
    if first_nbytes < 0 or first_nbytes % 4:
        raise ValueError(f"combine: the first part must be a whole number of 4-byte words, got {first_nbytes} bytes")
    a1, a2 = unpack(first)
    b1, b2 = unpack(second)
    shift = first_nbytes // 4
    return pack(a1 + b1, a2 + b2 + shift * b1)


def mulmod32(value: "torch.Tensor", weight: "torch.Tensor") -> "torch.Tensor":
    """``(value * weight) mod 2**32`` in int64 without overflow (value < 2**32, weight >= 0).

    ``v * w = v * w_lo + v * w_hi * 2**16`` with 16-bit halves of ``w mod 2**32``; both products are
    below 2**48, and ``v * w_hi * 2**16 mod 2**32`` only needs the low 16 bits of ``v * w_hi``.
    The Triton kernel uses the same identity.
    """
    w = weight & MASK32
    low = value * (w & 0xFFFF)
    high = ((value * (w >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _checksum_host(raw: "torch.Tensor") -> int:
    """The checksum of a CPU uint8 tensor with numpy, about 7x faster than the torch path.

    numpy's ``uint64`` arithmetic wraps modulo 2**64, which 2**32 divides, so ``dot(w, i + 1)``
    reduced mod 2**32 is S2 exactly; each block's S2 is shifted by ``start * S1(block)``.
    """
    import numpy as np

    data = raw.numpy()
    full_words = data.size // 4
    s1 = s2 = 0
    if full_words:
        words = data[: 4 * full_words].view("<u4")
        weights = np.arange(1, min(full_words, _REFERENCE_WORDS_PER_STEP) + 1, dtype=np.uint64)
        for start in range(0, full_words, _REFERENCE_WORDS_PER_STEP):
            block = words[start : start + _REFERENCE_WORDS_PER_STEP].astype(np.uint64)
            b1 = int(block.sum())
            s1 += b1
            s2 += int(np.dot(block, weights[: block.size])) + start * b1
    tail = data.size - 4 * full_words
    if tail:
        last = int.from_bytes(data[4 * full_words :].tobytes(), "little")
        s1 += last
        s2 += (full_words + 1) * last
    return pack(s1, s2)


def checksum_reference(tensor: "torch.Tensor") -> int:
    """Checksum of a tensor's logical row-major bytes, any dtype, layout or device.

    Non-contiguous tensors are read through one contiguous copy. CPU tensors are summed with numpy
    (:func:`_checksum_host`); others in torch on their device, in steps of
    :data:`_REFERENCE_WORDS_PER_STEP` words, synchronizing once at the end.
    """
    import torch

    dense = tensor.detach().contiguous()
    # as_strided, not reshape: a contiguous tensor's elements are dense in row-major order, but its
    # size-1 dims may carry any stride, which view(torch.uint8) would refuse.
    flat = dense.as_strided((dense.numel(),), (1,))
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
    if raw.data_ptr() % 4:  # e.g. an fp16 view at an odd element offset: realign for the int32 view
        raw = raw.clone()
    if raw.device.type == "cpu":
        return _checksum_host(raw)
    return _checksum_torch(raw)


def _checksum_torch(raw: "torch.Tensor") -> int:
    """The checksum of a uint8 tensor on any device, in int64 torch arithmetic."""
    import torch

    nbytes = raw.numel()
    full_words = nbytes // 4
    s1 = torch.zeros((), dtype=torch.int64, device=raw.device)
    s2 = torch.zeros((), dtype=torch.int64, device=raw.device)
    if full_words:
        words = raw[: 4 * full_words].view(torch.int32)
        for start in range(0, full_words, _REFERENCE_WORDS_PER_STEP):
            w = words[start : start + _REFERENCE_WORDS_PER_STEP].to(torch.int64) & MASK32
            index = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=raw.device)
            s1 = (s1 + w.sum()) & MASK32
            s2 = (s2 + mulmod32(w, index).sum()) & MASK32
    total1, total2 = int(s1.item()), int(s2.item())
    tail = nbytes - 4 * full_words
    if tail:
        last = int.from_bytes(bytes(raw[4 * full_words :].cpu().tolist()), "little")
        total1 += last
        total2 += (full_words + 1) * last
    return pack(total1, total2)
