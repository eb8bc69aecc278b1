"""Train the example GPT with ds_resilience's engine (the same model and data as vanilla_train.py).

Launch from the repository root, 4 local CPU processes over gloo (PP=2 x DP=2)::

    .venv/bin/deepspeed --num_gpus 4 examples/train_gpt.py --deepspeed_config configs/gpt_cpu_pp2_dp2.json

The ``"resilience"`` section of the config chooses the fault-free schedule (``1f1b`` or
``decoupled``) and, with ``simulate_failed: ["p:s", ...]``, leaves those workers idle while the
others run the planner's re-routed schedule (``configs/gpt_cpu_pp2_dp2_failed.json``). Every
rank's micro-batches come from ``gpt_model.micro_batch``, so a peer running a failed worker's
micro-batch reads that pipeline's data. Rank 0 prints each step's loss and samples/s, then a
summary; ``--dump PATH`` saves losses, times and rank 0's view of the plan.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed.comm as dist  # noqa: E402

import gpt_model  # noqa: E402

import ds_resilience  # noqa: E402


def _lag(text: str) -> tuple[int, int, float]:
    """``--lag RANK:STEP:SECONDS`` as (int, int, float)."""
    try:
        r, s, secs = text.split(":")
        return int(r), int(s), float(secs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP:SECONDS (e.g. 3:5:0.3), got {text!r}") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config with a resilience section")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dump", metavar="PATH", help="rank 0 saves losses and step times here (JSON); every "
                        "rank saves its stage's parameters and recovery log to PATH.rank<R>.pt")
    parser.add_argument("--progress", action="store_true", help="rank 0 draws a progress bar instead of a line per step")
    parser.add_argument("--min-step-seconds", type=float, default=0.0,
                        help="pad each step to at least this long (paces demos and re-join tests)")
    parser.add_argument("--lag", metavar="RANK:STEP:SECONDS", default=None, type=_lag,
                        help="global rank RANK sleeps SECONDS once after step STEP, outside the step's pacing: with "
                        "--min-step-seconds it runs that far behind its peers from then on, a straggler's phase "
                        "(tests a membership change reaching ranks at different points of an iteration)")
    parser.add_argument("--eval-every", type=int, default=0, help="engine.eval_batch every N steps (0: never)")
    parser.add_argument("--save-every", type=int, default=0, help="engine.save_checkpoint every N steps (0: never)")
    parser.add_argument("--save-dir", default="checkpoints", help="where save_checkpoint writes")
    parser.add_argument("--load-dir", default=None, help="engine.load_checkpoint from here before training")
    parser.add_argument("--load-tag", default=None, help="the tag to load (default: the 'latest' file's)")
    parser.add_argument("--log-allreduce", action="store_true",
                        help="all-reduce each step's loss over engine.survivor_group(), as a logging loop would")
    parser.add_argument("--training-data", action="store_true",
                        help="feed the corpus as DeepSpeed users do: a map-style torch Dataset passed as "
                        "initialize(training_data=...) (DeepSpeed's sampler, loader and its worker processes) "
                        "instead of batch_source")
    parser.add_argument("--dataset-size", type=int, default=200,
                        help="samples in the --training-data Dataset (fewer than the steps need: it wraps into "
                        "the next epoch as DeepSpeed's RepeatingLoader does)")
    parser.add_argument("--dropout", type=float, default=0.0, help="the GPT's dropout probability (default 0)")
    parser.add_argument("--d-model", type=int, default=64,
                        help="the GPT's width (default 64; a multiple of its 4 heads): the state a re-grid moves")
    parser.add_argument("--tied-embeddings", action="store_true",
                        help="tie the token embedding to the output projection (DeepSpeed's TiedLayerSpec)")
    parser.add_argument("--client-optimizer", action="store_true",
                        help="pass an optimizer and an LR scheduler object to initialize (torch AdamW with a "
                        "decay and a no-decay group, LambdaLR warm-up) instead of the config's")
    parser.add_argument("--activation-checkpoint-interval", type=int, default=0,
                        help="PipelineModule's activation_checkpoint_interval (0: off)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if os.environ.get("DSR_EXAMPLE_CPU_FP16") == "1":
        # tests of fp16 on CPU: DeepSpeed refuses fp16 where the CPU lacks native fp16 (mkldnn), torch
        # runs it on any CPU (as tests/dist/conformance_programs.py does)
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    ds_resilience.init_distributed()
    world = dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"world size {world} is not a multiple of --pp {args.pp}")
    dp = world // args.pp
    with open(args.deepspeed_config) as fh:
        config = json.load(fh)
    micro_batch_size = int(config["train_micro_batch_size_per_gpu"])
    microbatches = int(config["gradient_accumulation_steps"])
    cfg = gpt_model.GPTConfig(dropout=args.dropout, d_model=args.d_model)
    corpus = gpt_model.SyntheticCorpus(cfg, seed=args.seed)
    module = gpt_model.build_pipeline_module(cfg, num_stages=args.pp, seed=args.seed, tied=args.tied_embeddings,
                                             activation_checkpoint_interval=args.activation_checkpoint_interval)

    def batch_source(pipeline: int, iteration: int, microbatch: int):
        return gpt_model.micro_batch(corpus, pipeline=pipeline, iteration=iteration, microbatch=microbatch, dp=dp,
                                     microbatches=microbatches, micro_batch_size=micro_batch_size)

    eval_corpus = gpt_model.SyntheticCorpus(cfg, seed=args.seed + 1)

    def eval_source(pipeline: int, step: int, microbatch: int):
        return gpt_model.micro_batch(eval_corpus, pipeline=pipeline, iteration=step, microbatch=microbatch, dp=dp,
                                     microbatches=microbatches, micro_batch_size=micro_batch_size)

    data = {"batch_source": batch_source}
    if args.training_data:  # DeepSpeed's way: the engine samples, batches and loads it for each pipeline
        data = {"training_data": gpt_model.CorpusDataset(corpus, args.dataset_size)}
    if args.client_optimizer:  # the caller's own objects, as many a training script builds them
        decay = [p for p in module.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in module.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                      lr=0.002)
        data["optimizer"] = optimizer
        data["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    engine, *_ = ds_resilience.initialize(
        model=module,
        config=args.deepspeed_config,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        eval_source=eval_source,
        **data,
    )
    if args.load_dir:
        engine.load_checkpoint(args.load_dir, tag=args.load_tag)
    rank = dist.get_rank()
    lag = args.lag
    samples = micro_batch_size * microbatches * dp
    if rank == 0:
        failed = sorted(str(w) for w in engine.current.failed)
        print(
            f"ds_resilience: PP={args.pp} x DP={dp}, {microbatches} micro-batches/pipeline, schedule "
            f"{engine.schedule.name}, failed workers {failed or 'none'}",
            flush=True,
        )
        if getattr(engine, "plan_figures", None):
            f = engine.plan_figures
            print(
                f"planner: predicted iteration time {f['iteration_time']:g} vs fault-free 1F1B "
                f"{f['fault_free_iteration_time']:g} (degradation {f['degradation']:.1%}, unit costs)",
                flush=True,
            )
    losses, times, evals, reduced, step_ends = [], [], {}, {}, []
    started = time.perf_counter()
    stopped = None
    # Driven by the engine's step count, not a local counter: after a failure the engine replays the
    # interrupted iteration, and a re-joined worker starts at the survivors' step.
    stall_s = float(os.environ.get("DSR_STALL_DUMP_S", "0"))  # diagnostics: stacks of a step this slow
    while engine.global_steps < args.steps:
        t0 = time.perf_counter()
        if stall_s > 0:
            faulthandler.dump_traceback_later(stall_s, exit=False)  # re-armed every step
        step = engine.global_steps
        try:
            loss = engine.train_batch()
        except ds_resilience.BeyondTolerance as exc:
            stopped = str(exc)
            break
        if args.log_allreduce and loss is not None:  # a user's own collective, on the survivors
            t = loss.detach().reshape(1).to(torch.float64).clone()
            torch.distributed.all_reduce(t, group=engine.survivor_group())
            reduced[engine.global_steps] = (float(t), len(engine.survivors()))
        if args.eval_every and engine.global_steps % args.eval_every == 0:
            own = gpt_model.data_iterator(eval_corpus, pipeline=engine.me.pipeline, dp=dp, microbatches=microbatches,
                                          micro_batch_size=micro_batch_size, start_iteration=engine.global_steps)
            value = engine.eval_batch(own)
            if value is not None:
                evals[engine.global_steps] = float(value)
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)
        if args.min_step_seconds > 0:
            time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - t0)))
        if lag is not None and lag[0] == rank and lag[1] == step:
            time.sleep(lag[2])
        dt = time.perf_counter() - t0
        step_ends.append((engine.global_steps, time.time()))  # wall clock: lines up with the agent's events
        if loss is not None:
            losses.append(float(loss))
            times.append(dt)
        if rank == 0 and loss is not None:
            if args.progress:
                done = step + 1
                bar = "#" * (30 * done // args.steps)
                print(f"\r[{bar:<30}] step {done:3d}/{args.steps} loss {float(loss):.4f} {samples / dt:7.1f} samples/s",
                      end="", flush=True)
            else:
                print(f"step {step:3d} loss {float(loss):.4f} samples/s {samples / dt:7.1f} time_s {dt:.3f}", flush=True)
    total = time.perf_counter() - started
    engine.close_snapshots()  # the last snapshot is committed and replicated; threads stop
    if rank == 0 and args.progress:
        print(flush=True)
    if stopped:
        print(f"rank {rank}: training stopped: {stopped}", flush=True)
    if rank == 0 and losses:
        steady = times[len(times) // 4:] or times
        print(
            f"done: {engine.global_steps} steps in {total:.1f}s, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{samples * len(steady) / sum(steady):.1f} samples/s (steady state, last 3/4 of the steps)",
            flush=True,
        )
        if args.dump:
            with open(args.dump, "w") as fh:
                json.dump({"losses": losses, "times_s": times, "plan": getattr(engine, "plan_figures", None),
                           "recovery": engine.recovery_log, "stopped": stopped}, fh)
    if args.dump:
        master_of = getattr(engine.optimizer, "master_of", {})
        module = engine.module  # the stage the engine trains (after a re-grid, another one than the script built)
        torch.save({
            "rank": rank,
            "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
            "stage": engine.stage_id,
            "pipeline": engine.me.pipeline,
            "alive": engine.alive,
            "steps": engine.global_steps,
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": {n: {k: v.detach().clone() if torch.is_tensor(v) else v
                              for k, v in getattr(engine.optimizer, "state", {}).get(p, {}).items()}
                          for n, p in module.named_parameters()},
            "lr": [g["lr"] for g in getattr(engine.optimizer, "param_groups", [])],
            # fp16: the dynamic loss scale and its count of good steps (None without one)
            "loss_scale": getattr(getattr(engine.optimizer, "scaler", None), "scale", None),
            "good_steps": getattr(getattr(engine.optimizer, "scaler", None), "good_steps", None),
            # bf16/fp16: the fp32 master weights (what the optimizer steps; the module holds their rounding)
            "masters": {n: master_of[id(p)].detach().clone() for n, p in module.named_parameters() if id(p) in master_of},
            "validation": None if getattr(engine, "validator", None) is None else {
                "speculated": engine.validator.speculated, "rolled_back": engine.validator.rollbacks,
                "waited": engine.validator.waited, "ready": engine.validator.ready_steps,
                "clipped": engine.validator.clipped},
            "losses": losses,
            "times_s": times,
            "step_ends": step_ends,
            "recovery": engine.recovery_log,
            "stopped": stopped,
            # ZeRO-1: the replicas this worker's optimizer state is sharded over, and its shard's size
            "zero": None if getattr(engine, "sharded_optimizer", None) is None else {
                "members": list(engine.sharded_optimizer.members), "shard": engine.sharded_optimizer.shard_numel,
                "total": sum(engine.sharded_optimizer.numels)},
            "heartbeat_interval_s": engine.coordinator.heartbeat_interval_s if engine.coordinator else None,
            "evals": evals,
            "allreduce": reduced,
            # --training-data: how the engine read the Dataset (own pipeline through loader workers, re-routed directly)
            "data_reads": getattr(getattr(getattr(getattr(engine, "executor", None), "batch_source", None), "dataset", None),
                                  "reads", None),
        }, f"{args.dump}.rank{rank}.pt")
    if stopped:
        return 0
    if engine.coordinator is None:
        dist.barrier()  # rank 0 hosts the store: it must not exit while another rank still reads it
    else:
        engine.coordinator.close()  # the agent hosts the store; a dead peer must not block the exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
