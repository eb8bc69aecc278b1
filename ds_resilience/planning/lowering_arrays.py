"""The lowering of the C list scheduler's output, in numpy: the same schedule as :func:`.lowering.lower`.

At D=64, P=16, M=64 a plan's schedule holds 444k actions. Building them from the list scheduler's
Action lists in :func:`.lowering.lower` and reading them back into arrays for the C replay, check
and peaks (:mod:`ds_resilience.ir.native`) took more than half of an on-demand plan. Here the
tasks stay arrays (worker, kind, pipeline, micro-batch, as :func:`ds_resilience.ir.native.list_orders`
gives them with ``raw=True``): the receives, sends and each worker's tail (REDUCE_GRAD, its tied
groups' TIED_REDUCE, OPT_STEP) are placed with array operations, each action is built once, and
the arrays are handed to the C loops that read the schedule next (:func:`~ds_resilience.ir.native.remember`).

The rules are :func:`.lowering.lower`'s: a receive of the input activation before each F at stages > 0
from the worker that runs the previous stage's forward of that item, a send of the output after
each F at stages < last, the mirror image around each B/BW, W alone, then the tail. Where some pair
of workers would see its messages in another order than the sender sends them (the receives must
move, which :func:`.lowering.lower` does), this returns ``None`` and the caller lowers in Python:
never in the plans measured. ``tests/unit/planning/test_lowering_arrays.py`` holds the schedules
equal to :func:`.lowering.lower`'s, and the arrays equal to those read from the actions.
"""

from __future__ import annotations

from ..ir import ActionKind, Schedule, TiedGroups, check_tied, native
from ..ir.action import trusted_action

__all__ = ["lower_arrays"]

_TASKS = (ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW)  # native.list_orders' kind indices


def lower_arrays(raw: tuple, *, dp: int, pp: int, microbatches: int, failed: frozenset[int] = frozenset(),
                 optimizer: str = "global", name: str = "", tied: TiedGroups = ()) -> Schedule | None:
    """The schedule :func:`.lowering.lower` makes of the tasks ``raw`` (``(worker, kind, pipeline,
    microbatch, owner)`` arrays from :func:`ds_resilience.ir.native.list_orders` with ``raw=True``),
    or ``None`` where a pair's receives would have to move (lower it in Python)."""
    import numpy as np

    tied = check_tied(tied, pp)
    o_w, o_kind, o_p, o_m, owner = raw
    n, last, mbs = dp * pp, pp - 1, microbatches
    order = np.argsort(o_w, kind="stable")  # each worker's tasks, in the order the loop emitted them
    w = o_w[order].astype(np.int64)
    kind = o_kind[order].astype(np.int64)
    p = o_p[order].astype(np.int64)
    m = o_m[order].astype(np.int64)
    s = w // dp
    fwd = kind == 0
    bwd = (kind == 1) | (kind == 3)
    pre = (fwd & (s > 0)) | (bwd & (s < last))  # a receive before the task
    post = (fwd & (s < last)) | (bwd & (s > 0))  # a send after it
    count = 1 + pre.astype(np.int64) + post.astype(np.int64)
    # each surviving worker's tail: REDUCE_GRAD, one TIED_REDUCE per tied group holding its stage, OPT_STEP
    groups_of = [[g for g, group in enumerate(tied) if stage in group] for stage in range(pp)]
    alive = np.ones(n, dtype=bool)
    alive[list(failed)] = False
    tail = np.where(alive, 2 + np.array([len(groups_of[i // dp]) for i in range(n)], dtype=np.int64), 0)
    per_worker = np.bincount(w, weights=count, minlength=n).astype(np.int64) + tail
    off = np.zeros(n + 1, dtype=np.int64)
    off[1:] = np.cumsum(per_worker)
    total = int(off[-1])
    # where each task's first action goes: its worker's start plus the actions of its earlier tasks
    before = np.cumsum(count) - count
    first_of_worker = np.zeros(n, dtype=np.int64)
    first_task = np.searchsorted(w, np.arange(n), side="left")
    has = first_task < len(w)
    first_of_worker[has] = before[first_task[has]]
    start = off[w] + before - first_of_worker[w]
    code = native.kind_codes()
    K = np.zeros(total, dtype=np.int64)
    S = np.zeros(total, dtype=np.int64)
    M = np.full(total, -1, dtype=np.int64)
    P = np.full(total, -1, dtype=np.int64)
    Q = np.full(total, -1, dtype=np.int64)
    main = start + pre
    task_code = np.array([code[k] for k in _TASKS], dtype=np.int64)
    K[main], S[main], M[main], P[main] = task_code[kind], s, m, p
    # the neighbour's stage of each message: the input comes from s - 1 (F) or s + 1 (B); the output goes the other way
    up = np.where(fwd, s - 1, s + 1)
    down = np.where(fwd, s + 1, s - 1)
    r_at, r = start[pre], pre
    src = owner[(p[r] * pp + up[r]) * mbs + m[r]].astype(np.int64)
    K[r_at] = np.where(fwd[r], code[ActionKind.RECV_ACT], code[ActionKind.RECV_GRAD])
    S[r_at], M[r_at], P[r_at], Q[r_at] = s[r], m[r], p[r], src
    s_at, x = main[post] + 1, post
    dst = owner[(p[x] * pp + down[x]) * mbs + m[x]].astype(np.int64)
    K[s_at] = np.where(fwd[x], code[ActionKind.SEND_ACT], code[ActionKind.SEND_GRAD])
    S[s_at], M[s_at], P[s_at], Q[s_at] = s[x], m[x], p[x], dst
    # each pair's messages in the sender's order and in the receiver's must agree (else lower() moves receives)
    span = 2 * mbs
    sent_pair = w[post] * n + dst
    sent_msg = p[post] * span + 2 * m[post] + bwd[post]
    recv_pair = src * n + w[pre]
    recv_msg = p[pre] * span + 2 * m[pre] + bwd[pre]
    a = np.argsort(sent_pair, kind="stable")  # tasks are in program order, so within a pair too
    b = np.argsort(recv_pair, kind="stable")
    if not (np.array_equal(sent_pair[a], recv_pair[b]) and np.array_equal(sent_msg[a], recv_msg[b])):
        return None
    for i in np.flatnonzero(alive).tolist():
        at, stage = int(off[i + 1]) - int(tail[i]), i // dp
        K[at], S[at] = code[ActionKind.REDUCE_GRAD], stage
        for j, g in enumerate(groups_of[stage]):
            K[at + 1 + j], S[at + 1 + j], M[at + 1 + j] = code[ActionKind.TIED_REDUCE], stage, g
        K[at + 1 + len(groups_of[stage])], S[at + 1 + len(groups_of[stage])] = code[ActionKind.OPT_STEP], stage
    kinds = {c: k for k, c in code.items()}
    k_list = [kinds[c] for c in K.tolist()]
    columns = []
    for col in (M, P, Q):
        values = col.tolist()
        for i in np.flatnonzero(col < 0).tolist():
            values[i] = None
        columns.append(values)
    actions = list(map(trusted_action, k_list, S.tolist(), *columns))
    bounds = off.tolist()
    schedule = Schedule(dp=dp, pp=pp, microbatches=microbatches,
                        workers=tuple(tuple(actions[bounds[i]:bounds[i + 1]]) for i in range(n)),
                        failed=failed, optimizer=optimizer, name=name, tied=tied)
    native.remember(schedule, K, S, np.maximum(M, 0), np.maximum(P, 0), np.maximum(Q, 0))
    return schedule
