"""Live failure handling for a Megatron job under ``ds-resilience run``.

The same machinery as the DeepSpeed engine's, :class:`~ds_resilience.runtime.live_stage.LiveStage`
(progress and hang detection, the agent's coordinator, the checkpoint tier, the recovery: plan,
roll back the stages that stepped past the resume point, new groups, the new schedule), described
for a megatron-core stage here (:func:`describe`). The resilient
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
snapshots (:func:`restore`) (a rank's own, or a data-parallel peer's of the same stage and tensor-parallel rank).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..epochs import EpochRecord
from ..errors import ConfigError
from ..launch import LaunchEnv
from ..runtime.live_stage import LiveStage, StageDescription, StartMode
from ..runtime.recovery import RankView
from ..topology import Topology, Worker
from .grid import PTDPGrid

__all__ = ["EXPORT_FORMAT", "MegatronHost", "PlaneView", "describe", "restore"]


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


EXPORT_FORMAT = ("Megatron-LM torch layout: iter_<7 digits>/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt "
                 "(checkpoint version 3.0), one shard per tensor-parallel rank of each surviving stage")


def describe(forward_backward: Any, mode: StartMode, launch: LaunchEnv | None, *, me: Worker, rank: int,
             topology: Topology, params: Sequence[torch.nn.Parameter], grid: PTDPGrid, session: str) -> StageDescription:
    """The Megatron stage for :class:`~ds_resilience.runtime.live_stage.LiveStage`."""
    if mode is StartMode.REJOIN:
        raise ConfigError("ds-resilience run", "a re-joining Megatron worker is not supported yet (run without "
                                               "--rejoin_after)")
    job = forward_backward.job
    host = MegatronHost(forward_backward, params, forward_backward.optimizer,
                        job.micro_batch_size * job.microbatches * job.dp, scheduler=forward_backward.scheduler)
    return StageDescription(
        topology=topology, me=me, rank=rank, mode=mode, launch=launch, config=job.config, host=host, session=session,
        keep_pre_step=mode.live, snapshot_name=f"live-megatron/attempt{launch.restart}" if launch is not None else None,
        # replica-major: a placement group spans stages, so a lost stage keeps its snapshots
        machine_key=lambda r: (grid.coord(r)[0].pipeline, grid.coord(r)[0].stage, grid.coord(r)[1]),
        info={"pipeline": me.pipeline, "stage": me.stage, "dp": topology.dp, "pp": topology.pp})


def restore(forward_backward: Any, live: LiveStage, grid: PTDPGrid) -> dict:
    """After an agent restart: every rank restores its shard of the newest step held (a collective
    over the job; a data-parallel peer's snapshot of the same stage and tensor-parallel rank serves
    too) and the schedule goes on from there. Returns the restore's log entry."""
    shard_of = {r: (grid.coord(r)[0].stage, grid.coord(r)[1]) for r in range(grid.world_size)}
    entry = live.tier.restore(shard_of)
    fb = forward_backward
    fb.base = fb.iteration = fb.steps
    fb.calls = 0
    return entry
