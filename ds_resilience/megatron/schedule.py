"""The resilient forward-backward for megatron-core model chunks.

:class:`ResilientForwardBackward` is called exactly as megatron-core's ``forward_backward_func``
(``forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
forward_only, ...``; the keywords of megatron-core 0.16 and of Megatron-LM's current training
loop) and runs one iteration of this package's schedule for the rank's stage: fault-free 1F1B or
decoupled B/W, or the planned re-routing of a failed replica's micro-batches. It drives the
package's :class:`~ds_resilience.runtime.executor.Executor`, so the rules that keep the math of
fault-free training hold for Megatron as they do for DeepSpeed: a micro-batch is identified by
(pipeline, index) wherever it runs and its dropout is seeded from (seed, iteration, pipeline,
index, stage); each loss is scaled by ``1 / (dp * num_microbatches)`` (Megatron's
``/ num_microbatches`` and its data-parallel gradient average), gradients are summed over the
stage's surviving replicas and tied embeddings over every holder; clipping uses the global norm.

What the user's code sees is Megatron's contract: ``forward_step_func(data_iterator, model)``
returns ``(output_tensor, loss_func)`` and is called once per micro-batch with an iterator that
yields that micro-batch; a stage other than the first gets its input through
``model.set_input_tensor``; ``loss_func(output_tensor)`` returns ``(loss, logging_dict)`` or
``(loss, num_tokens, logging_dict)`` and is normalised as megatron-core does; the last stage
returns the logging dicts.

Each stage steps its optimizer inside the schedule (the staggered step): wrap the optimizer in
:class:`~ds_resilience.megatron.optimizer.ResilientOptimizer`, whose ``step()`` the training loop
still calls after the forward-backward.

:func:`~ds_resilience.megatron.factory.install` makes ``get_forward_backward_func()`` return it
where Megatron's training loop looks, whatever the import order.

With tensor parallelism every tensor-parallel rank runs the schedule in its *plane* (the ranks of
its tensor-parallel rank): messages go to the same tensor-parallel rank of the next stage, as in
Megatron; gradients are reduced per shard over the stage's surviving replicas; the global norm
sums every shard once (whole-held weights on tensor-parallel rank 0 only); a replica (its whole
tensor-parallel group) fails as one.

Evaluation (``forward_only=True``, :mod:`.evaluation`) runs forward passes only, a failed replica's
re-routed to its stage's survivors, and returns the last stage's logging dicts as megatron-core does.

The call's contract is read in :mod:`.contract`, the chunk in :mod:`.chunk`, the micro-batches in
:mod:`.data`; the plane's groups are built in :mod:`.groups`.

Under ``ds-resilience run`` a rank that dies is handled live (:mod:`.live`): the call that notices
it recovers and replays from the resume iteration; the other ranks of its tensor-parallel group
leave the membership and idle.

megatron-core's activation recompute (``recompute_granularity`` full or selective) is taken over at
stage granularity (:mod:`.recompute`): F keeps the chunk's input, B recomputes the chunk.

Supported today: one model chunk per rank (no interleaving), unwrapped
megatron-core modules (not Megatron's ``DistributedDataParallel``: this schedule reduces the
gradients itself), fp32, and bf16 chunks (``Float16Module``) with fp32 master weights
(:meth:`ResilientOptimizer.with_fp32_masters`: each micro-batch's gradient is accumulated in fp32,
clipped and stepped there, as the DeepSpeed path does) or megatron-core's mixed-precision optimizer.
"""

from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..comm.groups import GenerationGroups
from ..costs import CostModel
from ..errors import ConfigError, ResilienceError
from ..logs import STDOUT, get_logger
from ..planning.provider import ScheduleProvider
from ..launch import launch_env
from ..runtime.executor import Executor, StageSpec
from ..runtime.precision import MixedPrecisionOptimizer
from ..runtime.live_stage import LiveStage, RecoveryHooks, StartMode
from ..runtime.recovery import Generation
from ..topology import Topology, Worker
from .args import MegatronJob
from .chunk import check_unwrapped, tied_weights, unwrap
from .contract import call_arguments, normalised_loss
from .data import Item, MicroBatches
from .evaluation import EvalItems, forward_only
from .grid import PTDPGrid
from .groups import agree_session, plane_groups
from .tp_group import TensorParallelGroup
from .live import EXPORT_FORMAT, PlaneView, describe, restore
from .optimizer import ResilientOptimizer, ResilientScheduler
from .recompute import recompute_switch

