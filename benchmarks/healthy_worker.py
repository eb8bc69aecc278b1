"""One rank of ``benchmarks/healthy.py``: vanilla DeepSpeed, then ``ds_resilience.initialize``, on
the same AlexNet-shaped pipeline, in the same processes; rank 0 writes the step times as JSON.

Launched by ``torch.distributed.run`` (no agent) or ``ds-resilience run`` (under the agent). The
model is DeepSpeed's pipeline example as ``examples/deepspeed_pipe/train.py`` writes it (its
``SyntheticImages`` data and ``join_layers``), with AlexNet at torchvision's widths (57M
parameters at ``--width 1``) on 64 x 64 images, the smallest AlexNet's strides take.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "deepspeed_pipe"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from torch import nn  # noqa: E402

import train as example  # noqa: E402  (examples/deepspeed_pipe/train.py)

import ds_resilience  # noqa: E402

example.SIDE = 64  # AlexNet's stride-4 11x11 stem and three 3x3/2 poolings need >= 63 pixels


class AlexNet(nn.Module):
    """torchvision's AlexNet (features, 6x6 adaptive pooling, classifier with dropout); every width
    divided by ``width`` (1: torchvision's, 57M parameters with 10 classes)."""

    def __init__(self, width: int = 1, num_classes: int = example.CLASSES) -> None:
        super().__init__()
        c = [64 // width, 192 // width, 384 // width, 256 // width, 256 // width]
        hidden = 4096 // width
        self.features = nn.Sequential(
            nn.Conv2d(3, c[0], kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c[0], c[1], kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c[1], c[2], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[2], c[3], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[3], c[4], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.5), nn.Linear(c[4] * 36, hidden), nn.ReLU(inplace=True),
            nn.Dropout(p=0.5), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )


def config(args, dp: int) -> dict:
    """The example's config (``"type": "Adam"``: DeepSpeed's FusedAdam), clipping as asked."""
    return {
        "train_micro_batch_size_per_gpu": args.mbs,
        "gradient_accumulation_steps": args.microbatches,
        "train_batch_size": args.mbs * args.microbatches * dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 5e-4}},
        "gradient_clipping": args.clip,
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }


def run(engine_name: str, args, dp: int) -> dict:
    torch.manual_seed(args.seed)
    net = PipelineModule(layers=example.join_layers(AlexNet(args.width)), loss_fn=nn.CrossEntropyLoss(),
                         num_stages=2, partition_method="parameters", activation_checkpoint_interval=0)
    params = [p for p in net.parameters() if p.requires_grad]
    data = example.SyntheticImages(4096, args.seed)
    init = deepspeed.initialize if engine_name == "vanilla" else ds_resilience.initialize
    started = time.perf_counter()
    engine, *_ = init(model=net, model_parameters=params, training_data=data, config=config(args, dp))
    init_s = time.perf_counter() - started
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = engine.train_batch()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    out = {"times": times, "losses": losses, "init_s": init_s, "stage": engine.stage_id,
           "stage_params": sum(p.numel() for p in engine.module.parameters())}
    validator = getattr(engine, "validator", None)
    if validator is not None:
        out["validation"] = {"speculated": validator.speculated, "rolled back": validator.rollbacks,
                             "waited": validator.waited, "ready": validator.ready_steps}
    executor = getattr(engine, "executor", None)
    if executor is not None:
        durations = executor.stats.durations
        out["opt_step_s"] = statistics.median(durations["OPT"]) if durations.get("OPT") else None
    tier = getattr(engine, "tier", None)
    memory = getattr(tier, "memory", None) if tier is not None else None
    if memory is not None:
        caps = list(memory.captures)
        out["snapshot"] = {"interval": memory.interval, "captures": len(caps),
                           "stall_s": statistics.median(c["stall_s"] for c in caps) if caps else None,
                           "copy_s": statistics.median(c["copy_s"] for c in caps) if caps else None}
    if hasattr(engine, "close_snapshots"):
        engine.close_snapshots()
    del engine, net, params
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=1, help="divide AlexNet's widths by this (small runs)")
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--out", required=True, help="rank 0 writes the JSON here")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    results = {name: run(name, args, world // 2) for name in ("vanilla", "resilient")}
    rows: list = [None] * world
    dist.all_gather_object(rows, results)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"world": world, "ranks": rows, "args": vars(args)}))
    dist.barrier()


if __name__ == "__main__":
    main()
