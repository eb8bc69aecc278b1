"""Live failure handling for a Megatron job under ``ds-resilience run`` (tensor-parallel size 1).

The same machinery as the DeepSpeed engine's, wired to a megatron-core stage: the agent's
coordinator (heartbeats, latched membership epochs), the checkpoint tier (the pre-step state a
rollback needs), and :class:`~ds_resilience.runtime.recovery.LiveRecovery` (plan, roll back the
stages that stepped past the resume point, new groups, the new schedule). The resilient
forward-backward catches a failure, recovers, and replays from the resume iteration up to the
iteration the training loop asked for, so the loop sees one call per iteration as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..checkpoint.tier import CheckpointTier
from ..errors import ConfigError
from ..launch import LaunchEnv
from ..runtime.coordinator import Coordinator
from ..runtime.faults import FaultInjector
from ..runtime.recovery import LiveRecovery

__all__ = ["MegatronHost", "LiveParts", "live_parts"]


class MegatronHost:
    """The stage's state as the checkpoint tier sees it (:class:`~ds_resilience.checkpoint.state.StageHost`):
    the chunk's trainable parameters, the wrapped optimizer, and the step count the resilient
    schedule keeps (one step per iteration; the next iteration to run is the step count)."""

    def __init__(self, forward_backward: Any, parameters: Sequence[torch.nn.Parameter], optimizer: Any,
                 samples_per_iteration: int) -> None:
        self.fb = forward_backward
        self.parameters = list(parameters)
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.lr_scheduler = None
        self.samples_per_iteration = samples_per_iteration

    def counters(self) -> tuple[int, int]:
        return self.fb.steps, self.fb.steps * self.samples_per_iteration

    def set_counters(self, steps: int, samples: int) -> None:
        self.fb.steps = steps
        self.fb.iteration = steps


@dataclass
class LiveParts:
    coordinator: Coordinator
    tier: CheckpointTier
    recovery: LiveRecovery | None
    faults: FaultInjector


def live_parts(forward_backward: Any, launch: LaunchEnv, *, me, rank: int, topology, params) -> LiveParts:
    """The coordinator, tier and fault injector (the recovery comes once the executor exists)."""
    job = forward_backward.job
    if job.tp != 1:
        raise ConfigError("--tensor-model-parallel-size", f"{job.tp}: live failure handling of Megatron jobs runs "
                                                          f"tensor-parallel size 1 today (re-routing with TP works "
                                                          f"for planned failure sets, simulate_failed)")
    if launch.rejoin or launch.restart:
        raise ConfigError("ds-resilience run", "a re-joining or restarted Megatron worker is not supported yet "
                                               "(run without --rejoin_after; beyond tolerance the job stops)")
    cfg = job.config
    det = cfg.detector
    host = MegatronHost(forward_backward, params, forward_backward.optimizer,
                        job.micro_batch_size * job.microbatches * job.dp)
    faults = FaultInjector(cfg.fault_injection, rank, launch=launch)
    tier = CheckpointTier(host, stage=me.stage, rank=rank, keep_pre_step=True, memory=None,
                          fault_hook=faults.maybe_fire)
    coordinator = Coordinator(launch=launch, info={"pipeline": me.pipeline, "stage": me.stage, "dp": topology.dp,
                                                   "pp": topology.pp},
                              heartbeat_interval_s=det.heartbeat_interval_s, store_timeout_s=det.store_timeout_s,
                              on_epoch=forward_backward._on_epoch)
    return LiveParts(coordinator=coordinator, tier=tier, recovery=None, faults=faults)


def make_recovery(forward_backward: Any, parts: LiveParts, *, topology, me, executor, provider, session: str
                  ) -> LiveRecovery:
    cfg = forward_backward.job.config
    return LiveRecovery(
        topology=topology, me=me, coordinator=parts.coordinator, executor=executor, tier=parts.tier,
        provider=provider, session=session, timeout_s=forward_backward.timeout_s,
        grace_s=cfg.detector.heartbeat_timeout_s + 5.0, adopt=forward_backward._adopt,
        export=forward_backward._export, persistent_dir=cfg.checkpoint.persistent_dir,
        fault_hook=parts.faults.maybe_fire,
        export_format="Megatron-LM torch layout: iter_<7 digits>/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt "
                      "(checkpoint version 3.0), one shard per surviving stage")
