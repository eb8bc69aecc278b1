"""ds_resilience: keep hybrid-parallel DeepSpeed/Megatron training running through worker failures.

The top-level package imports nothing heavy: the pure layers (``ir``, ``planning``, ``sim``,
``topology``, ``config``) load without torch.
"""

from .errors import ConfigError, PlanningError, ResilienceError, ScheduleError, TopologyError
from .topology import Topology, Worker

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "PlanningError",
    "ResilienceError",
    "ScheduleError",
    "Topology",
    "TopologyError",
    "Worker",
    "__version__",
]
