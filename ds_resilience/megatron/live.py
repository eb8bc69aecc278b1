"""Live failure handling for a Megatron job under ``ds-resilience run``.

The same machinery as the DeepSpeed engine's, wired to a megatron-core stage: the agent's
coordinator (heartbeats, latched membership epochs), the checkpoint tier (the pre-step state a
rollback needs), and :class:`~ds_resilience.runtime.recovery.LiveRecovery` (plan, roll back the
stages that stepped past the resume point, new groups, the new schedule). The resilient
forward-backward catches a failure, recovers, and replays from the resume iteration up to the
iteration the training loop asked for, so the loop sees one call per iteration as before.

With tensor parallelism a replica is a tensor-parallel group (:class:`PlaneView`): one dead rank
takes its replica out; the replica's other ranks leave the membership and idle (their training
loop's calls return at once, ``step()`` reports no update), and every rank of the surviving
replicas recovers in its tensor-parallel plane: the same plan (computed over replicas), its own
shard rolled back, the plane's new groups.

With ``resilience.checkpoint.enabled`` (the default) every rank snapshots its stage state into host
memory each ``interval`` iterations (the chunk's parameters, the wrapped optimizer's state dict,
megatron-core's fp32 main parameters included, and the scheduler's), replicated by group
placement as for DeepSpeed. Beyond tolerance, with ``checkpoint.max_restarts``, the agent restarts
every worker; :meth:`ResilientForwardBackward.resume` then restores each rank's shard from those
snapshots (a rank's own, or a data-parallel peer's of the same stage and tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..checkpoint.inmemory import InMemoryCheckpointer
from ..checkpoint.tier import CheckpointTier
from ..errors import ConfigError
from ..launch import LaunchEnv
from ..runtime.coordinator import Coordinator
from ..runtime.faults import FaultInjector
from ..epochs import EpochRecord
from ..runtime.recovery import LiveRecovery, RankView
from ..topology import Topology, Worker
from .grid import PTDPGrid

__all__ = ["MegatronHost", "LiveParts", "PlaneView", "live_parts", "make_recovery", "start"]


class PlaneView(RankView):
    """The agent's global ranks as the grid's replicas, seen from one tensor-parallel rank: a
    replica with a failed rank is failed, the replica's rank in the plan is its grid rank
    (``topology.rank(worker)``), and a replica resumes at the fewest steps any of its ranks took."""

    def __init__(self, grid: PTDPGrid, topology: Topology, rank: int) -> None:
        self.grid, self.topology = grid, topology
        self.rank = rank
        self.leader = grid.coord(rank)[1] == 0

    def _worker_rank(self, rank: int) -> int:
        return self.topology.rank(self.grid.coord(rank)[0])

    def workers(self, record: EpochRecord) -> EpochRecord:
        if record.joining:
            raise ConfigError("ds-resilience run", f"ranks {list(record.joining)} re-join: a re-joining Megatron "
                                                   f"worker is not supported yet")
        failed = sorted({self._worker_rank(r) for r in record.failed})
        alive = [self.topology.rank(w) for w in self.topology.workers() if self.topology.rank(w) not in failed]
        return EpochRecord(epoch=record.epoch, failed=tuple(failed), alive=tuple(alive), stop=record.stop,
                           reason=record.reason, detected_at=record.detected_at, kind=record.kind,
                           restart=record.restart)

    def _worker(self, worker_rank: int) -> Worker:
        return self.topology.coord(worker_rank)[0]

    def ranks(self, worker_ranks) -> list[int]:
        return [r for w in worker_ranks for r in self.grid.replica(self._worker(w))]

    def worker_steps(self, steps: dict[int, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for rank, value in steps.items():
            w = self._worker_rank(rank)
            out[w] = min(out.get(w, value), value)
        return out


class MegatronHost:
    """The stage's state as the checkpoint tier sees it (:class:`~ds_resilience.checkpoint.state.StageHost`):
    the chunk's trainable parameters, the wrapped optimizer, and the step count the resilient
    schedule keeps (one step per iteration; the next iteration to run is the step count)."""

    def __init__(self, forward_backward: Any, parameters: Sequence[torch.nn.Parameter], optimizer: Any,
                 samples_per_iteration: int, scheduler: Any = None) -> None:
        self.fb = forward_backward
        self.parameters = list(parameters)
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.lr_scheduler = getattr(scheduler, "scheduler", scheduler)
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
    closed: bool = False


def live_parts(forward_backward: Any, launch: LaunchEnv, *, me, rank: int, topology, params,
               grid: PTDPGrid) -> LiveParts:
    """The coordinator, tier and fault injector (the recovery comes once the executor exists)."""
    job = forward_backward.job
    if launch.rejoin:
        raise ConfigError("ds-resilience run", "a re-joining Megatron worker is not supported yet (run without "
                                               "--rejoin_after)")
    cfg = job.config
    det = cfg.detector
    host = MegatronHost(forward_backward, params, forward_backward.optimizer,
                        job.micro_batch_size * job.microbatches * job.dp, scheduler=forward_backward.scheduler)
    faults = FaultInjector(cfg.fault_injection, rank, launch=launch)
    coordinator = Coordinator(launch=launch, info={"pipeline": me.pipeline, "stage": me.stage, "dp": topology.dp,
                                                   "pp": topology.pp},
                              heartbeat_interval_s=det.heartbeat_interval_s, store_timeout_s=det.store_timeout_s,
                              on_epoch=forward_backward._on_epoch)
    memory = None
    if cfg.checkpoint.enabled:
        world = launch.world_size
        memory = InMemoryCheckpointer(
            cfg.checkpoint, rank=rank, world=world, job_id=launch.job_id or "job-live-megatron",
            local_world_size=launch.local_world_size or world, name=f"live-megatron/attempt{launch.restart}",
            group_store=coordinator.store, timeout_s=det.pg_timeout_s,
            # replica-major: a placement group spans stages, so a lost stage keeps its snapshots
            machine_key=lambda r: (grid.coord(r)[0].pipeline, grid.coord(r)[0].stage, grid.coord(r)[1]))
    tier = CheckpointTier(host, stage=me.stage, rank=rank, keep_pre_step=True, memory=memory,
                          fault_hook=faults.maybe_fire)
    faults.lose_memory = tier.lose_memory
    return LiveParts(coordinator=coordinator, tier=tier, recovery=None, faults=faults)


def start(forward_backward: Any, parts: LiveParts, launch: LaunchEnv, grid: PTDPGrid) -> dict | None:
    """The snapshots' start: after an agent restart, every rank restores its shard of the newest
    step held (a collective over the job; a data-parallel peer's snapshot of the same stage and
    tensor-parallel rank serves too) and the schedule goes on from there; otherwise the initial
    state (step 0) is captured. Returns the restore's log entry, or ``None``."""
    tier = parts.tier
    if tier.memory is None:
        return None
    if not launch.restart:
        tier.capture_due()
        return None
    shard_of = {r: (grid.coord(r)[0].stage, grid.coord(r)[1]) for r in range(grid.world_size)}
    entry = tier.restore(shard_of)
    fb = forward_backward
    fb.base = fb.iteration = fb.steps
    fb.calls = 0
    return entry


def make_recovery(forward_backward: Any, parts: LiveParts, *, topology, me, executor, provider, session: str,
                  grid: PTDPGrid, rank: int, groups_for) -> LiveRecovery:
    cfg = forward_backward.job.config
    return LiveRecovery(
        topology=topology, me=me, coordinator=parts.coordinator, executor=executor, tier=parts.tier,
        provider=provider, session=session, timeout_s=forward_backward.timeout_s,
        grace_s=cfg.detector.heartbeat_timeout_s + 5.0, adopt=forward_backward._adopt,
        export=forward_backward._export, persistent_dir=cfg.checkpoint.persistent_dir,
        fault_hook=parts.faults.maybe_fire, view=PlaneView(grid, topology, rank), groups_for=groups_for,
        export_format="Megatron-LM torch layout: iter_<7 digits>/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt "
                      "(checkpoint version 3.0), one shard per tensor-parallel rank of each surviving stage")
