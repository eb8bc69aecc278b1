"""ds_resilience: keep hybrid-parallel DeepSpeed/Megatron training running through worker failures.

The top-level package imports nothing heavy: the pure layers (``ir``, ``planning``, ``sim``,
``topology``, ``config``) load without torch.
"""

from .errors import ConfigError, PlanningError, ResilienceError, ScheduleError, TopologyError
from .topology import Topology, Worker

__version__ = "0.1.0"


def __getattr__(name: str):
    """``ds_resilience.initialize`` loads the DeepSpeed integration (and torch) on first use."""
    if name in ("initialize", "ResilientPipelineEngine", "BeyondTolerance", "init_distributed"):
        from .integrations import deepspeed as _ds

        return getattr(_ds, name)
    raise AttributeError(f"module 'ds_resilience' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "PlanningError",
    "ResilienceError",
    "ScheduleError",
    "Topology",
    "TopologyError",
    "Worker",
    "__version__",
    "initialize",
    "init_distributed",
    "ResilientPipelineEngine",
    "BeyondTolerance",
]
