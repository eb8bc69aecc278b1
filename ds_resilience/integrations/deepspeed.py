"""DeepSpeed integration: :class:`ResilientPipelineEngine` and :func:`initialize`.

The engine is a :class:`deepspeed.runtime.pipe.engine.PipelineEngine` subclass, as DeepSpeed's own
``DualPipeVEngine`` is: it overrides ``_train_schedule`` to return this worker's actions from the IR
schedule (fault-free, or the planner's re-routed plan for ``resilience.simulate_failed``), adds one
``PipeInstruction`` per action kind and maps each to an ``_exec_*`` method in a re-declared
``_INSTRUCTION_MAP``; every method hands the action to the :class:`StageWorker` handler of the same
kind. Communication goes to explicit global ranks (across pipelines), gradients are reduced over the
stage's surviving replicas, and each stage steps its own optimizer.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config import ResilienceConfig, load_resilience_config
from ..errors import ConfigError, ResilienceError
from ..ir import Action, ActionKind, Schedule
from ..planning import generate
from ..planning.planner import plan as plan_failure
from ..runtime.coordinator import Coordinator, poison
from ..runtime.faults import FaultInjector
from ..runtime.groups import build_groups
from ..runtime.p2p import Messenger
from ..runtime.stage_worker import BatchSource, StageWorker
from ..topology import Topology, Worker
from .ds_instructions import (
    INSTRUCTIONS,
    ActionSchedule,
    BackwardFused,
    BackwardInput,
    BackwardWeight,
    ForwardMicroBatch,
    RecvActivationFrom,
    RecvGradFrom,
    ReduceStageGrads,
    SendActivationTo,
    SendGradTo,
    StageOptimizerStep,
)
from .live import BeyondTolerance, LiveFailureMixin, is_failure
from .snapshots import SnapshotMixin

__all__ = ["ResilientPipelineEngine", "initialize", "init_distributed", "ActionSchedule", "INSTRUCTIONS", "BeyondTolerance"]


class _IteratorSource:
    """A batch source over a DeepSpeed-style data iterator: own pipeline's micro-batches only."""

    def __init__(self, engine: "ResilientPipelineEngine") -> None:
        self.engine = engine
        self.cache: dict[tuple[int, int], Any] = {}
        self.next_mb: dict[int, int] = {}

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> tuple[Any, Any]:
        if pipeline != self.engine.me.pipeline:
            raise ResilienceError(
                f"re-routed micro-batch {microbatch} of pipeline {pipeline} needs that pipeline's data: pass "
                "batch_source=(pipeline, iteration, microbatch) -> (inputs, labels) to ds_resilience.initialize"
            )
        key = (iteration, microbatch)
        while key not in self.cache:
            m = self.next_mb.get(iteration, 0)
            self.cache[(iteration, m)] = next(self.engine.data_iterator)
            self.next_mb[iteration] = m + 1
        return self.cache.pop(key)


