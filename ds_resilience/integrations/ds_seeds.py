"""Per-layer dropout seeding of the DeepSpeed engine's stage.

Each layer's forward draws its random numbers (dropout) from a stream keyed by the iteration, the
micro-batch (as the first grid numbered it) and the layer: the same masks on whatever stage of
whatever grid the layer runs, re-routed or re-gridded.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ..runtime.executor import rng_seed

__all__ = ["LAYER_KEY", "LayerSeeds"]

LAYER_KEY = 1_000_000  # layer streams' keys, apart from the executor's per-stage ones


class LayerSeeds:
    """Reseeds this stage's generators before each layer's forward.

    Args:
        seed: ``resilience.seed``.
        device: the engine's device (its CUDA generator is reseeded too).
        current: the executor's current ``(pipeline, iteration, microbatch)`` (``None``: not in a
            scheduled forward, nothing is reseeded).
        origin_microbatches: new (pipeline, micro-batch) -> the first grid's, after a re-grid
            (``None``: the first grid).
    """

    def __init__(self, seed: int, device: Any, current: Callable[[], Any], origin_microbatches: Any = None) -> None:
        self.seed, self.current, self.origin_microbatches = seed, current, origin_microbatches
        # the generators this stage draws from, not torch.manual_seed's every backend (60x the cost)
        self.generators = [torch.random.default_generator]
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.generators.append(torch.cuda.default_generators[index])

    def install(self, module: Any) -> None:
        """Hooks every ``torch.nn.Module`` layer of a DeepSpeed ``PipelineModule``'s stage."""
        start = int(module._local_start)  # numpy's with DeepSpeed's uniform partition
        for k, layer in enumerate(module.forward_funcs):
            if isinstance(layer, torch.nn.Module):
                layer.register_forward_pre_hook(functools.partial(self.reseed, LAYER_KEY + start + k))

    def reseed(self, key: int, module: Any, args: Any) -> None:
        current = self.current()
        if current is None:
            return
        pipeline, iteration, microbatch = (int(v) for v in current)  # a data source may set numpy integers
        if self.origin_microbatches is not None:
            pipeline, microbatch = self.origin_microbatches[pipeline][microbatch]
        value = rng_seed(self.seed, iteration, pipeline, microbatch, key)
        for generator in self.generators:
            generator.manual_seed(value)
