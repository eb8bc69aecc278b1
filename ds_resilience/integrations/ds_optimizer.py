"""The DeepSpeed engine's optimizer side: our own mixed-precision and ZeRO-1 optimizers, and
ZeRO-1's re-sharding after a membership change, a restart or a checkpoint load.

:func:`build_optimizer` is the body of the engine's ``_configure_optimizer`` (which DeepSpeed calls
by name) for bf16 / fp16 and ZeRO-1; :class:`ZeroStage` is what re-sharding needs of the worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..checkpoint.fetch import fetch_versions
from ..errors import ConfigError
from ..runtime.precision import DynamicLossScaler, MixedPrecisionOptimizer
from ..runtime.zero import ShardedOptimizer
from ..topology import Topology

__all__ = ["OptimizerRequest", "ZeroStage", "build_optimizer", "on_membership", "reshard_loaded",
           "restore_after_restart", "sharded_of", "stage_members"]


@dataclass(frozen=True)
class OptimizerRequest:
    """What ``_configure_optimizer`` was asked for, and what it builds a basic optimizer with."""

    model_dtype: Any  # torch.float16 / torch.bfloat16 / torch.float32
    zero: int  # zero_optimization.stage
    client_optimizer: Any  # None, an optimizer, or a callable of the parameters
    model_parameters: Any
    basic: Callable[[Any], Any]  # DeepSpeed's _configure_basic_optimizer
    supported: tuple[type, ...]  # DeepSpeed's _supported_optims()
    fp16_config: dict  # the "fp16" section
    trainable: list  # the module's parameters that require gradients


def build_optimizer(request: OptimizerRequest) -> tuple[Any, Any]:
    """bf16 / fp16 and ZeRO-1: our own optimizers instead of DeepSpeed's BF16/FP16/ZeRO ones, whose
    steps, overflow checks and partitions run collectives over DeepSpeed's fixed groups (the
    executor reduces, clips and validates over the survivors instead). Returns the basic optimizer
    and the engine's optimizer:

    * bf16 / fp16: :class:`MixedPrecisionOptimizer` (fp32 masters, fp32 gradient accumulation,
      fp16 dynamic loss scaling);
    * ZeRO-1: :class:`ShardedOptimizer` (``runtime/zero.py``): the optimizer state sharded over
      the stage's surviving replicas (under mixed precision, inside the fp32 masters' wrapper).
    """
    import torch

    zero = request.zero
    if zero > 1:
        raise ConfigError("zero_optimization.stage", f"{zero}: the resilient engine supports stages 0 and 1")
    client = request.client_optimizer
    if client is None:
        basic = request.basic(request.model_parameters)
    elif isinstance(client, request.supported):
        basic = client
    else:
        basic = client(request.model_parameters)
    basic.param_groups[:] = [pg for pg in basic.param_groups if len(pg["params"]) != 0]
    optimizer: Any = basic
    if request.model_dtype != torch.float32:
        scaler = None
        if request.model_dtype == torch.float16:
            scaler = DynamicLossScaler.from_config(request.fp16_config)
        optimizer = MixedPrecisionOptimizer(basic, request.trainable, scaler=scaler)
    if zero == 1:  # bound to this replica's stage group once the topology is known (the engine's __init__)
        sharded = ShardedOptimizer(basic)
        if isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.shard(sharded)
        else:
            optimizer = sharded
    return basic, optimizer


def sharded_of(optimizer: Any) -> ShardedOptimizer | None:
    """The ZeRO-1 optimizer inside ``optimizer`` (``None`` without ZeRO)."""
    inner = optimizer.stepper if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer
    return inner if isinstance(inner, ShardedOptimizer) else None


def stage_members(topology: Topology, stage: int) -> list[int]:
    """The pipelines of ``stage``'s alive replicas in ``topology``: a ZeRO-1 shard's owners."""
    return sorted(w.pipeline for w in topology.stage_peers(stage))


@dataclass(frozen=True)
class ZeroStage:
    """What ZeRO-1's re-sharding needs of this worker."""

    sharded: ShardedOptimizer
    stage: int
    topology: Topology  # the grid (ranks <-> workers)
    tier: Any  # the checkpoint tier (its in-memory snapshots)
    recovery_log: list
    steps: Callable[[], int]  # the optimizer steps taken
    mixed: bool  # the sharded optimizer sits inside a MixedPrecisionOptimizer


