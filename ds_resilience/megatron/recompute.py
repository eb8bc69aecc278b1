"""megatron-core's activation recompute, taken over at stage granularity.

A Megatron user who trains with ``--recompute-granularity full`` (``TransformerConfig.
recompute_granularity="full"``: the transformer block wraps layer groups in
``tensor_parallel.checkpoint``) or ``selective`` (core attention, and the modules
``recompute_modules`` names, wrapped the same way) wants the activation memory that buys. megatron-
core's checkpoint function is reentrant: its backward recomputes the segment and runs the whole
backward inside, weight gradients included, so a decoupled B/W split cannot pass through it, and it
forks megatron-core's CUDA RNG tracker, which is CUDA-only.

So the resilient schedule checkpoints the stage itself, as it does for DeepSpeed's
``activation_checkpoint_interval``: F runs the chunk without building a graph and keeps only its
input; B recomputes the chunk's forward under the micro-batch's own RNG stream (the same dropout
masks) with megatron-core's recompute switched off for that call (:func:`recompute_switch`), then
splits into B and W as without checkpointing. The activation memory between F and B is one stage
input per micro-batch, at most what megatron-core's full recompute keeps.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

__all__ = ["recompute_switch"]

# module attributes megatron-core 0.16 sets from recompute_granularity="selective" / recompute_modules
_SELECTIVE = ("checkpoint_core_attention", "recompute_input_layernorm", "recompute_pre_mlp_layernorm",
              "recompute_mlp", "recompute_mla_up_proj", "recompute_moe", "recompute_layernorm")


def recompute_switch(model: Any) -> Callable[[], contextlib.AbstractContextManager] | None:
    """``None`` when the chunk recomputes nothing; otherwise a context-manager factory under which
    the chunk runs its plain forward (megatron-core's full and selective recompute switched off,
    restored on the way out)."""
    config = getattr(model, "config", None)
    granularity = getattr(config, "recompute_granularity", None)
    flagged = [(m, name) for m in model.modules() for name in _SELECTIVE if getattr(m, name, False) is True]
    if granularity is None and not flagged:
        return None

    @contextlib.contextmanager
    def plain_forward() -> Iterator[None]:
        saved = config.recompute_granularity if config is not None else None
        try:
            if config is not None and saved == "full":
                config.recompute_granularity = None
            for module, name in flagged:
                setattr(module, name, False)
            yield
        finally:
            if config is not None:
                config.recompute_granularity = saved
            for module, name in flagged:
                setattr(module, name, True)

    return plain_forward
