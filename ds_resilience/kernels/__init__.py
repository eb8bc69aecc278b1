"""Copy kernels for the checkpoint staging path: ``copy_chunk`` with an optional same-pass checksum.

Dispatch order csrc (CUDA extension built from ``csrc/``) -> Triton -> torch, chosen once per process
and logged; see :mod:`ds_resilience.kernels.copy` for the contract and
:mod:`ds_resilience.kernels.checksum` for the checksum's definition. Importing this package imports
torch but not triton (Triton loads on the first copy that uses it).
"""

from .checksum import checksum_of_bytes, checksum_reference, combine
from .copy import (
    BACKENDS,
    CopyKernelError,
    available_backends,
    backend_name,
    copy_chunk,
    copy_chunk_using,
)

__all__ = [
    "BACKENDS",
    "CopyKernelError",
    "available_backends",
    "backend_name",
    "checksum_of_bytes",
    "checksum_reference",
    "combine",
    "copy_chunk",
    "copy_chunk_using",
]
