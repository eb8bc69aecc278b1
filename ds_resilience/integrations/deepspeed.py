"""DeepSpeed integration, the public entry points: :func:`initialize` and :func:`init_distributed`.

``ds_resilience.initialize`` is ``deepspeed.initialize`` for a ``PipelineModule``: it parses and
removes the config's ``"resilience"`` section, reads the agent's launch contract once, and builds a
:class:`~.ds_engine.ResilientPipelineEngine` (see there for how it is composed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import ResilienceConfig, load_resilience_config
from ..errors import ConfigError
from ..launch import LaunchEnv, launch_env
from ..logs import get_logger
from ..runtime.build_locks import guard_build_locks
from ..runtime.coordinator import TrainingOver
from ..runtime.cpu_probe import memoize_cpu_info
from ..runtime.executor import BatchSource
from ..runtime.recovery import BeyondTolerance
from .ds_data import DataIterFactory, planned_tolerance, reroute_data_error, unfed_reason
from .ds_engine import ResilientPipelineEngine
from .ds_instructions import ActionSchedule, IRAction

__all__ = ["ResilientPipelineEngine", "initialize", "init_distributed", "ActionSchedule", "IRAction", "BeyondTolerance"]

log = get_logger(__name__)


def init_distributed(launch: LaunchEnv | None = None) -> None:
    """Initialize torch.distributed for a worker (call it where you would call ``deepspeed.init_distributed``).

    Under the deepspeed launcher or the agent it is gloo over the environment's rendezvous.
    A worker the agent restarts to re-join (``LaunchEnv.rejoin``) cannot enter the original world's
    collectives, so its default group is a local no-op stand-in (``comm/standin.py``): DeepSpeed builds its
    engine locally, and all real communication goes through ds_resilience's own groups on the
    agent's store.
    """
    import deepspeed

    from ..runtime.rejoin_boot import stand_in_default_group

    guard_build_locks()  # the shm comm op's load below
    launch = launch if launch is not None else launch_env()
    if launch is not None and launch.rejoin:
        stand_in_default_group(launch.rank, launch.world_size)
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
    if not resilience.enabled:
        return data, resilience, base_dir
    zero = data.get("zero_optimization", {})
    if isinstance(zero, dict) and int(zero.get("stage", 0)) > 1:
        raise ConfigError("zero_optimization.stage", f"{zero.get('stage')}: the resilient engine supports stages 0 and 1 "
                          f"(1: the optimizer state sharded over a stage's surviving replicas); stages 2 and 3 "
                          f"shard gradients and parameters, which DeepSpeed's pipeline engine does not support either")
    return data, resilience, base_dir


_DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT (checked by a test)


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = _DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    batch_source: BatchSource | None = None,
    eval_source: BatchSource | None = None,
    data_iter_factory: DataIterFactory | None = None,
):
    """``deepspeed.initialize`` for a ``PipelineModule``, returning a :class:`ResilientPipelineEngine`.

    DeepSpeed's parameters in DeepSpeed's order (a test holds them against the installed
    ``deepspeed.initialize``), then ds_resilience's own, keyword-only. Same return value,
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The config's ``"resilience"``
    section is validated here (a :class:`ConfigError` names the key) and removed before DeepSpeed
    sees the rest. With ``"resilience": {"enabled": false}`` this is plain ``deepspeed.initialize``
    (DeepSpeed's own engine, no resilience).

    Args:
        batch_source: ``(pipeline, iteration, microbatch) -> (inputs, labels)``: loads any
            pipeline's micro-batch, which a worker needs when it runs a failed peer's micro-batches
            (first and last stages).
        eval_source: ``(pipeline, step, microbatch) -> (inputs, labels)``: the same for
            ``eval_batch`` (a worker still reads its own pipeline's micro-batches from the
            ``data_iter`` it is given, as in DeepSpeed).
        data_iter_factory: ``(pipeline, iteration) -> iterator`` over pipeline ``pipeline``'s
            micro-batches from iteration ``iteration`` on, in DeepSpeed's order: with
            ``train_batch(data_iter)``, a worker reads its own pipeline from ``data_iter`` and a
            failed peer's from an iterator this makes.

    Without ``batch_source``, a map-style ``training_data`` serves any pipeline's micro-batch with
    DeepSpeed's sampling and batching (``ds_data.DatasetSource``). Where micro-batches may be
    re-routed (under ``ds-resilience run``, or with ``resilience.simulate_failed``), a data path
    that cannot serve a failed peer's micro-batches (none of ``batch_source``, a map-style
    ``training_data``, ``data_iter_factory``) is a :class:`ConfigError` here.
    """
    import deepspeed
    from deepspeed import comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.config import DeepSpeedConfig

    if config is None:
        config = config_params
    if args is not None and getattr(args, "deepspeed_config", None):
        if config is not None:
            raise ConfigError("deepspeed_config", "given both as --deepspeed_config and as config=; pass one")
        config = args.deepspeed_config
        args.deepspeed_config = None
    if config is None:
        raise ConfigError("deepspeed_config", "no DeepSpeed config given (pass config= or --deepspeed_config)")
    ds_config, resilience, base_dir = _split_config(config)
    if not resilience.enabled:
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler,
                                    distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                                    collate_fn=collate_fn, config=ds_config, mesh_param=mesh_param)
    if resilience.cost_model is not None and isinstance(resilience.cost_model, str) and base_dir is not None:
        resilience.cost(base_dir)  # fail early on a bad path
    if not isinstance(model, PipelineModule):
        raise ConfigError("model", f"ds_resilience needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}")
    if mpu is not None:
        raise ConfigError("mpu", "must be None with pipeline parallelism (the PipelineModule carries its topology)")
    if mesh_param is not None:
        raise ConfigError("mesh_param", "a sequence-parallel device mesh is not supported with pipeline parallelism")
    launch = launch_env()  # the agent's contract, read once
    guard_build_locks()  # the optimizer's op, loaded as DeepSpeed builds the engine
    memoize_cpu_info()  # the op's build flags ask py-cpuinfo twice (a subprocess each)
    if launch is not None:  # a pipeline may lose both ends within the tolerance: its data must be addressable
        error = reroute_data_error(training_data, batch_source, data_iter_factory,
                                   unfed=unfed_reason(model.num_stages, planned_tolerance(resilience)))
        if error is not None:
            raise error  # (simulated failures are checked by the engine, which knows the grid)
    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                             distributed_port=distributed_port, dist_init_required=dist_init_required)
    mpu = model.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    deepspeed.set_optimizer_flags(config_class, model)  # as deepspeed.initialize does (Muon flags)
    try:
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
            eval_source=eval_source,
            data_iter_factory=data_iter_factory,
            launch=launch,
            config_dir=base_dir,
            rebuild={"args": args, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "collate_fn": collate_fn,
                     "config": ds_config, "batch_source": batch_source, "eval_source": eval_source,
                     "config_dir": base_dir} if resilience.regrid else None,
        )
    except TrainingOver as over:  # a relaunched worker the survivors finished without
        log.info("%s; exiting", over)
        raise SystemExit(0) from None
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
