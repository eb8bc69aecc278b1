"""GPT pretraining in the shape of Megatron-LM's ``pretrain_gpt.py``, on megatron-core, with ds_resilience.

The parts a Megatron-LM user knows: ``model_provider`` (megatron-core's ``GPTModel`` for this rank's
stage, tied embeddings), ``forward_step`` (``get_batch`` + ``loss_func`` returning ``(loss sum,
tokens, logging dict)``), ``train_valid_test_datasets_provider``, and ``pretrain(...)`` with
``extra_args_provider=add_resilience_args``. Megatron-LM itself is not on the package index, so
:func:`pretrain` below is a small stand-in with its contract (Megatron-LM's argument names and
defaults, ``extra_args_provider``, model-parallel initialization, then a training loop that calls
``get_forward_backward_func()`` and ``optimizer.step()``); in a Megatron-LM checkout, drop it and
import ``megatron.training.pretrain``. The resilience lines are the five the README lists.

Runs on CPU (gloo), e.g. PP=2 x DP=2 and TP=2 x PP=2 on four processes (``--no_local_rank``: as
with DeepSpeed's launcher, Megatron-LM's parser reads ``LOCAL_RANK`` and rejects the flag)::

    ds-resilience run --no_local_rank --num_gpus 4 examples/megatron_gpt.py --pipeline-model-parallel-size 2 \\
        --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --resilience
    ds-resilience run --no_local_rank --num_gpus 4 examples/megatron_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --resilience

A ``--resilience-config`` file with ``"simulate_failed": ["1:0"]`` leaves that replica idle and
re-routes its micro-batches (the loss curve stays the fault-free one).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from unittest import mock

import torch
import torch.distributed as dist

from ds_resilience.megatron import (ResilientForwardBackward, ResilientOptimizer, ResilientScheduler,
                                   add_resilience_args, config_from_args, install, save_checkpoint)
from ds_resilience.megatron.attention import device_safe_layer_spec
from ds_resilience.runtime.recovery import BeyondTolerance

SEQ, VOCAB = 32, 128


# --- what pretrain_gpt.py defines ---------------------------------------------------------------------
def model_provider(args, pre_process: bool = True, post_process: bool = True):
    """megatron-core's GPTModel for this rank's stage (layers split over the pipeline by megatron-core)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
                               hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                               tensor_model_parallel_size=args.tensor_model_parallel_size,
                               pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                               bf16=args.bf16, pipeline_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    spec = get_gpt_layer_local_spec()
    if not torch.cuda.is_available():
        spec = device_safe_layer_spec(spec)  # megatron-core's local attention allocates on CUDA
        cuda = mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self)  # its tied-weight sync too
    else:
        cuda = mock.MagicMock()
    with cuda:
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                        position_embedding_type="learned_absolute", pre_process=pre_process,
                        post_process=post_process, share_embeddings_and_output_weights=True)


