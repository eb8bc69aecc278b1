"""ds_resilience for Megatron: argument hooks, the PTD-P grid (a stage replica is a tensor-parallel
group) and the resilient forward-backward.

In a Megatron-LM training script (``pretrain_gpt.py``)::

    from ds_resilience.megatron import add_resilience_args
    pretrain(..., extra_args_provider=add_resilience_args)

then, after Megatron validated its arguments, :func:`config_from_args` (``get_args()``) gives the
job's :class:`MegatronJob`, and :class:`ResilientOptimizer`, :class:`ResilientScheduler`,
:class:`ResilientForwardBackward` and :func:`install` put the resilient schedule in Megatron's
training loop (README, "Megatron"). Importing this package needs neither torch nor megatron: the
torch-side names load on first use.
"""

from typing import Any

from .args import FLAGS, MegatronJob, add_resilience_args, config_from_args, with_resilience_args
from .grid import PTDPGrid

__all__ = ["FLAGS", "MegatronJob", "PTDPGrid", "ResilientForwardBackward", "ResilientOptimizer", "ResilientScheduler",
           "add_resilience_args", "config_from_args", "install", "load_checkpoint", "save_checkpoint", "uninstall",
           "with_resilience_args"]


def __getattr__(name: str) -> Any:
    """The torch-side names, imported when first asked for (the argument hooks stay light)."""
    if name == "ResilientForwardBackward":
        from .schedule import ResilientForwardBackward

        return ResilientForwardBackward
    if name in ("ResilientOptimizer", "ResilientScheduler"):
        from . import optimizer

        return getattr(optimizer, name)
    if name in ("install", "uninstall"):
        from . import factory

        return getattr(factory, name)
    if name in ("save_checkpoint", "load_checkpoint"):
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
