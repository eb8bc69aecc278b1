"""The resilient DeepSpeed pipeline engine: a thin adapter over composed parts.

:class:`ResilientPipelineEngine` is a :class:`deepspeed.runtime.pipe.engine.PipelineEngine`
subclass, as DeepSpeed's own ``DualPipeVEngine`` is: it overrides ``_train_schedule`` to yield this
worker's IR actions and maps DeepSpeed's one IR instruction (``_INSTRUCTION_MAP``) to the executor.
The work is done by composed parts, each with one owner:

* :class:`~ds_resilience.runtime.executor.Executor`: runs actions through one table and holds the
  generation's process groups;
* :class:`~ds_resilience.checkpoint.tier.CheckpointTier`: the stage's saved states (pre-step copies,
  in-memory snapshots, replication gating), hooked around the executor's optimizer step;
* :class:`~ds_resilience.runtime.recovery.LiveRecovery` (under the agent): plans and applies
  recovery, with schedules from :class:`~ds_resilience.planning.provider.ScheduleProvider` (the
  plan table, then the planner).

:class:`~.ds_stage.DeepSpeedStage` is what those parts see of DeepSpeed.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..checkpoint.inmemory import InMemoryCheckpointer
from ..checkpoint.tier import CheckpointTier
from ..comm.groups import build_groups, world_group
from ..config import ResilienceConfig
from ..errors import ConfigError
from ..ir import Action, ActionKind, Schedule
from ..launch import LaunchEnv
from ..planning.provider import ScheduleChoice, ScheduleProvider
from ..runtime.coordinator import Coordinator
from ..runtime.executor import BatchSource, Executor, StageSpec
from ..runtime.faults import FaultInjector
from ..runtime.recovery import Generation, LiveRecovery, is_failure
from ..topology import Topology, Worker
from .ds_checkpoint_engine import install as install_checkpoint_engine
from .ds_instructions import ActionSchedule, IRAction
from .ds_stage import DeepSpeedStage, IteratorSource

__all__ = ["ResilientPipelineEngine"]


class ResilientPipelineEngine(PipelineEngine):
    """A PipelineEngine that runs IR schedules (fault-free or re-routed around failed workers).

    Extra keyword arguments:
        resilience: the parsed ``"resilience"`` section.
        batch_source: ``(pipeline, iteration, microbatch) -> (inputs, labels)``; needed when this
            worker runs other pipelines' micro-batches (first and last stages).
        launch: the agent's contract (:func:`ds_resilience.launch.launch_env`), ``None`` when not
            launched by the agent (no live recovery).
        config_dir: the directory a relative ``resilience.cost_model`` path is resolved against.
    """

    def __init__(self, *args: Any, resilience: ResilienceConfig, batch_source: BatchSource | None = None,
                 launch: LaunchEnv | None = None, config_dir: Path | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.resilience, self.launch = resilience, launch
        if self.grid.model_parallel_size != 1:
            raise ConfigError("resilience", "tensor parallelism is not supported yet (model_parallel_size must be 1)")
        if resilience.microbatches is not None and resilience.microbatches != self.micro_batches:
            raise ConfigError("resilience.microbatches",
                              f"{resilience.microbatches} differs from gradient_accumulation_steps={self.micro_batches}")
        self.topology = Topology(dp=self.grid.data_parallel_size, pp=self.num_stages)
        self.me = Worker(pipeline=self.grid.data_parallel_id, stage=self.stage_id)
        self.my_index = self.topology.worker_index(self.me)
        self.rank = self.topology.rank(self.me)
        try:
            failed = frozenset(self.topology.check(w) for w in resilience.simulate_failed)
        except Exception as exc:
            raise ConfigError("resilience.simulate_failed", str(exc)) from exc
        live, rejoin = launch is not None, launch is not None and launch.rejoin
        if live and failed:
            raise ConfigError("resilience.simulate_failed", "simulated failures and the live agent do not mix")
        self.alive = self.me not in failed
        self.iteration_log: list[dict[str, Any]] = []
        self.recovery_log: list[dict[str, Any]] = []
        self._idle_iteration = 0
        self.stage_host = DeepSpeedStage(self)
        self.provider = self._schedule_provider(config_dir)
        self.coordinator = self._coordinator() if live else None
        self.faults = FaultInjector(resilience.fault_injection, self.rank, launch=launch)
        self.tier = CheckpointTier(self.stage_host, stage=self.stage_id, rank=self.rank, keep_pre_step=live,
                                   memory=self._memory_tier(rejoin) if live and self.alive else None)
        self.faults.lose_memory = self.tier.lose_memory
        self.executor = Executor(
            StageSpec(stage=self.stage_id, pipeline=self.me.pipeline, num_stages=self.num_stages, dp=self.topology.dp,
                      microbatches=self.micro_batches, seed=resilience.seed,
                      gradient_clipping=float(self.gradient_clipping() or 0.0),
                      timeout_s=resilience.detector.pg_timeout_s),
            module=self.module, parameters=self.stage_host.parameters, loss_fn=self.module.loss_fn,
            batch_source=batch_source or IteratorSource(self), rank_of=lambda i: self.topology.rank(self.topology.worker(i)),
            step=self.stage_host.step, fault_hook=self.faults.maybe_fire, hooks=self.tier,
        )
        self.recovery = None
        if live:
            self.recovery = LiveRecovery(
                topology=self.topology, me=self.me, coordinator=self.coordinator, executor=self.executor,
                tier=self.tier, provider=self.provider, session=self.session, timeout_s=resilience.detector.pg_timeout_s,
                grace_s=resilience.detector.heartbeat_timeout_s + 5.0, adopt=self._adopt, export=self._export_stage,
                persistent_dir=resilience.checkpoint.persistent_dir,
            )
            self.recovery.log = self.recovery_log
        self.generation = self._first_generation(failed, live=live, rejoin=rejoin)
        self.persistent_engine = None
        if resilience.checkpoint.enabled:  # save_checkpoint / load_checkpoint: asynchronous, atomic, keep_last
            self.persistent_engine = install_checkpoint_engine(self, keep_last=resilience.checkpoint.keep_last)
        if self.tier.memory is not None and not rejoin:
            if launch.restart:
                self._restore_after_restart()
            else:
                self.tier.capture_due()  # the initial state, step 0
        if rejoin and self.alive:
            self.recovery.join()

    # --- construction ----------------------------------------------------------------------------------
    def _schedule_provider(self, base_dir: Path | None) -> ScheduleProvider:
        cfg = self.resilience
        planner = cfg.planner
        return ScheduleProvider.build(
            self.topology, self.micro_batches, cfg.cost(base_dir), schedule=cfg.schedule, variant=cfg.variant,
            solver=planner.solver, time_limit_s=planner.time_limit_s, memory_cap=planner.memory_cap,
            max_failures=cfg.max_failures, all_coverable=planner.all_coverable, cache_dir=planner.cache_dir,
            workers=planner.workers,
        )

    def _coordinator(self) -> Coordinator:
        self.session = "live"
        det = self.resilience.detector
        return Coordinator(launch=self.launch,
                           info={"pipeline": self.me.pipeline, "stage": self.me.stage, "dp": self.topology.dp,
                                 "pp": self.topology.pp},
                           heartbeat_interval_s=det.heartbeat_interval_s, store_timeout_s=det.store_timeout_s,
                           on_epoch=self._on_epoch)

    def _memory_tier(self, rejoin: bool) -> InMemoryCheckpointer | None:
        cfg = self.resilience.checkpoint
        if not cfg.enabled:
            return None
        launch = self.launch
        world = launch.world_size
        topology = self.topology
        return InMemoryCheckpointer(
            cfg, rank=self.rank, world=world, job_id=launch.job_id or f"job-{self.session}",
            local_world_size=launch.local_world_size or world, name=f"{self.session}/attempt{launch.restart}",
            replicate=not rejoin, group_store=self.coordinator.store, timeout_s=self.resilience.detector.pg_timeout_s,
            # pipeline-major: a placement group spans stages, so a lost stage keeps its snapshots
            machine_key=lambda rank: (topology.coord(rank)[0].pipeline, topology.coord(rank)[0].stage),
        )

    def _first_generation(self, failed: frozenset[Worker], *, live: bool, rejoin: bool) -> Generation:
        """The schedule and groups to start with.

        Under the agent every worker starts fault-free (a re-joining one learns the real membership
        when it joins). Otherwise rank 0 plans the simulated failure set (with the configured
        solver) and broadcasts the schedule as JSON, with a session id that names the groups.
        """
        timeout = self.resilience.detector.pg_timeout_s
        if live:
            choice = self.provider.schedule_for(frozenset())
            groups = None
            if not rejoin:
                groups = build_groups(self.topology, self.me, session=self.session, timeout_s=timeout,
                                      store=self.coordinator.store)
        else:
            payload = None
            if dist.get_rank() == 0:
                c = self.provider.schedule_for(failed, solver=self.resilience.planner.solver)
                payload = {"schedule": c.schedule.to_text(), "source": c.source, "seconds": c.seconds,
                           "figures": c.figures, "session": uuid.uuid4().hex[:12]}
            payload = world_group(timeout).broadcast_json(payload, src=0)
            self.session = payload["session"]
            choice = ScheduleChoice(Schedule.from_text(payload["schedule"]), payload["source"], payload["seconds"],
                                    payload["figures"])
            groups = (build_groups(self.topology.without(failed), self.me, session=self.session, timeout_s=timeout)
                      if self.alive else None)
        generation = Generation(epoch=0, topology=self.topology.without(failed), schedule=choice.schedule,
                                source=choice.source, lookup_s=choice.seconds, figures=choice.figures, groups=groups)
        if groups is not None:
            self.executor.install(groups)
        return generation

    def _adopt(self, generation: Generation) -> None:
        self.generation = generation

    def _restore_after_restart(self) -> None:
        # ZeRO-0: the data-parallel replicas of a stage hold identical states, so any of them
        # restores the others (a stage stays covered while one of its snapshots survives)
        world = self.launch.world_size
        stage_of = ({r: self.topology.coord(r)[0].stage for r in range(world)}
                    if self.zero_optimization_stage() == 0 else None)
        self.recovery_log.append(self.tier.restore(stage_of))

    # --- what the rest of the code reads ----------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        return self.generation.schedule

    @property
    def current(self) -> Topology:
        """The grid with the workers currently failed (or simulated failed)."""
        return self.generation.topology

    @property
    def plan_figures(self) -> dict[str, Any] | None:
        """The current plan's predicted figures (``None`` when fault-free)."""
        return self.generation.figures

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.workers[self.my_index]

    def _train_schedule(self):
        forwards = sum(1 for a in self.actions if a.kind is ActionKind.F)
        return ActionSchedule(self.actions, self.micro_batches, self.num_stages, self.stage_id, forwards)

    def _exec_ir(self, action: Action) -> None:
        """DeepSpeed calls ``_INSTRUCTION_MAP[type(instruction)](self, **instruction.kwargs)``."""
        self.executor.execute(action)

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, IRAction: _exec_ir}

    def _on_epoch(self, record) -> None:
        """Watcher thread: a new epoch was latched; release whatever the main thread is blocked on.

        A re-join changes nothing for the running iteration: it is applied at the next iteration
        boundary, without aborting anything.
        """
        groups = self.generation.groups if getattr(self, "generation", None) is not None else None
        if groups is not None and record.kind != "rejoin":
            groups.poison()
        if getattr(self, "tier", None) is not None:
            self.tier.drop(record.failed)

    def _export_stage(self, ckpt_dir: str, step: int) -> None:
        """This stage's layers (DeepSpeed's file names) and optimizer state, written atomically."""
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        for idx, layer in enumerate(self.module.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            path = self.module.ckpt_layer_path(ckpt_dir, idx)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({k: v.detach().clone() for k, v in layer.state_dict().items()}, tmp)
            os.replace(tmp, path)
        optim_path = os.path.join(ckpt_dir, f"stage{self.stage_id}-optim_states.pt")
        tmp = f"{optim_path}.tmp{os.getpid()}"
        torch.save({"step": step, "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}, tmp)
        os.replace(tmp, optim_path)

    # --- training --------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Run one iteration of this worker's schedule; returns the global mean loss (survivors).

        A worker left idle by ``simulate_failed`` runs nothing and returns ``None``.
        """
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if not self.alive:
            self._park()
            return None
        self.module.train()
        while True:
            try:
                if self.coordinator is not None:
                    self.coordinator.check()
                return self._train_iteration()
            except Exception as exc:  # noqa: BLE001 - filtered by is_failure
                if self.recovery is None or not is_failure(exc):
                    raise
                self.recovery.recover(exc)

    def _train_iteration(self):
        started = time.perf_counter()
        self.executor.begin_iteration(self.global_steps)
        self.tier.begin_iteration(self.schedule, self.my_index, self.provider.cost)
        self._exec_schedule(self._train_schedule())
        self.executor.end_iteration()
        stats = self.executor.stats
        loss = self._aggregate_loss(stats.loss_sum)
        elapsed = time.perf_counter() - started
        self.tier.end_iteration(elapsed)
        if self.persistent_engine is not None and self.checkpoint_engine is self.persistent_engine:
            self.persistent_engine.poll()  # finalize finished writes (commit markers, keep_last)
        self.iteration_log.append(
            {"step": self.global_steps, "loss": float(loss), "seconds": elapsed, "rerouted": stats.rerouted, "forwards": stats.forwards}
        )
        self.agg_train_loss = loss.float()
        return self.agg_train_loss

    def close_snapshots(self) -> None:
        """Stop the checkpoint tier's threads (the snapshots stay in host memory for the agent)."""
        self.tier.close()

    # --- loss aggregation without a global barrier -------------------------------------------------
    def _store(self):
        if self.coordinator is not None:
            return self.coordinator.store
        return dist.distributed_c10d._get_default_store()

    def _loss_key(self, step: int) -> str:
        epoch = self.coordinator.applied if self.coordinator is not None else 0
        return f"dsr/{self.session}/loss/{epoch}/{step}"

    def _aggregate_loss(self, local_sum: float) -> torch.Tensor:
        """Global mean loss of the iteration, without a barrier over all stages.

        The last stage's survivors sum their losses among themselves; the first of them publishes
        the mean in the store, where every other worker reads it when it finishes its iteration
        (after the last stage's final backward, so the value is already there). The last stage
        never waits for the first, and with the staggered optimizer the next iteration starts
        stage by stage. The key of iteration k-2 is deleted at k: by then every worker has read it
        (each worker's next forwards feed the last stage's reduce).
        """
        step = self.global_steps - 1  # the optimizer step of this iteration has been taken
        key = self._loss_key(step)
        last = self.topology.pp - 1
        if self.stage_id == last:
            total = torch.tensor([local_sum], dtype=torch.float64)
            self.generation.groups.stage.all_reduce(total)
            loss = total / (self.topology.dp * self.micro_batches)
            if self.me == self.current.stage_peers(last)[0]:
                store = self._store()
                store.set(key, repr(float(loss)))
                if step >= 2:
                    store.delete_key(self._loss_key(step - 2))
                if self.current.failed and self.coordinator is None:
                    store.set(self._idle_key(step), "1")  # wakes the simulated-failed workers
            return loss
        store = self._store()
        if self.coordinator is not None:
            value = self.coordinator.wait_key(key)
        else:
            store.wait([key], timedelta(seconds=self.resilience.detector.store_timeout_s))
            value = store.get(key)
        return torch.tensor([float(value)], dtype=torch.float64)

    # --- idle (simulated failed) workers ---------------------------------------------------------
    def _park(self) -> None:
        """Block (not spin) until the survivors published this iteration's loss.

        A simulated-failed worker must not race ahead into collectives of later code, where
        DeepSpeed's CPU communication backend busy-waits and steals a core from the survivors.
        """
        self._store().wait([self._idle_key(self._idle_iteration)], timedelta(seconds=self.resilience.detector.pg_timeout_s * 10))
        self._idle_iteration += 1

    def _idle_key(self, step: int) -> str:
        """Set once per iteration while workers are simulated-failed; never deleted (a parked
        worker may be late), one tiny key per iteration."""
        return f"dsr/{self.session}/idle/{step}"
