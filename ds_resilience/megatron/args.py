"""Megatron argument hooks: the ``extra_args_provider`` and the mapping of a Megatron job's own
arguments onto the resilience config.

Megatron-LM builds one ``argparse`` parser (``allow_abbrev=False``), adds its groups, then calls
``extra_args_provider(parser)``, which must add its own group and return the parser; it parses
the command line (unknown flags are an error unless ``ignore_unknown_args``) and then validates
(``validate_args`` computes ``data_parallel_size`` and the default global batch size). So:

* :func:`add_resilience_args` is such a provider (:func:`with_resilience_args` chains it to a
  provider of the user's own). Every flag defaults to ``None`` ("not given"), so a flag is never
  confused with a value a config file set; values are checked by ``argparse`` at parse time.
* :func:`config_from_args` runs after Megatron's validation and returns a :class:`MegatronJob`:
  the parallel sizes, the batch geometry, precision and clipping Megatron already holds, and the
  :class:`~ds_resilience.config.ResilienceConfig` (from ``--resilience-config``, the same section
  the DeepSpeed path reads, then the flags). A contradiction (a flag against the file, the file
  against Megatron's own arguments) is a :class:`~ds_resilience.errors.ConfigError` naming both.
  What this runtime does not support yet (interleaved schedules, sequence, context and expert
  parallelism, batch-size ramp-up) is rejected here, naming the flag.

Pure Python (argparse and the config layer): importable without torch or megatron.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..argtypes import int_at_least, memory_cap, positive_int
from ..config import CheckpointConfig, PlannerConfig, ResilienceConfig, read_resilience_file
from ..errors import ConfigError
from ..vocab import SCHEDULES, SOLVERS, VARIANT_CHOICES

__all__ = ["FLAGS", "MegatronJob", "add_resilience_args", "config_from_args", "with_resilience_args"]

GROUP_TITLE = "resilience"


@dataclass(frozen=True)
class _Flag:
    flag: str
    key: tuple[str, ...]  # where it goes in the resilience section
    kwargs: dict[str, Any]
    help: str


FLAGS: tuple[_Flag, ...] = (
    _Flag("--resilience-max-failures", ("max_failures",), {"type": int_at_least(0)},
          "plans are precomputed for every set of up to this many failed replicas (a replica is a "
          "tensor-parallel group)"),
    _Flag("--resilience-variant", ("variant",), {"choices": VARIANT_CHOICES},
          "when degraded: re-routing only (adaptive), + decoupled backward, + staggered optimizer "
          "(recycle), or auto (the fastest the cost model predicts); unset: auto with a cost model, "
          "recycle with unit costs"),
    _Flag("--resilience-schedule", ("schedule",), {"choices": SCHEDULES}, "the fault-free schedule"),
    _Flag("--resilience-snapshot-interval", ("checkpoint", "interval"), {"type": positive_int},
          "iterations between in-memory snapshots"),
    _Flag("--resilience-snapshot-replicas", ("checkpoint", "replicas"), {"type": positive_int},
          "copies of each in-memory snapshot, the own one included"),
    _Flag("--resilience-memory-cap", ("planner", "memory_cap"), {"type": memory_cap("--resilience-memory-cap")},
          "memory a worker's micro-batch states may take (a size such as 24GiB, or a number in the "
          "cost model's unit); default: what fault-free 1F1B holds"),
    _Flag("--resilience-solver", ("planner", "solver"), {"choices": SOLVERS}, "the planner's optimizer"),
)
"""The flags beside ``--resilience`` and ``--resilience-config``, with the key each one sets."""


def add_resilience_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: add the ``resilience`` argument group, return the parser."""
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument("--resilience", action="store_true",
                       help="keep training through worker failures (ds_resilience): re-route a failed "
                            "replica's micro-batches, in-memory snapshots, restart from memory")
    group.add_argument("--resilience-config", type=str, default=None, metavar="FILE",
                       help="a JSON file: a DeepSpeed config with a \"resilience\" section, or that "
                            "section alone (the keys of configs/default_resilience.json)")
    for flag in FLAGS:
        group.add_argument(flag.flag, default=None, help=flag.help, **flag.kwargs)
    return parser


def with_resilience_args(provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None
                         ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """An ``extra_args_provider`` that runs ``provider`` (the script's own, or ``None``) and then
    :func:`add_resilience_args`."""

    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
            if parser is None:
                raise TypeError(f"extra_args_provider {getattr(provider, '__name__', provider)!r} returned "
                                f"None; it must return the parser (Megatron-LM's contract)")
        return add_resilience_args(parser)

    return chained


@dataclass(frozen=True)
class MegatronJob:
    """What the resilience runtime takes from a validated Megatron job.

    ``microbatches`` is per pipeline and iteration (``global_batch_size / (micro_batch_size *
    dp)``, Megatron's ``get_num_microbatches()``); a stage replica is a tensor-parallel group of
    ``tp`` ranks, so the planner's grid is ``dp`` pipelines by ``pp`` stages.
    """

    enabled: bool
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    global_batch_size: int
    microbatches: int
    precision: str  # "fp32" | "bf16" | "fp16"
    clip_grad: float  # 0: off (Megatron's --clip-grad 0)
    seed: int
    train_iters: int | None
    distributed_optimizer: bool
    config: ResilienceConfig

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


# flags a Megatron job may carry that this runtime cannot honour yet: (dest, flag, "is set" test, why)
_UNSUPPORTED: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage / "
     "--num-virtual-stages-per-pipeline-rank", lambda v: v is not None and v > 1,
     "interleaved (virtual-stage) schedules are not supported yet; run without virtual stages"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage", lambda v: v is not None,
     "interleaved (virtual-stage) schedules are not supported yet; run without virtual stages"),
    ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank", lambda v: v is not None,
     "interleaved (virtual-stage) schedules are not supported yet; run without virtual stages"),
    ("sequence_parallel", "--sequence-parallel", bool,
     "sequence parallelism changes the tensors between stages; not supported yet"),
    ("context_parallel_size", "--context-parallel-size", lambda v: v is not None and v > 1,
     "context parallelism is not supported yet (a replica would span tensor and context groups)"),
    ("expert_model_parallel_size", "--expert-model-parallel-size", lambda v: v is not None and v > 1,
     "expert parallelism is not supported yet"),
    ("num_experts", "--num-experts", lambda v: v is not None and v > 0,
     "mixture-of-experts layers are not supported yet"),
    ("rampup_batch_size", "--rampup-batch-size", lambda v: v is not None,
     "a batch-size ramp-up is not supported yet: it changes the micro-batch count every few "
     "iterations, and plans are made for a fixed count"),
)