class SyntheticTokens(torch.utils.data.Dataset):
    """A learnable language: each sequence follows t[i+1] = (5 t[i] + 3) mod V from a random start,
    with one noisy token in eight."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        tokens = torch.empty(SEQ + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, VOCAB, (1,), generator=g)
        for i in range(SEQ):
            tokens[i + 1] = (5 * tokens[i] + 3) % VOCAB
        noise = torch.rand(SEQ + 1, generator=g) < 0.125
        tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
        return {"text": tokens}


def train_valid_test_datasets_provider(args):
    return SyntheticTokens(args.train_iters * args.global_batch_size, args.seed), None, None


def get_batch(data_iterator):
    item = next(data_iterator)
    text = item["text"]
    b = text.size(0)
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(b, SEQ),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(b, -1),
            "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1) > 0.5}


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


# --- a stand-in for megatron.training.pretrain (its contract, not its code) -----------------------------
def _parse(extra_args_provider) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=2)
    g.add_argument("--lr-decay-style", type=str, default="cosine")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--bf16", action="store_true")
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None, help="write a Megatron-format checkpoint here at the end")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args()
    args.rank, args.world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model:
        parser.error(f"world size {args.world_size} is not divisible by TP x PP = {model}")
    args.data_parallel_size = args.world_size // model
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    return args


def pretrain(datasets_provider, model_provider_func, forward_step_func, extra_args_provider=None) -> None:
    args = _parse(extra_args_provider)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ps.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    stage, pp = ps.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size
    torch.manual_seed(args.seed + 100 * stage)
    model = model_provider_func(args, pre_process=stage == 0, post_process=stage == pp - 1)
    if args.bf16:  # Megatron-LM's get_model: the chunk in bf16 behind Float16Module
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    train_ds, _, _ = datasets_provider(args)

    job = config_from_args(args)  # --- ds_resilience: the job, the optimizer wrapper, install()
    mbs, dp, m = args.micro_batch_size, args.data_parallel_size, job.microbatches

    def batch(pipeline: int, iteration: int, microbatch: int) -> dict:
        """Any pipeline's micro-batch, as Megatron's sampler orders the global batch."""
        start = iteration * args.global_batch_size + (pipeline * m + microbatch) * mbs
        return {"text": torch.stack([train_ds[i]["text"] for i in range(start, start + mbs)])}

    if not job.enabled:
        raise SystemExit("megatron_gpt.py runs megatron-core's model through ds_resilience's schedule: pass "
                         "--resilience (megatron-core's own schedule allocates on CUDA)")
    gbs = args.global_batch_size  # megatron.training.training.get_optimizer_param_scheduler's sample-based schedule
    opt_param_scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.train_iters * gbs, lr_decay_style=args.lr_decay_style, start_wd=0.01, end_wd=0.01,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")
    # bf16: fp32 master weights, gradients accumulated in fp32 (megatron-core's Float16Optimizer needs CUDA)
    optimizer = ResilientOptimizer.with_fp32_masters(optimizer, model) if args.bf16 else ResilientOptimizer(optimizer)
    opt_param_scheduler = ResilientScheduler(opt_param_scheduler)
    forward_backward = ResilientForwardBackward(job, optimizer, batches=batch, scheduler=opt_param_scheduler)
    install(forward_backward)
    start = forward_backward.resume([model])  # Megatron's args.iteration = load_checkpoint(...)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pipeline = ps.get_data_parallel_rank()
    data = (batch(pipeline, it, k) for it in range(args.train_iters) for k in range(m))
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    for iteration in range(start + 1, args.train_iters + 1):
        started = time.perf_counter()
        optimizer.zero_grad()
        try:
            losses = get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=data,
                                                 model=[model], num_microbatches=m, seq_length=SEQ,
                                                 micro_batch_size=mbs, forward_only=False)
        except BeyondTolerance as exc:  # a stage lost every replica: the survivors saved (or the agent
            print(f"[megatron_gpt] rank {dist.get_rank()} stopped: {exc}", flush=True)  # restarts from memory)
            return
        update_ok, grad_norm, _ = optimizer.step()
        if update_ok:  # train_step: the scheduler after a successful update
            opt_param_scheduler.step(increment=gbs)
        if last and losses and iteration % args.log_interval == 0:
            total = torch.stack([d["lm loss"] for d in losses]).sum(0)
            print(f" iteration {iteration:4d}/{args.train_iters} | pipeline {pipeline} | lm loss "
                  f"{float(total[0] / total[1]):.6f} | grad norm {grad_norm or 0.0:.4f} | "
                  f"{(time.perf_counter() - started) * 1e3:.0f} ms", flush=True)
    if args.save:  # the first surviving replica of each stage writes its tensor-parallel shards
        save_checkpoint(forward_backward, args.save, args.train_iters, model=model, optimizer=optimizer)
    # no barrier on the default group: after a failure it holds a dead rank (the agent's store outlives us)
    if dist.get_rank() == 0:
        print(f"[megatron_gpt] done: {args.train_iters} iterations, TP={args.tensor_model_parallel_size} "
              f"PP={pp} DP={dp}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, forward_step, extra_args_provider=add_resilience_args)
