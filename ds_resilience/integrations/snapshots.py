"""The in-memory checkpoint tier inside the resilient engine (a mixin of ``ResilientPipelineEngine``).

With ``resilience.checkpoint.enabled``, DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` go
through the asynchronous, atomic ``AsyncPersistentCheckpointEngine`` (``keep_last`` tags). The
in-memory tier is active under the agent (``ds-resilience run``):

* the initial state is snapshot as step 0, then every ``interval`` steps right after the stage's
  optimizer step (``_stage_step``); the snapshot of step ``s`` is also the pre-step state of step
  ``s + 1``, so a stage that must roll back after a peer's failure reloads it from host memory
  instead of keeping a second copy;
* replication chunks go out while the engine runs an action the timeline marks link-idle
  (``sim/idle.py``), for the measured length of that action (from the previous iteration) times
  ``idle_fraction``;
* on a restart by the agent (``DSR_RESTART`` > 0, after a failure beyond tolerance) every worker
  restores the newest step held for all of them, from local memory, a peer, or the persistent tier,
  and training continues from there exactly.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist

from ..checkpoint.inmemory import InMemoryCheckpointer
from ..checkpoint.persistent import install
from ..checkpoint.state import apply, collect
from ..ir import Action
from ..sim.idle import replication_windows

__all__ = ["SnapshotMixin"]


class SnapshotMixin:
    """Snapshot capture, interleaving, rollback and restore for the engine (see the module doc)."""

    checkpointer: InMemoryCheckpointer | None = None

    def _init_snapshots(self, *, live: bool, rejoin: bool, faults) -> None:
        cfg = self.resilience.checkpoint
        self.checkpointer = None
        self._windows: dict[int, Any] = {}
        self._windows_of = None  # the schedule the windows belong to
        self._measured: dict[int, float] = {}  # action index -> its duration in the last iteration
        self._action_cursor = 0
        self.persistent_engine = None
        if cfg.enabled:  # save_checkpoint / load_checkpoint: asynchronous, atomic, keep_last
            self.persistent_engine = install(self, keep_last=cfg.keep_last)
        if not (live and cfg.enabled and self.alive):
            return
        world = int(os.environ.get("WORLD_SIZE", dist.get_world_size()))
        restart = int(os.environ.get("DSR_RESTART", "0") or 0)
        topology = self.topology
        self.checkpointer = InMemoryCheckpointer(
            cfg, rank=self.topology.rank(self.me), world=world,
            job_id=os.environ.get("DSR_JOB_ID") or f"job-{self.session}",
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            name=f"{self.session}/attempt{restart}", replicate=not rejoin,
            group_store=self.coordinator.store if self.coordinator is not None else None,
            timeout_s=self.resilience.detector.pg_timeout_s,
            # pipeline-major: a placement group spans stages, so a lost stage keeps its snapshots
            machine_key=lambda rank: (topology.coord(rank)[0].pipeline, topology.coord(rank)[0].stage),
        )
        faults.lose_memory = self.checkpointer.lose_memory
        if restart and not rejoin:
            self._restore_snapshots()
        elif not rejoin:
            self._capture()

    # --- capture -------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return collect(params=self.worker.parameters, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                       steps=self.global_steps, samples=self.global_samples, stage=self.stage_id,
                       rank=self.topology.rank(self.me))

    def _capture(self) -> None:
        ck = self.checkpointer
        if ck is not None and ck.due(self.global_steps):
            ck.capture(self.global_steps, self._state())

    def _before_optimizer_step(self) -> None:
        """The snapshot copy of the previous step reads the live tensors: it must be done first."""
        if self.checkpointer is not None:
            self.checkpointer.wait_copied()

    def _needs_pre_step_copy(self) -> bool:
        """Whether the pre-step state must be copied now (no snapshot of this step to roll back to)."""
        ck = self.checkpointer
        return ck is None or ck.last_captured != self.global_steps

    def _rollback_from_snapshot(self, steps: int) -> bool:
        """Reload this rank's snapshot of ``steps`` from host memory; ``False`` when there is none."""
        ck = self.checkpointer
        if ck is None or ck.last_captured is None or ck.last_captured < steps:
            return False
        if not ck.wait_committed(steps):
            return False
        state = ck.load_local(steps)
        self.global_steps, self.global_samples = apply(state, params=self.worker.parameters, optimizer=self.optimizer,
                                                       lr_scheduler=self.lr_scheduler, stage=self.stage_id)
        return True

    def _end_iteration_snapshots(self, seconds: float) -> None:
        if self.checkpointer is not None:
            self.checkpointer.note_iteration(seconds)
        if self.persistent_engine is not None and self.checkpoint_engine is self.persistent_engine:
            self.persistent_engine.poll()  # finalize finished writes (commit markers, keep_last)

    # --- interleaving ----------------------------------------------------------------------------------
    def _begin_actions(self) -> None:
        self._action_cursor = 0
        ck = self.checkpointer
        if ck is not None and ck.replicator is not None and ck.cfg.interleave and self._windows_of is not self.schedule:
            self._windows = {w.index: w for w in replication_windows(self.schedule, self.my_index, self.resilience.cost())}
            self._windows_of = self.schedule
            self._measured.clear()

    def _run_action(self, action: Action) -> None:
        index = self._action_cursor
        self._action_cursor += 1
        ck = self.checkpointer
        if ck is None or ck.replicator is None or index not in self._windows:
            self.worker.execute(action)
            return
        expected = self._measured.get(index)
        ck.gate.open(None if expected is None else expected * ck.cfg.idle_fraction)
        started = time.perf_counter()
        try:
            self.worker.execute(action)
        finally:
            ck.gate.close()
            self._measured[index] = time.perf_counter() - started

    # --- failures ------------------------------------------------------------------------------------
    def _snapshots_drop(self, ranks) -> None:
        ck = self.checkpointer
        if ck is not None and ck.replicator is not None:
            ck.replicator.drop(ranks)

    def _snapshots_ready_for_restart(self, step: int) -> dict[str, Any]:
        """Before exiting for a restart: the snapshot of ``step`` is committed (and replicated, if
        the holders are alive and it takes less than a few seconds)."""
        ck = self.checkpointer
        if ck.last_captured != step:  # the interval skipped it: the state is exactly step ``step`` now
            ck.capture(step, self._state())
        committed = ck.wait_committed(step)
        ck.gate.open(None)  # no training traffic any more: replicate freely
        replicated = ck.replicator.wait_replicated(step, 5.0) if ck.replicator is not None else True
        return {"committed": committed, "replicated": replicated}

    def _restore_snapshots(self) -> None:
        started = time.time()
        # ZeRO-0: the data-parallel replicas of a stage hold identical states, so any of them
        # restores the others (a stage stays covered while one of its snapshots survives)
        world = self.checkpointer.world
        stage_of = ({r: self.topology.coord(r)[0].stage for r in range(world)}
                    if self.zero_optimization_stage() == 0 else None)
        state, plan, timings = self.checkpointer.restore(stage_of=stage_of)
        self.global_steps, self.global_samples = apply(state, params=self.worker.parameters, optimizer=self.optimizer,
                                                       lr_scheduler=self.lr_scheduler, stage=self.stage_id)
        self.checkpointer.mark_held(self.global_steps)
        me = self.topology.rank(self.me)
        self.recovery_log.append({
            "kind": "restored", "resume_step": plan.step, "source": plan.sources[me][0],
            "holder": plan.sources[me][1], "from_rank": plan.sources[me][2],
            "sources": {str(r): s for r, (s, _, _) in plan.sources.items()},
            "recovery_s": time.time() - started, **timings,
        })

    def close_snapshots(self) -> None:
        """Stop the tier's threads (the snapshots stay in host memory for the agent)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
