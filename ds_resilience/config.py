"""The ``"resilience"`` section of a DeepSpeed JSON config, parsed into frozen dataclasses.

Strict: an unknown key, a value of the wrong type (``true`` is not an integer; an integer is a
number) or out of range raises :class:`~ds_resilience.errors.ConfigError` naming the full key path,
the value and what is allowed. Each field declares its type and constraints once, in its
``dataclasses.field`` metadata; one walker (``_parse``) and one checker (``_coerce``) enforce them.
Pure Python: no torch.

Keys (under ``"resilience"``), defaults in brackets::

    enabled                         bool                                  [true]
    schedule                        "1f1b" | "decoupled"                  ["1f1b"]
    variant                         "adaptive" | "decoupled" | "recycle" | "auto" | null
                                    [null: auto with measured or given costs, recycle with unit costs]
    max_failures                    int >= 0                              [1]
    microbatches                    int >= 1 | null                       [null]
    seed                            int >= 0                              [1234]
    clipping                        "speculative" | "barrier"             ["speculative"]
    simulate_failed                 list of "p:s" strings, no duplicates  [[]]
    cost_model                      null | "unit" | path (string) | object  [null: profiled at start]
                                    (a path to what `ds-resilience profile` wrote)
    profile_steps                   int >= 0 | null (with cost_model null)   [null: 2; 0 = unit costs]
    profile_out                     string | null                         [null]
    planner.solver                  "heuristic" | "cpsat"                 ["cpsat"]
    planner.time_limit_s            number > 0                            [10.0]
    planner.cache_dir               string                                [".plan_cache"]
    planner.workers                 int >= 0 (0 = cpu count)              [0]
    planner.memory_cap              number > 0 | size ("24GiB") | null    [null: 1F1B's peak]
    planner.all_coverable           bool                                  [false]
    detector.heartbeat_interval_s   number > 0                            [0.5]
    detector.heartbeat_timeout_s    number > heartbeat_interval_s         [5.0]
    detector.store_timeout_s        number > 0                            [30.0]
    detector.pg_timeout_s           number > 0                            [60.0]
    detector.stall_timeout_s        number > 0 | null                     [300.0]
    detector.straggler_window       int >= 2                              [5]
    detector.straggler_margin       number > 0                            [0.3]
    detector.straggler_hold         int >= 0                              [20]
    detector.straggler_replan       bool | null                           [null: true]
    fault_injection                 list of objects, each with all of:    [[]]
    fault_injection[].rank          int >= 0
    fault_injection[].step          int >= 0
    fault_injection[].point         "before_forward" | "mid_backward" | "in_reduce" | "in_optimizer" |
                                    "in_recovery" | "in_snapshot" | "in_rejoin"
    fault_injection[].kind          "exit" | "sigkill" | "hang" | "stall" | "lose_machine" | "delay" | "slow"
    fault_injection[].speed         number in (0, 1] (kind slow)          [null]
    fault_injection[].steps         int >= 1 (kind slow)                  [null]
    fast_w                          bool                                  [true]
    checkpoint.enabled              bool                                  [true]
    checkpoint.interval             int >= 1                              [1]
    checkpoint.replicas             int >= 1                              [2]
    checkpoint.gpu_buffer_mb        int >= 1                              [128]
    checkpoint.num_sub_buffers      int >= 1                              [4]
    checkpoint.persistent_interval  int >= 1                              [100]
    checkpoint.persistent_dir       string | null                         [null]
    checkpoint.keep_last            int >= 1                              [2]
    checkpoint.stall_budget         number in (0, 1]                      [0.02]
    checkpoint.ranks_per_machine    int >= 1 | null                       [null]
    checkpoint.host_dir             string | null                         [null]
    checkpoint.chunk_mb             number > 0                            [4.0]
    checkpoint.interface            string | null                         [null: gloo's default]
    checkpoint.interleave           bool                                  [true]
    checkpoint.idle_fraction        number in (0, 1]                      [0.8]
    checkpoint.max_restarts         int >= 0                              [3]
    regrid                          bool                                  [false]
    grow_back                       bool                                  [true]

``configs/default_resilience.json`` is a complete CPU DeepSpeed config with every key at its default.
A dataclass built directly in Python is checked the same way; its error paths are then relative to
the section (``max_failures`` rather than ``resilience.max_failures``).
"""

