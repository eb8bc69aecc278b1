"""Cost model: how long each action takes, per stage, and what the links cost.

Loaded from JSON (``configs/costs_*.json``). Every per-stage field takes one number (all stages) or
a list with one number per stage. Times are in any consistent unit (the reference profiles use
milliseconds; the default unit model uses 1 per pass). Pure Python.

JSON fields (all optional, defaults in brackets)::

    name               label                                         ["unit"]
    t_f, t_b, t_w      forward, input-gradient, weight-gradient time  [1, 1, 1]
    t_fused            the fused backward (B and W in one pass, what 1F1B runs); 0 = t_b + t_w.
                       A profile measures it: on real hardware B + W costs more than fused  [0]
    t_opt              optimizer step time per stage                  [0]
    t_reduce           data-parallel gradient reduce time per stage   [0]
    t_tied_reduce      tied-gradient reduce time per stage (TIED_REDUCE; a tied group's reduce lasts
                       the max over its stages)                         [0]
    t_recompute        the forward B recomputes under activation checkpointing (the runtime
                       recomputes the whole stage before its B or fused BW)  [0]
    activation_bytes   bytes of one micro-batch's activation (or gradient) crossing a stage boundary [0]
    state_bytes        memory a worker holds for one micro-batch between its F and its B (the
                       saved activations; under activation checkpointing, the stage's input)  [0]
    pending_w_bytes    memory held for one micro-batch between its B and its deferred W (the
                       saved layer inputs and output gradients W needs)                     [0]
    p2p_latency        per-message latency                            [0]
    p2p_bandwidth      bytes per time unit, null = infinite           [null]
    split_noise        how far the measured (B + W) / fused ratio moved between the profile's
                       iterations (relative half-range; the profile writes it): the planner keeps a
                       fully split schedule over a mixed one only if predicted faster by more than
                       this (clamped; null = the planner's fixed margin)   [null]

Memory: with ``state_bytes`` (and ``pending_w_bytes``) given, plans count a worker's memory in
bytes; without them every micro-batch state (an activation held from F to B, or a pending W from B
to W) weighs 1, and the memory cap is a number of states (:meth:`CostModel.memory_weights`).

How each step agrees on the global gradient norm (clipping) and fp16 overflow, and what that costs
(see ``runtime/validation.py`` and :mod:`ds_resilience.ir.replay`)::

    step_check         "none" (no clipping, no fp16), "barrier" (every survivor all-reduces the
                       norm before any stage steps: OPT_STEP becomes a global collective) or
                       "speculative" (each stage publishes its norm and steps at once; every
                       worker validates before its next iteration)          ["none"]
    t_sync             one agreement message: the barrier's scalar all-reduce, or one store
                       round trip (a publication is 2, reading the norms 2 per stage)  [0]
    t_undo             rolling a stage back to its pre-step state (per stage)  [0]
    check_waits        speculative: fraction of steps that wait for every stage's norm (the
                       last step clipped or overflowed, or the stage's own norm decides)  [0]
    check_rollbacks    speculative: fraction of steps rolled back and redone    [0]
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from .errors import CostModelError

__all__ = ["CostModel", "StageCosts", "parse_size", "format_memory"]

_PER_STAGE = ("t_f", "t_b", "t_w", "t_opt", "t_reduce", "t_tied_reduce", "t_recompute", "activation_bytes",
              "t_undo", "state_bytes", "pending_w_bytes", "t_fused")
_OPTIONAL = ("t_undo", "state_bytes", "pending_w_bytes", "t_fused")
"""Per-stage fields left out of ``to_dict`` when all zero (older models keep their form and cache key)."""
_SCALAR = ("p2p_latency", "p2p_bandwidth", "t_sync", "check_waits", "check_rollbacks")
STEP_CHECKS = ("none", "barrier", "speculative")
"""How a step agrees on the global gradient norm / overflow (``step_check``)."""


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: object, *, what: str = "memory_cap") -> tuple[float, bool]:
    """Read a cap: a number (in the cost model's memory unit) or a size string (``"24GiB"``).

    Returns ``(value, in_bytes)``: ``in_bytes`` is true for a size string, which only a cost model
    with memory figures can honour.

    Raises:
        ValueError: not a positive number or a size with a known unit (callers re-raise it as
            their own error: ``ConfigError``, ``PlanningError``).
    """
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number or a size such as '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{what} must be > 0, got {value!r}")
        return float(value), False
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).upper() if match else None
        if match and unit in _UNITS:
            number = float(match.group(1)) * _UNITS[unit]
            if number <= 0:
                raise ValueError(f"{what} must be > 0, got {value!r}")
            return number, unit != ""
        raise ValueError(f"{what}: cannot read {value!r}; give a number or a size with a unit "
                            f"({', '.join(u for u in _UNITS if u)}), e.g. '24GiB'")
    raise ValueError(f"{what} must be a number or a size such as '24GiB', got {type(value).__name__}")


def format_memory(value: float, unit: str) -> str:
    """``3.2 GiB`` for bytes, ``4 states`` for states."""
    if unit != "bytes":
        return f"{value:g} states"
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {name}"
    return f"{value:g} B"


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCosts:
    """Resolved costs of one stage. ``t_b`` is B's whole time, its ``t_recompute`` included: what
    every planner, bound and replay uses; ``t_bw`` the fused backward's (``t_fused``, or ``t_b +
    t_w``), recompute included too."""

    t_f: float
    t_b: float
    t_w: float
    t_opt: float
    t_reduce: float
    t_tied_reduce: float
    t_recompute: float
    activation_bytes: float
    t_undo: float = 0.0
    state_bytes: float = 0.0
    pending_w_bytes: float = 0.0
    t_fused: float = 0.0
    t_bw: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Per-stage compute costs and a latency/bandwidth link model.

    A per-stage field is a tuple: of length 1 (applies to every stage) or one entry per stage.
    """

    name: str = "unit"
    t_f: tuple[float, ...] = (1.0,)
    t_b: tuple[float, ...] = (1.0,)
    t_w: tuple[float, ...] = (1.0,)
    t_opt: tuple[float, ...] = (0.0,)
    t_reduce: tuple[float, ...] = (0.0,)
    t_tied_reduce: tuple[float, ...] = (0.0,)
    t_recompute: tuple[float, ...] = (0.0,)
    activation_bytes: tuple[float, ...] = (0.0,)
    p2p_latency: float = 0.0
    p2p_bandwidth: float | None = None
    t_undo: tuple[float, ...] = (0.0,)
    state_bytes: tuple[float, ...] = (0.0,)
    pending_w_bytes: tuple[float, ...] = (0.0,)
    t_fused: tuple[float, ...] = (0.0,)
    step_check: str = "none"
    t_sync: float = 0.0
    check_waits: float = 0.0
    check_rollbacks: float = 0.0
    split_noise: float | None = None

    def __post_init__(self) -> None:
        for name in _PER_STAGE:
            raw = getattr(self, name)
            values = tuple(raw) if isinstance(raw, (list, tuple)) else (raw,)
            if not values:
                raise CostModelError(f"cost model {self.name!r}: {name} is empty")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise CostModelError(
                        f"cost model {self.name!r}: {name} must hold finite numbers >= 0, got {v!r}"
                    )
            object.__setattr__(self, name, tuple(float(v) for v in values))
        if isinstance(self.p2p_latency, bool) or not isinstance(self.p2p_latency, (int, float)) or self.p2p_latency < 0:
            raise CostModelError(f"cost model {self.name!r}: p2p_latency must be >= 0, got {self.p2p_latency!r}")
        bw = self.p2p_bandwidth
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw <= 0):
            raise CostModelError(f"cost model {self.name!r}: p2p_bandwidth must be > 0 or null, got {bw!r}")
        if self.step_check not in STEP_CHECKS:
            raise CostModelError(f"cost model {self.name!r}: step_check must be one of {', '.join(STEP_CHECKS)}, "
                                 f"got {self.step_check!r}")
        for name in ("t_sync", "check_waits", "check_rollbacks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise CostModelError(f"cost model {self.name!r}: {name} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        noise = self.split_noise
        if noise is not None:
            if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
                raise CostModelError(f"cost model {self.name!r}: split_noise must be a finite number >= 0 or null, "
                                     f"got {noise!r}")
            object.__setattr__(self, "split_noise", float(noise))
        if self.check_waits + self.check_rollbacks > 1.0 + 1e-12:
            raise CostModelError(f"cost model {self.name!r}: check_waits + check_rollbacks are fractions of the "
                                 f"steps and must sum to at most 1, got {self.check_waits} + {self.check_rollbacks}")
        if any(self.pending_w_bytes) and not any(self.state_bytes):
            raise CostModelError(f"cost model {self.name!r}: pending_w_bytes needs state_bytes (memory is counted in "
                                 "bytes only when a held activation's size is known)")
        if self.t_f and all(f == 0 for f in self.t_f):
            raise CostModelError(f"cost model {self.name!r}: t_f must be > 0 for some stage")

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def unit(cls) -> "CostModel":
        """t_F = t_B = t_W = 1, free optimizer and communication (the reference model)."""
        return cls()

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "cost model") -> "CostModel":
        """Build from a JSON object; unknown keys raise :class:`CostModelError`."""
        if not isinstance(data, dict):
            raise CostModelError(f"{source}: expected a JSON object, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed - {"comment", "measured"})  # a profile's report rides along
        if unknown:
            raise CostModelError(f"{source}: unknown keys {unknown}; allowed: {sorted(allowed)}")
        kwargs = {k: v for k, v in data.items() if k in allowed}
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise CostModelError(f"{source}: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Load a cost model from a JSON file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise CostModelError(f"cost model file {str(path)!r} does not exist") from exc
        except json.JSONDecodeError as exc:
            raise CostModelError(f"cost model file {str(path)!r} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``from_dict`` reads it back). A model without rollback costs or a step check
        keeps the form (and the plan-table cache key) it had before those fields existed."""
        out: dict[str, Any] = {"name": self.name}
        for name in _PER_STAGE:
            values = getattr(self, name)
            if name in _OPTIONAL and not any(values):
                continue
            out[name] = values[0] if len(values) == 1 else list(values)
        out["p2p_latency"] = self.p2p_latency
        out["p2p_bandwidth"] = self.p2p_bandwidth
        if self.step_check != "none":
            for name in ("step_check", "t_sync", "check_waits", "check_rollbacks"):
                out[name] = getattr(self, name)
        if self.split_noise is not None:
            out["split_noise"] = self.split_noise
        return out

    def step_mix(self) -> tuple[tuple[str, float], ...]:
        """The replay modes of a step and their weights: ``(("plain", 1),)`` without a step check,
        ``(("barrier", 1),)`` for the barrier, and for speculation the fractions of steps that
        ``speculate`` (and hold), ``wait`` for every norm, or ``rollback`` (zero weights dropped)."""
        if self.step_check == "none":
            return (("plain", 1.0),)
        if self.step_check == "barrier":
            return (("barrier", 1.0),)
        mix = (("speculate", 1.0 - self.check_waits - self.check_rollbacks), ("wait", self.check_waits),
               ("rollback", self.check_rollbacks))
        return tuple((m, w) for m, w in mix if w > 1e-12)

    # --- queries ---------------------------------------------------------------------------
    def check_stages(self, pp: int) -> None:
        """Raise :class:`CostModelError` unless every per-stage list fits ``pp`` stages."""
        for name in _PER_STAGE:
            n = len(getattr(self, name))
            if n not in (1, pp):
                raise CostModelError(
                    f"cost model {self.name!r}: {name} has {n} entries, expected 1 or pp={pp}"
                )

    def stages(self, pp: int) -> tuple[StageCosts, ...]:
        """Costs of stages ``0..pp-1``, resolved once (for hot loops)."""
        self.check_stages(pp)
        return tuple(self.stage(s) for s in range(pp))

    def stage(self, stage: int) -> StageCosts:
        """Costs of ``stage`` (a length-1 field applies to all stages)."""

        def pick(values: Sequence[float]) -> float:
            if len(values) == 1:
                return values[0]
            if stage >= len(values):
                raise CostModelError(
                    f"cost model {self.name!r} has {len(values)} stages, no entry for stage {stage}"
                )
            return values[stage]

        picked = {name: pick(getattr(self, name)) for name in _PER_STAGE}
        fused = picked["t_fused"] or picked["t_b"] + picked["t_w"]
        picked["t_b"] += picked["t_recompute"]  # B recomputes the stage's forward first
        picked["t_bw"] = fused + picked["t_recompute"]  # and so does the fused backward
        return StageCosts(**picked)

    @property
    def has_memory(self) -> bool:
        """Whether the model gives memory in bytes (``state_bytes``); else memory counts states."""
        return any(self.state_bytes)

    @property
    def memory_unit(self) -> str:
        """``"bytes"`` or ``"states"`` (micro-batch states): the unit of memory caps and peaks."""
        return "bytes" if self.has_memory else "states"

    def memory_weights(self, pp: int) -> tuple[tuple[float, float], ...]:
        """Per stage, what one held activation and one pending W weigh in :attr:`memory_unit`:
        ``(state_bytes, pending_w_bytes)``, or ``(1, 1)`` for a model without memory figures."""
        if not self.has_memory:
            return tuple((1.0, 1.0) for _ in range(pp))
        return tuple((c.state_bytes, c.pending_w_bytes) for c in self.stages(pp))

    def tied_reduce_time(self, group: Sequence[int]) -> float:
        """Duration of one TIED_REDUCE of the tied group holding ``group``'s stages: the slowest
        stage's ``t_tied_reduce`` (the collective ends for all its members at once)."""
        return max((self.stage(s).t_tied_reduce for s in group), default=0.0)

    def transfer_time(self, nbytes: float) -> float:
        """Time a message of ``nbytes`` occupies a link (serialization), excluding latency."""
        if self.p2p_bandwidth is None or nbytes <= 0:
            return 0.0
        return nbytes / self.p2p_bandwidth
