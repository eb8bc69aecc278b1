"""Fuse the backward on the stages where the split does not pay, keep it split elsewhere.

A profile can find B + W dearer than the fused backward on one stage (on a CPU, the last stage's
head and loss: 1.28x in ``benchmarks/engine.py --world 2``) and not on another (stage 0: 0.98x).
The split variants (``decoupled``, ``recycle``) split every stage, so such a stage pays the
difference on every micro-batch. A *mixed* schedule runs fused BW on those stages and B/W on the
others; the planner tries it next to the fully split one and keeps the split one only where the
replay finds it faster by more than the margin (:func:`split_margin`: the profile's measured noise, or
:data:`SPLIT_MARGIN`; :func:`prefer_mixed`).

One observation does all the work: a fused BW on stage ``s`` is a B lasting ``t_bw`` followed at
once by a W lasting nothing and holding nothing. So a mixed schedule under the cost model ``cost``
is a fully split schedule under :func:`as_split` ``(cost, stages)`` (those stages' ``t_b`` set to
their fused time, ``t_w`` and ``pending_w_bytes`` to 0), and back with :func:`fuse`. The list
scheduler (Python and C) makes mixed schedules with no change, and every lower bound on split
schedules under the second model bounds the mixed ones (:func:`ds_resilience.planning.bounds.lower_bound`
takes the smaller of the two). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from ..costs import CostModel
from ..ir import Schedule
from ..ir.action import ActionKind, trusted_action

__all__ = ["SPLIT_MARGIN", "MARGIN_RANGE", "as_split", "costly_stages", "fusable_stages", "fuse", "fused_in",
           "prefer_mixed", "split_margin"]

_SLACK = 1e-9  # relative: a stage whose B + W is within this of its fused time is split as before

#: How much faster (relative) the replay must find the fully split schedule than the mixed one for
#: the split to be kept on the costly stages. A smaller predicted gain is inside a profile's own
#: noise: the same job, profiled again and again on dedicated cores (docs/benchmarks/engine.md, "The same rows
#: with a core per worker, and the split's margin"), measured its last stage's B + W at 1.06-1.75x
#: its fused backward, and a run whose profiles predicted the split 0.9% and 3.1% faster ran at
#: 0.870 of vanilla DeepSpeed against 0.968 for 1F1B. The mixed schedule also holds no pending W
#: on its fused stages, so in a tie it is the one to run. The margin of a model that says nothing of
#: its noise (hand-written, unit costs); a profile measures its own (:func:`split_margin`).
SPLIT_MARGIN = 0.05

#: The margin a profile's measured noise is clamped to: at least 1% (a tie, and the replay's own
#: error, go to the schedule that holds no pending W on its fused stages), at most 25% (past that
#: the profile says little; only a large predicted gain keeps the split).
MARGIN_RANGE = (0.01, 0.25)


def split_margin(cost: CostModel) -> float:
    """How much faster the fully split schedule must be predicted under ``cost`` to be kept over
    the mixed one: the profile's measured ``split_noise`` (how far (B + W) / fused moved between its
    iterations) clamped to :data:`MARGIN_RANGE`, or :data:`SPLIT_MARGIN` for a model without it."""
    if cost.split_noise is None:
        return SPLIT_MARGIN
    low, high = MARGIN_RANGE
    return min(high, max(low, cost.split_noise))


def prefer_mixed(mixed_time: float, split_time: float, margin: float = SPLIT_MARGIN) -> bool:
    """Whether to run the mixed schedule (``mixed_time``, replayed) rather than the fully split one
    (``split_time``): unless the split one is predicted faster by more than ``margin``
    (:func:`split_margin` of the cost model both were replayed under)."""
    return mixed_time <= split_time * (1 + margin) + 1e-12


def costly_stages(cost: CostModel, pp: int) -> tuple[int, ...]:
    """The stages whose split backward costs more than their fused one (``t_b + t_w > t_bw``): the
    ones a mixed schedule runs fused. Empty under any model without ``t_fused`` (unit costs)."""
    out = []
    for s, c in enumerate(cost.stages(pp)):
        if c.t_b + c.t_w > c.t_bw * (1 + _SLACK) + _SLACK:
            out.append(s)
    return tuple(out)


def fusable_stages(cost: CostModel, pp: int, variant: str) -> tuple[int, ...]:
    """The stages ``variant``'s plans may run fused: :func:`costly_stages` for the split variants,
    none for ``adaptive`` (fused everywhere already). The heuristic's candidates and the lower bound
    both read it, so the bound covers every plan the heuristic can return."""
    return costly_stages(cost, pp) if variant != "adaptive" else ()


def as_split(cost: CostModel, stages: tuple[int, ...], pp: int) -> CostModel:
    """``cost`` with each of ``stages`` read as a split stage whose B is its fused backward and whose
    W lasts nothing and holds nothing (see the module docstring); other stages unchanged."""
    if not stages:
        return cost
    cost.check_stages(pp)

    def per_stage(name: str) -> list[float]:
        values = getattr(cost, name)
        return list(values) * pp if len(values) == 1 else list(values)

    t_b, t_w, t_fused, pending = (per_stage(n) for n in ("t_b", "t_w", "t_fused", "pending_w_bytes"))
    for s in stages:
        fused = t_fused[s] or t_b[s] + t_w[s]  # recompute is added on top by CostModel.stage, as before
        t_b[s], t_w[s], t_fused[s], pending[s] = fused, 0.0, fused, 0.0
    return replace(cost, name=f"{cost.name}, stages {list(stages)} fused", t_b=tuple(t_b), t_w=tuple(t_w),
                   t_fused=tuple(t_fused), pending_w_bytes=tuple(pending))


def fuse(schedule: Schedule, stages: tuple[int, ...]) -> Schedule:
    """``schedule`` with every B of ``stages`` made a fused BW and their W's dropped (a W there lasts
    nothing under :func:`as_split`, so the timing is the same); other stages untouched."""
    if not stages:
        return schedule
    chosen = frozenset(stages)
    workers = []
    for actions in schedule.workers:
        if not any(a.stage in chosen and a.kind in (ActionKind.B, ActionKind.W) for a in actions):
            workers.append(actions)
            continue
        out = []
        for a in actions:
            if a.stage in chosen and a.kind is ActionKind.B:
                out.append(trusted_action(ActionKind.BW, a.stage, a.microbatch, a.pipeline))
            elif not (a.stage in chosen and a.kind is ActionKind.W):
                out.append(a)
        workers.append(tuple(out))
    return replace(schedule, workers=tuple(workers))


def fused_in(schedule: Schedule) -> list[int]:
    """The stages whose backward ``schedule`` runs fused (a BW action), ascending: for a split
    variant's schedule, the stages :func:`fuse` fused."""
    return sorted({a.stage for actions in schedule.workers for a in actions if a.kind is ActionKind.BW})