class ResilientPipelineEngine(LiveFailureMixin, SnapshotMixin, PipelineEngine):
    """A PipelineEngine that runs IR schedules (fault-free or re-routed around failed workers).

    Extra keyword arguments:
        resilience: the parsed ``"resilience"`` section.
        batch_source: ``(pipeline, iteration, microbatch) -> (inputs, labels)``; needed when this
            worker runs other pipelines' micro-batches (first and last stages).
    """

    def __init__(self, *args: Any, resilience: ResilienceConfig, batch_source: BatchSource | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.resilience = resilience
        if self.grid.model_parallel_size != 1:
            raise ConfigError("resilience", "tensor parallelism is not supported yet (model_parallel_size must be 1)")
        self.topology = Topology(dp=self.grid.data_parallel_size, pp=self.num_stages)
        self.me = Worker(pipeline=self.grid.data_parallel_id, stage=self.stage_id)
        self.my_index = self.topology.worker_index(self.me)
        if resilience.microbatches is not None and resilience.microbatches != self.micro_batches:
            raise ConfigError(
                "resilience.microbatches",
                f"{resilience.microbatches} differs from gradient_accumulation_steps={self.micro_batches}",
            )
        try:
            failed = [self.topology.check(w) for w in resilience.simulate_failed]
        except Exception as exc:
            raise ConfigError("resilience.simulate_failed", str(exc)) from exc
        self.current = self.topology.without(failed)
        self.iteration_log: list[dict[str, Any]] = []
        self.recovery_log: list[dict[str, Any]] = []
        self._idle_iteration = 0
        self.worker: StageWorker | None = None
        self.groups = None
        self.coordinator = None
        live = os.environ.get("DSR_AGENT") == "1"
        rejoin = live and os.environ.get("DSR_REJOIN") == "1"
        if live and failed:
            raise ConfigError("resilience.simulate_failed", "simulated failures and the live agent do not mix")
        if rejoin:  # the original world's collectives are gone: plan locally, groups come with the epoch
            self.session = "live"
            self.schedule = self._plan_for(self.current)
        else:
            self.schedule = self._make_schedule(live)
        self.alive = self.me not in self.current.failed
        if live:
            self.coordinator = Coordinator(
                rank=dist.get_rank(),
                info={"pipeline": self.me.pipeline, "stage": self.me.stage, "dp": self.topology.dp, "pp": self.topology.pp},
                heartbeat_interval_s=resilience.detector.heartbeat_interval_s,
                store_timeout_s=resilience.detector.store_timeout_s,
                on_epoch=self._on_epoch,
            )
        faults = FaultInjector(resilience.fault_injection if not rejoin else (), dist.get_rank())
        if self.alive:
            groups = None
            if not rejoin:
                groups = build_groups(
                    self.current, self.me, session=self.session, timeout_s=resilience.detector.pg_timeout_s,
                    store=self.coordinator.store if self.coordinator else None,
                )
            self.groups = groups
            self.worker = StageWorker(
                module=self.module,
                parameters=[p for p in self.module.parameters() if p.requires_grad],
                stage=self.stage_id,
                pipeline=self.me.pipeline,
                num_stages=self.num_stages,
                dp=self.topology.dp,
                microbatches=self.micro_batches,
                rank_of=lambda index: self.topology.rank(self.topology.worker(index)),
                batch_source=batch_source or _IteratorSource(self),
                loss_fn=self.module.loss_fn,
                messenger=Messenger(group=groups.world if groups else None, timeout_s=resilience.detector.pg_timeout_s),
                stage_group=groups.stage if groups else None,
                world_group=groups.world if groups else None,
                stage_replicas=len(groups.stage) if groups else 1,
                step_fn=self._stage_step,
                gradient_clipping=float(self.gradient_clipping() or 0.0),
                seed=int(os.environ.get("DSR_SEED", "1234")),
                fault_hook=faults.maybe_fire,
            )
        self._init_snapshots(live=live, rejoin=rejoin, faults=faults)
        if self.alive and rejoin:
            self._join()

    def _install_groups(self, groups) -> None:
        """Switch the worker to a new generation's groups."""
        self.groups = groups
        timeout = self.resilience.detector.pg_timeout_s
        self.worker.messenger = Messenger(group=groups.world, timeout_s=timeout)
        self.worker.stage_group = groups.stage
        self.worker.world_group = groups.world
        self.worker.stage_replicas = len(groups.stage)

    def _on_epoch(self, record) -> None:
        """Watcher thread: a new epoch was latched; release whatever the main thread is blocked on.

        A re-join changes nothing for the running iteration: it is applied at the next iteration
        boundary, without aborting anything.
        """
        groups = self.groups
        if groups is not None and record.kind != "rejoin":
            poison(groups.world)
            poison(groups.stage)
        self._snapshots_drop(record.failed)

    # --- planning ------------------------------------------------------------------------------
    def _make_schedule(self, live: bool) -> Schedule:
        """The schedule for the current failure set, computed on rank 0 and broadcast.

        Rank 0 also draws the session id that names this engine's process groups.
        """
        payload = [None, None]
        if dist.get_rank() == 0:
            payload = [self._plan_for(self.current).to_text(), "live" if live else uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(payload, src=0)
        self.session = payload[1]
        return Schedule.from_text(payload[0])

    def _plan_for(self, topology: Topology) -> Schedule:
        """Fault-free schedule, or the planner's for ``topology``'s failed set.

        Under the live agent every survivor plans for itself, so the solver is the heuristic:
        deterministic, identical on every survivor, and milliseconds.
        """
        cfg = self.resilience
        cost = cfg.cost()
        if not topology.failed:
            return generate(cfg.schedule, self.topology.dp, self.topology.pp, self.micro_batches, cost)
        result = plan_failure(
            self.topology.dp,
            self.topology.pp,
            self.micro_batches,
            topology.failed,
            cost=cost,
            variant=cfg.variant,
            solver="heuristic" if self.coordinator is not None else cfg.planner.solver,
            time_limit_s=cfg.planner.time_limit_s,
            memory_cap=cfg.planner.memory_cap,
        )
        self.plan_figures = result.to_dict(with_schedule=False)
        return result.schedule

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.workers[self.my_index]

    def _train_schedule(self):
        forwards = sum(1 for a in self.actions if a.kind is ActionKind.F)
        return ActionSchedule(self.actions, self.micro_batches, self.num_stages, self.stage_id, forwards)

    # --- the optimizer step of one stage ---------------------------------------------------------
    def _stage_step(self) -> None:
        self._snapshot_before_step()
        self._before_optimizer_step()
        self._force_grad_boundary = True
        self.optimizer.step()
        self.zero_grad()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._force_grad_boundary = False
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._capture()

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
                if self.coordinator is None or not is_failure(exc):
                    raise
                self._recover(exc)

    def _train_iteration(self):
        started = time.perf_counter()
        self.worker.begin_iteration(self.global_steps)
        self._begin_actions()
        self._exec_schedule(self._train_schedule())
        self.worker.end_iteration()
        stats = self.worker.stats
        loss = self._aggregate_loss(stats.loss_sum)
        elapsed = time.perf_counter() - started
        self._end_iteration_snapshots(elapsed)
        self.iteration_log.append(
            {"step": self.global_steps, "loss": float(loss), "seconds": elapsed, "rerouted": stats.rerouted, "forwards": stats.forwards}
        )
        self.agg_train_loss = loss.float()
        return self.agg_train_loss

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
            self.groups.stage.all_reduce(total)
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

    def _exec_action(self, action: Action) -> None:
        self._run_action(action)

    _exec_ir_forward = _exec_ir_backward_input = _exec_ir_backward_weight = _exec_ir_backward_fused = _exec_action
    _exec_ir_send_activation = _exec_ir_recv_activation = _exec_ir_send_grad = _exec_ir_recv_grad = _exec_action
    _exec_ir_reduce_grads = _exec_ir_optimizer_step = _exec_action

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ForwardMicroBatch: _exec_ir_forward,
        BackwardInput: _exec_ir_backward_input,
        BackwardWeight: _exec_ir_backward_weight,
        BackwardFused: _exec_ir_backward_fused,
        SendActivationTo: _exec_ir_send_activation,
        RecvActivationFrom: _exec_ir_recv_activation,
        SendGradTo: _exec_ir_send_grad,
        RecvGradFrom: _exec_ir_recv_grad,
        ReduceStageGrads: _exec_ir_reduce_grads,
        StageOptimizerStep: _exec_ir_optimizer_step,
    }


def init_distributed() -> None:
    """Initialize torch.distributed for a worker (call it where you would call ``deepspeed.init_distributed``).

    Under the deepspeed launcher or the agent it is gloo over the environment's rendezvous.
    A worker the agent restarts to re-join (``DSR_REJOIN=1``) cannot enter the original world's
    collectives, so its default group is torch's no-op "fake" backend: DeepSpeed builds its
    engine locally, and all real communication goes through ds_resilience's own groups on the
    agent's store.
    """
    import deepspeed
    import torch.distributed as tdist

    if os.environ.get("DSR_REJOIN") == "1" and not tdist.is_initialized():
        import torch.testing._internal.distributed.fake_pg as fake_pg

        tdist.init_process_group(
            "fake", store=fake_pg.FakeStore(), rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
        )
    deepspeed.init_distributed(dist_backend="gloo")


def _split_config(config: Any) -> tuple[dict[str, Any], ResilienceConfig, Path | None]:
    """Load the DeepSpeed config, parse and remove its ``"resilience"`` section."""
    base_dir = None
    if isinstance(config, (str, Path)):
        path = Path(config)
        base_dir = path.resolve().parent
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(str(path), "DeepSpeed config file does not exist") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(str(path), f"not valid JSON: {exc}") from None
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise ConfigError("config", f"expected a path or a dict, got {type(config).__name__}")
    resilience = load_resilience_config(data)
    data.pop("resilience", None)
    for key in ("fp16", "bf16"):
        if isinstance(data.get(key), dict) and data[key].get("enabled"):
            raise ConfigError(key, "the resilient engine trains in fp32/fp64 only for now; set enabled: false")
    zero = data.get("zero_optimization", {})
    if isinstance(zero, dict) and int(zero.get("stage", 0)) > 0:
        raise ConfigError("zero_optimization.stage", f"{zero.get('stage')}: only stage 0 is supported with the resilient engine")
    return data, resilience, base_dir


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
    *,
    batch_source: BatchSource | None = None,
):
    """``deepspeed.initialize`` for a ``PipelineModule``, returning a :class:`ResilientPipelineEngine`.

    Same arguments and return value ``(engine, optimizer, training_dataloader, lr_scheduler)``;
    the config's ``"resilience"`` section is validated here (a :class:`ConfigError` names the key)
    and removed before DeepSpeed sees the rest.
    """
    from deepspeed import comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfig

    if config is None:
        config = config_params
    if config is None and args is not None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        args.deepspeed_config = None
    if config is None:
        raise ConfigError("deepspeed_config", "no DeepSpeed config given (pass config= or --deepspeed_config)")
    ds_config, resilience, base_dir = _split_config(config)
    if resilience.cost_model is not None and isinstance(resilience.cost_model, str) and base_dir is not None:
        resilience.cost(base_dir)  # fail early on a bad path
    if not isinstance(model, PipelineModule):
        raise ConfigError("model", f"ds_resilience needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}")
    if mpu is not None:
        raise ConfigError("mpu", "must be None with pipeline parallelism")
    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(), dist_init_required=dist_init_required)
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    engine = ResilientPipelineEngine(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        config_class=config_class,
        resilience=resilience,
        batch_source=batch_source,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
