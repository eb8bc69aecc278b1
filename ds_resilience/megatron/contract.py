"""megatron-core's ``forward_backward_func`` contract, as the resilient schedule reads it: the
call's keywords (:func:`call_arguments`) and what a ``loss_func`` returns (:func:`normalised_loss`)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ConfigError, ResilienceError

__all__ = ["KNOWN", "call_arguments", "normalised_loss"]

# megatron-core 0.16's forward_backward_func keywords, and those Megatron-LM's training loop passes
KNOWN = frozenset({
    "forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length", "micro_batch_size",
    "decoder_seq_length", "forward_only", "collect_non_loss_data", "first_val_step", "adjust_tensor_shapes_fn",
    "p2p_communicator", "pg_collection", "force_all_reduce",
})


def call_arguments(kwargs: dict[str, Any]) -> tuple[Any, Any, int]:
    """The call's keywords checked (none unknown, none missing, nothing unsupported asked for);
    returns the rank's one model chunk, its data iterator and ``num_microbatches``."""
    unknown = sorted(set(kwargs) - KNOWN)
    if unknown:
        raise TypeError(f"resilient forward_backward_func got unknown keywords {unknown}; it accepts "
                        f"{sorted(KNOWN)} (a newer Megatron-LM? nothing is dropped silently)")
    missing = [k for k in ("forward_step_func", "data_iterator", "model", "num_microbatches") if k not in kwargs]
    if missing:
        raise TypeError(f"resilient forward_backward_func needs {missing}")
    if kwargs.get("collect_non_loss_data"):
        raise ResilienceError("collect_non_loss_data is not supported by the resilient schedule")
    model = kwargs["model"]
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage", f"{len(model)} model chunks per rank: "
                                                                         f"interleaving is not supported yet")
        model = model[0]
    data = kwargs["data_iterator"]
    if isinstance(data, (list, tuple)):
        data = data[0] if data else None
    return model, data, kwargs["num_microbatches"]


def normalised_loss(outputs: tuple) -> tuple[torch.Tensor, Any]:
    """``loss_func(output_tensor)``'s ``(loss, logging_dict)`` or ``(loss, num_tokens, logging_dict)``
    as ``(loss, logging_dict)``, the loss normalised per micro-batch as megatron-core does."""
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        loss = loss / torch.clamp(num_tokens, min=1)  # megatron-core's per-micro-batch normalisation
    elif len(outputs) == 2:
        loss, reduced = outputs
    else:
        raise ResilienceError(f"loss_func returned {len(outputs)} values; megatron-core's contract is (loss, "
                              f"logging_dict) or (loss, num_tokens, logging_dict)")
    return loss, reduced
