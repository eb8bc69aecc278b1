"""Lowering: from per-worker compute orders to a complete, executable :class:`Schedule`.

A generator or planner decides only *where* and *in which order* each F/B/W runs. This pass adds
the rest, the same way for every schedule:

* a receive of the input activation right before each F at stages > 0, from whichever worker ran
  the previous stage's F of that micro-batch (which may be in another pipeline after re-routing);
* a send of the output right after each F at stages < last, to whichever worker runs the next
  stage's F;
* the mirror image for gradients around each B/BW;
* REDUCE_GRAD, then one TIED_REDUCE per tied group holding the worker's stage (in group order, so
  every member of a group meets its collectives in the same order), then OPT_STEP at the end of
  every surviving worker's iteration.

Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from ..errors import ScheduleError
from ..ir import Action, ActionKind, Schedule, TiedGroups, check_tied

__all__ = ["lower", "placement_of", "repeat", "compute_orders"]

Key = tuple[int, int, int]  # (pipeline, stage, microbatch)


def placement_of(orders: Sequence[Sequence[Action]]) -> dict[Key, int]:
    """Map each (pipeline, stage, microbatch) to the worker that runs its forward."""
    where: dict[Key, int] = {}
    for w, actions in enumerate(orders):
        for a in actions:
            if a.kind is ActionKind.F:
                if a.key in where:
                    raise ScheduleError(f"{a} is placed on workers {where[a.key]} and {w}")
                where[a.key] = w  # type: ignore[index]
    return where


def lower(
    orders: Sequence[Sequence[Action]],
    *,
    dp: int,
    pp: int,
    microbatches: int,
    failed: frozenset[int] = frozenset(),
    optimizer: str = "global",
    name: str = "",
    tied: TiedGroups = (),
) -> Schedule:
    """Add communication and the optimizer tail to per-worker compute orders.

    Args:
        orders: one list of F/B/W/BW actions per worker index (empty for failed workers).
        dp, pp, microbatches: the grid.
        failed: worker indices that run nothing.
        optimizer: ``"global"`` or ``"staggered"``.
        name: schedule label.
        tied: tied groups (sorted stage tuples, see :class:`~ds_resilience.ir.Schedule`); their
            TIED_REDUCEs follow REDUCE_GRAD on the groups' surviving workers.

    Returns:
        The schedule (not yet validated: call :func:`ds_resilience.ir.validate`).
    """
    where: Mapping[Key, int] = placement_of(orders)
    last = pp - 1
    tied = check_tied(tied, pp)

    def peer(p: int, s: int, m: int) -> int:
        try:
            return where[(p, s, m)]
        except KeyError:
            raise ScheduleError(f"micro-batch {m} of pipeline {p} at stage {s} is not placed on any worker") from None

    workers: list[tuple[Action, ...]] = []
    for w, compute in enumerate(orders):
        if w in failed:
            workers.append(())
            continue
        out: list[Action] = []
        stage = w // dp
        for a in compute:
            p, s, m = a.pipeline, a.stage, a.microbatch
            assert p is not None and m is not None
            if a.kind is ActionKind.F:
                if s > 0:
                    out.append(Action(kind=ActionKind.RECV_ACT, stage=s, microbatch=m, pipeline=p, peer=peer(p, s - 1, m)))
                out.append(a)
                if s < last:
                    out.append(Action(kind=ActionKind.SEND_ACT, stage=s, microbatch=m, pipeline=p, peer=peer(p, s + 1, m)))
            elif a.kind in (ActionKind.B, ActionKind.BW):
                if s < last:
                    out.append(Action(kind=ActionKind.RECV_GRAD, stage=s, microbatch=m, pipeline=p, peer=peer(p, s + 1, m)))
                out.append(a)
                if s > 0:
                    out.append(Action(kind=ActionKind.SEND_GRAD, stage=s, microbatch=m, pipeline=p, peer=peer(p, s - 1, m)))
            else:
                out.append(a)
        out.append(Action(kind=ActionKind.REDUCE_GRAD, stage=stage))
        for g, group in enumerate(tied):
            if stage in group:
                out.append(Action(kind=ActionKind.TIED_REDUCE, stage=stage, microbatch=g))
        out.append(Action(kind=ActionKind.OPT_STEP, stage=stage))
        workers.append(tuple(out))
    return Schedule(
        dp=dp,
        pp=pp,
        microbatches=microbatches,
        workers=tuple(workers),
        failed=failed,
        optimizer=optimizer,
        name=name,
        tied=tied,
    )


def repeat(schedule: Schedule, iterations: int) -> Schedule:
    """The same per-iteration schedule run ``iterations`` times back to back (for steady state)."""
    if schedule.iterations != 1:
        raise ScheduleError("repeat() takes a one-iteration schedule")
    return replace(
        schedule,
        workers=tuple(actions * iterations for actions in schedule.workers),
        iterations=iterations,
    )


def compute_orders(schedule: Schedule) -> list[list[Action]]:
    """The compute actions (F/B/W/BW) of each worker, in order: the inverse of :func:`lower`
    (``lower(compute_orders(s), ..., tied=s.tied)`` rebuilds ``s``)."""
    return [[a for a in actions if a.kind.is_compute] for actions in schedule.workers]