from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from .costs import CostModel, parse_size
from .errors import ConfigError, CostModelError, TopologyError
from .topology import Worker, format_worker, parse_worker
from .vocab import FAULT_KINDS, FAULT_POINTS, SCHEDULES, SOLVERS, VARIANT_CHOICES, VARIANTS

__all__ = [
    "ResilienceConfig", "PlannerConfig", "DetectorConfig", "FaultInjection", "CheckpointConfig",
    "load_resilience_config", "load_resilience_file", "read_resilience_file", "SCHEDULES", "VARIANTS", "SOLVERS", "FAULT_POINTS", "FAULT_KINDS",
]

UNIT_COSTS = "unit"
"""``resilience.cost_model: "unit"``: unit costs, no profile."""
DEFAULT_PROFILE_STEPS = 2
"""Fused and decoupled iterations the engine profiles at start when no cost model is given."""

_JSON_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", dict: "object",
               list: "list", tuple: "list", type(None): "null"}


# --- the generic mechanism --------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class _Spec:
    """Type and constraints of one config value (a field, or the elements of a list field)."""

    types: tuple[type, ...]  # accepted types; float accepts int; a _Section accepts a dict
    what: str  # the expected type in words, for messages
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    items: "_Spec | None" = None  # element spec of a list (types == (tuple,))
    unique: bool = False  # list elements must be distinct
    convert: Callable[[Any, str], Any] | None = None  # (value, path) -> value, after the type check

    def bounds(self) -> str:
        parts = (("> ", self.exclusive_minimum), (">= ", self.minimum), ("<= ", self.maximum))
        return " and ".join(f"{op}{bound}" for op, bound in parts if bound is not None)


_WHAT = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _opt(kind: Any, doc: str, *, default: Any = MISSING, factory: Any = MISSING, **constraints: Any) -> Any:
    """A dataclass field of type ``kind`` with its doc and constraints in the metadata."""
    what = constraints.pop("what", None) or _WHAT.get(kind, "an object" if isinstance(kind, type) else "")
    types = kind if isinstance(kind, tuple) else (kind,)
    spec = _Spec(types=types, what=what, **constraints)
    return field(default=default, default_factory=factory, metadata={"spec": spec, "doc": doc})


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({_JSON_NAMES.get(type(value), type(value).__name__)})"


