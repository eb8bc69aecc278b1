"""What the runtime sees of a DeepSpeed pipeline engine: its stage, and its data.

:class:`DeepSpeedStage` is the stage (``checkpoint.state.StageHost``): parameters, optimizer,
scheduler, step counters, and DeepSpeed's optimizer step for this stage alone.
:class:`IteratorSource` (a DeepSpeed-style data iterator as a batch source) now lives in
``ds_data`` with the other data sources; it is re-exported here.
:func:`activation_checkpointing` reads a ``PipelineModule``'s checkpointing settings and
:func:`tied_layout` its tied modules.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.pipe.engine import PipelineEngine

from ..errors import ConfigError
from .ds_data import IteratorSource
from .ds_fused_adam import align_bias_correction

__all__ = ["DeepSpeedStage", "IteratorSource", "activation_checkpointing", "param_layers", "tied_layout"]


def param_layers(module: Any) -> list[int] | None:
    """The model layer of each trainable parameter of a ``PipelineModule``'s stage, in
    ``module.parameters()`` order (DeepSpeed registers layer ``i`` as the submodule ``"i"``).

    A tied module (``TiedLayerSpec``, registered once per stage as ``tied_modules.<key>``) is the
    stage's lowest layer of its key: a re-grid moves it with that layer, and a new stage takes it
    from whichever of its layers of that key comes first (every copy is kept equal by DeepSpeed's
    tied-gradient reduction). ``None`` when a parameter belongs to no layer of the stage."""
    from deepspeed.pipe import TiedLayerSpec

    specs = list(getattr(module, "_layer_specs", ()))
    start = getattr(module, "_local_start", 0)
    stop = getattr(module, "_local_stop", None)
    stop = len(specs) if stop is None else stop
    tied_layer: dict[str, int] = {}
    for i in range(start, stop):
        if i < len(specs) and isinstance(specs[i], TiedLayerSpec):
            tied_layer.setdefault(specs[i].key, i)
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        head = name.split(".", 1)[0]
        if head.isdigit():
            out.append(int(head))
            continue
        key = next((k for k in tied_layer if head == "tied_modules" and name.startswith(f"tied_modules.{k}.")), None)
        if key is None:
            return None
        out.append(tied_layer[key])
    return out


class DeepSpeedStage:
    """The stage of a DeepSpeed pipeline engine as the runtime sees it (``checkpoint.state.StageHost``)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.parameters = [p for p in engine.module.parameters() if p.requires_grad]
        self.param_layers = param_layers(engine.module)
        self.grad_norm = lambda: None  # the executor's global norm of this step (set by the engine)

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def optimizer_order(self) -> list[int] | None:
        """Optimizer parameter index (group after group) -> this stage's parameter position (module
        order), when they differ (a caller's optimizer with several groups); ``None`` when they are
        the same, without ZeRO-1 (its shards carry their own layout: :attr:`zero_groups`)."""
        if "_optimizer_order" not in vars(self):
            from .ds_optimizer import sharded_of

            optimizer, order = self.engine.optimizer, None
            if optimizer is not None and sharded_of(optimizer) is None:
                masters = getattr(optimizer, "masters", None)
                ids = [id(m) for m in masters] if masters is not None else [id(p) for p in self.parameters]
                position = {i: k for k, i in enumerate(ids)}
                flat = [position.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
                if None not in flat and flat != list(range(len(flat))):
                    order = flat
            self._optimizer_order = order
        return self._optimizer_order

    @property
    def zero_groups(self) -> list[list[int]] | None:
        """ZeRO-1: each parameter group's stage parameter indices in the order its shards flatten
        them (``ds_regrid_zero.zero_groups``; a snapshot records it); ``None`` without ZeRO."""
        cached = getattr(self, "_zero_groups", None)
        if cached is None:
            from .ds_optimizer import sharded_of
            from .ds_regrid_zero import zero_groups

            sharded = sharded_of(self.engine.optimizer)
            if sharded is None:
                return None
            cached = self._zero_groups = zero_groups(sharded, self.engine.optimizer, self.parameters)
        return cached

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def counters(self) -> tuple[int, int]:
        return self.engine.global_steps, self.engine.global_samples

    def set_counters(self, steps: int, samples: int) -> None:
        self.engine.global_steps, self.engine.global_samples = steps, samples

    def step(self, *, zero_grad: bool = True, skip: bool = False) -> None:
        """DeepSpeed's optimizer step for this stage only (gradients already reduced and clipped).

        ``skip``: an fp16 overflow skips the update, as DeepSpeed does (the counters still move, the
        LR scheduler does not); ``zero_grad=False`` keeps the gradients (a speculative step, see
        ``runtime/validation.py``)."""
        e = self.engine
        e._force_grad_boundary = True
        if skip:
            e.skipped_steps += 1
        else:
            align_bias_correction(e.optimizer)  # a process resuming mid-run: DeepSpeed's CPU FusedAdam's powers
            e.optimizer.step()
            if e.lr_scheduler is not None:
                e.lr_scheduler.step()
        if zero_grad:
            self.zero_grad()
        e._force_grad_boundary = False
        e._global_grad_norm = self.grad_norm()
        e.global_steps += 1
        e.global_samples += e.train_batch_size()

    def zero_grad(self) -> None:
        """Every gradient of the stage: the module's and, under mixed precision, the fp32 masters'."""
        self.engine.zero_grad()
        zero = getattr(self.engine.optimizer, "zero_grad", None)
        if zero is not None:
            zero()  # as DeepSpeed calls it: FusedAdam's, FusedLion's and many a client's take no argument


def activation_checkpointing(module: Any) -> tuple[Any, bool]:
    """``(recompute, reentrant)`` for a ``PipelineModule``: the stage's forward without
    checkpointing (``None`` when checkpointing is off) and whether DeepSpeed would use its reentrant
    checkpoint function (it then marks the first stage's floating inputs as requiring grad).

    The executor checkpoints at stage granularity (see ``runtime.executor.Executor``): the forward
    it recomputes in B is the module's own forward with ``activation_checkpoint_interval`` set to 0
    for the call, so neither B nor W ever enters DeepSpeed's checkpoint function.
    """
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    interval = getattr(module, "activation_checkpoint_interval", 0) or 0
    if interval <= 0:
        return None, False
    reentrant = module.activation_checkpoint_func is not ds_checkpointing.non_reentrant_checkpoint

    def forward_without_checkpointing(inputs: Any) -> Any:
        saved = module.activation_checkpoint_interval
        module.activation_checkpoint_interval = 0
        try:
            return module(inputs)
        finally:
            module.activation_checkpoint_interval = saved

    return forward_without_checkpointing, reentrant


def tied_layout(module: Any) -> tuple[tuple[tuple[int, ...], ...], dict[int, list[Any]]]:
    """A ``PipelineModule``'s tied weights as the schedule IR sees them.

    Returns ``(groups, params)``: ``groups`` are the tied groups, each the sorted stages that hold
    one ``TiedLayerSpec`` key (keys on the same stages form one group), in a deterministic order;
    ``params`` maps the index of each group that holds this stage to this stage's copies of the
    group's tied weights (the ``tied_weight_attr`` attributes, as DeepSpeed's ``ReduceTiedGrads``
    reduces them). A key held by one stage only (e.g. ``PP=1``) is no group: nothing to reduce.
    """
    from deepspeed.pipe import TiedLayerSpec

    specs = list(getattr(module, "_layer_specs", ()))
    keys = sorted({s.key for s in specs if isinstance(s, TiedLayerSpec)})
    by_stages: dict[tuple[int, ...], list[str]] = {}
    for key in keys:
        stages = tuple(sorted({module.stage_owner(i) for i, s in enumerate(specs)
                               if isinstance(s, TiedLayerSpec) and s.key == key}))
        if len(stages) >= 2:
            by_stages.setdefault(stages, []).append(key)
    groups = tuple(sorted(by_stages))
    params: dict[int, list[Any]] = {}
    for g, stages in enumerate(groups):
        if module.stage_id not in stages:
            continue
        params[g] = [module._recursive_getattr(module.tied_modules[key], attr)
                     for key in by_stages[stages] for attr in module.tied_weight_attrs[key]]
        params[g] = [p for p in params[g] if p.requires_grad]
    return groups, params


def refuse_unsupported(model_parallel_size: int, module: Any, resilience: Any, micro_batches: int) -> None:
    """What the engine cannot train resiliently, refused at construction with what to do instead."""
    if model_parallel_size != 1:
        raise ConfigError("resilience", "tensor parallelism is not supported yet (model_parallel_size must be 1)")
    if getattr(module, "seed_layers", False):
        raise ConfigError("PipelineModule(seed_layers=True)", "its per-layer seeds count the forwards a worker has "
                          "run, which re-routing and activation recomputation change; ds_resilience seeds every "
                          "micro-batch's forward from (resilience.seed, iteration, pipeline, micro-batch, stage) "
                          "instead: build the module with seed_layers=False")
    if resilience.microbatches is not None and resilience.microbatches != micro_batches:
        raise ConfigError("resilience.microbatches",
                          f"{resilience.microbatches} differs from gradient_accumulation_steps={micro_batches}")


def refuse_unsupported_live(live: bool, zero_stage: int, resilience: Any) -> None:
    """What the engine cannot recover from under the agent."""
    if live and zero_stage == 1 and not resilience.checkpoint.enabled:
        raise ConfigError("resilience.checkpoint.enabled", "false with zero_optimization.stage 1 under the agent: "
                          "a dead replica's optimizer shard comes back from the in-memory snapshots; enable "
                          "them, or use stage 0")
