"""Train the example GPT with plain DeepSpeed pipeline parallelism (the baseline, no ds_resilience).

Launch, from the repository root, 4 local CPU processes over gloo (PP=2 x DP=2)::

    .venv/bin/deepspeed --num_gpus 4 --master_port 29511 examples/vanilla_train.py \\
        --deepspeed_config configs/gpt_cpu_pp2_dp2.json --steps 20

No extra flag is needed on CPU: DeepSpeed picks its CPU accelerator when no GPU is found
(``DS_ACCELERATOR=cpu`` forces it), whose backend is gloo, and ``--num_gpus 4`` makes the launcher
start 4 local ranks whatever the CPU accelerator's device count (one per NUMA node) is.
``--force_multi`` is NOT wanted (it takes the multi-node ssh path). Pick a free ``--master_port``
when several runs share the machine. ``--pp`` sets the pipeline stages (world size / pp pipelines).

The shipped config takes DeepSpeed's defaults: ``"Adam"`` is DeepSpeed's FusedAdam and
``gradient_clipping`` is 1.0, which DeepSpeed's pipeline engine applies by the first stage's norm
alone (ds_resilience clips by the global norm). To compare this run with ``train_gpt.py``'s, or with
a one-process reference, set ``"gradient_clipping": 0.0`` (``tests/dist/test_gpt_example.py`` does).

The first launch on a fresh machine JIT-builds DeepSpeed's CPU shm comm op (about a minute, then
cached under ~/.cache/torch_extensions); after that a 20-step run takes 12-20 s wall, of which
training is 1-2 s and the rest process start-up and teardown. Besides DeepSpeed's own logging, rank 0 prints one line per step::

    step 3 loss 4.358854 samples/s 346.3 time_s 0.046

and a ``done:`` summary. Float32 only: DeepSpeed 0.19.8's CPU accelerator cannot all-reduce float64
gradients (``supported_dtypes`` is float32 and bf16), even with one pipeline.

The pipeline ``p`` of a rank is its data-parallel index; its micro-batches come from
``gpt_model.data_iterator`` (any process can load any pipeline's micro-batch). ``--dump PATH``
writes, from rank 0, ``torch.save`` of a dict::

    losses      list[float]   the mean loss of each step (DeepSpeed's aggregate over the global batch)
    state_dict  {name: tensor} the whole model after the last step, names "<global layer>.<param>"
                               (loads into gpt_model.build_full_model), gathered from pipeline 0
    ranks       {rank: {"stage", "pipeline", "state_dict"}}  every rank's own stage parameters
    config      {"gpt": GPTConfig fields (dtype as a string), "seed", "pp", "dp", "microbatches",
                 "micro_batch_size", "steps", "ds_config"}
    times_s     list[float]   wall time of each step

A ``"resilience"`` section in the config is removed before DeepSpeed sees it (DeepSpeed 0.19.8
ignores unknown top-level keys, but this is the baseline: it runs without the plugin).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

import gpt_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config")
    parser.add_argument("--steps", type=int, default=20, help="training iterations (train_batch calls)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--seed", type=int, default=1234, help="model and data seed")
    parser.add_argument("--n_layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--partition_method", default="uniform", help="'uniform' or 'parameters'")
    parser.add_argument("--dump", default=None, help="torch.save losses and final parameters here")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return parser.parse_args(argv)


def load_ds_config(path: str) -> dict:
    """The DeepSpeed config without its ``"resilience"`` section (this is the vanilla baseline)."""
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    config.pop("resilience", None)
    return config


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"world size {world} is not a multiple of --pp {args.pp}")
    dp = world // args.pp

    ds_config = load_ds_config(args.deepspeed_config)
    micro_batch_size = int(ds_config["train_micro_batch_size_per_gpu"])
    microbatches = int(ds_config.get("gradient_accumulation_steps", 1))
    cfg = gpt_model.GPTConfig(n_layers=args.n_layers, dtype=torch.float32)

    model = gpt_model.build_pipeline_module(cfg, args.pp, args.seed, args.partition_method)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=ds_config, model_parameters=[p for p in model.parameters() if p.requires_grad])
    pipeline, stage = engine.grid.get_data_parallel_id(), engine.stage_id
    corpus = gpt_model.SyntheticCorpus(cfg, args.seed)
    data = gpt_model.data_iterator(corpus, pipeline=pipeline, dp=dp, microbatches=microbatches,
                                   micro_batch_size=micro_batch_size)
    global_batch = dp * microbatches * micro_batch_size
    if rank == 0:
        params = sum(p.numel() for p in gpt_model.build_full_model(cfg, args.seed).parameters())
        print(f"vanilla deepspeed: world {world} = pp {args.pp} x dp {dp}, micro-batches {microbatches} x "
              f"{micro_batch_size} per pipeline, global batch {global_batch}, params {params}", flush=True)

    losses, times = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=data)
        elapsed = time.perf_counter() - start
        losses.append(float(loss))
        times.append(elapsed)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f} samples/s {global_batch / elapsed:.1f} "
                  f"time_s {elapsed:.3f}", flush=True)

    if rank == 0 and args.steps:
        steady = times[1:] or times
        print(f"done: {args.steps} steps, total {sum(times):.2f} s, steady-state "
              f"{global_batch * len(steady) / sum(steady):.1f} samples/s, final loss {losses[-1]:.6f}",
              flush=True)

    if args.dump:
        own = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
        gathered = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "stage": stage, "pipeline": pipeline, "state_dict": own})
        if rank == 0:
            merged = {}
            for entry in gathered:
                if entry["pipeline"] == 0:
                    merged.update(entry["state_dict"])
            gpt = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(cfg).items()}
            torch.save({
                "losses": losses,
                "times_s": times,
                "state_dict": merged,
                "ranks": {e["rank"]: {"stage": e["stage"], "pipeline": e["pipeline"],
                                      "state_dict": e["state_dict"]} for e in gathered},
                "config": {"gpt": gpt, "seed": args.seed, "pp": args.pp, "dp": dp,
                           "microbatches": microbatches, "micro_batch_size": micro_batch_size,
                           "steps": args.steps, "ds_config": ds_config},
            }, args.dump)
            print(f"dumped to {args.dump}", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
