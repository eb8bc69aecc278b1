"""The hold-out check's program: a user's pipeline as DeepSpeed's documentation writes one.

Nothing here is shaped for ds_resilience: a ``PipelineModule`` of stock torch layers
(``nn.Linear``, ``nn.ReLU``, ``nn.LayerNorm``, ``nn.Dropout`` in training mode) with
``nn.CrossEntropyLoss``, a ``TensorDataset`` passed as ``training_data``, and DeepSpeed's default
configuration (``configs/default_resilience.json``: ``"Adam"``, which is DeepSpeed's FusedAdam, and
``gradient_clipping`` 1.0), in fp32. Each engine trains in the same processes: vanilla DeepSpeed and
ds_resilience, fault-free and with a simulated failure, clipping on and off.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from data_programs import _allow_children, _close_loaders

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FEATURES, CLASSES, SAMPLES = 12, 5, 96


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x[:, :CLASSES] * 3).argmax(dim=1)  # a learnable rule
    return torch.utils.data.TensorDataset(x, y)


def pipeline_module(num_stages: int, dropout: float = 0.1):
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(3)
    layers = [nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.ReLU(),
              nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, CLASSES)]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=nn.CrossEntropyLoss())


def config(*, clip: float | None, failed=()) -> dict[str, Any]:
    cfg = json.loads(open(os.path.join(REPO, "configs", "default_resilience.json")).read())
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 4
    cfg["train_batch_size"] = 16  # DP=2
    cfg["steps_per_print"] = 10**6
    cfg["bf16"] = {"enabled": False}  # fp32 (the template says bf16): parameters are compared to 1e-6 and to vanilla's
    if clip is not None:
        cfg["gradient_clipping"] = clip
    cfg["resilience"] = {"simulate_failed": list(failed), "planner": {"solver": "heuristic"}}
    return cfg


def train(rank: int, world: int, scenarios: list[dict], steps: int) -> dict[str, Any]:
    import deepspeed

    import ds_resilience

    _allow_children()  # DeepSpeed's loader starts worker processes, as in a user's run
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for sc in scenarios:
        module = pipeline_module(2, sc.get("dropout", 0.1))
        cfg = config(clip=sc.get("clip"), failed=sc.get("failed", ()))
        params = [p for p in module.parameters() if p.requires_grad]
        initial = {n: p.detach().clone() for n, p in module.named_parameters()}
        if sc["engine"] == "vanilla":
            cfg.pop("resilience")
            engine, *_ = deepspeed.initialize(model=module, config=cfg, model_parameters=params, training_data=dataset())
        else:
            engine, *_ = ds_resilience.initialize(model=module, config=cfg, model_parameters=params,
                                                  training_data=dataset())
        losses = [engine.train_batch() for _ in range(steps)]
        validator = getattr(engine, "validator", None)
        out[sc["name"]] = {
            "alive": getattr(engine, "alive", True), "stage": engine.stage_id,
            "losses": [None if x is None else float(x) for x in losses],
            "validation": None if validator is None else {"speculated": validator.speculated, "rolled_back":
                                                          validator.rollbacks, "waited": validator.waited,
                                                          "ready": validator.ready_steps,
                                                          "clipped": validator.clipped},
            "grad_norm": engine.get_global_grad_norm(),
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "moved": max((p.detach() - initial[n]).abs().max().item() for n, p in module.named_parameters()),
        }
        del engine
        _close_loaders()
        torch.distributed.barrier()
    return out
