"""Timed replay of a schedule: when each action starts and ends under a cost model.

The execution model, which the runtime follows:

* a worker runs its actions strictly in list order, one at a time;
* a send is posted without blocking the worker (``isend``); the message occupies the directed link
  (src, dst) for ``bytes / bandwidth`` after the link is free, and arrives ``latency`` later;
* a receive blocks until its message has arrived; the k-th receive of a key matches the k-th send;
* REDUCE_GRAD is a collective of the stage's surviving workers; OPT_STEP is local (``staggered``) or
  a collective of every surviving worker (``global``, DeepSpeed's barrier at the optimizer step).

The replay needs no real clock, so it doubles as the deadlock check: if no worker can advance and
some have actions left, the schedule deadlocks. Pure Python.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from ..costs import CostModel
from .action import Action, ActionKind
from .schedule import Schedule

__all__ = ["Transfer", "Replay", "replay", "message_key"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """One message on a directed link."""

    src: int
    dst: int
    kind: ActionKind
    start: float
    end: float
    arrival: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Replay:
    """Start and end time of every action, per worker, and the messages sent.

    ``blocked`` is empty when the replay completed; otherwise it maps each stuck worker to the
    index of the action it could not run (a deadlock).
    """

    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    transfers: tuple[Transfer, ...]
    blocked: dict[int, int]

    @property
    def makespan(self) -> float:
        last = [ends[-1] for ends in self.ends if ends]
        arrivals = [t.arrival for t in self.transfers]
        return max(last + arrivals, default=0.0)

    @property
    def deadlocked(self) -> bool:
        return bool(self.blocked)


def message_key(worker: int, action: Action) -> tuple:
    """The key a send and its receive share: (channel, pipeline, microbatch, src, dst).

    Activations are keyed by the sender's stage, so ``p1s2SA5>7`` on worker 4 and ``p1s3RA5<4``
    on worker 7 share ``("act", 1, 5, 2, 4, 7)``.
    """
    kind, peer = action.kind, action.peer
    if kind is ActionKind.SEND_ACT:
        return ("act", action.pipeline, action.microbatch, action.stage, worker, peer)
    if kind is ActionKind.RECV_ACT:
        return ("act", action.pipeline, action.microbatch, action.stage - 1, peer, worker)
    if kind is ActionKind.SEND_GRAD:
        return ("grad", action.pipeline, action.microbatch, action.stage, worker, peer)
    if kind is ActionKind.RECV_GRAD:
        return ("grad", action.pipeline, action.microbatch, action.stage + 1, peer, worker)
    if kind is ActionKind.CKPT_SEND:
        return ("ckpt", None, action.microbatch, None, worker, peer)
    if kind is ActionKind.CKPT_RECV:
        return ("ckpt", None, action.microbatch, None, peer, worker)
    raise ValueError(f"{action} is not a message")


def _compute_time(cost: CostModel, action: Action) -> float:
    c = cost.stage(action.stage)
    return {
        ActionKind.F: c.t_f,
        ActionKind.B: c.t_b,
        ActionKind.W: c.t_w,
        ActionKind.BW: c.t_b + c.t_w,
        ActionKind.REDUCE_GRAD: c.t_reduce,
        ActionKind.OPT_STEP: c.t_opt,
    }[action.kind]


def replay(schedule: Schedule, cost: CostModel | None = None, *, ckpt_chunk_bytes: float = 0.0) -> Replay:
    """Replay ``schedule`` under ``cost`` (unit costs when ``None``).

    Args:
        schedule: the schedule to replay (not validated here; see :func:`validate`).
        cost: the cost model; its per-stage lists must fit ``schedule.pp``.
        ckpt_chunk_bytes: size of one checkpoint chunk message (CKPT_SEND).

    Returns:
        The :class:`Replay`; check ``blocked`` for a deadlock.
    """
    cost = cost or CostModel.unit()
    workers = schedule.workers
    n = len(workers)
    pcs = [0] * n
    clock = [0.0] * n
    starts: list[list[float]] = [[0.0] * len(a) for a in workers]
    ends: list[list[float]] = [[0.0] * len(a) for a in workers]
    mailbox: dict[tuple, deque[float]] = defaultdict(deque)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    transfers: list[Transfer] = []
    alive = [i for i in range(n) if i not in schedule.failed]
    stage_group = {s: [i for i in alive if i // schedule.dp == s] for s in range(schedule.pp)}
    # collective instance -> {worker: arrival clock}; instance id = (name, group key, occurrence)
    arrived: dict[tuple, dict[int, float]] = defaultdict(dict)
    occurrence: dict[tuple[int, str], int] = defaultdict(int)

    def collective(w: int, action: Action) -> tuple[tuple, list[int]] | None:
        if action.kind is ActionKind.REDUCE_GRAD:
            return ("rd", action.stage), stage_group[action.stage]
        if action.kind is ActionKind.OPT_STEP and schedule.optimizer == "global":
            return ("opt", None), alive
        return None

    def advance(w: int) -> bool:
        """Run worker ``w`` as far as it can go; True if it ran anything."""
        moved = False
        actions = workers[w]
        while pcs[w] < len(actions):
            i = pcs[w]
            action = actions[i]
            kind = action.kind
            if kind.is_send:
                nbytes = ckpt_chunk_bytes if kind is ActionKind.CKPT_SEND else cost.stage(action.stage).activation_bytes
                link = (w, action.peer)
                busy = cost.transfer_time(nbytes)
                begin = max(clock[w], link_free[link])
                link_free[link] = begin + busy
                arrival = begin + busy + cost.p2p_latency
                mailbox[message_key(w, action)].append(arrival)
                transfers.append(Transfer(src=w, dst=action.peer, kind=kind, start=begin, end=begin + busy, arrival=arrival))
                starts[w][i] = ends[w][i] = clock[w]
            elif kind.is_recv:
                box = mailbox.get(message_key(w, action))
                if not box:
                    return moved
                arrival = box.popleft()
                starts[w][i] = clock[w]
                clock[w] = max(clock[w], arrival)
                ends[w][i] = clock[w]
            else:
                group = collective(w, action)
                if group is None:
                    starts[w][i] = clock[w]
                    clock[w] += _compute_time(cost, action)
                    ends[w][i] = clock[w]
                else:
                    name, members = group
                    occ_key = (w, repr(name))
                    instance = (name, occurrence[occ_key])
                    arrived[instance][w] = clock[w]
                    if len(arrived[instance]) < len(members):
                        return moved
                    begin = max(arrived[instance].values())
                    end = begin + _compute_time(cost, action)
                    for m in members:
                        occurrence[(m, repr(name))] += 1
                        j = pcs[m]
                        starts[m][j] = begin
                        ends[m][j] = end
                        clock[m] = end
                        pcs[m] += 1
                    del arrived[instance]
                    moved = True
                    continue
            pcs[w] += 1
            moved = True
        return moved

    progress = True
    while progress:
        progress = False
        for w in range(n):
            if advance(w):
                progress = True
    blocked = {w: pcs[w] for w in range(n) if pcs[w] < len(workers[w])}
    return Replay(
        starts=tuple(tuple(s) for s in starts),
        ends=tuple(tuple(e) for e in ends),
        transfers=tuple(transfers),
        blocked=blocked,
    )
