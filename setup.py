"""ds_resilience's build: everything but the optional CUDA extension is in pyproject.toml.

The CUDA copy kernel (csrc/) is built only where torch has CUDA and nvcc exists, else skipped; it
needs the installed torch, so build it with ``pip install --no-build-isolation -e .`` (see
csrc/build_ext.py).
"""

import os
import runpy

from setuptools import setup

_CUDA = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build_ext.py"))

setup(
    ext_modules=_CUDA["cuda_extensions"](),
    cmdclass=_CUDA["cmdclass"](),
)
