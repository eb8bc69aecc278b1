"""Model profiles for the failure-trace simulator, and what the planner says about them.

A profile (``configs/models/<name>.json``) describes one training job on one cluster:

* the job: global batch (samples per iteration), layers, parameters, the healthy grid
  ``dp`` x ``pp`` and ``microbatches`` per pipeline (``G = dp * microbatches`` per iteration);
* the absolute scale: ``anchor_throughput``, the samples/s of DeepSpeed's 1F1B schedule on the
  healthy grid (we take Oobleck's throughput with all 30 nodes: homogeneous 1F1B pipelines);
* costs of the recovery mechanisms (failure detection, full restart and persistent checkpoint),
  and, per baseline, its measured throughput per live node count and pauses. The live re-grid's
  pause comes from the engine's measured cost (:mod:`.regrid_cost`) for the profile's size
  (:meth:`ModelProfile.regrid_pause_s`); a profile's ``regrid_s`` overrides it with a fixed pause.

The cost model of the planner-driven systems is built from first principles: a stage's forward
time is its layer count times a per-layer time ``f``; backward-input and weight-gradient times are
``backward_ratio * f`` and ``weight_ratio * f`` per layer. ``f`` is the one number fitted: the
planner's replay of 1F1B on the healthy grid must take ``global_batch / anchor_throughput``.
:class:`PlanCache` then answers "iteration time of grid (dp, pp) with these failed slots" with the
real planner's plan (the same plans the engine runs), cached by normalized failure set. Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..costs import CostModel
from ..errors import PlanningError
from ..topology import Worker
from .regrid_cost import CLUSTER, RegridCost, regrid_bytes
from .traces import SimulationError

__all__ = [
    "ModelProfileError",
    "ThroughputTable",
    "ModelProfile",
    "PlanCache",
    "MODEL_NAMES",
    "models_dir",
    "load_model",
    "list_models",
    "stage_layers",
    "divisors",
    "Grid",
    "Slots",
    "profile_from_dict",
]

MODEL_NAMES = ("bert-large", "gpt2", "gpt3-medium", "gpt3-2.7b", "gpt3-6.7b")
"""The built-in profiles (Oobleck's Table 2 models), in ``configs/models/``."""


class ModelProfileError(SimulationError):
    """A model name is unknown or a profile file is invalid."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputTable:
    """Measured samples/s at ``max_nodes``, ``max_nodes - 1``, ... live nodes.

    Above ``max_nodes`` the extra nodes idle (the value at ``max_nodes``). Below the smallest
    measured count the value scales with the node count (no measurement exists); a 0 entry means
    the system cannot run at that size (out of memory), and so cannot below it either.
    """

    max_nodes: int
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not self.values or any(not math.isfinite(v) or v < 0 for v in self.values):
            raise ModelProfileError(f"throughput list must hold numbers >= 0, got {list(self.values)!r}")
        if self.max_nodes < len(self.values):
            raise ModelProfileError(f"max_nodes {self.max_nodes} is below the list length {len(self.values)}")

    @property
    def min_nodes(self) -> int:
        return self.max_nodes - len(self.values) + 1

    def at(self, nodes: int) -> float:
        if nodes >= self.max_nodes:
            return self.values[0]
        if nodes >= self.min_nodes:
            return self.values[self.max_nodes - nodes]
        return self.values[-1] * max(nodes, 0) / self.min_nodes

    @property
    def runs(self) -> bool:
        """False when the system runs out of memory at every size."""
        return any(v > 0 for v in self.values)


def stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage when ``layers`` are cut into ``pp`` contiguous stages (earlier stages get the rest)."""
    if pp < 1 or pp > layers:
        raise ModelProfileError(f"cannot cut {layers} layers into {pp} stages")
    base, extra = divmod(layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def _table(raw: Any, nodes: int, where: str) -> ThroughputTable | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise ModelProfileError(f"{where}: 'throughput' must be a non-empty list of samples/s (from {nodes} nodes down) or null")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in raw):
        raise ModelProfileError(f"{where}: 'throughput' entries must be numbers, got {raw!r}")
    return ThroughputTable(max_nodes=nodes, values=tuple(raw))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """One training job on one cluster (see the module docstring for the meaning of each field)."""

    name: str
    description: str = ""
    global_batch: int
    layers: int
    params_billion: float
    gpu_memory_gb: float = 48.0
    nodes: int = 30
    boot_s: float = 45.0
    dp: int = 5
    pp: int = 6
    microbatches: int = 12
    anchor_throughput: float
    backward_ratio: float = 1.0
    weight_ratio: float = 1.0
    detect_s: float = 5.0
    regrid_s: float | None = None
    restart_s: float = 60.0
    checkpoint_s: float = 15.0
    max_stages: int = 12
    oobleck: ThroughputTable | None = None
    oobleck_reconfigure_s: float = 2.0
    varuna: ThroughputTable | None = None
    varuna_restart_s: float = 76.0
    varuna_restart_by_nodes: tuple[tuple[int, float], ...] = ()
    varuna_checkpoint_s: float = 15.8
    varuna_checkpoint_every: int = 10
    bamboo: ThroughputTable | None = None
    bamboo_rebalance_s: float = 76.0
    bamboo_fatal_restart_s: float = 30.0
    bamboo_stages: int = 12
    bamboo_slowdown: float = 1.5
    bamboo_redundant_fraction: float = 0.25
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        for name in ("global_batch", "layers", "nodes", "dp", "pp", "microbatches", "max_stages",
                     "varuna_checkpoint_every", "bamboo_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelProfileError(f"{where}: {name} must be an integer >= 1, got {v!r}")
        for name in ("params_billion", "gpu_memory_gb", "anchor_throughput", "backward_ratio", "bamboo_slowdown"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ModelProfileError(f"{where}: {name} must be a number > 0, got {v!r}")
        if self.regrid_s is not None:  # the override of the measured re-grid cost
            v = self.regrid_s
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ModelProfileError(f"{where}: regrid_s must be a number >= 0 or null (the measured cost), got {v!r}")
        for name in ("boot_s", "weight_ratio", "detect_s", "restart_s", "checkpoint_s",
                     "oobleck_reconfigure_s", "varuna_restart_s", "varuna_checkpoint_s", "bamboo_rebalance_s",
                     "bamboo_fatal_restart_s", "bamboo_redundant_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ModelProfileError(f"{where}: {name} must be a number >= 0, got {v!r}")
        if self.dp * self.pp > self.nodes:
            raise ModelProfileError(f"{where}: grid {self.dp}x{self.pp} needs more than its {self.nodes} nodes")
        if self.pp > self.layers:
            raise ModelProfileError(f"{where}: pp={self.pp} exceeds layers={self.layers}")
        if self.varuna_restart_s < self.varuna_checkpoint_s:
            raise ModelProfileError(f"{where}: varuna restart_s must include its checkpoint_s (restart >= checkpoint)")

    # --- derived figures -------------------------------------------------------------------
    @property
    def total_microbatches(self) -> int:
        """Micro-batches per iteration, fixed whatever the grid (the math of training)."""
        return self.dp * self.microbatches

    @property
    def min_stages(self) -> int:
        """Fewest stages whose weights, gradients and Adam state (16 bytes/param) fit in 80% of a GPU."""
        need = self.params_billion * 16.0 / (0.8 * self.gpu_memory_gb)
        return max(2, math.ceil(need))

    def stage_options(self) -> tuple[int, ...]:
        """Pipeline depths the re-grid may choose."""
        return tuple(range(self.min_stages, min(self.max_stages, self.layers) + 1))

    def cost_model(self, pp: int, layer_ms: float) -> CostModel:
        """The planner's cost model for ``pp`` stages with ``layer_ms`` per layer and micro-batch."""
        split = stage_layers(self.layers, pp)
        return CostModel(
            name=f"{self.name}-pp{pp}",
            t_f=tuple(n * layer_ms for n in split),
            t_b=tuple(n * layer_ms * self.backward_ratio for n in split),
            t_w=tuple(n * layer_ms * self.weight_ratio for n in split),
        )

    def regrid_pause_s(self, stages: int | None = None, *, cost: RegridCost = CLUSTER) -> float:
        """Seconds a live re-grid onto ``stages`` stages (the profile's ``pp`` by default) pauses the
        survivors: ``regrid_s`` when the profile sets it, else ``cost`` (the engine's measured cost
        scaled to the traces' cluster) for its busiest receiver, which takes one new stage's weights
        and optimizer state (:func:`~.regrid_cost.regrid_bytes` of ``params_billion``)."""
        if self.regrid_s is not None:
            return float(self.regrid_s)
        return cost.pause_s(regrid_bytes(self.params_billion * 1e9, self.pp if stages is None else stages))

    def restart_varuna(self, nodes: int) -> float:
        for n, s in self.varuna_restart_by_nodes:
            if n == nodes:
                return s
        return self.varuna_restart_s


_SYSTEM_KEYS = {
    "oobleck": {"throughput": "oobleck", "reconfigure_s": "oobleck_reconfigure_s"},
    "varuna": {"throughput": "varuna", "restart_s": "varuna_restart_s", "restart_s_by_nodes": "varuna_restart_by_nodes",
               "checkpoint_s": "varuna_checkpoint_s", "checkpoint_every": "varuna_checkpoint_every"},
    "bamboo": {"throughput": "bamboo", "rebalance_s": "bamboo_rebalance_s", "fatal_restart_s": "bamboo_fatal_restart_s",
               "stages": "bamboo_stages", "slowdown": "bamboo_slowdown", "redundant_fraction": "bamboo_redundant_fraction"},
}
_TOP_KEYS = {f.name for f in fields(ModelProfile)} - {v for m in _SYSTEM_KEYS.values() for v in m.values()} - {"source"}


def profile_from_dict(data: Mapping[str, Any], *, source: str = "<profile>") -> ModelProfile:
    """Build a profile from its JSON object (unknown keys raise, naming the allowed ones)."""
    if not isinstance(data, Mapping):
        raise ModelProfileError(f"{source}: expected a JSON object, got {type(data).__name__}")
    allowed = _TOP_KEYS | set(_SYSTEM_KEYS) | {"comment", "systems"}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ModelProfileError(f"{source}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    for key in ("name", "global_batch", "layers", "params_billion", "anchor_throughput"):
        if key not in data:
            raise ModelProfileError(f"{source}: missing required key {key!r}")
    kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in _TOP_KEYS}
    nodes = int(data.get("nodes", 30))
    systems = data.get("systems", {})
    if not isinstance(systems, Mapping):
        raise ModelProfileError(f"{source}: 'systems' must be an object with oobleck/varuna/bamboo sections")
    for system, raw in systems.items():
        if system not in _SYSTEM_KEYS:
            raise ModelProfileError(f"{source}: unknown system {system!r} under 'systems'; allowed: {sorted(_SYSTEM_KEYS)}")
        keymap = _SYSTEM_KEYS[system]
        bad = sorted(set(raw) - set(keymap) - {"comment"})
        if bad:
            raise ModelProfileError(f"{source}: systems.{system}: unknown keys {bad}; allowed: {sorted(keymap)}")
        for key, attr in keymap.items():
            if key not in raw:
                continue
            value = raw[key]
            if key == "throughput":
                value = _table(value, nodes, f"{source}: systems.{system}")
            elif key == "restart_s_by_nodes":
                value = tuple(sorted((int(n), float(s)) for n, s in dict(value).items()))
            kwargs[attr] = value
    try:
        profile = ModelProfile(**kwargs, source=source)
    except TypeError as exc:
        raise ModelProfileError(f"{source}: {exc}") from exc
    return profile


def models_dir() -> Path:
    """``configs/models`` of this checkout (the built-in profiles)."""
    return Path(__file__).resolve().parents[2] / "configs" / "models"


def list_models() -> tuple[str, ...]:
    """Names of the profiles in :func:`models_dir`."""
    d = models_dir()
    return tuple(sorted(p.stem for p in d.glob("*.json"))) if d.is_dir() else ()


def load_model(name_or_path: str | Path) -> ModelProfile:
    """A built-in profile by name (``gpt2``), or any profile JSON file by path.

    Raises:
        ModelProfileError: unknown name (the message lists the known ones) or invalid file.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".json") or path.is_file()):
        path = models_dir() / f"{text}.json"
        if not path.is_file():
            known = ", ".join(list_models()) or f"none found in {models_dir()}"
            raise ModelProfileError(f"unknown model {text!r}; known models: {known} (or pass a profile .json path)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelProfileError(f"model profile {str(path)!r} does not exist") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelProfileError(f"model profile {str(path)!r} is not valid JSON: {exc}") from exc
    return profile_from_dict(data, source=str(path))


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending (the pipeline counts that split a batch evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


class Slots:
    """Positions (``slot``: position -> node), each held by a node or empty (a hole)."""

    slot: dict

    @property
    def nodes(self) -> set[str]:
        return {n for n in self.slot.values() if n is not None}

    def holes(self) -> list:
        return [k for k, n in self.slot.items() if n is None]

    def vacate(self, node: str) -> bool:
        """Empty the position ``node`` holds; False if it holds none."""
        for key, holder in self.slot.items():
            if holder == node:
                self.slot[key] = None
                return True
        return False


class Grid(Slots):
    """A ``dp`` x ``pp`` grid of slots, each held by a node or empty (a hole re-routed around)."""

    def __init__(self, model: ModelProfile, dp: int, pp: int, nodes: list[str]) -> None:
        self.dp, self.pp = dp, pp
        self.slot: dict[tuple[int, int], str | None] = {(p, s): None for p in range(dp) for s in range(pp)}
        per_stage = [0] * pp
        n = min(len(nodes), dp * pp)
        for k in range(n):  # balanced: one more replica for the stages holding the most layers first
            per_stage[k % pp] += 1
        heavy = sorted(range(pp), key=lambda s: -stage_layers(model.layers, pp)[s])
        per_stage = [per_stage[heavy.index(s)] for s in range(pp)]
        it = iter(nodes[:n])
        for s in range(pp):
            for p in range(per_stage[s]):
                self.slot[(p, s)] = next(it)

    @property
    def failed(self) -> frozenset[Worker]:
        return frozenset(Worker(pipeline=p, stage=s) for (p, s), n in self.slot.items() if n is None)

    def covered(self) -> bool:
        return all(any(self.slot[(p, s)] is not None for p in range(self.dp)) for s in range(self.pp))

    def describe(self) -> str:
        return f"grid {self.dp}x{self.pp}"

    def fill(self, node: str) -> bool:
        """Put ``node`` into a hole of the stage with the fewest live replicas; False if no hole."""
        holes = self.holes()
        if not holes:
            return False
        live = {s: sum(1 for p in range(self.dp) if self.slot[(p, s)] is not None) for s in range(self.pp)}
        self.slot[min(holes, key=lambda k: (live[k[1]], k[0], k[1]))] = node
        return True


class PlanCache:
    """Planner answers for one model: per-layer time, 1F1B times, and plans by normalized failure set.

    Plans are made with the cost model in *layer units* (one layer's forward = 1) and scaled by the
    fitted per-layer time: with no link or optimizer costs the planner's schedules are invariant
    under a change of time unit, and integer costs keep its tie-breaks exact. So profiles with the
    same layer count and ratios share plans: pass one ``store`` dict to their caches.
    """

    def __init__(self, profile: ModelProfile, *, variant: str = "recycle", store: dict | None = None) -> None:
        self.profile = profile
        self.variant = variant
        self._store: dict = {} if store is None else store
        self._shape = (profile.layers, profile.backward_ratio, profile.weight_ratio)
        self.planner_calls = 0
        g = profile.total_microbatches
        target_ms = profile.global_batch / profile.anchor_throughput * 1000.0
        self.layer_ms = target_ms / self._units_1f1b(profile.dp, profile.pp, g // profile.dp)

    def _units_1f1b(self, dp: int, pp: int, m: int) -> float:
        key = (self._shape, "1f1b", dp, pp, m)
        if key not in self._store:
            from ..planning.planner import one_f_one_b_time

            self._store[key] = one_f_one_b_time(dp, pp, m, self.profile.cost_model(pp, 1.0))
        return self._store[key]

    def _split(self, dp: int) -> int:
        g = self.profile.total_microbatches
        if dp < 1 or g % dp:
            raise SimulationError(f"{g} micro-batches per iteration do not split over dp={dp} pipelines")
        return g // dp

    def one_f_one_b_s(self, dp: int, pp: int) -> float:
        """Seconds per iteration of healthy 1F1B on a ``dp`` x ``pp`` grid (``G / dp`` micro-batches each)."""
        return self._units_1f1b(dp, pp, self._split(dp)) * self.layer_ms / 1000.0

    @property
    def healthy_1f1b_s(self) -> float:
        """DeepSpeed's fault-free iteration on the profile's grid (equals ``global_batch / anchor``)."""
        return self.one_f_one_b_s(self.profile.dp, self.profile.pp)

    def plan_s(self, dp: int, pp: int, failed: Iterable[Worker]) -> float:
        """Seconds per iteration of the planner's plan for ``failed`` on a ``dp`` x ``pp`` grid.

        Raises:
            PlanningError: a stage lost every replica (re-routing cannot cover the set).
        """
        from ..planning.normalize import normalize
        from ..planning.planner import plan

        m = self._split(dp)
        failed = frozenset(failed)
        norm = normalize(dp, pp, failed)
        key = (self._shape, self.variant, norm.key, m)
        if key not in self._store:
            lost = [s for s in range(pp) if sum(1 for w in failed if w.stage == s) >= dp]
            if lost:
                raise PlanningError(f"stages {lost} lost every replica on the {dp}x{pp} grid")
            self.planner_calls += 1
            result = plan(dp, pp, m, norm.canonical, cost=self.profile.cost_model(pp, 1.0), variant=self.variant)
            self._store[key] = result.iteration_time
        return self._store[key] * self.layer_ms / 1000.0
