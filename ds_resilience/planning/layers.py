"""A per-layer profile: what each layer of the model costs, the input of pipeline templates.

The stage-level cost model (:mod:`ds_resilience.costs`) rates a fixed partition; a template
(:mod:`.templates`) *chooses* the partition, so it needs the costs of each layer. One row per layer,
in model order (JSON: ``{"layers": [{...}, ...]}``, or the columns as lists of equal length)::

    t_f, t_b, t_w       forward, input-gradient and weight-gradient time of one micro-batch
    param_bytes         the layer's weights (and their gradients' buffer)          [0]
    optimizer_bytes     its optimizer state (moments, fp32 masters)                 [0]
    activation_bytes    what one micro-batch keeps from its F to its B               [0]
    output_bytes        the activation one micro-batch sends to the next layer      [0]

Pure Python.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import CostModelError

__all__ = ["LayerProfile", "LAYER_FIELDS"]

LAYER_FIELDS = ("t_f", "t_b", "t_w", "param_bytes", "optimizer_bytes", "activation_bytes", "output_bytes")
_REQUIRED = ("t_f", "t_b", "t_w")


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer costs (see the module docstring); every field a tuple with one value per layer."""

    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    param_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    name: str = "layers"

    def __post_init__(self) -> None:
        n = len(self.t_f)
        if n < 1:
            raise CostModelError("a layer profile needs at least one layer")
        for field in LAYER_FIELDS:
            values = getattr(self, field)
            if len(values) != n:
                raise CostModelError(f"layer profile: {field} has {len(values)} values for {n} layers")
            bad = [i for i, v in enumerate(values) if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
            if bad:
                raise CostModelError(f"layer profile: {field} of layers {bad[:5]} must be finite and >= 0")
        if not any(self.t_f[i] + self.t_b[i] + self.t_w[i] > 0 for i in range(n)):
            raise CostModelError("layer profile: every layer takes no time (t_f + t_b + t_w = 0)")

    @property
    def num_layers(self) -> int:
        return len(self.t_f)

    @classmethod
    def uniform(cls, layers: int, *, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0, param_bytes: float = 0.0,
                optimizer_bytes: float = 0.0, activation_bytes: float = 0.0, output_bytes: float = 0.0,
                name: str = "uniform") -> "LayerProfile":
        """``layers`` identical layers."""
        if not isinstance(layers, int) or layers < 1:
            raise CostModelError(f"layers must be an integer >= 1, got {layers!r}")
        row = dict(t_f=t_f, t_b=t_b, t_w=t_w, param_bytes=param_bytes, optimizer_bytes=optimizer_bytes,
                   activation_bytes=activation_bytes, output_bytes=output_bytes)
        return cls(**{k: (float(v),) * layers for k, v in row.items()}, name=name)

    @classmethod
    def from_rows(cls, rows: Sequence[dict[str, Any]], *, name: str = "layers") -> "LayerProfile":
        if not isinstance(rows, (list, tuple)) or not rows:
            raise CostModelError("layer profile: 'layers' must be a non-empty list of rows")
        columns: dict[str, list[float]] = {f: [] for f in LAYER_FIELDS}
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise CostModelError(f"layer profile: layer {i} must be an object, got {type(row).__name__}")
            unknown = sorted(set(row) - set(LAYER_FIELDS) - {"name", "comment"})
            if unknown:
                raise CostModelError(f"layer profile: layer {i} has unknown fields {unknown}; allowed: "
                                     f"{', '.join(LAYER_FIELDS)}")
            missing = [f for f in _REQUIRED if f not in row]
            if missing:
                raise CostModelError(f"layer profile: layer {i} lacks {missing}")
            for f in LAYER_FIELDS:
                columns[f].append(row.get(f, 0.0))
        return cls(**{f: tuple(v) for f, v in columns.items()}, name=name)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "layer profile") -> "LayerProfile":
        """``{"layers": [rows]}`` or the columns (``{"t_f": [...], ...}``)."""
        if not isinstance(data, dict):
            raise CostModelError(f"{source}: expected a JSON object, got {type(data).__name__}")
        name = str(data.get("name", "layers"))
        if "layers" in data:
            return cls.from_rows(data["layers"], name=name)
        unknown = sorted(set(data) - set(LAYER_FIELDS) - {"name", "comment"})
        if unknown:
            raise CostModelError(f"{source}: unknown fields {unknown}; allowed: layers, {', '.join(LAYER_FIELDS)}")
        missing = [f for f in _REQUIRED if f not in data]
        if missing:
            raise CostModelError(f"{source}: lacks {missing}")
        n = len(data["t_f"])
        return cls(**{f: tuple(data.get(f, [0.0] * n)) for f in LAYER_FIELDS}, name=name)

    @classmethod
    def load(cls, path: str | Path) -> "LayerProfile":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise CostModelError(f"{path}: cannot read the layer profile: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layers": [{f: getattr(self, f)[i] for f in LAYER_FIELDS}
                                               for i in range(self.num_layers)]}
