"""Programs the distributed engine tests run in every rank (module-level, so they pickle).

``train_scenarios`` builds the small GPT of ``examples/gpt_model.py`` as a DeepSpeed
``PipelineModule`` and trains it for a few steps under several engines one after the other, in the
same processes: vanilla DeepSpeed, and the resilient engine with a given schedule, variant and
simulated failure set. It returns each scenario's losses and this rank's stage parameters.
"""

from __future__ import annotations

import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")

MICRO_BATCH_SIZE = 2


def ds_config(*, microbatches: int, dp: int, clip: float = 0.0, optimizer: str = "adam") -> dict[str, Any]:
    """Adam for parity with vanilla DeepSpeed; SGD with momentum where summation order differs
    (re-routing): Adam divides by sqrt(v), which turns a 1e-7 rounding difference in a near-zero
    gradient into a visible parameter difference, SGD keeps it at rounding size."""
    opt = (
        {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
        if optimizer == "adam"
        else {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    )
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": MICRO_BATCH_SIZE * microbatches * dp,
        "optimizer": opt,
        "gradient_clipping": clip,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
    }


def train_scenarios(rank: int, world: int, pp: int, microbatches: int, scenarios: list[dict], steps: int = 5,
                    dtype: str = "float32", n_layers: int = 4) -> dict[str, Any]:
    import torch

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import deepspeed
    from gpt_model import GPTConfig, SyntheticCorpus, build_pipeline_module, data_iterator, micro_batch

    import ds_resilience

    # DSR_TEST_BACKEND=nccl (the multigpu tests): one GPU per rank, NCCL for DeepSpeed's groups and ours
    backend = os.environ.get("DSR_TEST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    deepspeed.init_distributed(dist_backend=backend)
    dp = world // pp
    cfg = GPTConfig(dtype=getattr(torch, dtype), n_layers=n_layers)
    corpus = SyntheticCorpus(cfg, seed=11)
    out: dict[str, Any] = {}
    for sc in scenarios:
        module = build_pipeline_module(cfg, num_stages=pp, seed=5)
        config = ds_config(microbatches=microbatches, dp=dp, clip=sc.get("clip", 0.0), optimizer=sc.get("optimizer", "adam"))
        if sc.get("bf16"):
            config["bf16"] = {"enabled": True}
        params = [p for p in module.parameters() if p.requires_grad]
        if sc["engine"] == "vanilla":
            engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params)
            it = data_iterator(corpus, pipeline=engine.grid.data_parallel_id, dp=dp, microbatches=microbatches,
                               micro_batch_size=MICRO_BATCH_SIZE)
            losses = [float(engine.train_batch(it)) for _ in range(steps)]
            alive = True
        else:
            config["resilience"] = {
                "schedule": sc.get("schedule", "1f1b"),
                "variant": sc.get("variant", "recycle"),
                "simulate_failed": sc.get("failed", []),
                "planner": {"solver": sc.get("solver", "heuristic"), **sc.get("planner", {})},
                **{k: sc[k] for k in ("enabled", "max_failures", "seed") if k in sc},
            }

            def source(p: int, i: int, m: int):
                return micro_batch(corpus, pipeline=p, iteration=i, microbatch=m, dp=dp, microbatches=microbatches,
                                   micro_batch_size=MICRO_BATCH_SIZE)

            engine, *_ = ds_resilience.initialize(model=module, config=config, model_parameters=params,
                                                  batch_source=source)
            losses = []
            plain = not hasattr(engine, "generation")  # "enabled": false gives DeepSpeed's own engine
            it = data_iterator(corpus, pipeline=engine.grid.data_parallel_id, dp=dp, microbatches=microbatches,
                               micro_batch_size=MICRO_BATCH_SIZE) if plain else None
            for _ in range(steps):
                loss = engine.train_batch(it) if plain else engine.train_batch()
                losses.append(None if loss is None else float(loss))
            alive = getattr(engine, "alive", True)
        state = {name: p.detach().clone() for name, p in module.named_parameters()}
        out[sc["name"]] = {
            "losses": losses,
            "params": state,
            "stage": engine.stage_id,
            "pipeline": engine.grid.data_parallel_id,
            "alive": alive,
            "stats": getattr(engine, "iteration_log", None),
            "engine_class": type(engine).__name__,
            "schedule_source": engine.generation.source if hasattr(engine, "generation") else None,
            "step_check": engine.provider.cost.step_check if hasattr(engine, "provider") else None,
            "matching": engine.generation.groups.world.matching if alive and hasattr(engine, "generation") else None,
            "early_posts": sum(map(len, engine.live.posts.values())) if alive and hasattr(engine, "live") else 0,
        }
        del engine
    # rank 0 hosts the store: nobody leaves while another rank may still read it
    torch.distributed.barrier()
    return out


def resilient_save_load(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """The resilient engine's save_checkpoint / load_checkpoint: asynchronous, keep_last, bitwise."""
    import torch

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import deepspeed
    from gpt_model import GPTConfig, SyntheticCorpus, build_pipeline_module, micro_batch

    import ds_resilience
    from ds_resilience.integrations.ds_checkpoint_engine import AsyncPersistentCheckpointEngine

    deepspeed.init_distributed(dist_backend="gloo")
    pp, microbatches = 2, 2
    dp = world // pp
    cfg = GPTConfig()
    corpus = SyntheticCorpus(cfg, seed=11)
    module = build_pipeline_module(cfg, num_stages=pp, seed=5)
    config = ds_config(microbatches=microbatches, dp=dp)
    config["resilience"] = {"checkpoint": {"keep_last": 1}}

    def source(p: int, i: int, m: int):
        return micro_batch(corpus, pipeline=p, iteration=i, microbatch=m, dp=dp, microbatches=microbatches,
                           micro_batch_size=MICRO_BATCH_SIZE)

    engine, *_ = ds_resilience.initialize(model=module, config=config,
                                          model_parameters=[p for p in module.parameters() if p.requires_grad],
                                          batch_source=source)
    saved = {}
    for tag in ("a", "b"):
        engine.train_batch()
        saved[tag] = {n: p.detach().clone() for n, p in module.named_parameters()}
        engine.save_checkpoint(save_dir, tag=tag)
    is_async = isinstance(engine.checkpoint_engine, AsyncPersistentCheckpointEngine)
    engine.checkpoint_engine.flush()
    torch.distributed.barrier()
    engine.train_batch()  # move away from "b"
    moved = any(not torch.equal(p, saved["b"][n]) for n, p in module.named_parameters())
    engine.load_checkpoint(save_dir, tag="b")
    back = all(torch.equal(p, saved["b"][n]) for n, p in module.named_parameters())
    torch.distributed.barrier()
    return {"async": is_async, "moved": moved, "back": back, "steps": engine.global_steps}
