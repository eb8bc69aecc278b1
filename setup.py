"""ds_resilience: fault-tolerant hybrid-parallel training for DeepSpeed and Megatron.

Install torch first (``pip install torch==2.13.0`` takes the local CPU build), then
``pip install -e .[test]``. The CUDA copy kernel in csrc/ is built only where CUDA is available.
"""

import os
import runpy

from setuptools import find_packages, setup

# The CUDA copy kernel (csrc/) is built only where torch has CUDA and nvcc exists; else skipped.
_CUDA = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "build_ext.py"))

TEST = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",  # tests/run.sh runs the unit and dist tiers on two workers
    "hypothesis>=6",
]
DEEPSPEED = ["torch>=2.4", "deepspeed>=0.19.8,<0.20"]
MEGATRON = ["megatron-core>=0.16"]
TRITON = ["triton>=3.0"]

setup(
    name="ds_resilience",
    version="0.1.0",
    description="Keep DeepSpeed/Megatron pipeline training running through worker failures",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["ds_resilience", "ds_resilience.*"]),
    install_requires=[
        "ortools>=9.10",  # CP-SAT: the planner's optimizing solver
        "matplotlib>=3.7",  # Gantt charts and plots (imported lazily)
        "numpy>=1.24",  # the planner's C core reads schedules as arrays (ir/native.py)
    ],
    extras_require={
        "deepspeed": DEEPSPEED,
        "megatron": MEGATRON,
        "triton": TRITON,
        "test": TEST + DEEPSPEED + MEGATRON + TRITON,
    },
    entry_points={"console_scripts": ["ds-resilience=ds_resilience.cli:main"]},
    include_package_data=True,
    ext_modules=_CUDA["cuda_extensions"](),
    cmdclass=_CUDA["cmdclass"](),
)
