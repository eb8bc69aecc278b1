"""Fault-free schedule generators: 1F1B (DeepSpeed's order) and decoupled backward (ZB-H1 style).

Both are pure functions of the grid (and, for the decoupled one, the cost model) that return a
validated :class:`Schedule`. ``tied`` (the model's tied groups, e.g. ``((0, 3),)`` for tied
embeddings on 4 stages) adds each group's TIED_REDUCE right after REDUCE_GRAD on its stages' workers
(DeepSpeed runs its ``ReduceTiedGrads`` before ``ReduceGrads``; the order within the tail does not
change the sums).
"""

from __future__ import annotations

from functools import lru_cache

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import Action, ActionKind, Schedule, TiedGroups, validate
from ..ir.timeline import iteration_time
from ..vocab import SCHEDULES
from .list_scheduler import list_schedule
from .lowering import lower
from .stage_mix import as_split, costly_stages, fuse, prefer_mixed, split_margin

__all__ = ["one_f_one_b", "decoupled", "decoupled_candidates", "one_f_one_b_order", "activation_caps", "SCHEDULES", "generate"]


def check_grid(dp: int, pp: int, microbatches: int) -> None:
    """Raise :class:`PlanningError` unless the grid's three sizes are integers >= 1."""
    for name, value in (("dp", dp), ("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise PlanningError(f"{name} must be an integer >= 1, got {value!r}")


def activation_caps(pp: int, microbatches: int) -> list[int]:
    """1F1B's in-flight activations per stage: ``min(pp - s, microbatches)`` (DeepSpeed's buffers)."""
    return [min(pp - s, microbatches) for s in range(pp)]


def one_f_one_b_order(stage: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """DeepSpeed ``TrainSchedule``'s compute order at ``stage``: ``[("F", 0), ("F", 1), ("B", 0), ...]``.

    ``pp - stage`` warm-up forwards (capped by the micro-batch count), then alternating backward and
    forward, then the remaining backwards.
    """
    warmup = min(pp - stage, microbatches)
    order = [("F", m) for m in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < microbatches:
        order.append(("B", next_b))
        next_b += 1
        if next_f < microbatches:
            order.append(("F", next_f))
            next_f += 1
    return order


def one_f_one_b(dp: int, pp: int, microbatches: int, *, tied: TiedGroups = ()) -> Schedule:
    """The 1F1B schedule DeepSpeed runs today (fused backward, one global optimizer step).

    The last two grids' schedules are kept (schedules are immutable): a plan asks for 1F1B's time
    and for its memory peak, and at D=64 x P=16 each generation is a second."""
    try:
        key = tuple(tuple(g) for g in tied)
        hash(key)
    except TypeError:  # not groups of stages: the lowering's check says what is wrong
        return _one_f_one_b.__wrapped__(dp, pp, microbatches, tied)
    return _one_f_one_b(dp, pp, microbatches, key)


@lru_cache(maxsize=2)
def _one_f_one_b(dp: int, pp: int, microbatches: int, tied: TiedGroups) -> Schedule:
    check_grid(dp, pp, microbatches)
    orders = []
    for w in range(dp * pp):
        stage, pipeline = divmod(w, dp)
        orders.append(
            [
                Action(kind=ActionKind.F if k == "F" else ActionKind.BW, stage=stage, microbatch=m, pipeline=pipeline)
                for k, m in one_f_one_b_order(stage, pp, microbatches)
            ]
        )
    return validate(lower(orders, dp=dp, pp=pp, microbatches=microbatches, name="1f1b", tied=tied))


def decoupled(
    dp: int, pp: int, microbatches: int, cost: CostModel | None = None, *, tied: TiedGroups = ()
) -> Schedule:
    """Decoupled backward in the style of ZB-H1.

    B (input gradient) stays on the critical path; W (weight gradient) fills what would be idle
    time, mostly the cool-down bubble. In-flight activations (F done, B not yet) never exceed
    1F1B's on any stage (``pp - s``); pending W at stage ``s`` are capped at ``s + 1``, so a worker
    holds at most ``pp + 1`` micro-batches of state of either kind, as in ZB-H1.

    Under a cost model (a profile) whose split backward is dearer than the fused one on some
    stages (:func:`.stage_mix.costly_stages`), the *mixed* schedule that runs those stages fused
    is built too, and returned unless the replay under ``cost`` finds the fully split one faster
    by more than the model's margin (:func:`.stage_mix.split_margin`): a stage where
    the split does not pay stops paying for it on every micro-batch of a healthy run.
    """
    cost = cost or CostModel.unit()
    split, fused = decoupled_candidates(dp, pp, microbatches, cost, tied=tied)
    if fused is None:
        return split
    keep_mixed = prefer_mixed(iteration_time(fused, cost, "decoupled"), iteration_time(split, cost, "decoupled"),
                              split_margin(cost))
    return fused if keep_mixed else split


def decoupled_candidates(
    dp: int, pp: int, microbatches: int, cost: CostModel, *, tied: TiedGroups = ()
) -> tuple[Schedule, Schedule | None]:
    """:func:`decoupled`'s two candidates: the fully split schedule, and the mixed one fusing the
    costly stages (``None`` without a costly stage)."""
    check_grid(dp, pp, microbatches)
    cost.check_stages(pp)
    split = _decoupled(dp, pp, microbatches, cost, (), tied)
    costly = costly_stages(cost, pp)
    return split, (_decoupled(dp, pp, microbatches, cost, costly, tied) if costly else None)


def _decoupled(dp: int, pp: int, microbatches: int, cost: CostModel, fused: tuple[int, ...],
               tied: TiedGroups) -> Schedule:
    """:func:`decoupled`'s list schedule with the stages ``fused`` run fused (listed as split
    stages whose W lasts nothing, right after their B: :func:`.stage_mix.as_split`)."""
    caps = activation_caps(pp, microbatches)
    assignment = {
        (p, s, m): s * dp + p for p in range(dp) for s in range(pp) for m in range(microbatches)
    }
    result = list_schedule(
        dp=dp,
        pp=pp,
        microbatches=microbatches,
        cost=as_split(cost, fused, pp),
        assignment=assignment,
        split_backward=True,
        act_caps=[caps[w // dp] for w in range(dp * pp)],
        w_caps=[1 if w // dp in fused else min(w // dp + 1, microbatches) for w in range(dp * pp)],
    )
    schedule = lower(result.orders, dp=dp, pp=pp, microbatches=microbatches, name="decoupled", tied=tied)
    return validate(fuse(schedule, fused))


def generate(
    name: str, dp: int, pp: int, microbatches: int, cost: CostModel | None = None, *, tied: TiedGroups = ()
) -> Schedule:
    """Build the fault-free schedule called ``name`` (one of :data:`SCHEDULES`), with ``tied`` groups."""
    if name == "1f1b":
        return one_f_one_b(dp, pp, microbatches, tied=tied)
    if name == "decoupled":
        return decoupled(dp, pp, microbatches, cost, tied=tied)
    raise PlanningError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
