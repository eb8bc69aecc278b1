"""From what every rank measured to one cost model: the profile the planner, the engine and the
trace simulator all read.

Each rank reports one row (``integrations/ds_profile.py`` measures it on the real model, in the
job's own iterations): its stage, the durations of its actions by kind (``F``, ``B``, ``W`` from
decoupled iterations, ``BW`` from fused 1F1B ones, ``OPT``, ``RD``), the memory one micro-batch's
activations take from F to B and its pending W from B to W, the bytes crossing its output boundary,
and, for ranks that pinged a neighbour, a latency and a bandwidth. Per stage the figure is the
median over the stage's ranks' samples (a re-routed job measures the same code on every replica).

Rows may also carry ``fused_iters`` and ``split_iters``: per iteration of the profile (they
alternate, fused first), the median fused backward and the median B plus the median W. How far
their ratio moves between iterations is the model's ``split_noise`` (:func:`split_noise`), from
which the planner sets its margin for keeping a fully split schedule over a mixed one.

The fused backward is measured, not assumed: it is the model's ``t_fused`` (what every plan with
a fused backward, 1F1B's included, is rated with), and the ``measured`` section puts it next to
``t_b + t_w``: their ratio says what the B/W split costs on this hardware. Times are in seconds.
Pure Python.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping

from ..costs import CostModel
from ..errors import CostModelError

__all__ = ["cost_from_profile", "profile_summary", "split_noise"]

_TIMES = {"t_f": "F", "t_b": "B", "t_w": "W", "t_fused": "BW", "t_opt": "OPT", "t_reduce": "RD", "t_tied_reduce": "TR"}


def _median(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return statistics.median(values) if values else 0.0


def _per_stage(rows: list[Mapping[str, Any]], pp: int, pick) -> list[float]:
    out = []
    for s in range(pp):
        samples: list[float] = []
        for row in rows:
            if row["stage"] == s:
                samples.extend(pick(row))
        out.append(_median(samples))
    return out


def cost_from_profile(rows: list[Mapping[str, Any]], pp: int, *, name: str = "profiled") -> CostModel:
    """The cost model of the measured rows (see the module docstring).

    Raises:
        CostModelError: a stage without any row, or a stage whose forward, B or W was never timed.
    """
    missing = sorted(set(range(pp)) - {int(r["stage"]) for r in rows})
    if missing:
        raise CostModelError(f"profile: no rank reported for stages {missing}")
    fields: dict[str, Any] = {}
    for field, kind in _TIMES.items():
        fields[field] = _per_stage(rows, pp, lambda r, k=kind: r.get("durations", {}).get(k, ()))
    for field in ("t_f", "t_b", "t_w"):
        zero = [s for s, v in enumerate(fields[field]) if v <= 0]
        if zero:
            raise CostModelError(f"profile: {field} was not measured on stages {zero} (the profile runs decoupled "
                                 "iterations to time B and W apart)")
    fields["state_bytes"] = _per_stage(rows, pp, lambda r: [r["state_bytes"]] if r.get("state_bytes") else [])
    fields["pending_w_bytes"] = _per_stage(rows, pp, lambda r: [r["pending_w_bytes"]] if r.get("pending_w_bytes") else [])
    fields["activation_bytes"] = _per_stage(rows, pp, lambda r: [r["activation_bytes"]] if r.get("activation_bytes") else [])
    if not any(fields["state_bytes"]):
        fields.pop("state_bytes")
        fields.pop("pending_w_bytes")
    noise = split_noise(rows, pp)
    if noise is not None:
        fields["split_noise"] = noise
    latency = _median(r["p2p_latency"] for r in rows if r.get("p2p_latency"))
    bandwidth = _median(r["p2p_bandwidth"] for r in rows if r.get("p2p_bandwidth"))
    return CostModel(name=name, p2p_latency=latency, p2p_bandwidth=bandwidth or None, **fields)


def split_noise(rows: list[Mapping[str, Any]], pp: int) -> float | None:
    """How far the split's price moved during the profile: per stage, the ratio of each decoupled
    iteration's B + W to the fused backward of the iteration before it, on every rank of the stage;
    the half-range of those ratios over their median; the largest over the stages. None when no
    stage has two ratios (one rank, one pair of iterations)."""
    worst = None
    for s in range(pp):
        ratios = [b / f for r in rows if int(r["stage"]) == s
                  for f, b in zip(r.get("fused_iters", ()), r.get("split_iters", ())) if f > 0]
        if len(ratios) < 2:
            continue
        spread = (max(ratios) - min(ratios)) / (2 * statistics.median(ratios))
        worst = spread if worst is None else max(worst, spread)
    return worst


def profile_summary(rows: list[Mapping[str, Any]], pp: int, cost: CostModel) -> dict[str, Any]:
    """The cost model's JSON plus a ``measured`` section: the fused backward per stage and what the
    split costs (``(t_b + t_w) / fused``), the sample counts and the ranks that reported."""
    stages = cost.stages(pp)
    fused = [c.t_fused for c in stages]  # as measured (0: no fused iteration ran)
    split = [(c.t_b + c.t_w) / f if f > 0 else None for c, f in zip(stages, fused)]
    samples = {kind: sum(len(r.get("durations", {}).get(kind, ())) for r in rows) for kind in ("F", "B", "W", "BW")}
    out = cost.to_dict()
    out["measured"] = {"fused_backward": fused, "split_over_fused": split, "samples": samples,
                       "ranks": sorted(int(r["rank"]) for r in rows if "rank" in r), "unit": "seconds"}
    return out