def _matches(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    if kind is tuple:
        return isinstance(value, (list, tuple))
    if isinstance(kind, type) and issubclass(kind, _Section):
        return isinstance(value, (dict, kind))
    return isinstance(value, kind)


def _coerce(spec: _Spec, value: Any, path: str) -> Any:
    """Check ``value`` against ``spec`` and return its stored form; raise ConfigError at ``path``."""
    if value is None:
        if spec.nullable:
            return None
        raise ConfigError(path, f"expected {spec.what}, got null")
    if not any(_matches(value, kind) for kind in spec.types):
        expected = spec.what + (" or null" if spec.nullable else "")
        raise ConfigError(path, f"expected {expected}, got {_show(value)}")
    kind = next(kind for kind in spec.types if _matches(value, kind))
    if kind is float:
        if not math.isfinite(value):
            raise ConfigError(path, f"expected a finite number, got {_show(value)}")
        value = float(value)
    elif isinstance(kind, type) and issubclass(kind, _Section) and isinstance(value, dict):
        value = _parse(kind, value, path)
    elif kind is tuple:
        value = tuple(_coerce(spec.items, v, f"{path}[{i}]") for i, v in enumerate(value))
        if spec.unique:
            for i, v in enumerate(value):
                if v in value[:i]:
                    raise ConfigError(f"{path}[{i}]", f"duplicate of entry {value.index(v)} ({v})")
    if spec.convert is not None:
        value = spec.convert(value, path)
    if spec.choices is not None and value not in spec.choices:
        allowed = ", ".join(repr(c) for c in spec.choices)
        close = difflib.get_close_matches(str(value), [str(c) for c in spec.choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(path, f"got {value!r}, allowed values: {allowed}{hint}")
    low_ok = spec.minimum is None or value >= spec.minimum
    excl_ok = spec.exclusive_minimum is None or value > spec.exclusive_minimum
    high_ok = spec.maximum is None or value <= spec.maximum
    if not (low_ok and excl_ok and high_ok):
        raise ConfigError(path, f"must be {spec.bounds()}, got {value!r}")
    return value


def _reroot(exc: ConfigError, prefix: str) -> ConfigError:
    """``exc`` with its (relative) key path put under ``prefix``."""
    message = str(exc).removeprefix(f"{exc.path}: ")
    return ConfigError(f"{prefix}.{exc.path}", message)


def _parse(cls: type, data: Any, path: str) -> Any:
    """Build section ``cls`` from the JSON object ``data`` found at key path ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected an object, got {_show(data)}")
    names = [f.name for f in fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{path}.{key}", f"unknown key; {hint}allowed keys: {', '.join(names)}")
    for f in fields(cls):
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{path}.{f.name}", "required key is missing")
    try:
        return cls(**data)
    except ConfigError as exc:
        raise _reroot(exc, path) from None


def _dump(value: Any) -> Any:
    if isinstance(value, (_Section, CostModel)):
        return value.to_dict()
    if isinstance(value, Worker):
        return format_worker(value)
    if isinstance(value, tuple):
        return [_dump(v) for v in value]
    return value


class _Section:
    """Base of the config dataclasses: checks every field on construction; to/from JSON objects."""

    __slots__ = ()
    _PATH: ClassVar[str] = "resilience"  # key path of this section in a DeepSpeed config

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _coerce(f.metadata["spec"], getattr(self, f.name), f.name))
        self._check_together()

    def _check_together(self) -> None:
        """Cross-field invariants; raise ConfigError with a path relative to the section."""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, path: str | None = None) -> Any:
        """Parse the JSON object ``data`` (``None``: all defaults) found at key path ``path``."""
        return cls() if data is None else _parse(cls, data, path or cls._PATH)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal object."""
        return {f.name: _dump(getattr(self, f.name)) for f in fields(self)}


def _to_worker(value: Any, path: str) -> Worker:
    if isinstance(value, Worker):
        return value
    try:
        return parse_worker(value)
    except TopologyError as exc:
        raise ConfigError(path, str(exc)) from None


def _to_cost_model(value: Any, path: str) -> str | CostModel:
    if not isinstance(value, dict):
        return value
    try:
        return CostModel.from_dict(value, source="inline cost model")
    except CostModelError as exc:
        raise ConfigError(path, str(exc)) from exc


# --- the schema -------------------------------------------------------------------------------
def _memory_cap(value: Any, path: str) -> Any:
    try:
        parse_size(value, what="memory_cap")
    except ValueError as exc:
        raise ConfigError(path, str(exc).removeprefix("memory_cap ").removeprefix("memory_cap: ")) from None
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig(_Section):
    """How the plan table (one schedule per failure set) is computed and cached."""

    _PATH: ClassVar[str] = "resilience.planner"
    solver: str = _opt(str, "optimizer of the schedules", default="cpsat", choices=SOLVERS)
    time_limit_s: float = _opt(float, "solver time limit per failure set, seconds",
                               default=10.0, exclusive_minimum=0)
    cache_dir: str = _opt(str, "directory of the on-disk plan cache", default=".plan_cache")
    workers: int = _opt(int, "parallel processes for the plan table; 0 = cpu count", default=0, minimum=0)
    memory_cap: float | str | None = _opt(
        (float, str), "memory a worker's micro-batch states may take: bytes with a profiled cost model, else "
        "micro-batch states; a size such as '24GiB' is bytes; null = fault-free 1F1B's peak",
        default=None, nullable=True, what="a number or a size such as '24GiB'", convert=_memory_cap)
    all_coverable: bool = _opt(bool, "also precompute every failure set that leaves each stage a replica",
                               default=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectorConfig(_Section):
    """Failure detection: heartbeats and the timeouts of every blocking call."""

    _PATH: ClassVar[str] = "resilience.detector"
    heartbeat_interval_s: float = _opt(float, "seconds between heartbeats", default=0.5, exclusive_minimum=0)
    heartbeat_timeout_s: float = _opt(float, "silence after which a peer is suspected; > interval",
                                      default=5.0, exclusive_minimum=0)
    store_timeout_s: float = _opt(float, "timeout of TCPStore reads", default=30.0, exclusive_minimum=0)
    pg_timeout_s: float = _opt(float, "timeout of process-group operations", default=60.0, exclusive_minimum=0)
    stall_timeout_s: float | None = _opt(float, "a worker whose main thread runs one action (not a wait on peers) "
                                         "this long stops beating and is taken for hung; null = never",
                                         default=300.0, nullable=True, exclusive_minimum=0)
    straggler_window: int = _opt(int, "iterations over which a worker's compute pace (its fastest) is held against "
                                 "its stage peers' (runtime/stragglers.py)", default=5, minimum=2)
    straggler_margin: float = _opt(float, "a worker whose pace is slower than its stage peers' by more than this "
                                   "fraction is reported slow; recovered below half of it", default=0.3,
                                   exclusive_minimum=0)
    straggler_hold: int = _opt(int, "iterations after a straggler switch before the next one: a worker a busy "
                               "machine makes slow and fast by turns does not switch the schedule back and forth "
                               "(decisions are logged at once; the switch follows the newest state)", default=20,
                               minimum=0)
    straggler_replan: bool | None = _opt(
        bool, "under the agent, a worker found slow switches the job to the weighted plan for its speed at an "
        "iteration boundary (a slow epoch), and back when it recovers; false: only reported; null = true "
        "(DSR_STRAGGLER_REPLAN=0 in the environment turns this default off)", default=None, nullable=True)

    def _check_together(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("heartbeat_timeout_s", f"must be > heartbeat_interval_s "
                              f"({self.heartbeat_interval_s!r}), got {self.heartbeat_timeout_s!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultInjection(_Section):
    """Kill global rank ``rank`` at ``point`` of iteration ``step`` (for tests and demos)."""

    _PATH: ClassVar[str] = "resilience.fault_injection[]"
    rank: int = _opt(int, "global rank that fails", minimum=0)
    step: int = _opt(int, "iteration at which it fails", minimum=0)
    point: str = _opt(str, "where in the iteration it fails", choices=FAULT_POINTS)
    kind: str = _opt(str, "how: exit, SIGKILL itself, hang forever (SIGSTOP: every thread), stall (the main thread "
                   "alone stops), lose its machine (host memory included), or delay (a straggler: the main "
                   "thread sleeps `seconds`, then goes on)", choices=FAULT_KINDS)
    seconds: float | None = _opt(float, "how long a delay lasts (kind delay only)", default=None, nullable=True,
                                 exclusive_minimum=0)
    speed: float | None = _opt(float, "the speed of a slow worker's forward and backward passes, a fraction of its "
                               "own (kind slow only)", default=None, nullable=True, exclusive_minimum=0, maximum=1)
    steps: int | None = _opt(int, "for how many iterations a worker stays slow, from `step` (kind slow only)",
                             default=None, nullable=True, minimum=1)

    def _check_together(self) -> None:
        if (self.kind == "delay") != (self.seconds is not None):
            raise ConfigError("seconds", f"is required by kind 'delay' and allowed with it only; kind {self.kind!r}, "
                              f"seconds {self.seconds!r}")
        for name in ("speed", "steps"):
            if (self.kind == "slow") != (getattr(self, name) is not None):
                raise ConfigError(name, f"is required by kind 'slow' and allowed with it only; kind {self.kind!r}, "
                                  f"{name} {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointConfig(_Section):
    """In-memory checkpoints replicated to peers, with a low-frequency persistent tier."""

    _PATH: ClassVar[str] = "resilience.checkpoint"
    enabled: bool = _opt(bool, "take in-memory checkpoints", default=True)
    interval: int = _opt(int, "iterations between in-memory checkpoints", default=1, minimum=1)
    replicas: int = _opt(int, "copies of each snapshot, the own one included", default=2, minimum=1)
    gpu_buffer_mb: int = _opt(int, "GPU staging buffer size, MiB", default=128, minimum=1)
    num_sub_buffers: int = _opt(int, "pipelined sub-buffers the staging buffer is split into",
                                default=4, minimum=1)
    persistent_interval: int = _opt(int, "iterations between disk checkpoints", default=100, minimum=1)
    persistent_dir: str | None = _opt(str, "directory of disk checkpoints; null = none", default=None,
                                      nullable=True)
    keep_last: int = _opt(int, "disk checkpoints kept", default=2, minimum=1)
    stall_budget: float = _opt(float, "max fraction of iteration time checkpointing may stall training",
                               default=0.02, exclusive_minimum=0, maximum=1)
    ranks_per_machine: int | None = _opt(int, "ranks that share a machine (and its host memory); null = the "
                                         "launcher's LOCAL_WORLD_SIZE", default=None, nullable=True, minimum=1)
    host_dir: str | None = _opt(str, "host-memory directory of the snapshots (tmpfs); null = /dev/shm/ds_resilience",
                                default=None, nullable=True)
    chunk_mb: float = _opt(float, "replication chunk size, MiB", default=4.0, exclusive_minimum=0)
    interface: str | None = _opt(str, "network interface the replicas travel on to other machines (e.g. a "
                                 "storage or second NIC: \"eth1\"); null = gloo's default (GLOO_SOCKET_IFNAME)",
                                 default=None, nullable=True)
    interleave: bool = _opt(bool, "send replication chunks only in the idle spans of the schedule's network "
                            "links (false: whenever ready)", default=True)
    idle_fraction: float = _opt(float, "fraction of an idle span replication may fill (Gemini's alpha)",
                                default=0.8, exclusive_minimum=0, maximum=1)
    max_restarts: int = _opt(int, "restarts of all workers from the snapshots when a failure is beyond "
                             "tolerance (0: stop instead)", default=3, minimum=0)


_WORKER = _Spec(types=(str, Worker), what="a 'pipeline:stage' string", convert=_to_worker)
_FAULT = _Spec(types=(FaultInjection,), what="an object")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResilienceConfig(_Section):
    """The whole ``"resilience"`` section; :meth:`from_dict` parses it, :meth:`to_dict` writes it."""

    enabled: bool = _opt(bool, "turn the plugin on", default=True)
    schedule: str = _opt(str, "fault-free schedule", default="1f1b", choices=SCHEDULES)
    variant: str | None = _opt(str, "techniques when degraded: re-routing only; + decoupled backward; "
                               "+ staggered optimizer; auto: per failure set, the one the cost model predicts "
                               "fastest; null: auto with measured or given costs, recycle with unit costs",
                               default=None, nullable=True, choices=VARIANT_CHOICES)
    max_failures: int = _opt(int, "plans are precomputed for every failure set up to this size",
                             default=1, minimum=0)
    microbatches: int | None = _opt(int, "micro-batches per pipeline; null = DeepSpeed's "
                                    "gradient_accumulation_steps", default=None, nullable=True, minimum=1)
    seed: int = _opt(int, "base of every micro-batch's RNG stream (dropout masks are drawn from (seed, "
                     "iteration, pipeline, micro-batch, and the layer (DeepSpeed engine) or the stage (Megatron)), so a re-routed "
                     "or re-gridded micro-batch draws the same)",
                     default=1234, minimum=0)
    clipping: str = _opt(str, "how gradient clipping and fp16 overflow checks agree on the global norm: each "
                         "stage steps speculatively and validates (rolling back when wrong), or all wait at a "
                         "barrier", default="speculative", choices=("speculative", "barrier"))
    simulate_failed: tuple[Worker, ...] = _opt(tuple, "workers left idle (alive, running nothing)",
                                               default=(), what="a list", items=_WORKER, unique=True)
    cost_model: str | CostModel | None = _opt(
        (str, dict, CostModel), "null = measured by the profile at start (profile_steps); \"unit\" = unit "
        "costs; a path to a cost-model JSON file; or one inline",
        default=None, nullable=True, what="a path (string) or an object", convert=_to_cost_model)
    profile_steps: int | None = _opt(
        int, "with cost_model null: the first 2k+1 iterations profile the job (integrations/ds_profile.py) and the "
        "engine re-plans with what they measured; null = 2 (DSR_SELF_PROFILE=0 in the environment turns this "
        "default off), 0 = off (unit costs)", default=None, nullable=True, minimum=0)
    profile_out: str | None = _opt(str, "with profile_steps: where rank 0 also writes the profiled cost model",
                                   default=None, nullable=True)
    planner: PlannerConfig = _opt(PlannerConfig, "plan-table computation", factory=PlannerConfig)
    detector: DetectorConfig = _opt(DetectorConfig, "failure detection", factory=DetectorConfig)
    fault_injection: tuple[FaultInjection, ...] = _opt(tuple, "failures to inject", default=(),
                                                       what="a list", items=_FAULT)
    checkpoint: CheckpointConfig = _opt(CheckpointConfig, "checkpointing", factory=CheckpointConfig)
    fast_w: bool = _opt(bool, "the decoupled backward computes the weight gradient of linear layers (also megatron-core's), "
                        "LayerNorms and parameters that scale or shift an activation without autograd (bit-equal); false: "
                        "every W through autograd, so a hook registered on a parameter's gradient-accumulator node, "
                        "which a fast W cannot see, still fires", default=True)
    regrid: bool = _opt(bool, "when a stage loses every replica, the survivors re-form a smaller dp x pp grid in "
                        "their running processes (layers moved between them, a lost stage's from the in-memory "
                        "snapshots) instead of every worker restarting from the snapshots", default=False)
    grow_back: bool = _opt(bool, "after such a re-grid, the agent keeps relaunching the ranks it left out "
                           "(ds-resilience run --rejoin_after) and, once they all registered and growing pays, the "
                           "survivors and they re-form the first grid; false: the ranks left out stay out",
                           default=True)

    def self_profile_steps(self, environ: Mapping[str, str] | None = None) -> int:
        """How many fused and decoupled iterations the engine profiles at start (0: none): only
        with ``cost_model`` null; ``profile_steps`` if set, else :data:`DEFAULT_PROFILE_STEPS`
        unless ``DSR_SELF_PROFILE=0`` is in the environment."""
        if self.cost_model is not None:
            return 0
        if self.profile_steps is not None:
            return self.profile_steps
        environ = os.environ if environ is None else environ
        return 0 if environ.get("DSR_SELF_PROFILE", "1") == "0" else DEFAULT_PROFILE_STEPS

    def variant_for(self, cost: CostModel) -> str:
        """The variant to plan with under ``cost``: the configured one; unset (null), ``auto`` when
        the costs are measured or given (the engine's own profile by default), since then which
        variant is fastest is a measured fact (on a CPU the split backward can cost more than the
        bubbles it fills, on a GPU it pays), and ``recycle`` under unit costs, which price B + W as
        one fused backward and so always rate ``recycle`` at least as fast."""
        if self.variant is not None:
            return self.variant
        return "recycle" if cost == CostModel.unit() else "auto"

    def cost(self, base_dir: str | Path | None = None) -> CostModel:
        """The cost model: the unit model for null, the file's (relative to ``base_dir``) for a path.

        Raises:
            ConfigError: at ``resilience.cost_model`` if the file is missing or invalid.
        """
        if self.cost_model is None or self.cost_model == UNIT_COSTS:
            return CostModel.unit()
        if isinstance(self.cost_model, CostModel):
            return self.cost_model
        path = Path(self.cost_model)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        try:
            return CostModel.load(path)
        except CostModelError as exc:
            raise ConfigError(f"{self._PATH}.cost_model", str(exc)) from exc


def load_resilience_config(ds_config: dict[str, Any] | str | Path) -> ResilienceConfig:
    """Parse the ``"resilience"`` section of a DeepSpeed config (a dict or a JSON file's path).

    A missing section gives the defaults. Raises :class:`ConfigError` for a bad section, or (with
    the file's path) for a file that cannot be read or is not a JSON object.
    """
    if isinstance(ds_config, (str, Path)):
        source = str(ds_config)
        try:
            ds_config = json.loads(Path(ds_config).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(source, f"cannot read the DeepSpeed config: {exc.strerror or exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(source, f"the DeepSpeed config is not valid JSON: {exc}") from exc
    else:
        source = "ds_config"
    if not isinstance(ds_config, dict):
        raise ConfigError(source, f"a DeepSpeed config must be a JSON object, got {_show(ds_config)}")
    if "resilience" not in ds_config:
        return ResilienceConfig()
    section = ds_config["resilience"]
    if not isinstance(section, dict):
        raise ConfigError("resilience", f"expected an object (omit the section for the defaults), "
                          f"got {_show(section)}")
    return ResilienceConfig.from_dict(section)


def read_resilience_file(path: str | Path) -> tuple[ResilienceConfig, dict[str, Any], str]:
    """The resilience settings in the JSON file ``path`` as Megatron's ``--resilience-config`` reads
    it (a DeepSpeed config holding a ``"resilience"`` section, or the section alone): the config,
    the raw section and a name for messages."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("--resilience-config", f"cannot read {path}: {exc.strerror or exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("--resilience-config", f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("--resilience-config", f"{path} must hold a JSON object, got {type(data).__name__}")
    if "resilience" in data:
        section = data["resilience"]
        return load_resilience_config(data), section if isinstance(section, dict) else {}, f"resilience in {path}"
    return ResilienceConfig.from_dict(data), data, f"{path}"


def load_resilience_file(path: str | Path) -> ResilienceConfig:
    """:func:`read_resilience_file`'s config alone (what the agent reads from the script's flags)."""
    return read_resilience_file(path)[0]