__all__ = ["ResilientForwardBackward", "plane_groups", "unwrap"]

log = get_logger(__name__)


@dataclass
class _Runtime:
    """What the first call builds for this rank: its place in the grid and its live stage
    (executor, generation, checkpoint tier and, under the agent, coordinator and recovery)."""

    grid: PTDPGrid
    me: Worker
    model: Any
    live: LiveStage
    tp_rank: int = 0
    losses: list = field(default_factory=list)

    @property
    def executor(self) -> Executor:
        return self.live.executor

    @property
    def topology(self) -> Topology:
        return self.live.generation.topology


class ResilientForwardBackward:
    """megatron-core's ``forward_backward_func``, running this package's schedule.

    Args:
        job: the job (:func:`~ds_resilience.megatron.config_from_args`).
        optimizer: the stage's optimizer wrapped in :class:`ResilientOptimizer`.
        batches: ``batches(pipeline, iteration, microbatch) -> item`` for any pipeline's micro-batch
            (what that pipeline's data iterator would yield); needed where a failure re-routes
            another pipeline's micro-batches to this rank. Without it, the rank reads its own
            pipeline's micro-batches from the ``data_iterator`` Megatron passes, in order.
        simulate_failed: replicas left idle from the start (tests, what-if runs); default: the
            config's ``resilience.simulate_failed``.
        cost: the cost model the planner rates schedules with (default: the config's).
        timeout_s: how long a message or collective may wait.
        eval_batches: ``eval_batches(pipeline, evaluation, microbatch) -> item`` for evaluation
            (``forward_only``) micro-batches re-routed from a failed replica's pipeline.
        scheduler: megatron-core's ``OptimizerParamScheduler`` wrapped in
            :class:`~ds_resilience.megatron.optimizer.ResilientScheduler`: stepped right after each
            update of the stage, and part of every snapshot and rollback.
    """

    def __init__(self, job: MegatronJob, optimizer: ResilientOptimizer, *,
                 batches: Callable[[int, int, int], Any] | None = None, simulate_failed: Iterable[Worker] | None = None,
                 cost: CostModel | None = None, timeout_s: float | None = None,
                 eval_batches: Callable[[int, int, int], Any] | None = None,
                 scheduler: ResilientScheduler | None = None) -> None:
        if not isinstance(optimizer, ResilientOptimizer):
            raise TypeError(f"optimizer must be a ResilientOptimizer (wrap yours: ResilientOptimizer(opt)), got "
                            f"{type(optimizer).__name__}")
        if scheduler is not None and not isinstance(scheduler, ResilientScheduler):
            raise TypeError(f"scheduler must be a ResilientScheduler (wrap yours: ResilientScheduler(sched)), got "
                            f"{type(scheduler).__name__}")
        self.job = job
        self.optimizer = optimizer
        self.scheduler = scheduler
        if scheduler is not None:
            scheduler.increment = job.micro_batch_size * job.microbatches * job.dp  # Megatron's train_step's
        self.batches = batches
        self.simulate_failed = frozenset(job.config.simulate_failed if simulate_failed is None else simulate_failed)
        self.cost = cost or job.config.cost()
        self.timeout_s = timeout_s if timeout_s is not None else job.config.detector.pg_timeout_s
        self.eval_batches = eval_batches
        self.iteration = 0  # the next iteration to run
        self.steps = 0  # optimizer steps this stage took (the tier's counters)
        self.calls = 0  # training calls since the start (or the load)
        self.base = 0  # the iteration the job started from (a loaded checkpoint's)
        self.evaluations = 0
        self.rt: _Runtime | None = None
        self._tp: TensorParallelGroup | None = None  # megatron-core's tensor-parallel group, under the agent
        self._reader: MicroBatches | None = None  # the training micro-batches (built with the runtime)
        self._item: Callable[[int, int, int], Any] | None = None  # the reader now: training's or an evaluation's
        self._forward_step: Callable | None = None
        self._loss_funcs: dict[tuple[int, int], Callable] = {}
        self._switch: Callable | None = None  # megatron-core's activation recompute, switched off per call

    # --- megatron-core's interface ---------------------------------------------------------------
    def __call__(self, **kwargs: Any) -> list:
        model, data, m = call_arguments(kwargs)
        if kwargs.get("forward_only"):
            rt = self.rt if self.rt is not None else self._build(model)
            return self._evaluate(rt, kwargs["forward_step_func"], data, m)
        if m != self.job.microbatches:
            raise ConfigError("--global-batch-size", f"num_microbatches={m} but the job was planned for "
                              f"{self.job.microbatches} micro-batches per pipeline (a batch-size ramp-up?)")
        rt = self.rt if self.rt is not None else self._build(model)
        if model is not rt.model:
            raise ResilienceError("the model passed differs from the one of the first call")
        self._forward_step, self._reader.iterator = kwargs["forward_step_func"], data
        rt.losses = []
        ex = rt.executor
        if ex.groups is None:  # a simulated-failed replica idles: its training loop's step() reports no update
            self.iteration += 1
            self.calls += 1
            self.optimizer._result = (False, None, None)
            return []
        self.calls += 1
        target = self.base + self.calls  # iterations done when this call returns

        def run_to_target() -> bool:
            """The iterations up to ``target`` (after a recovery's rollback: the resume one first);
            ``False``: this rank's replica lost a rank, it idles from now on."""
            if rt.live.retired:
                return False
            self.iteration = self.steps
            while self.iteration < target:
                rt.losses = []
                rt.live.iteration(self.iteration, lambda: rt.executor.run(rt.live.actions), self.cost)
                self.iteration += 1
            return True

        if not rt.live.resilient(run_to_target):
            self.iteration = target
            self.optimizer._result = (False, None, None)
            return []
        self._reader.keep_from(self.iteration - 1)  # one back: a replay
        return rt.losses if ex.is_last else []

    def _step(self, *, zero_grad: bool = True, skip: bool = False) -> None:
        """The executor's step: the optimizer's, and the stage's step count (the tier's counters)."""
        self.optimizer.run_step(zero_grad=zero_grad, skip=skip)
        if self.scheduler is not None and self.optimizer._result[0]:  # train_step: after a successful update
            self.scheduler.run_step()
        self.steps += 1

    def close(self) -> None:
        """The end of training under the agent: the last snapshot committed and replicated, the
        tier's threads and the heartbeats stopped (an exit, not a hang). Runs at interpreter exit
        if the script does not call it; calling it twice is harmless."""
        if self.rt is not None:
            self.rt.live.close()

    def resume(self, model: Any) -> int:
        """Where Megatron-LM loads its checkpoint (``args.iteration = load_checkpoint(...)``): build
        this rank's runtime and return the iteration to start from. A fresh start returns 0 (or
        the iteration :func:`~ds_resilience.megatron.checkpoint.load_checkpoint` set); after the
        agent restarted every worker beyond tolerance, the stage's state comes back from the
        in-memory snapshots here and the newest step they hold is returned."""
        if isinstance(model, (list, tuple)):
            model = model[0]
        if self.rt is None:
            self._build(model)
        elif model is not self.rt.model:
            raise ResilienceError("the model passed differs from the one of the first call")
        return self.iteration

    # --- live recovery's callbacks ------------------------------------------------------------------
    def _adopted(self, generation: Any) -> None:
        """A recovery's new generation (the live stage runs its schedule from now on): logged once."""
        rt = self.rt
        if self._tp is not None:
            self._tp.renew(generation.epoch)
        if dist.get_rank() == min(rt.grid.rank(w, 0) for w in generation.topology.alive_workers()):
            failed = ",".join(sorted(str(w) for w in generation.topology.failed)) or "none"
            log.info("megatron: epoch %s, failed %s: %s %s schedule", generation.epoch, failed, generation.source,
                     generation.schedule.name, extra=STDOUT)

    def _export(self, directory: str, step: int, writer: bool = True) -> None:
        """Beyond tolerance: this stage's shard in Megatron-LM's layout under ``directory``."""
        if writer:
            from .checkpoint import write_shard

            write_shard(directory, step, model=self.rt.model, optimizer=self.optimizer, tp_rank=self.rt.tp_rank,
                        pp_rank=self.rt.me.stage, pp=self.job.pp)

    def _evaluate(self, rt: _Runtime, forward_step: Callable, data: Iterator | None, microbatches: int) -> list:
        """Megatron's evaluation (``forward_only=True``, :mod:`.evaluation`): the last stage returns
        the loss functions' logging dicts."""
        ex = rt.executor
        rt.losses = []
        if ex.groups is None:
            return []
        item = EvalItems(rt.me.pipeline, data, self.eval_batches, self.evaluations)
        self._item = item  # the stages read evaluation data meanwhile
        self._forward_step = forward_step
        try:
            forward_only(ex, rt.topology, rt.me, microbatches, item, self._switch)
        finally:
            self._item = self._reader.item  # the training reader again
            self.evaluations += 1
        return rt.losses if ex.is_last else []

    # --- construction -----------------------------------------------------------------------------
    def _build(self, model: Any) -> _Runtime:
        job = self.job
        grid = PTDPGrid(tp=job.tp, pp=job.pp, dp=job.dp)
        if not dist.is_initialized() or dist.get_world_size() != grid.world_size:
            raise ResilienceError(f"torch.distributed must be initialized with {grid.world_size} ranks "
                                  f"(tp x pp x dp = {job.tp} x {job.pp} x {job.dp})")
        check_unwrapped(model)
        me, tp_rank = grid.coord(dist.get_rank())
        topology = grid.topology()
        params = [p for p in model.parameters() if p.requires_grad]
        tied_groups, tied_params = tied_weights(model, me.stage, job.pp)
        self._switch = recompute_switch(model)  # megatron-core's recompute: done at stage granularity here
        cfg = job.config
        launch = launch_env()
        failed = self.simulate_failed
        mode = StartMode.of(launch, simulated=bool(failed))
        rank = dist.get_rank()
        provider = ScheduleProvider.build(
            topology, job.microbatches, self.cost, schedule=cfg.schedule, variant=cfg.variant_for(self.cost),
            solver="heuristic",
            time_limit_s=cfg.planner.time_limit_s, memory_cap=cfg.planner.memory_cap,
            max_failures=cfg.max_failures if mode.live else 0, all_coverable=False, cache_dir=None,
            workers=1, tied=tied_groups)
        choice = provider.schedule_for(failed)  # the heuristic: every rank computes the same plan
        session = "live-megatron" if mode.live else agree_session(self.timeout_s)
        # under the agent: heartbeats, epochs, hang detection, snapshots, rollback, recovery
        live = LiveStage(describe(self, mode, launch, me=me, rank=rank, topology=topology, params=params, grid=grid,
                                  session=session))
        alive = me not in failed
        device = params[0].device if params else torch.device("cpu")
        on_gpu = device.type == "cuda"
        spec = StageSpec(stage=me.stage, pipeline=me.pipeline, num_stages=job.pp, dp=job.dp,
                         microbatches=job.microbatches, seed=job.seed, gradient_clipping=job.clip_grad,
                         timeout_s=self.timeout_s, device=str(device) if on_gpu else "cpu")
        inner = self.optimizer.optimizer
        precision = inner if isinstance(inner, MixedPrecisionOptimizer) else None  # fp32 masters: accumulate there
        if job.precision == "fp16" and precision is not None:
            raise ConfigError("--fp16", "fp16 needs dynamic loss scaling with a global overflow decision, which the "
                                        "resilient Megatron schedule does not run yet; use --bf16")
        if job.precision != "fp32" and precision is None and not self.optimizer.megatron:
            raise ConfigError("--bf16" if job.precision == "bf16" else "--fp16",
                              f"{job.precision} parameters with a plain optimizer would accumulate gradients and step in "
                              f"{job.precision}; give ResilientOptimizer.with_fp32_masters(optimizer, model) (fp32 "
                              f"master weights and gradient accumulation) or megatron-core's mixed-precision optimizer")
        self._reader = MicroBatches(self.batches, me.pipeline)
        self._item = self._reader.item
        executor = Executor(
            spec, module=model, parameters=params, loss_fn=self._loss, batch_source=self._reader.batch,
            rank_of=lambda i: grid.rank(topology.worker(i), tp_rank), step=self._step,
            forward_fn=self._forward, tied=tied_params,
            recompute=self._recompute if self._switch is not None else None, precision=precision,
            hooks=live.tier, fault_hook=live.faults.maybe_fire,
            counted_tied=[g for g, stages in enumerate(tied_groups) if stages[0] == me.stage],
            # a weight every tensor-parallel rank holds whole (norms, row-parallel biases) counts once
            counted_param=lambda p: tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False)))
        self.optimizer.grad_norm = lambda: executor.last_grad_norm
        store = live.coordinator.store if live.coordinator is not None else None

        def groups_for(target: Topology, generation: int) -> GenerationGroups:
            return plane_groups(grid, target, me, tp_rank, session=session, timeout_s=self.timeout_s, tied=tied_groups,
                                generation=generation, device=device if on_gpu else None, store=store)

        live.attach(executor, provider, RecoveryHooks(
            export=self._export, export_format=EXPORT_FORMAT, adopted=self._adopted, view=PlaneView(grid, topology, rank),
            groups_for=groups_for))
        self.rt = _Runtime(grid=grid, me=me, model=model, live=live, tp_rank=tp_rank)
        if mode.live and job.tp > 1:  # megatron-core's own group: released by an epoch, renewed after it
            self._tp = TensorParallelGroup(model, grid.replica(me), live.coordinator, session=session,
                                           timeout_s=self.timeout_s)
            live.releases.append(self._tp.release)
        live.begin(Generation(epoch=0, topology=topology.without(failed), schedule=choice.schedule, source=choice.source,
                              lookup_s=choice.seconds, figures=choice.figures,
                              groups=groups_for(topology.without(failed), 0) if alive else None))
        if mode.live:
            atexit.register(_close_at_exit, weakref.ref(self))
        restored = live.start(restore=lambda: restore(self, live, grid))
        if restored is not None:
            live.recovery.log.append(restored)
            if rank == 0:
                log.info("megatron: restart %s: restored step %s from the in-memory snapshots (sources %s, %.2f s)",
                         launch.restart, restored["resume_step"], restored["sources"], restored["recovery_s"],
                         extra=STDOUT)
        if rank == 0:
            what = ",".join(sorted(str(w) for w in failed)) or "none"
            log.info("megatron: %s x %s replicas, failed %s: %s %s schedule", job.dp, job.pp, what, choice.source,
                     choice.schedule.name, extra=STDOUT)
        return self.rt

    # --- what the executor calls ----------------------------------------------------------------
    def _forward(self, arg: Any) -> Any:
        pipeline, iteration, microbatch = self.rt.executor.current
        if isinstance(arg, Item):
            item, input_tensor = arg.item, None
        else:
            item, input_tensor = self._item(pipeline, iteration, microbatch), arg
        model = self.rt.model
        model.set_input_tensor(input_tensor)
        output, loss_func = self._forward_step(iter([item]), model)
        if self.rt.executor.is_last:
            self._loss_funcs[(pipeline, microbatch)] = loss_func
        return output

    def _recompute(self, arg: Any) -> Any:
        """Activation recompute (:mod:`.recompute`): the chunk's plain forward, run without a graph
        in F and again, with one, in B."""
        with self._switch():
            return self._forward(arg)

    def _loss(self, output: Any, _labels: Any) -> torch.Tensor:
        pipeline, _, microbatch = self.rt.executor.current
        loss_func = self._loss_funcs.pop((pipeline, microbatch))
        loss, reduced = normalised_loss(loss_func(output))
        if self._switch is None or not torch.is_grad_enabled():  # B's recomputation (with a graph) logs nothing
            self.rt.losses.append(reduced)
        return loss


def _close_at_exit(ref: "weakref.ref[ResilientForwardBackward]") -> None:
    fb = ref()
    if fb is not None:
        fb.close()
