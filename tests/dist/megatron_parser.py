"""A parser built the way Megatron-LM builds its own (``megatron/training/arguments.py``:
``ArgumentParser(description='Megatron-LM Arguments', allow_abbrev=False)``, its groups, then
``extra_args_provider(parser)``, then ``parse_args``), and the part of ``validate_args`` that
derives the data-parallel size and the default global batch size. Megatron-LM is not on the
package index, so the tests carry the flags they exercise, with Megatron-LM's names and defaults."""

from __future__ import annotations

import argparse


def megatron_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs="*", default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--num-experts", type=int, default=None)
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_and_validate(argv, *, world_size: int, extra_args_provider=None) -> argparse.Namespace:
    args = megatron_parser(extra_args_provider).parse_args(argv)
    args.world_size = world_size
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert world_size % model == 0
    args.data_parallel_size = world_size // model
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        args.virtual_pipeline_model_parallel_size = 2
    return args
