"""Optional CUDA extension for setup.py: ``ds_resilience.kernels._copy_cuda`` from csrc/.

Used by setup.py through ``runpy.run_path`` (so this file needs no package around it)::

    _cuda = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build_ext.py"))
    setup(..., ext_modules=_cuda["cuda_extensions"](), cmdclass=_cuda["cmdclass"]())

The extension is built only when all of these hold, else the lists are empty and the package
installs without it (``copy_chunk`` then falls back to Triton or torch):

* ``DSR_BUILD_CUDA`` is not ``"0"`` (``"1"`` makes a missing prerequisite an error instead);
* torch imports in the build environment and is a CUDA build (``torch.version.cuda``); pip's
  isolated builds do not see the installed torch, so use ``pip install --no-build-isolation -e .``;
* ``nvcc`` is found (``CUDA_HOME``/``CUDA_PATH``, or on ``PATH``).

Target architectures follow torch's ``TORCH_CUDA_ARCH_LIST`` (default: the visible GPUs, or torch's
list when none is visible).
"""

from __future__ import annotations

import functools
import os
import shutil

__all__ = ["EXTENSION_NAME", "SOURCES", "cmdclass", "cuda_extensions", "skip_reason"]

EXTENSION_NAME = "ds_resilience.kernels._copy_cuda"
SOURCES = ("csrc/bindings.cpp", "csrc/copy_kernel.cu")  # relative to the project root, as setuptools wants
_HERE = os.path.dirname(os.path.abspath(__file__))


def _find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


def skip_reason() -> str | None:
    """Why the extension will not be built here, or ``None`` if it will."""
    if os.environ.get("DSR_BUILD_CUDA", "").strip() == "0":
        return "DSR_BUILD_CUDA=0"
    try:
        import torch
    except ImportError:
        return "torch is not importable in the build environment (use pip install --no-build-isolation)"
    if not getattr(torch.version, "cuda", None):
        return f"torch {torch.__version__} is not a CUDA build"
    if _find_nvcc() is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


@functools.lru_cache(maxsize=1)
def cuda_extensions() -> list:
    """``[CUDAExtension(...)]`` when the extension can be built here, else ``[]`` (with a note on stderr)."""
    reason = skip_reason()
    if reason is not None:
        if os.environ.get("DSR_BUILD_CUDA", "").strip() == "1":
            raise RuntimeError(f"DSR_BUILD_CUDA=1 but the CUDA copy kernel cannot be built: {reason}")
        print(f"ds_resilience: skipping the CUDA copy kernel ({reason}); copy_chunk will use Triton or torch")
        return []
    from torch.utils.cpp_extension import CUDAExtension

    root = os.path.dirname(_HERE)
    for source in SOURCES:
        if not os.path.isfile(os.path.join(root, source)):
            raise FileNotFoundError(f"missing CUDA source {source} under {root}")
    return [
        CUDAExtension(
            name=EXTENSION_NAME,
            sources=list(SOURCES),
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
    ]


def cmdclass() -> dict:
    """``{"build_ext": BuildExtension}`` when there is an extension to build, else ``{}``."""
    if not cuda_extensions():
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension}
