"""Timed replay of a schedule: when each action starts and ends under a cost model.

The execution model, which the runtime follows:

* a worker runs its actions strictly in list order, one at a time;
* a send is posted without blocking the worker (``isend``); the message occupies the directed link
  (src, dst) for ``bytes / bandwidth`` after the link is free, and arrives ``latency`` later;
* a receive blocks until its message has arrived; the k-th receive of a key matches the k-th send;
* REDUCE_GRAD is a collective of the stage's surviving workers; TIED_REDUCE(g) a collective of the
  surviving workers of every stage of tied group g, lasting the slowest of those stages'
  ``t_tied_reduce``; OPT_STEP is local (``staggered``) or a collective of every surviving worker
  (``global``, DeepSpeed's barrier at the optimizer step). A collective starts when its last member
  arrives and ends for all members at once.
* the step check (the cost model's ``step_check``, one ``mode`` per replay, see
  :meth:`CostModel.step_mix`; ``t_sync`` is one message): ``barrier`` makes every OPT_STEP a
  collective of every survivor that also all-reduces the norm; ``wait`` is the same through the
  store (publish the stage's norm, read every stage's); ``speculate`` publishes the norm and steps
  at once, and right after its OPT_STEP a worker *validates*: it waits until every survivor has
  published that iteration's norm, then reads them; ``rollback`` validates and then undoes and
  redoes the step (``t_undo + t_opt``).

The replay needs no real clock, so it doubles as the deadlock check: if no worker can advance and
some have actions left, the schedule deadlocks. Pure Python; the planner's hot path, which needs only
the iteration ends, runs the same loop in C (:mod:`.native`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..costs import CostModel
from ..errors import ScheduleError
from .action import Action, ActionKind
from .schedule import Schedule

__all__ = ["Transfer", "Replay", "replay", "message_key", "STEP_MODES"]

STEP_MODES = ("plain", "barrier", "wait", "speculate", "rollback")
"""How a replay runs OPT_STEP (see the module docstring)."""


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
    raw_messages: list[tuple[int, int, int, float, float, float]]  # (src, dst, action index, ...)
    workers: tuple[tuple[Action, ...], ...]  # the replayed schedule's lists (for the kinds)
    blocked: dict[int, int]

    @property
    def messages(self) -> tuple[tuple[int, int, ActionKind, float, float, float], ...]:
        """Every message: (src, dst, kind, start, end, arrival); built on demand (a plan's rating
        reads only the times)."""
        workers = self.workers
        return tuple((src, dst, workers[src][j].kind, b, e, arr) for src, dst, j, b, e, arr in self.raw_messages)

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every message as a :class:`Transfer` (built on demand; the replay keeps plain tuples)."""
        return tuple(Transfer(src=s, dst=d, kind=k, start=b, end=e, arrival=a) for s, d, k, b, e, a in self.messages)

    @property
    def makespan(self) -> float:
        last = max((ends[-1] for ends in self.ends if ends), default=0.0)
        return max([last] + [m[5] for m in self.raw_messages])

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


def _duration_table(cost: CostModel, pp: int) -> dict[tuple[ActionKind, int], float]:
    table: dict[tuple[ActionKind, int], float] = {}
    for s, c in enumerate(cost.stages(pp)):
        table[ActionKind.F, s] = c.t_f
        table[ActionKind.B, s] = c.t_b
        table[ActionKind.W, s] = c.t_w
        table[ActionKind.BW, s] = c.t_bw
        table[ActionKind.REDUCE_GRAD, s] = c.t_reduce
        table[ActionKind.OPT_STEP, s] = c.t_opt
    return table


_COMPUTE, _SEND, _RECV, _COLLECTIVE, _CHECKED = range(5)
_GLOBAL = -1
"""Collective group id of the global optimizer barrier; stage s's reduce is group ``s``."""


def _tied_gid(group: int) -> int:
    """Collective group id of tied group ``group`` (distinct from the stages' and the global one)."""
    return -2 - group


