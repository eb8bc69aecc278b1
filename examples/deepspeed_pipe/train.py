#!/usr/bin/env python
"""DeepSpeed's pipeline-parallel example, as its users write it, with ds_resilience swapped in.

It follows DeepSpeed's own ``training/pipeline_parallelism/train.py``: an AlexNet-style CNN cut
into a ``PipelineModule`` (convolutions, a lambda layer that flattens, dropout), the model fed
through ``training_data`` (DeepSpeed's sampler and loader), ``deepspeed.add_config_arguments``,
and the example's config (``"type": "Adam"``, gradient clipping left at DeepSpeed's default). The
one change is ``ds_resilience.initialize`` for ``deepspeed.initialize`` (``--vanilla`` switches
back). CIFAR-10 cannot be downloaded here, so the images are generated (a fixed seed, the classes
separable). Run it under the agent::

    ds-resilience run --num_workers 4 examples/deepspeed_pipe/train.py \
        --deepspeed_config examples/deepspeed_pipe/ds_config.json -p 2 --steps 20

``--eval`` also runs the evaluation loop users write: ``eval_batch(data_iter)`` after every step on
a held-out set (a fresh iterator over DeepSpeed's loader for this data-parallel rank, as
``engine.deepspeed_io`` builds it) and ``save_checkpoint`` every other step. Every rank prints ``step N loss X`` (and
``eval_loss Y``) after each step. ``--data-iter`` feeds ``train_batch(data_iter)`` from this rank's
DeepSpeed loader instead of ``training_data``; a relaunched worker (``--rejoin_after``) builds it
again from the start, and the engine skips the items its pipeline ran before.
"""

from __future__ import annotations

import argparse
import os
import time

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader
from torch import nn

import ds_resilience

CLASSES, SIDE = 10, 16


class SyntheticImages(torch.utils.data.Dataset):
    """A CIFAR-shaped dataset (3 x SIDE x SIDE, 10 classes) generated from its index: item ``i`` is
    the same image in every process, and a class shifts the colour means so the model can learn."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        label = int(torch.randint(0, CLASSES, (1,), generator=g))
        image = torch.randn(3, SIDE, SIDE, generator=g) * 0.5
        image += torch.tensor([label / CLASSES, 1 - label / CLASSES, (label % 3) / 3]).view(3, 1, 1)
        return image, label


def join_layers(vision_model: nn.Module) -> list:
    """AlexNet's features, pooling and classifier as one flat list of layers (as the example does)."""
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


class SmallAlexNet(nn.Module):
    """AlexNet's structure at CPU size: convolutions with ReLU and max-pooling, adaptive average
    pooling, and a classifier with dropout."""

    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, kernel_size=3, padding=1), nn.ReLU(inplace=True),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=0.2), nn.Linear(32 * 2 * 2, 64), nn.ReLU(inplace=True),
            nn.Dropout(p=0.2), nn.Linear(64, num_classes),
        )


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR-style pipeline training")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=20, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--dataset-size", type=int, default=512, help="training images")
    parser.add_argument("--eval", action="store_true", help="eval_batch(data_iter) every step, save_checkpoint "
                        "every other step")
    parser.add_argument("--save-dir", default=None, help="where --eval saves checkpoints (default: ./checkpoints)")
    parser.add_argument("--data-iter", action="store_true", help="train_batch(data_iter) with this rank's "
                        "DeepSpeed loader (engine.deepspeed_io) instead of training_data")
    parser.add_argument("--min-step-seconds", type=float, default=0.0, help="pace the loop (demos, tests: a "
                        "relaunched worker has time to join before the end)")
    parser.add_argument("--vanilla", action="store_true", help="deepspeed.initialize instead of ds_resilience's")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_pipe(args) -> None:
    torch.manual_seed(args.seed)
    net = PipelineModule(layers=join_layers(SmallAlexNet()), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method="parameters",
                         activation_checkpoint_interval=0)
    trainset = SyntheticImages(args.dataset_size, args.seed)
    init = deepspeed.initialize if args.vanilla else ds_resilience.initialize
    engine, _, _, _ = init(args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                           training_data=None if args.data_iter else trainset)
    train_iter = iter(RepeatingLoader(engine.deepspeed_io(trainset))) if args.data_iter else None
    eval_loader = None
    if args.eval:  # a held-out set: each evaluation reads its first batches (as many as a step has)
        eval_loader = engine.deepspeed_io(SyntheticImages(engine.train_batch_size(), args.seed + 1))
    rank = dist.get_rank()
    # from the engine's step, as a loop that resumes from a checkpoint is written: a worker the agent
    # relaunched (--rejoin_after) joins the survivors at their step
    for step in range(engine.global_steps, args.steps):
        started = time.monotonic()
        loss = engine.train_batch(data_iter=train_iter)
        line = f"[rank {rank}] step {step + 1} loss {float(loss):.6f}"
        if eval_loader is not None:
            eval_loss = engine.eval_batch(data_iter=iter(eval_loader))
            line += f" eval_loss {float(eval_loss):.6f}"
            if (step + 1) % 2 == 0:
                engine.save_checkpoint(args.save_dir or os.path.join(os.getcwd(), "checkpoints"))
        print(line, flush=True)
        time.sleep(max(0.0, args.min_step_seconds - (time.monotonic() - started)))


if __name__ == "__main__":
    args = get_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    train_pipe(args)
