"""Shared pytest setup: GPU markers skip where no CUDA device exists."""

from __future__ import annotations

import os
import sys

import pytest

# The engine profiles itself at start when no cost model is given (resilience.profile_steps null):
# every test job would spend its first 5 iterations on it and plan with timings of a loaded machine.
# Tests run with unit costs unless they ask for a profile (tests/test_profile.py does, both ways).
os.environ.setdefault("DSR_SELF_PROFILE", "0")
# Point-to-point messages match as NCCL matches them (tags ignored, FIFO per pair) in every test job,
# so the whole suite runs under NCCL's rules on gloo; tests/test_engine.py also runs gloo's tags.
os.environ.setdefault("DSR_P2P_MATCHING", "fifo")
# Start-up is paid once: agents fork their workers from a server that imported these modules
# (ds_resilience/runtime/spawn.py), and tests/dist_harness.py forks its ranks from the same list.
# A 4-rank job under the agent starts in ~1 s instead of 5-15 s of imports per process. Tests of
# the default path (a fresh interpreter per worker) set DSR_PRELOAD="" for their agent.
os.environ.setdefault(
    "DSR_PRELOAD", "torch,torch.distributed,deepspeed,ds_resilience,ds_resilience.integrations.deepspeed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def required_gpus(item) -> int:
    """``@pytest.mark.gpu``: 1; ``@pytest.mark.multigpu(n)``: n (2 when not given)."""
    marker = item.get_closest_marker("multigpu")
    if marker is None:
        return 1
    need = marker.args[0] if marker.args else marker.kwargs.get("gpus", 2)
    if not isinstance(need, int) or need < 2:
        raise pytest.UsageError(f"{item.nodeid}: multigpu(n) needs an integer n >= 2, got {need!r}")
    return need


def pytest_collection_modifyitems(config, items):
    gpus = None
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if gpus is None:
                gpus = _cuda_devices()
            need = required_gpus(item)
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {gpus}"))
