"""ds_resilience for Megatron: argument hooks, the PTD-P grid (a stage replica is a tensor-parallel
group) and the resilient forward-backward.

In a Megatron-LM training script (``pretrain_gpt.py``)::

    from ds_resilience.megatron import add_resilience_args
    pretrain(..., extra_args_provider=add_resilience_args)

then, after Megatron validated its arguments, :func:`config_from_args` (``get_args()``) gives the
job's :class:`MegatronJob`. Importing this package needs neither torch nor megatron.
"""

from .args import FLAGS, MegatronJob, add_resilience_args, config_from_args, with_resilience_args
from .grid import PTDPGrid

__all__ = ["FLAGS", "MegatronJob", "PTDPGrid", "add_resilience_args", "config_from_args", "with_resilience_args"]