def _opt_op(schedule: Schedule, cost: CostModel, stage: int, mode: str, t_opt: float) -> tuple:
    """The op of one OPT_STEP under the step-check ``mode``.

    Message counts follow the runtime (``runtime/validation.py``): the barrier is one scalar
    all-reduce; a publication is a store set and the delete of an old key (2 messages); reading
    the norms is a wait and a get per stage (``2 * pp``)."""
    sync = cost.t_sync
    publish, read = 2 * sync, 2 * schedule.pp * sync
    redo = cost.stage(stage).t_undo + t_opt if mode == "rollback" else 0.0
    if mode == "plain":
        return (_COLLECTIVE, _GLOBAL, t_opt) if schedule.optimizer == "global" else (_COMPUTE, t_opt)
    if mode == "barrier":
        return (_COLLECTIVE, _GLOBAL, t_opt + sync)
    if mode == "wait" or schedule.optimizer == "global":  # every norm is in when the step runs
        return (_COLLECTIVE, _GLOBAL, publish + read + t_opt + redo)
    return (_CHECKED, publish + t_opt, publish, read + redo)


def _compile(schedule: Schedule, cost: CostModel, ckpt_chunk_bytes: float, mode: str = "plain",
             speeds: Sequence[float] | None = None) -> list[list[tuple]]:
    """Each worker's actions as flat tuples the replay loop can run without attribute lookups.

    ``(_COMPUTE, duration)``, ``(_SEND, peer, key_id, busy, on_pair_stream)``, ``(_RECV, key_id, peer, on_pair_stream)``,
    ``(_COLLECTIVE, group_id, duration)`` (group ids: stage s, :data:`_GLOBAL`, :func:`_tied_gid`),
    ``(_CHECKED, step, published_after, validation)`` (a speculative OPT_STEP: publish, step, then
    wait for every survivor's norm of that step and validate). Message keys become small integers.
    ``speeds``: per worker, the fraction of the cost model's speed at which its forward and backward
    passes run (a straggler's is below 1); ``None``: every worker at full speed.
    """
    if mode not in STEP_MODES:
        raise ValueError(f"step mode {mode!r}; allowed: {', '.join(STEP_MODES)}")
    duration = _duration_table(cost, schedule.pp)
    act_busy = [cost.transfer_time(c.activation_bytes) for c in cost.stages(schedule.pp)]
    ckpt_busy = cost.transfer_time(ckpt_chunk_bytes)
    tied_time = [cost.tied_reduce_time(group) for group in schedule.tied]
    key_ids: dict[tuple, int] = {}
    program: list[list[tuple]] = []
    for w, actions in enumerate(schedule.workers):
        ops = []
        slow = 1.0 if speeds is None else 1.0 / speeds[w]
        for a in actions:
            kind = a.kind
            if kind.is_send:
                kid = key_ids.setdefault(message_key(w, a), len(key_ids))
                # a gradient crosses the boundary below its sender: the previous stage's output size
                busy = (ckpt_busy if kind is ActionKind.CKPT_SEND else
                        act_busy[a.stage - 1] if kind is ActionKind.SEND_GRAD else act_busy[a.stage])
                ops.append((_SEND, a.peer, kid, busy, kind is not ActionKind.CKPT_SEND))
            elif kind.is_recv:
                ops.append((_RECV, key_ids.setdefault(message_key(w, a), len(key_ids)), a.peer,
                            kind is not ActionKind.CKPT_RECV))
            elif kind is ActionKind.REDUCE_GRAD:
                ops.append((_COLLECTIVE, a.stage, duration[kind, a.stage]))
            elif kind is ActionKind.TIED_REDUCE:
                g = a.microbatch
                if not 0 <= g < len(schedule.tied):  # type: ignore[operator]
                    raise ScheduleError(f"{a} on worker {w}: the schedule has {len(schedule.tied)} tied groups")
                ops.append((_COLLECTIVE, _tied_gid(g), tied_time[g]))  # type: ignore[arg-type]
            elif kind is ActionKind.OPT_STEP:
                ops.append(_opt_op(schedule, cost, a.stage, mode, duration[kind, a.stage]))
            else:
                ops.append((_COMPUTE, duration[kind, a.stage] * slow))
        program.append(ops)
    return program


