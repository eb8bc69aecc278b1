"""What the resilient schedule needs to know of a rank's megatron-core model chunk: the chunk
inside Megatron's precision wrapper (:func:`unwrap`), that no gradient hooks of megatron-core's
``DistributedDataParallel`` sit on it (:func:`check_unwrapped`), and its tied embedding
(:func:`tied_weights`)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError, ResilienceError

__all__ = ["check_unwrapped", "tied_weights", "unwrap"]


def unwrap(model: Any) -> Any:
    """The megatron-core model inside Megatron's precision wrapper (``Float16Module``)."""
    while type(model).__name__ == "Float16Module" and hasattr(model, "module"):
        model = model.module
    return model


def check_unwrapped(model: Any) -> None:
    """Refuse a chunk wrapped in megatron-core's ``DistributedDataParallel``."""
    if hasattr(model, "ddp_config") or any(hasattr(p, "main_grad") for p in model.parameters()):
        raise ConfigError("model", "a model chunk wrapped in megatron-core's DistributedDataParallel: its "
                                   "gradient hooks would take the gradients this schedule reduces (training "
                                   "silently wrong); pass the unwrapped chunks (Megatron-LM: get_model(..., "
                                   "wrap_with_ddp=False))")


def tied_weights(model: Any, stage: int, pp: int) -> tuple[tuple[tuple[int, ...], ...], dict[int, list]]:
    """Tied input embedding and output layer (megatron-core's ``share_embeddings_and_output_weights``):
    one tied group over the first and last stages, holding this stage's copy."""
    model = unwrap(model)  # Megatron-LM wraps a bf16/fp16 chunk in Float16Module
    shared = getattr(model, "share_embeddings_and_output_weights", False)
    if not shared or pp == 1:
        return (), {}
    weight = model.shared_embedding_or_output_weight()
    if stage in (0, pp - 1) and weight is None:
        raise ResilienceError(f"stage {stage} shares its embedding with the output layer but holds no copy")
    return ((0, pp - 1),), ({0: [weight]} if stage in (0, pp - 1) else {})
