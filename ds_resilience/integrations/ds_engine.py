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

import functools
import os
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..checkpoint.store import CheckpointError
from ..config import ResilienceConfig
from ..errors import ConfigError
from ..ir import Action, ActionKind, Schedule
from ..runtime.plan_agreement import check_joined
from ..launch import LaunchEnv, job_checkpoint_dir
from ..logs import STDOUT, get_logger, log_dist
from ..runtime.executor import BatchSource, Executor, StageSpec
from ..runtime.live_stage import LiveStage, RecoveryHooks, StageDescription, StartMode
from ..runtime.precision import MixedPrecisionOptimizer
from ..runtime.recovery import Generation, SurvivorView
from ..runtime.zero import ShardedOptimizer
from ..topology import Topology, Worker
from .ds_checkpoint_engine import install as install_checkpoint_engine
from .ds_instructions import ActionSchedule, IRAction
from .ds_checkpoints import export_done, export_stage
from .ds_evaluation import evaluate
from .ds_loss import LossPost, aggregate_loss, park, step_validator
from .ds_optimizer import (OptimizerRequest, ZeroStage, build_optimizer, on_membership, reshard_loaded,
                           restore_after_restart, sharded_of, stage_members)
from .ds_plans import REPLAN_LAG, REPLAN_SOLVER, BackgroundReplan, EnginePlans, PlanSettings, first_generation
from .ds_seeds import LayerSeeds
from .ds_profile import from_engine as profile_from_engine, requested as profile_requested
from .ds_reporting import is_reporter, plan_line, report
from .ds_data import DataIterFactory, engine_batch_source, unfed_by
from .ds_relay import TrainingRelay, starved
from .ds_regrid import RegridContext, regrid, regrid_blocker, regrid_pays_for
from .ds_grow import grow, post_figures
from .ds_survivor_api import SurvivorAPI
from .ds_stage import DeepSpeedStage, activation_checkpointing, refuse_unsupported, refuse_unsupported_live, tied_layout

__all__ = ["ResilientPipelineEngine"]

log = get_logger(__name__)


def _plan_settings(engine: Any) -> PlanSettings:
    """What the engine's plan tables are built from (``ds_plans.py``)."""
    return PlanSettings(config=engine.resilience, topology=engine.topology, microbatches=engine.micro_batches,
                        tied=engine.tied_groups, clipping=float(engine.gradient_clipping() or 0.0) > 0,
                        fp16=bool(engine.fp16_enabled()), config_dir=getattr(engine, "_config_dir", None))


