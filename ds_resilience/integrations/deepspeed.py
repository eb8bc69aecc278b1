"""DeepSpeed integration, the public entry points: :func:`initialize` and :func:`init_distributed`.

``ds_resilience.initialize`` is ``deepspeed.initialize`` for a ``PipelineModule``: it parses and
removes the config's ``"resilience"`` section, reads the agent's launch contract once, and builds a
:class:`~.ds_engine.ResilientPipelineEngine` (see there for how it is composed).

What ``deepspeed.initialize`` (0.19.8) does around its engine, ours does too: the version line, the
deprecated ``--deepscale_config``, the config read as DeepSpeed reads it (hjson, base64),
``zero.Init``'s wrappers taken off while the engine is built and put back after
(``shutdown_init_context`` / ``restore_init_context``), ``set_optimizer_flags`` (Muon's parameter
tags), AutoTP's training mode, and the Python GC policy (``disable_python_gc``). What it would do
that this engine cannot is refused by name: a ``DualPipeVModule`` (DeepSpeed builds a
``DualPipeVEngine`` for it), parameters ``zero.Init`` partitioned, and tensor parallelism through
AutoTP (``tensor_parallel.autotp_size`` or ``deepspeed.tp_model_init`` above 1). README, "Switching
from ``deepspeed.initialize``", lists the rest.
"""

from __future__ import annotations

import base64
import binascii
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config import ResilienceConfig, load_resilience_config
from ..errors import ConfigError
from ..launch import LaunchEnv, launch_env
from ..runtime.coordinator import TrainingOver
from ..runtime.executor import BatchSource
from ..runtime.recovery import BeyondTolerance
from .ds_data import DataIterFactory, reroute_data_error, unfed_reason
from .ds_engine import ResilientPipelineEngine
from .ds_instructions import ActionSchedule, IRAction

__all__ = ["ResilientPipelineEngine", "initialize", "init_distributed", "ActionSchedule", "IRAction", "BeyondTolerance"]


def init_distributed(launch: LaunchEnv | None = None) -> None:
    """Initialize torch.distributed for a worker (call it where you would call ``deepspeed.init_distributed``).

    Under the deepspeed launcher or the agent it is gloo over the environment's rendezvous.
    A worker the agent restarts to re-join (``LaunchEnv.rejoin``) cannot enter the original world's
    collectives, so its default group is torch's no-op "fake" backend: DeepSpeed builds its
    engine locally, and all real communication goes through ds_resilience's own groups on the
    agent's store.
    """
    import deepspeed
    import torch.distributed as tdist

    launch = launch if launch is not None else launch_env()
    if launch is not None and launch.rejoin and not tdist.is_initialized():
        import torch.testing._internal.distributed.fake_pg as fake_pg

        tdist.init_process_group("fake", store=fake_pg.FakeStore(), rank=launch.rank, world_size=launch.world_size)
    deepspeed.init_distributed(dist_backend="gloo")


