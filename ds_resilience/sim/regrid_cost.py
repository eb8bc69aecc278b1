"""What a live re-grid costs, as the engine measured it: a fixed part and a part per byte moved.

A re-grid (``integrations/ds_regrid.py``) pauses the survivors for

* a **fixed part**, ``rebuild_s``: the survivors' group, the step they agree on, the plan, the
  process groups of the new grid and the engine rebuilt for each worker's new position;
* a **per-byte part**, ``bytes / bytes_per_s``: the lost stages' state fetched from the in-memory
  snapshots and the layers moved between survivors. Every receiver receives at once, so the pause
  is set by the busiest receiver's bytes.

The constants (:data:`MEASURED`) are fitted from ``benchmarks/regrid.py --fit`` (see
``docs/benchmarks/regrid.md``): the example GPT at several widths, CPU processes on gloo over
loopback. :data:`CLUSTER` is that cost on the traces' cluster (30 x A40 nodes, 200 Gbps
InfiniBand, the model profiles' comment): the per-byte part scaled by the ratio of that link to the
loopback link measured in the same run (the re-grid's transfer path reaches the same fraction of
its link's raw bandwidth on both), the fixed part as measured (see the doc for what that leaves
out). What the busiest receiver takes in a re-grid onto ``stages`` stages is modelled as one whole
new stage's state (:func:`regrid_bytes`): weights and optimizer state, not gradients (a re-grid
happens at an iteration boundary). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .traces import SimulationError

__all__ = [
    "RegridCostError",
    "RegridCost",
    "regrid_bytes",
    "STATE_BYTES_PER_PARAM",
    "MEASURED",
    "MEASURED_LINK_BYTES_PER_S",
    "CLUSTER_LINK_BYTES_PER_S",
    "CLUSTER",
]


class RegridCostError(SimulationError):
    """Constants of a re-grid cost model, or the bytes asked about, are not valid numbers."""


def _number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise RegridCostError(f"re-grid cost: {name} must be a finite number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class RegridCost:
    """Pause of a live re-grid: ``rebuild_s`` plus the busiest receiver's bytes at ``bytes_per_s``.

    Raises:
        RegridCostError: ``rebuild_s`` is not a finite number >= 0 or ``bytes_per_s`` not one > 0.
    """

    rebuild_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "rebuild_s", _number("rebuild_s", self.rebuild_s, positive=False))
        object.__setattr__(self, "bytes_per_s", _number("bytes_per_s", self.bytes_per_s, positive=True))

    def transfer_s(self, bytes_moved: float) -> float:
        """Seconds to move ``bytes_moved`` (the per-byte part alone)."""
        return _number("bytes_moved", bytes_moved, positive=False) / self.bytes_per_s

    def pause_s(self, bytes_moved: float) -> float:
        """Seconds the survivors pause for a re-grid whose busiest receiver takes ``bytes_moved``."""
        return self.rebuild_s + self.transfer_s(bytes_moved)

    def scaled(self, *, link_bytes_per_s: float, measured_link_bytes_per_s: float) -> "RegridCost":
        """The same re-grid on another link: the per-byte part scaled by the links' ratio, the fixed
        part unchanged."""
        link = _number("link_bytes_per_s", link_bytes_per_s, positive=True)
        measured = _number("measured_link_bytes_per_s", measured_link_bytes_per_s, positive=True)
        return RegridCost(rebuild_s=self.rebuild_s, bytes_per_s=self.bytes_per_s * link / measured)


STATE_BYTES_PER_PARAM = 14.0
"""Bytes of state a re-grid moves per parameter on the traces' GPUs: bf16 weights (2), fp32 master
weights (4) and Adam's two moments (8); gradients are not moved. (The live benchmark's fp32 job
moves 12: weights and two moments.)"""


def regrid_bytes(params: float, stages: int, *, bytes_per_param: float = STATE_BYTES_PER_PARAM) -> float:
    """Bytes the busiest receiver takes in a re-grid onto ``stages`` stages: one stage's state,
    ``params * bytes_per_param / stages``.

    Raises:
        RegridCostError: ``params`` or ``bytes_per_param`` is not a finite number >= 0, or
            ``stages`` is not an integer >= 1.
    """
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise RegridCostError(f"re-grid cost: stages must be an integer >= 1, got {stages!r}")
    return _number("params", params, positive=False) * _number("bytes_per_param", bytes_per_param,
                                                               positive=False) / stages


MEASURED = RegridCost(rebuild_s=0.335, bytes_per_s=5.92e7)
"""Fitted by ``benchmarks/regrid.py --fit 64,256,512`` on the development machine (2 shared vCPUs,
CPU processes, gloo over loopback; 2026-11-29): the example GPT at 0.21M, 3.2M and 12.7M
parameters re-gridded from 3 x 2 onto 2 x 2 (``docs/benchmarks/regrid.md``)."""

MEASURED_LINK_BYTES_PER_S = 1.41e9
"""Raw gloo send/recv over loopback between two processes, measured in the same run (1.4 GB/s;
0.37-2.2 GB/s over four probes that day on the loaded machine)."""

CLUSTER_LINK_BYTES_PER_S = 25.0e9
"""The traces' cluster: 200 Gbps InfiniBand per node (Oobleck's evaluation, the profiles' comment)."""

CLUSTER = MEASURED.scaled(link_bytes_per_s=CLUSTER_LINK_BYTES_PER_S,
                          measured_link_bytes_per_s=MEASURED_LINK_BYTES_PER_S)
"""The measured cost on the traces' cluster (the template tier's default; see the module docstring)."""