def replay(
    schedule: Schedule, cost: CostModel | None = None, *, ckpt_chunk_bytes: float = 0.0, repeat: int = 1,
    mode: str | None = None, blocking_sends: bool = False, posts: Sequence[Mapping[int, tuple[int, ...]]] | None = None,
    speeds: Sequence[float] | None = None,
) -> Replay:
    """Replay ``schedule`` under ``cost`` (unit costs when ``None``).

    Args:
        schedule: the schedule to replay (not validated here; see :func:`validate`).
        cost: the cost model; its per-stage lists must fit ``schedule.pp``.
        ckpt_chunk_bytes: size of one checkpoint chunk message (CKPT_SEND).
        repeat: run every worker's list this many times back to back (steady-state replays);
            the result then covers ``repeat`` copies of each list.
        mode: how OPT_STEP runs (:data:`STEP_MODES`); default: the cost model's step check alone
            (``plain``, ``barrier``, or ``speculate`` when every step's speculation holds). The
            weighted mix is :func:`ds_resilience.ir.timeline.iteration_time`'s business.
        blocking_sends: NCCL's rules for training messages (:mod:`.pairs`): each pair of workers has
            one stream per side on which its sends and receive posts run in issue order; a send
            and its receive run together once both are at the heads of their sides (a send waits
            for its receive to be posted), then the next operations of the pair may run. The
            worker itself never blocks on a send; it blocks on a receive until the message is
            there. Heads that do not match (two sends, two posts, or different messages) stay
            stuck: a deadlock, or on real NCCL a message in the wrong buffer. Gloo's sends (the
            default, ``False``) leave at once and are buffered.
        posts: with ``blocking_sends``: per worker, action index -> receive indices posted right
            before it (:func:`~.pairs.early_posts`); ``None``: every receive is posted where it
            waits, which deadlocks 1F1B.
        speeds: per worker, the fraction of its stage's compute speed it runs at (a straggler's
            below 1; :mod:`ds_resilience.planning.stragglers`); ``None``: all at full speed.

    Returns:
        The :class:`Replay`; check ``blocked`` for a deadlock.
    """
    cost = cost or CostModel.unit()
    if mode is None:
        mode = {"none": "plain", "barrier": "barrier", "speculative": "speculate"}[cost.step_check]
    if speeds is not None and (len(speeds) != len(schedule.workers) or not all(0 < v <= 1 for v in speeds)):
        raise ValueError(f"speeds: one value in (0, 1] per worker ({len(schedule.workers)}), got {list(speeds)}")
    program = _compile(schedule, cost, ckpt_chunk_bytes, mode, speeds)
    latency = cost.p2p_latency
    n = len(program)
    lengths = [len(ops) * repeat for ops in program]
    pcs = [0] * n
    clock = [0.0] * n
    starts: list[list[float]] = [[0.0] * k for k in lengths]
    ends: list[list[float]] = [[0.0] * k for k in lengths]
    mailbox: dict[int, deque[float]] = defaultdict(deque)
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    transfers: list[tuple] = []
    alive = [i for i in range(n) if i not in schedule.failed]
    groups = {s: [i for i in alive if i // schedule.dp == s] for s in range(schedule.pp)}
    groups[_GLOBAL] = alive
    for g, tied_stages in enumerate(schedule.tied):
        groups[_tied_gid(g)] = [i for i in alive if i // schedule.dp in tied_stages]
    # (group id, occurrence) -> {worker: arrival clock}
    arrived: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    occurrence: dict[tuple[int, int], int] = defaultdict(int)
    woken: set[int] = set()  # workers a step of the current one may have unblocked
    # the speculative step check: per step occurrence, the publication times so far and the
    # workers waiting to validate; each worker's published (occurrence, stepped-at clock) if waiting
    published: dict[int, list[float]] = defaultdict(list)
    validating: dict[int, list[int]] = defaultdict(list)
    checked: list[int] = [0] * n
    validated: dict[int, int] = defaultdict(int)
    stepped: dict[int, float] = {}
    # NCCL's rules (blocking_sends): per pair (a < b), each side's issued operations
    # (is_send, key id, issue time, busy, action index); when the pair's stream is free again;
    # per worker, the receives (global indices) already posted
    sides: dict[tuple[int, int], dict[int, deque[tuple]]] = defaultdict(lambda: defaultdict(deque))
    stream_free: dict[tuple[int, int], float] = defaultdict(float)
    posted_at: list[set[int]] = [set() for _ in range(n)]
    early = posts if posts is not None else [{} for _ in range(n)]

    def issue(w: int, peer: int, item: tuple) -> None:
        """Put one send or receive post on the pair's stream, then run what now matches."""
        pair = (w, peer) if w < peer else (peer, w)
        side = sides[pair]
        side[w].append(item)
        a, b = pair
        qa, qb = side[a], side[b]
        while qa and qb:
            ha, hb = qa[0], qb[0]
            if ha[1] != hb[1] or ha[0] == hb[0]:
                return  # stuck: two sends, two posts, or another message
            (src, send), (dst, post) = ((a, ha), (b, hb)) if ha[0] else ((b, hb), (a, ha))
            begin = max(send[2], post[2], stream_free[pair])
            end = begin + send[3]
            stream_free[pair] = end
            arrival = end + latency
            mailbox[send[1]].append(arrival)
            woken.add(dst)
            transfers.append((src, dst, send[4], begin, end, arrival))
            qa.popleft()
            qb.popleft()

    def advance(w: int) -> None:
        """Run worker ``w`` as far as it can go."""
        ops = program[w]
        size = len(ops)
        total = lengths[w]
        st, en = starts[w], ends[w]
        while pcs[w] < total:
            i = pcs[w]
            op = ops[i % size]
            code = op[0]
            now = clock[w]
            if blocking_sends:
                for r in early[w].get(i % size, ()):
                    g = i - i % size + r
                    if g not in posted_at[w]:
                        posted_at[w].add(g)
                        issue(w, ops[r][2], (False, ops[r][1], now, 0.0, r))
                if code == _SEND and op[4]:
                    issue(w, op[1], (True, op[2], now, op[3], i % size))
                    st[i] = en[i] = now
                    pcs[w] += 1
                    continue
                if code == _RECV and op[3] and i not in posted_at[w]:
                    posted_at[w].add(i)
                    issue(w, op[2], (False, op[1], now, 0.0, i % size))
            if code == _COMPUTE:
                st[i] = now
                clock[w] = en[i] = now + op[1]
            elif code == _SEND:
                _, peer, kid, busy, _ = op
                link = (w, peer)
                begin = now if now >= link_free[link] else link_free[link]
                link_free[link] = begin + busy
                arrival = begin + busy + latency
                mailbox[kid].append(arrival)
                woken.add(peer)
                transfers.append((w, peer, i % size, begin, begin + busy, arrival))
                st[i] = en[i] = now
            elif code == _RECV:
                box = mailbox.get(op[1])
                if not box:
                    return
                arrival = box.popleft()
                st[i] = now
                clock[w] = en[i] = arrival if arrival > now else now
            elif code == _CHECKED:
                k = checked[w]
                if w not in stepped:  # publish the norm, step
                    st[i] = now
                    stepped[w] = now + op[1]
                    pubs = published[k]
                    pubs.append(now + op[2])
                    if len(pubs) == len(alive):
                        woken.update(validating.pop(k, ()))
                pubs = published[k]
                if len(pubs) < len(alive):
                    validating[k].append(w)
                    return
                done = stepped.pop(w)
                ready = max(pubs)
                clock[w] = en[i] = (done if done > ready else ready) + op[3]
                checked[w] += 1
                validated[k] += 1
                if validated[k] == len(alive):
                    del published[k], validated[k]
            else:
                gid = op[1]
                members = groups[gid]
                instance = (gid, occurrence[w, gid])
                waiting = arrived[instance]
                waiting[w] = now
                if len(waiting) < len(members):
                    return
                begin = max(waiting.values())
                for m in members:
                    occurrence[m, gid] += 1
                    j = pcs[m]
                    # each member's own duration: the same within a stage's or a tied group's
                    # reduce; a global OPT_STEP's members step their own stage after the barrier
                    mops = program[m]
                    end = begin + mops[j % len(mops)][2]
                    starts[m][j] = begin
                    ends[m][j] = end
                    clock[m] = end
                    pcs[m] += 1
                    woken.add(m)
                del arrived[instance]
                continue
            pcs[w] += 1

    # Worklist: a worker is looked at again only when something it may wait for happened.
    pending = deque(range(n))
    queued = [True] * n
    while pending:
        w = pending.popleft()
        queued[w] = False
        woken.clear()
        advance(w)
        for v in woken:
            if not queued[v]:
                queued[v] = True
                pending.append(v)
    blocked = {w: pcs[w] for w in range(n) if pcs[w] < lengths[w]}
    return Replay(
        starts=tuple(tuple(x) for x in starts),
        ends=tuple(tuple(x) for x in ends),
        raw_messages=transfers,
        workers=schedule.workers,
        blocked=blocked,
    )