def _load_config(config: Any) -> tuple[dict[str, Any], Path | None]:
    """The DeepSpeed config as ``deepspeed.initialize`` reads it (``load_ds_config``,
    ``DeepSpeedConfig``): a dict (copied); a file, read as hjson (JSON, or JSON with comments and
    unquoted keys; a duplicate key is an error); or a string holding the config base64-encoded.
    Returns the config and the directory of its file (``None`` otherwise)."""
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    if isinstance(config, dict):
        return dict(config), None
    if not isinstance(config, (str, Path)):
        raise ConfigError("config", f"expected a path or a dict, got {type(config).__name__}")
    path = Path(config)
    if path.is_file():
        try:
            data = hjson.loads(path.read_text(encoding="utf-8"), object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except (ValueError, UnicodeDecodeError) as exc:  # hjson's errors, a duplicate key
            raise ConfigError(str(path), f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(str(path), f"a DeepSpeed config must be a JSON object, got {type(data).__name__}")
        return dict(data), path.resolve().parent
    data = None
    if isinstance(config, str):  # DeepSpeed's other form: the config itself, base64-encoded
        try:
            data = hjson.loads(base64.urlsafe_b64decode(config).decode("utf-8"),
                               object_pairs_hook=dict_raise_error_on_duplicate_keys)
        except (ValueError, UnicodeDecodeError, binascii.Error):
            data = None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "DeepSpeed config file does not exist (nor is it a base64-encoded config)")
    return dict(data), None


def _split_config(config: Any) -> tuple[dict[str, Any], ResilienceConfig, Path | None]:
    """Load the DeepSpeed config, parse and remove its ``"resilience"`` section."""
    data, base_dir = _load_config(config)
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


def _check_model(model: Any, ds_config: dict[str, Any]) -> int:
    """Refuse what ``deepspeed.initialize`` would build for ``model`` but this engine cannot run;
    returns the AutoTP size (0 or 1) DeepSpeed would set the training mode for."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.tensor_parallel import init_utils

    if not isinstance(model, PipelineModule):
        raise ConfigError("model", f"ds_resilience needs a deepspeed.pipe.PipelineModule, got {type(model).__name__}")
    try:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
    except ImportError:  # pragma: no cover - a DeepSpeed before DualPipeV
        DualPipeVModule = ()
    if isinstance(model, DualPipeVModule):
        raise ConfigError("model", "a DualPipeVModule (deepspeed.initialize builds a DualPipeVEngine for it): each "
                          "rank holds two stages in a V, which the planner's schedules do not place (they put one "
                          "stage per pipeline rank); use a PipelineModule, or \"resilience\": {\"enabled\": false} "
                          "for DeepSpeed's own DualPipeVEngine")
    partitioned = [name for name, p in model.named_parameters() if hasattr(p, "ds_id")]
    if partitioned:
        raise ConfigError("model", f"{len(partitioned)} parameters (first {partitioned[0]!r}) are partitioned by "
                          f"deepspeed.zero.Init (ZeRO-3), which pipelines do not support; build the PipelineModule "
                          f"outside zero.Init")
    section = ds_config.get("tensor_parallel") or {}
    size = int(section.get("autotp_size") or 0) if isinstance(section, dict) else 0
    recorded = init_utils._TP_MODEL_INIT_ARGS  # what deepspeed.tp_model_init recorded, merged into the config
    if recorded is not None and not size:
        size = int(recorded.get("tp_size") or 0)
    if size > 1:
        raise ConfigError("tensor_parallel.autotp_size", f"{size}: the resilient DeepSpeed engine has no tensor "
                          f"parallelism (AutoTP or deepspeed.tp_model_init); the Megatron path has it")
    return size


@contextmanager
def _without_zero_init():
    """``zero.Init``'s wrappers off while the engine is built, back on after, as
    ``deepspeed.initialize`` does (``shutdown_init_context`` / ``restore_init_context``): modules
    and tensors made while building (the optimizer's, the engine's buffers) are not partitioned."""
    from deepspeed.runtime.zero import partition_parameters

    partition_parameters.shutdown_init_context()
    try:
        yield
    finally:  # back on also when the build fails, for the user's next module
        partition_parameters.restore_init_context()


@contextmanager
def _config_in_args_lent(args: Any):
    """``args.deepspeed_config`` set aside while ``config`` carries the loaded dict (DeepSpeed
    refuses both), then put back: the caller's ``args`` keep the path it gave, as with
    ``deepspeed.initialize``."""
    if args is None or getattr(args, "deepspeed_config", None) is None:
        yield
        return
    given = args.deepspeed_config
    args.deepspeed_config = None
    try:
        yield
    finally:
        args.deepspeed_config = given


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
    from deepspeed.module_inject import set_autotp_mode
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import log_dist, logger

    if config is None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:  # as deepspeed.initialize: the deprecated name
        logger.warning("************ --deepscale_config is deprecated, please use --deepspeed_config ************")
        if getattr(args, "deepspeed_config", None) is not None:
            raise ConfigError("deepscale_config", "given with --deepspeed_config; pass one")
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise ConfigError("deepspeed_config", "given both as --deepspeed_config and as config=; pass one")
        config = args.deepspeed_config
    if config is None:
        raise ConfigError("deepspeed_config", "no DeepSpeed config given (pass config= or --deepspeed_config)")
    ds_config, resilience, base_dir = _split_config(config)
    if not resilience.enabled:
        with _config_in_args_lent(args):
            return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                        training_data=training_data, lr_scheduler=lr_scheduler,
                                        distributed_port=distributed_port, mpu=mpu,
                                        dist_init_required=dist_init_required, collate_fn=collate_fn,
                                        config=ds_config, mesh_param=mesh_param)
    log_dist(f"DeepSpeed info: version={deepspeed.__version__}, git-hash={deepspeed.__git_hash__}, "
             f"git-branch={deepspeed.__git_branch__} (ds_resilience engine)", ranks=[0])
    if resilience.cost_model is not None and isinstance(resilience.cost_model, str) and base_dir is not None:
        resilience.cost(base_dir)  # fail early on a bad path
    autotp_size = _check_model(model, ds_config)
    if mpu is not None:
        raise ConfigError("mpu", "must be None with pipeline parallelism (the PipelineModule carries its topology)")
    if mesh_param is not None:
        raise ConfigError("mesh_param", "a sequence-parallel device mesh is not supported with pipeline parallelism")
    launch = launch_env()  # the agent's contract, read once
    if launch is not None:  # a pipeline may lose both ends within the tolerance: its data must be addressable
        tolerance = max(resilience.max_failures, 2) if resilience.planner.all_coverable else resilience.max_failures
        error = reroute_data_error(training_data, batch_source, data_iter_factory,
                                   unfed=unfed_reason(model.num_stages, tolerance))
        if error is not None:
            raise error  # (simulated failures are checked by the engine, which knows the grid)
    with _without_zero_init():
        ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                 distributed_port=distributed_port, dist_init_required=dist_init_required)
        if autotp_size > 0:
            set_autotp_mode(training=True)  # as deepspeed.initialize (a size of 1: no sharding, refused above 1)
        mpu = model.mpu()
        config_class = DeepSpeedConfig(ds_config, mpu)
        deepspeed.set_optimizer_flags(config_class, model)  # as deepspeed.initialize does (Muon's use_muon tags)
        try:
            with _config_in_args_lent(args):
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
                    rebuild={"args": args, "optimizer": optimizer, "lr_scheduler": lr_scheduler,
                             "collate_fn": collate_fn, "config": ds_config, "batch_source": batch_source,
                             "eval_source": eval_source, "config_dir": base_dir} if resilience.regrid else None,
                )
        except TrainingOver as over:  # a relaunched worker the survivors finished without
            print(f"[ds_resilience] {over}; exiting", file=sys.stderr, flush=True)
            raise SystemExit(0) from None
    engine._configure_python_gc()  # as deepspeed.initialize: "disable_python_gc" turns automatic GC off
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
