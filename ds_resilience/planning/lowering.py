"""Lowering: from per-worker compute orders to a complete, executable :class:`Schedule`.

A generator or planner decides only *where* and *in which order* each F/B/W runs. This pass adds
the rest, the same way for every schedule:

* a receive of the input activation right before each F at stages > 0, from whichever worker ran
  the previous stage's F of that micro-batch (which may be in another pipeline after re-routing);
* a send of the output right after each F at stages < last, to whichever worker runs the next
  stage's F;
* the mirror image for gradients around each B/BW;
* then each worker's receives from one peer in the order that peer sends them (NCCL matches a
  pair's messages in order, ignoring tags): a receive whose message was sent after another not yet
  received moves right after that other one's receive, earlier than its use. Waiting for a message
  sent earlier on the same link neither delays the worker (it arrives first) nor can deadlock;
* REDUCE_GRAD, then one TIED_REDUCE per tied group holding the worker's stage (in group order, so
  every member of a group meets its collectives in the same order), then OPT_STEP at the end of
  every surviving worker's iteration.

Pure Python.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Mapping, Sequence

from ..errors import ScheduleError
from ..ir import Action, ActionKind, Schedule, TiedGroups, check_tied
from ..ir.action import trusted_action

__all__ = ["lower", "placement_of", "repeat", "compute_orders"]

Key = tuple[int, int, int]  # (pipeline, stage, microbatch)


def placement_of(orders: Sequence[Sequence[Action]]) -> dict[Key, int]:
    """Map each (pipeline, stage, microbatch) to the worker that runs its forward."""
    where: dict[Key, int] = {}
    F = ActionKind.F
    placed = 0
    for w, actions in enumerate(orders):
        for a in actions:
            if a.kind is F:
                where[a.pipeline, a.stage, a.microbatch] = w  # type: ignore[index]
                placed += 1
    if placed != len(where):  # a forward placed twice: find it, in order
        seen: dict[Key, int] = {}
        for w, actions in enumerate(orders):
            for a in actions:
                if a.kind is F:
                    if a.key in seen:
                        raise ScheduleError(f"{a} is placed on workers {seen[a.key]} and {w}")
                    seen[a.key] = w  # type: ignore[index]
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
    tied = check_tied(tied, pp)
    try:
        workers, sent, received = _lowered(orders, where, dp, pp, microbatches, failed, tied)
    except KeyError as exc:  # a peer's micro-batch placed nowhere
        p, s, m = exc.args[0]
        raise ScheduleError(f"micro-batch {m} of pipeline {p} at stage {s} is not placed on any worker") from None
    n = dp * pp
    unordered = {pair % n for pair, seq in received.items() if sent.get(pair) != seq}
    if unordered:
        workers = _receives_in_send_order(workers, unordered)
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


def _lowered(orders: Sequence[Sequence[Action]], where: Mapping[Key, int], dp: int, pp: int, microbatches: int,
             failed: frozenset[int], tied: TiedGroups) -> tuple[list[tuple[Action, ...]], dict, dict]:
    """:func:`lower`'s loop: each worker's actions, and per directed pair the messages in the sender's
    order and in the receiver's (a peer placed nowhere raises ``KeyError`` with its key)."""
    last = pp - 1
    workers: list[tuple[Action, ...]] = []
    # per directed pair (src * n + dst): the messages in the sender's order and in the receiver's;
    # where the two agree for every pair into a worker (nearly always), its receives stay put
    n = dp * pp
    span = 2 * microbatches
    sent: dict[int, list[int]] = defaultdict(list)
    received: dict[int, list[int]] = defaultdict(list)
    make = trusted_action  # the fields below are right by construction; validate() checks the result
    RA, SA, RG, SG = ActionKind.RECV_ACT, ActionKind.SEND_ACT, ActionKind.RECV_GRAD, ActionKind.SEND_GRAD
    F, B, BW = ActionKind.F, ActionKind.B, ActionKind.BW
    for w, compute in enumerate(orders):
        if w in failed:
            workers.append(())
            continue
        out: list[Action] = []
        stage = w // dp
        for a in compute:
            p, s, m = a.pipeline, a.stage, a.microbatch
            assert p is not None and m is not None
            kind = a.kind
            if kind is F:
                msg = p * span + 2 * m
                if s > 0:
                    src = where[p, s - 1, m]
                    out.append(make(RA, s, m, p, src))
                    received[src * n + w].append(msg)
                out.append(a)
                if s < last:
                    dst = where[p, s + 1, m]
                    out.append(make(SA, s, m, p, dst))
                    sent[w * n + dst].append(msg)
            elif kind is B or kind is BW:
                msg = p * span + 2 * m + 1
                if s < last:
                    src = where[p, s + 1, m]
                    out.append(make(RG, s, m, p, src))
                    received[src * n + w].append(msg)
                out.append(a)
                if s > 0:
                    dst = where[p, s - 1, m]
                    out.append(make(SG, s, m, p, dst))
                    sent[w * n + dst].append(msg)
            else:
                out.append(a)
        out.append(make(ActionKind.REDUCE_GRAD, stage))
        for g, group in enumerate(tied):
            if stage in group:
                out.append(make(ActionKind.TIED_REDUCE, stage, g))
        out.append(make(ActionKind.OPT_STEP, stage))
        workers.append(tuple(out))
    return workers, sent, received


_RECEIVES = {ActionKind.RECV_ACT: (ActionKind.SEND_ACT, -1), ActionKind.RECV_GRAD: (ActionKind.SEND_GRAD, 1)}


def _receives_in_send_order(workers: list[tuple[Action, ...]], only: set[int] | None = None) -> list[tuple[Action, ...]]:
    """Each worker's receives from each peer moved into that peer's send order (module docstring);
    only the workers in ``only`` when given (the others' receives are in order already)."""
    sent: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> (kind, p, sender stage, m)
    for w, actions in enumerate(workers):
        for a in actions:
            if a.kind is ActionKind.SEND_ACT or a.kind is ActionKind.SEND_GRAD:
                sent[w, a.peer].append((a.kind, a.pipeline, a.stage, a.microbatch))
    out = []
    for w, actions in enumerate(workers):
        if only is not None and w not in only:
            out.append(actions)
            continue
        receives = {}
        for a in actions:
            if a.kind in _RECEIVES:
                kind, delta = _RECEIVES[a.kind]
                receives[a.peer, (kind, a.pipeline, a.stage + delta, a.microbatch)] = a
        if not receives:
            out.append(actions)
            continue
        cursor: dict[int, int] = defaultdict(int)
        done: set[int] = set()
        order: list[Action] = []
        for a in actions:
            if a.kind not in _RECEIVES:
                order.append(a)
                continue
            if id(a) in done:
                continue
            kind, delta = _RECEIVES[a.kind]
            want = (kind, a.pipeline, a.stage + delta, a.microbatch)
            seq = sent[a.peer, w]
            while cursor[a.peer] < len(seq) and seq[cursor[a.peer]] != want:
                earlier = receives.get((a.peer, seq[cursor[a.peer]]))
                if earlier is not None and id(earlier) not in done:
                    done.add(id(earlier))
                    order.append(earlier)
                cursor[a.peer] += 1
            cursor[a.peer] += 1
            done.add(id(a))
            order.append(a)
        out.append(tuple(order))
    return out


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