def on_membership(zero: ZeroStage, record, plan, previous: Topology | None, generation, *,
                  beyond_tolerance: Callable[[Any, Any], Any]) -> None:
    """ZeRO-1 after a membership change: the dead replicas' shards of the resume step come back
    from the snapshot tier to their stage's lowest survivor (``checkpoint/fetch.py``, a
    collective over every survivor), then each changed stage re-shards over its new replicas
    (a collective over the stage). A shard held nowhere: a restart from the in-memory snapshots
    (``beyond_tolerance(record, plan)``: every rank restores its own newest common version)."""
    sharded, topology = zero.sharded, zero.topology
    new = generation.topology
    dead: list[int] = []
    if previous is not None:
        alive_now = {new.rank(w) for w in new.alive_workers()}
        dead = sorted({previous.rank(w) for w in previous.alive_workers()} - alive_now)
    trees: dict[int, Any] | None = {}
    if dead:
        trees = fetch_versions(zero.tier.memory, dead, plan.resume_step, generation.groups.world,
                               receiver_of=lambda d: min(new.rank(w) for w in new.stage_peers(
                                   topology.coord(d)[0].stage)))
    if trees is None:
        stages = sorted({topology.coord(d)[0].stage for d in dead})
        beyond_tolerance(record, replace(plan, action="restart", lost_stages=tuple(stages)))
    extra = [t["optimizer"]["optimizer"] if zero.mixed else t["optimizer"] for t in trees.values()]
    members = stage_members(new, zero.stage)
    if tuple(members) == sharded.members and not sharded.stale and not extra:
        return
    started = time.perf_counter()
    moved = sharded.reshard(members, generation.groups.stage, extra)
    if zero.tier.memory is not None:
        zero.tier.memory.forget_captures()  # the held versions are of the old partition
    zero.recovery_log.append({"kind": "zero_reshard", "epoch": record.epoch, "resume_step": zero.steps(),
                              "from_snapshots": [d for d in dead if topology.coord(d)[0].stage == zero.stage],
                              "seconds": time.perf_counter() - started, **moved})


def restore_after_restart(tier: Any, topology: Topology, world: int, *, zero_stage: int, stage: int,
                          sharded: ShardedOptimizer | None, generation, recovery_log: list,
                          steps: Callable[[], int], newer_than: int | None = None) -> bool:
    """A restart from the in-memory snapshots: every rank restores its newest common version.

    ZeRO-0: the data-parallel replicas of a stage hold identical states, so any of them restores
    the others (a stage stays covered while one of its snapshots survives). ZeRO-1: every rank
    restores its own shard, then the stage re-shards from what they hold. ``newer_than``: only
    if that version is newer (a step already loaded); returns whether one was restored."""
    stage_of = {r: topology.coord(r)[0].stage for r in range(world)} if zero_stage == 0 else None
    entry = tier.restore(stage_of, newer_than=newer_than)
    if entry is None:
        return False
    recovery_log.append(entry)
    if sharded is not None and sharded.stale:
        moved = sharded.reshard(stage_members(generation.topology, stage), generation.groups.stage)
        tier.memory.forget_captures()
        recovery_log.append({"kind": "zero_reshard", "epoch": 0, "resume_step": steps(), **moved})
    return True


def reshard_loaded(sharded: ShardedOptimizer | None, members: list[int], group: Any, tier: Any) -> None:
    """ZeRO-1 after a checkpoint load: every replica read the whole state; keep its own range."""
    if sharded is None or not sharded.stale:
        return
    sharded.reshard(members, group)
    if tier.memory is not None:
        tier.memory.forget_captures()
