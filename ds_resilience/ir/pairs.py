"""NCCL's point-to-point rules, derived from a schedule: pair order and early receive posts.

NCCL ignores tags. Between two ranks a and b, torch runs point-to-point operations on one
communicator and one stream for the pair, so

* the k-th send from a to b matches the k-th receive at b from a (FIFO per direction: the
  validator's rule 7 makes a schedule post them in the same order), and
* both directions share the stream: an operation of the pair starts only when every earlier one
  issued on that side is done, and a send (larger than NCCL's eager buffer) completes only once
  its receive is posted on the other side.

Run as written, with each receive posted where the schedule waits for it, 1F1B deadlocks under
these rules: stage 0 sends activation 1 and then waits for gradient 0, while stage 1 sends gradient
0 and then waits for activation 1; each send waits for a receive queued behind the other send.
Megatron batches such pairs (``send_forward_recv_backward``); here the runtime posts receives
early instead, and this module says where: the pair order of two workers is the order in which
their messages are sent in a buffered replay of the schedule (causal: a message a worker sends
after receiving another comes later); before a worker issues a send, it posts every receive from
the same peer that comes earlier in that order. Then both sides of every pair issue their
operations in the same order (the streams mirror each other), and the schedule completes under
NCCL's rules exactly when it completes with buffered sends. The replay's ``blocking_sends`` mode
checks it (:func:`ds_resilience.ir.replay.replay`). Checkpoint messages (CKPT_SEND/RECV) travel on
their own pair groups and take no part. Pure Python.
"""

from __future__ import annotations

from collections import defaultdict

from ..errors import ScheduleError
from .action import ActionKind
from .replay import message_key, replay
from .schedule import Schedule

__all__ = ["TRAINING_MESSAGES", "early_posts", "pair_order", "replay_nccl"]

TRAINING_MESSAGES = frozenset({ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD})
"""The message kinds that share a pair's training stream."""


def pair_order(schedule: Schedule) -> dict[tuple[int, int], list[tuple]]:
    """For each pair of workers ``(a, b)``, ``a < b``, the messages they exchange (both directions)
    as ``(message key, occurrence)`` (a key recurs once per iteration the schedule holds), in the
    order a buffered replay sends them.

    Raises:
        ScheduleError: the schedule deadlocks even with buffered sends.
    """
    result = replay(schedule)
    if result.blocked:
        w, i = min(result.blocked.items())
        raise ScheduleError(f"schedule {schedule.name or ''} deadlocks (worker {w} at step {i}); it has no pair order",
                            worker=w, step=i)
    order: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    seen: dict[tuple, int] = defaultdict(int)
    workers = schedule.workers
    for src, dst, j, *_ in result.raw_messages:
        action = workers[src][j]
        if action.kind in TRAINING_MESSAGES:
            key = message_key(src, action)
            order[(src, dst) if src < dst else (dst, src)].append((key, seen[key]))
            seen[key] += 1
    return dict(order)


def early_posts(schedule: Schedule) -> tuple[dict[int, tuple[int, ...]], ...]:
    """Per worker: action index -> the indices of its receives to post right before that action.

    Only sends get entries: before a send to peer q, every receive from q that comes earlier in the
    pair order and is not posted yet (in pair order). A receive with no earlier post is posted
    where it is, right before its wait.
    """
    order = pair_order(schedule)
    position = {key: k for seq in order.values() for k, key in enumerate(seq)}
    out: list[dict[int, tuple[int, ...]]] = []
    for w, actions in enumerate(schedule.workers):
        recv_at: dict[tuple, int] = {}
        sent: dict[tuple, int] = defaultdict(int)
        occurrence = defaultdict(int)
        for i, a in enumerate(actions):
            if a.kind in TRAINING_MESSAGES and a.kind.is_recv:
                key = message_key(w, a)
                recv_at[key, occurrence[key]] = i
                occurrence[key] += 1
        posts: dict[int, tuple[int, ...]] = {}
        cursor: dict[int, int] = defaultdict(int)  # peer -> pair-order position scanned so far
        posted: set[int] = set()
        for i, a in enumerate(actions):
            if a.kind not in TRAINING_MESSAGES:
                continue
            if a.kind.is_recv:
                posted.add(i)
                continue
            peer = a.peer
            seq = order[(w, peer) if w < peer else (peer, w)]
            key = message_key(w, a)
            k = position[key, sent[key]]
            sent[key] += 1
            early = []
            for item in seq[cursor[peer]:k]:
                j = recv_at.get(item) if item[0][5] == w else None
                if j is not None and j not in posted:
                    posted.add(j)
                    early.append(j)
            cursor[peer] = max(cursor[peer], k + 1)
            if early:
                posts[i] = tuple(early)
        out.append(posts)
    return tuple(out)


def replay_nccl(schedule: Schedule, cost=None, *, early: bool = True, **options):
    """The replay under NCCL's rules (``blocking_sends``), with the runtime's early receive posts
    (or, ``early=False``, every receive posted where it waits)."""
    posts = early_posts(schedule) if early else None
    return replay(schedule, cost, blocking_sends=True, posts=posts, **options)