class ResilientPipelineEngine(SurvivorAPI, PipelineEngine):
    """A PipelineEngine that runs IR schedules (fault-free or re-routed around failed workers).

    Extra keyword arguments:
        resilience: the parsed ``"resilience"`` section.
        batch_source: ``(pipeline, iteration, microbatch) -> (inputs, labels)``; needed when this
            worker runs other pipelines' micro-batches (first and last stages).
        launch: the agent's contract (:func:`ds_resilience.launch.launch_env`), ``None`` when not
            launched by the agent (no live recovery).
        config_dir: the directory a relative ``resilience.cost_model`` path is resolved against.
        eval_source: ``(pipeline, step, microbatch) -> (inputs, labels)``: any pipeline's evaluation
            micro-batch for an ``eval_batch`` at optimizer step ``step``; needed when a worker
            evaluates a failed peer's micro-batches (first and last stages).
        data_iter_factory: ``(pipeline, iteration) -> iterator`` over that pipeline's micro-batches
            from that iteration on: other pipelines' data for ``train_batch(data_iter)``. Without
            ``batch_source``, data come from ``training_data`` or the iterators (see ``ds_data``).
        rebuild: what ``initialize`` was given, kept to build the engine of a re-formed grid.
        regrid_from: set by a re-grid (``ds_regrid.py``): this engine is a survivor's new position.
    """

    def __init__(self, *args: Any, resilience: ResilienceConfig, batch_source: BatchSource | None = None,
                 launch: LaunchEnv | None = None, config_dir: Path | None = None,
                 eval_source: BatchSource | None = None, data_iter_factory: DataIterFactory | None = None,
                 rebuild: dict[str, Any] | None = None, regrid_from: RegridContext | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.resilience, self.launch = resilience, launch
        self._rebuild = rebuild
        refuse_unsupported(self.grid.model_parallel_size, self.module, resilience, self.micro_batches)
        self.topology = Topology(dp=self.grid.data_parallel_size, pp=self.num_stages,
                                 ranks=regrid_from.ranks if regrid_from is not None else None)
        self.origin_topology = regrid_from.origin if regrid_from is not None else self.topology
        # the first grid's layer partition (growing back re-forms it; this engine's is module.parts)
        self.origin_parts = regrid_from.origin_bounds if regrid_from is not None else tuple(self.module.parts)
        self.gone = regrid_from.gone if regrid_from is not None else ()
        self.regrids = regrid_from.grid if regrid_from is not None else 0  # re-grids so far
        self.me = Worker(pipeline=self.grid.data_parallel_id, stage=self.stage_id)
        self.my_index = self.topology.worker_index(self.me)
        self.rank = self.topology.rank(self.me)
        try:
            failed = frozenset(self.topology.check(w) for w in resilience.simulate_failed)
        except Exception as exc:
            raise ConfigError("resilience.simulate_failed", str(exc)) from exc
        mode = StartMode.of(launch, simulated=bool(failed), regrid=regrid_from is not None)
        live, rejoin = mode.live, mode is StartMode.REJOIN
        self.alive = self.me not in failed
        refuse_unsupported_live(live, self.zero_optimization_stage(), resilience)
        self.iteration_log: list[dict[str, Any]] = []
        self.recovery_log: list[dict[str, Any]] = regrid_from.recovery_log if regrid_from is not None else []
        self._idle_iteration = 0
        self._since_print = 0.0
        self._reported_recoveries = 0
        self._reported_stragglers = 0
        self._monitor_warned = False
        self.eval_source = eval_source
        self.stage_host = DeepSpeedStage(self)
        self.tied_groups, tied_params = tied_layout(self.module)
        self._config_dir = config_dir
        # a fresh start without a cost model profiles itself and re-plans: until then the unit-cost
        # table (only used by a failure during the profile) is the heuristic's, built in seconds
        fresh = mode.fresh
        profiling = fresh and (resilience.self_profile_steps() > 0 or profile_requested())
        self.session = regrid_from.session if regrid_from is not None else "live" if live else "local"
        topology = self.origin_topology  # the machines of the first grid hold the snapshots, after a re-grid too
        # clipping and fp16 overflow agreed without a barrier; its store is read lazily: the coordinator's
        self.validator = step_validator(self._loss_post, clip=float(self.gradient_clipping() or 0.0),
                                        fp16=bool(self.fp16_enabled()), mode=resilience.clipping,
                                        num_stages=self.num_stages)
        self.live = LiveStage(
            StageDescription(
                topology=self.topology, me=self.me, rank=self.rank, mode=mode, launch=launch, config=resilience,
                host=self.stage_host, session=self.session, alive=self.alive,
                # live handling may roll back any step; a speculative step's copy is kept either way
                keep_pre_step=live,
                # pipeline-major: a placement group spans stages, so a lost stage keeps its snapshots
                machine_key=lambda rank: (topology.coord(rank)[0].pipeline, topology.coord(rank)[0].stage),
                exclude=self.gone, info={"pipeline": self.me.pipeline, "stage": self.me.stage, "dp": self.topology.dp,
                                         "pp": self.topology.pp,
                                         # beyond tolerance with no restart left, the agent restarts once
                                         # to save every stage (this engine restores, then saves on the interrupt)
                                         "settings": {"export_restart": True}}),
            coordinator=regrid_from.coordinator if regrid_from is not None else None,
            progress=regrid_from.progress if regrid_from is not None else None)
        # under the agent every worker answers a failure from rank 0's table (runtime/plan_agreement.py)
        self.plans = EnginePlans(_plan_settings(self), rank=self.rank, coordinator=self.coordinator,
                                 scope=f"attempt{launch.restart}" + (f"-grid{self.regrids}" if self.regrids else "")
                                 if launch is not None else "local",
                                 fire=self.faults.maybe_fire, step=lambda: self.global_steps)
        self.provider = self.plans.joined() if rejoin else None
        if self.provider is None:
            self.provider = self.plans.build(0, solver="heuristic" if profiling else None)
        recompute, reentrant = activation_checkpointing(self.module)
        unfed = unfed_by(self.num_stages, resilience, live=live,
                         simulated=self.topology.without(failed) if failed else None)
        executor = Executor(
            StageSpec(stage=self.stage_id, pipeline=self.me.pipeline, num_stages=self.num_stages, dp=self.topology.dp,
                      microbatches=self.micro_batches, seed=resilience.seed,
                      gradient_clipping=float(self.gradient_clipping() or 0.0),
                      timeout_s=resilience.detector.pg_timeout_s, mark_inputs=reentrant,
                      dynamic_shapes=bool(getattr(self.module, "dynamic_shape", False)),
                      device=str(self.device) if torch.device(self.device).type != "cpu" else "cpu"),
            module=self.module, parameters=self.stage_host.parameters, loss_fn=self.module.loss_fn,
            batch_source=engine_batch_source(self, batch_source=batch_source, data_iter_factory=data_iter_factory,
                                             rerouting=live or bool(failed), unfed=unfed),
            rank_of=self._rank_of,
            step=self.stage_host.step, recompute=recompute, fault_hook=self.faults.maybe_fire, hooks=self.tier,
            tied=tied_params, counted_tied=[g for g, stages in enumerate(self.tied_groups) if stages[0] == self.stage_id],
            precision=self.optimizer if isinstance(self.optimizer, MixedPrecisionOptimizer) else None,
            validator=self.validator, zero_grad=self.stage_host.zero_grad,
        )
        # new (pipeline, micro-batch) -> the first grid's, after a re-grid (None: the first grid)
        self.origin_microbatches = regrid_from.origin_microbatches if regrid_from is not None else None
        # get_global_grad_norm(): the true global norm where this engine computes one (clipping on);
        # like vanilla's fp32 engine, None otherwise
        self.stage_host.grad_norm = lambda: executor.last_grad_norm
        self._relay = TrainingRelay(me=self.my_index, rank_of=self._rank_of, dp=self.topology.dp,
                                    microbatches=self.micro_batches, timeout_s=resilience.detector.pg_timeout_s)
        self.live.attach(executor, self.provider, RecoveryHooks(
            export=functools.partial(export_stage, self), exported=export_done, adopted=self._adopted,
            on_membership=self._on_membership,
            view=SurvivorView(self.topology, self.me) if regrid_from is not None else None,
            regrid=functools.partial(regrid, self) if resilience.regrid else None,
            prefer_regrid=functools.partial(regrid_pays_for, self) if resilience.regrid else None,
            grow=functools.partial(grow, self) if resilience.regrid else None,
            unfed=self._starved))
        # each layer's dropout from a stream of (iteration, micro-batch as the first grid numbered it, layer)
        self.layer_seeds = LayerSeeds(resilience.seed, self.device, lambda: self.executor.current,
                                      self.origin_microbatches)
        self.layer_seeds.install(self.module)
        if self.recovery is not None:
            self.recovery.log = self.recovery_log
            blocker = regrid_blocker(self, rebuild) if resilience.regrid else None
            if blocker is not None:
                raise ConfigError("resilience.regrid", blocker)
        generation, self.session = first_generation(
            self.provider, self.topology, self.me, failed, live=live, rejoin=rejoin, alive=self.alive,
            session=self.session, store=self.coordinator.store if live else None, tied=self.tied_groups,
            device=self._comm_device(), solver=resilience.planner.solver, timeout_s=resilience.detector.pg_timeout_s)
        self.live.begin(generation)
        sharded = self.sharded_optimizer
        # ZeRO-1: every replica of a stage makes the same choice (speculate or wait), so their
        # collective steps pair up; one replica finding every norm in while another does not would not
        self.executor.ready_path = sharded is None
        if sharded is not None and self.alive:  # ZeRO-1; a worker simulated failed never steps
            sharded.bind(me=self.me.pipeline, members=self._stage_members(self.generation.topology),
                         group=lambda: self.executor.groups.stage if self.executor.groups is not None else None)
        self.persistent_engine = None
        if resilience.checkpoint.enabled:  # save_checkpoint / load_checkpoint: asynchronous, atomic, keep_last
            self.persistent_engine = install_checkpoint_engine(self, keep_last=resilience.checkpoint.keep_last)
            self.persistent_engine.participants = self.survivors
            self.persistent_engine.finalizer = lambda: is_reporter(self)
            self.persistent_engine.barrier = self._survivor_barrier
        if regrid_from is not None:
            self.tier.drop(self.gone)
            regrid_from.load(self)  # the moved layers' state, before the first snapshot of the new layout
            if self.tier.memory is not None:
                self.tier.capture_due()
        else:
            if mode is StartMode.LIVE and launch.resume:  # a named job started again
                self._resume_named_job(launch.job_id, resilience.checkpoint.persistent_dir)
            restored = self.live.start(restore=self._restore_after_restart)
            if restored is not None:
                self.recovery_log.append(restored)
        if rejoin and self.alive and self.recovery.growing is None:  # growing back: at its first iteration
            check_joined(self.coordinator.store, self.plans.scope, self.plans.joined_record, rank=self.rank,
                         step=self.global_steps)
        # the profile (DSR_PROFILE_OUT, set by `ds-resilience profile`): a fresh, fault-free start only
        self.replanning: BackgroundReplan | None = None  # the re-plan after it (``_replan``)
        self.profiler = profile_from_engine(self, on_done=self._replan) if fresh else None

    # --- the optimizer side (ds_optimizer.py) ------------------------------------------------------
    def _configure_optimizer(self, client_optimizer, model_parameters):
        """bf16 / fp16 and ZeRO-1: our own optimizers (``ds_optimizer.build_optimizer``); fp32
        without ZeRO is DeepSpeed's own."""
        model_dtype, _ = self.get_data_types()
        zero = self.zero_optimization_stage()
        if model_dtype == torch.float32 and not zero:
            return super()._configure_optimizer(client_optimizer, model_parameters)
        self.basic_optimizer, self.optimizer = build_optimizer(OptimizerRequest(
            model_dtype=model_dtype, zero=zero, client_optimizer=client_optimizer, model_parameters=model_parameters,
            basic=self._configure_basic_optimizer, supported=tuple(self._supported_optims()),
            fp16_config=self._config._param_dict.get("fp16", {}),
            trainable=[p for p in self.module.parameters() if p.requires_grad]))

    @property
    def sharded_optimizer(self) -> ShardedOptimizer | None:
        """The ZeRO-1 optimizer (``None`` without ZeRO)."""
        return sharded_of(self.optimizer)

    def _stage_members(self, topology: Topology) -> list[int]:
        return stage_members(topology, self.stage_id)

    def _on_membership(self, record, plan, previous: Topology | None, generation, *, joining: bool) -> None:
        """ZeRO-1 after a membership change (``ds_optimizer.on_membership``)."""
        sharded = self.sharded_optimizer
        if sharded is None:
            return
        zero = ZeroStage(sharded=sharded, stage=self.stage_id, topology=self.topology, tier=self.tier,
                         recovery_log=self.recovery_log, steps=lambda: self.global_steps,
                         mixed=isinstance(self.optimizer, MixedPrecisionOptimizer))
        on_membership(zero, record, plan, previous, generation, beyond_tolerance=self.recovery._beyond_tolerance)

    def _restore_after_restart(self) -> None:
        self._restore_snapshots()

    def _restore_snapshots(self, newer_than: int | None = None) -> bool:
        """Every rank restores the newest step held for all (if newer than ``newer_than``)."""
        return restore_after_restart(self.tier, self.topology, self.launch.world_size,
                                     zero_stage=self.zero_optimization_stage(), stage=self.stage_id,
                                     sharded=self.sharded_optimizer, generation=self.generation,
                                     recovery_log=self.recovery_log, steps=lambda: self.global_steps,
                                     newer_than=newer_than)

    def _resume_named_job(self, job_id: str, persistent_dir: str | None) -> None:
        """A named job started again: its last stop's checkpoint (``latest``), then the snapshots
        its earlier run left, if newer: in host memory when its agent was killed (the next agent
        of the job keeps them), on disk (``persistent_dir``) after a machine crash. Every rank
        takes part (the restore is collective); with neither, the job starts from scratch."""
        resumed = job_checkpoint_dir(persistent_dir, job_id)
        tag = self.resume_job(resumed)
        if tag is not None:
            log_dist(f"job {job_id} resumes from {resumed}/{tag} (step {self.global_steps})", ranks=[0])
            self.recovery_log.append({"kind": "resume", "checkpoint_dir": os.path.join(resumed, tag),
                                      "resume_step": self.global_steps})
        if self.tier.memory is None:
            return
        try:
            found = self._restore_snapshots(newer_than=self.global_steps if tag is not None else -1)
        except CheckpointError as exc:  # the same plan on every rank: all of them go on without
            log_dist(f"job {job_id}: no snapshot of its earlier run restores every rank ({exc})", ranks=[0])
            return
        if found:
            entry = self.recovery_log[-1]
            log_dist(f"job {job_id} resumes from the snapshots its earlier run left (step {entry['resume_step']}, "
                     f"from {entry['source']})", ranks=[0])

    def _reshard_loaded(self) -> None:
        sharded = self.sharded_optimizer
        if sharded is not None and self.alive and sharded.stale:  # ZeRO-1: keep this replica's range
            reshard_loaded(sharded, self._stage_members(self.current), self.executor.groups.stage,
                           self.tier)

    # --- the plan table (ds_plans.py) -------------------------------------------------------------
    def _replan(self, cost) -> None:
        """The profile is in (``resilience.profile_steps``): plan every failure set with it in a
        thread (``ds_plans.BackgroundReplan``); every rank adopts the table ``REPLAN_LAG`` steps on
        (``train_batch``), and until then plans with the one it has (``self.provider``'s stand-in)."""
        step = self.global_steps  # the same on every rank: the profile's last step
        due = step + REPLAN_LAG
        build = functools.partial(self.plans.build, 1, cost=cost, solver=REPLAN_SOLVER, step=step, own_store=True,
                                  from_step=due)
        self.replanning = BackgroundReplan(build, cost, rank=self.rank, due=due, before=self.provider,
                                           steps=lambda: self.global_steps, reporter=lambda: is_reporter(self)).start()
        self.provider = self.replanning.provider
        if self.recovery is not None:
            self.recovery.provider = self.provider

    def _starved(self, failed: frozenset[Worker]) -> str | None:
        """Why a failed set leaves micro-batches no worker can load (``ds_relay.starved``)."""
        return starved(self.executor.batch_source, self.topology.without(failed))

    def _rank_of(self, index: int) -> int:
        return self.topology.rank(self.topology.worker(index))

    def _adopted(self, generation: Generation) -> None:
        """A recovery's new generation: its plan's predicted figures, from the reporting rank."""
        figures = generation.figures
        if figures and generation.groups is not None and is_reporter(self):
            failed = ",".join(sorted(str(w) for w in generation.topology.failed)) or "none"
            log.info("%s", plan_line(figures, self.provider.cost.name, failed), extra=STDOUT)

    # --- what the rest of the code reads ----------------------------------------------------------------
    # the live stage's parts (runtime/live_stage.py), read by this engine's helpers
    coordinator = property(lambda self: self.live.coordinator)
    progress = property(lambda self: self.live.progress)
    faults = property(lambda self: self.live.faults)
    tier = property(lambda self: self.live.tier)
    executor = property(lambda self: self.live.executor)
    recovery = property(lambda self: self.live.recovery)

    @property
    def generation(self) -> Generation:
        return self.live.generation

    @generation.setter
    def generation(self, generation: Generation) -> None:
        self.live.generation = generation

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
        return self.live.actions

    def _comm_device(self) -> str | None:
        """The device of this worker's groups: its GPU (NCCL groups), or ``None`` (gloo, CPU)."""
        device = torch.device(self.device)
        return str(device) if device.type == "cuda" else None

    def _train_schedule(self):
        forwards = sum(1 for a in self.actions if a.kind is ActionKind.F)
        return ActionSchedule(self.actions, self.micro_batches, self.num_stages, self.stage_id, forwards)

    def _exec_ir(self, action: Action) -> None:
        """DeepSpeed calls ``_INSTRUCTION_MAP[type(instruction)](self, **instruction.kwargs)``."""
        self.executor.execute(action)

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, IRAction: _exec_ir}

    # --- training --------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Run one iteration of this worker's schedule; returns the global mean loss (survivors).

        A worker left idle by ``simulate_failed`` runs nothing and returns ``None``.
        """
        if not torch._C.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if not self.alive:  # blocks (not spins) until the survivors finished this iteration
            park(self._loss_post(), self._idle_iteration, self.resilience.detector.pg_timeout_s * 10)
            self._idle_iteration += 1
            return None
        if self.replanning is not None:  # from its step on: the re-plan's table and healthy schedule
            self.generation = self.replanning.at_boundary(self.global_steps, self.generation)
        self.module.train()
        return self._resilient(self._train_iteration, rejoin=True)

    def _resilient(self, run, *, rejoin: bool = False):
        """Run ``run()``; on a failure signal under the agent, recover and run it again. A pending
        re-join is applied only before a training iteration (``rejoin``), the joiner's first call."""
        return self.live.resilient(run, rejoin=rejoin)

    def _train_iteration(self):
        elapsed = 0.0

        def before() -> None:
            if self.profiler is not None:
                self.profiler.before()  # the profile's iterations run its own schedules
            self.executor.resolve()  # the previous step is validated before this iteration's forwards
            self._relay.run(self.executor.batch_source, self.generation, self.actions, self.global_steps)

        def after():
            loss = aggregate_loss(self._loss_post(), self.executor.stats.loss_sum, step=self.global_steps - 1,
                                  me=self.me, topology=self.topology, current=self.current,
                                  stage_group=self.generation.groups.stage, microbatches=self.micro_batches)
            # the step taken speculatively is validated now, in time this stage would wait anyway (its
            # next forward needs an activation that follows the first stage's step): train_batch
            # returns a final state, and no stage's step waited for another's gradients
            self.executor.resolve()
            if self.profiler is not None:
                self.profiler.after()
            return loss

        loss, elapsed = self.live.iteration(self.global_steps, lambda: self._exec_schedule(self._train_schedule()),
                                            self.provider.cost, before=before, after=after)
        if self.persistent_engine is not None and self.checkpoint_engine is self.persistent_engine:
            self.persistent_engine.poll()  # finalize finished writes (commit markers, keep_last)
        stats = self.executor.stats
        self.iteration_log.append(
            {"step": self.global_steps, "loss": float(loss), "seconds": elapsed, "rerouted": stats.rerouted, "forwards": stats.forwards}
        )
        # what vanilla returns: a 0-dim tensor, the loss's dtype on the last stage, float32 elsewhere
        dtype = stats.loss_dtype if self.stage_id == self.num_stages - 1 and stats.loss_dtype else torch.float32
        self.agg_train_loss = loss.reshape(()).to(device=self.device, dtype=dtype)
        report(self, elapsed)
        post_figures(self)  # on a re-formed grid's lowest rank: what growing back would save (the agent decides)
        return self.agg_train_loss

    # --- evaluation ----------------------------------------------------------------------------
    def eval_batch(self, data_iter=None, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        """DeepSpeed's ``eval_batch`` on the survivors: the same arguments and return values.

        Every pipeline's ``num_micro_batches`` (default: the training count) evaluation
        micro-batches run forward on the worker the re-routing assignment gives them, so a failed
        worker's share runs on its data-parallel peers and the result equals a fault-free
        evaluation. A worker reads its own pipeline's micro-batches from ``data_iter`` (as in
        DeepSpeed) and other pipelines' from ``eval_source`` (``initialize(eval_source=...)``).
        Collectives go over the survivors only.
        """
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"reduction type {reduce_output} not supported.")
        micro_batches = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        self._resilient(self.executor.resolve)
        self.module.eval()
        try:
            return self._resilient(lambda: evaluate(self, data_iter, micro_batches, return_logits, compute_loss,
                                                    reduce_output, bcast_loss))
        finally:
            self.module.train()

    # --- the loss without a global barrier, the idle workers' parking (ds_loss.py) -------------------
    def _loss_post(self) -> LossPost:
        return LossPost(session=self.session, rank=self.rank, coordinator=self.coordinator,
                        store_timeout_s=self.resilience.detector.store_timeout_s)