def _need(args: argparse.Namespace, dest: str, flag: str) -> Any:
    if not hasattr(args, dest):
        raise ConfigError(flag, f"args has no {dest!r}: config_from_args reads a Megatron-LM argument "
                                f"namespace after its validation (initialize_megatron / get_args())")
    return getattr(args, dest)


def _lookup(raw: dict[str, Any], key: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = raw
    for part in key:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(config: ResilienceConfig, key: tuple[str, ...], value: Any) -> ResilienceConfig:
    if len(key) == 1:
        return replace(config, **{key[0]: value})
    section = getattr(config, key[0])
    cls = {"checkpoint": CheckpointConfig, "planner": PlannerConfig}[key[0]]
    data = section.to_dict()
    data[key[1]] = value
    return replace(config, **{key[0]: cls.from_dict(data, f"resilience.{key[0]}")})


def config_from_args(args: argparse.Namespace) -> MegatronJob:
    """Map a validated Megatron-LM argument namespace (plus the flags of :func:`add_resilience_args`)
    onto a :class:`MegatronJob`.

    Raises:
        ConfigError: an unsupported Megatron feature (naming its flag), a batch geometry the grid
            cannot hold, or a contradiction between two settings (naming both).
    """
    for dest, flag, is_set, why in _UNSUPPORTED:
        if is_set(getattr(args, dest, None)):
            raise ConfigError(flag, f"{why} (ds_resilience supports tensor, pipeline and data parallelism "
                                    f"with the non-interleaved schedule)")
    tp = int(_need(args, "tensor_model_parallel_size", "--tensor-model-parallel-size"))
    pp = int(_need(args, "pipeline_model_parallel_size", "--pipeline-model-parallel-size"))
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        world = _need(args, "world_size", "--data-parallel-size")
        if world % (tp * pp):
            raise ConfigError("--tensor-model-parallel-size", f"world size {world} is not divisible by tensor "
                                                              f"x pipeline parallel size {tp} x {pp}")
        dp = world // (tp * pp)
    dp = int(dp)
    mbs = _need(args, "micro_batch_size", "--micro-batch-size")
    if mbs is None or int(mbs) < 1:
        raise ConfigError("--micro-batch-size", f"must be set to an integer >= 1, got {mbs!r}")
    mbs = int(mbs)
    gbs = getattr(args, "global_batch_size", None)
    gbs = mbs * dp if gbs is None else int(gbs)  # Megatron's own default
    if gbs % (mbs * dp):
        raise ConfigError("--global-batch-size", f"{gbs} is not divisible by --micro-batch-size {mbs} x the "
                                                 f"data-parallel size {dp}: every pipeline needs the same number "
                                                 f"of micro-batches")
    microbatches = gbs // (mbs * dp)
    bf16, fp16 = bool(getattr(args, "bf16", False)), bool(getattr(args, "fp16", False))
    if bf16 and fp16:
        raise ConfigError("--bf16", "and --fp16 are both set; choose one")
    seed = int(getattr(args, "seed", 1234))

    enabled = bool(getattr(args, "resilience", False))
    path = getattr(args, "resilience_config", None)
    if path is not None:
        config, raw, where = read_resilience_file(path)
        if not enabled and raw.get("enabled", True):
            enabled = True  # naming a config file asks for the plugin
    else:
        config, raw, where = ResilienceConfig(), {}, ""
    for flag in FLAGS:
        value = getattr(args, flag.flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        in_file, current = _lookup(raw, flag.key)
        if in_file and current != value:
            raise ConfigError(flag.flag, f"{value!r} contradicts {'.'.join(('resilience',) + flag.key)} = "
                                         f"{current!r} in {where}; set it in one place")
        config = _set(config, flag.key, value)
    # Megatron's own arguments hold the batch geometry and the seed: the file may repeat them, not change them
    in_file, current = _lookup(raw, ("microbatches",))
    if in_file and current is not None and current != microbatches:
        raise ConfigError("resilience.microbatches", f"{current} in {where} contradicts --global-batch-size {gbs} / "
                                                     f"(--micro-batch-size {mbs} x data-parallel size {dp}) = "
                                                     f"{microbatches} micro-batches per pipeline")
    in_file, current = _lookup(raw, ("seed",))
    if in_file and current != seed:
        raise ConfigError("resilience.seed", f"{current} in {where} contradicts --seed {seed}; the micro-batch "
                                             f"RNG streams derive from Megatron's seed")
    config = replace(config, microbatches=microbatches, seed=seed)
    clip = getattr(args, "clip_grad", 1.0)
    return MegatronJob(
        enabled=enabled and config.enabled, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs,
        microbatches=microbatches, precision="bf16" if bf16 else "fp16" if fp16 else "fp32",
        clip_grad=float(clip) if clip is not None else 0.0, seed=seed,
        train_iters=getattr(args, "train_iters", None),
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)), config=config)
