"""The one schedule validator. Every generator, the planner, the tests and the runtime use it.

What a valid schedule satisfies (checked in this order; the first violation raises
:class:`ScheduleError` whose message shows every worker's steps with the failing one marked):

1. Shape: each action's stage is its worker's stage; pipelines, micro-batches and peers are in range;
   no action on a failed worker and no message to one; activations go to stage s+1 and come from
   s-1, gradients the other way.
2. Order on each worker, for each (pipeline, stage, micro-batch) it runs: F, then B then W (or the
   fused BW); F only after its activation was received (stages > 0); B/BW only after its output
   gradient was received (stages < last); a send only after the value it sends exists.
3. Coverage: every (pipeline, stage, micro-batch) of the grid runs exactly once per iteration, on one
   worker, even the failed workers' micro-batches (they are re-routed).
4. Messages: every send is matched by exactly one receive (same key, same pair of workers).
5. Optimizer: every surviving worker ends each iteration with one REDUCE_GRAD and then one
   OPT_STEP, after all its W (no pending backward at REDUCE_GRAD; no compute in between).
   Tied groups (``Schedule.tied``): every surviving worker of a stage of tied group g runs exactly
   one TIED_REDUCE(g) per iteration, after all its compute (F/B/W/BW) and its REDUCE_GRAD and
   before its OPT_STEP; workers of stages outside g run none, and g names an existing group (rule 1).
6. No deadlock: the timed replay (:mod:`.replay`) under unit costs completes.
7. Pair order (NCCL matches a pair's messages in order and ignores tags): for every two workers
   a -> b, a sends its messages to b in the order b receives them. With rule 6 this is what the
   runtime needs to run the schedule under NCCL's rules too (:mod:`.pairs`: receives are posted
   early so that both sides of a pair issue their operations in the same order).

Rules 1-5 and 7 run first in C (:func:`.native.check`, the same rules over flat arrays) where the
library builds; it passes only what this module passes, and whenever it does not pass, the Python
checks below run and raise with the exact message.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ..costs import CostModel
from ..errors import ScheduleError
from . import native
from .action import ActionKind
from .render import format_steps
from .replay import message_key, replay
from .schedule import Schedule

__all__ = ["validate"]


def _fail(schedule: Schedule, worker: int | None, step: int | None, why: str) -> ScheduleError:
    where = f"worker {worker} step {step}: " if worker is not None else ""
    mark = (worker, step) if worker is not None and step is not None else None
    grid = format_steps(schedule, mark=mark)
    return ScheduleError(f"invalid schedule {schedule.name or ''}: {where}{why}\n{grid}", worker=worker, step=step)


_PEER_STAGE = {ActionKind.SEND_ACT: 1, ActionKind.RECV_ACT: -1, ActionKind.SEND_GRAD: -1, ActionKind.RECV_GRAD: 1}
"""The stage a message's peer must hold, relative to the worker's own."""


def _check_shape(schedule: Schedule) -> None:
    dp, pp, mbs = schedule.dp, schedule.pp, schedule.microbatches
    n = dp * pp
    for w, actions in enumerate(schedule.workers):
        stage = w // dp
        for i, a in enumerate(actions):
            if a.stage != stage:
                raise _fail(schedule, w, i, f"{a} names stage {a.stage}, but worker {w} holds stage {stage}")
            if a.pipeline is not None and not 0 <= a.pipeline < dp:
                raise _fail(schedule, w, i, f"{a}: pipeline {a.pipeline} out of range 0..{dp - 1}")
            if a.kind is ActionKind.TIED_REDUCE:
                g = a.microbatch
                if not 0 <= g < len(schedule.tied):  # type: ignore[operator]
                    k = len(schedule.tied)
                    have = f"groups 0..{k - 1} {list(schedule.tied)}" if k else "no tied groups"
                    raise _fail(schedule, w, i, f"{a}: tied group index {g} out of range; the schedule has {have}")
                if stage not in schedule.tied[g]:  # type: ignore[index]
                    raise _fail(
                        schedule, w, i,
                        f"{a}: TIED_REDUCE on a worker outside tied group {g} {schedule.tied[g]}"  # type: ignore[index]
                        f" (worker {w} holds stage {stage}); only the group's stages reduce its gradients",
                    )
                continue
            if a.microbatch is not None and a.kind not in (ActionKind.CKPT_SEND, ActionKind.CKPT_RECV):
                if not 0 <= a.microbatch < mbs:
                    raise _fail(schedule, w, i, f"{a}: micro-batch {a.microbatch} out of range 0..{mbs - 1}")
            if a.peer is None:
                continue
            if not 0 <= a.peer < n or a.peer == w:
                raise _fail(schedule, w, i, f"{a}: peer {a.peer} must be another worker in 0..{n - 1}")
            if a.peer in schedule.failed:
                raise _fail(schedule, w, i, f"{a}: peer {a.peer} has failed")
            offset = _PEER_STAGE.get(a.kind)
            want = None if offset is None else stage + offset
            if want is not None and a.peer // dp != want:
                if not 0 <= want < pp:
                    raise _fail(schedule, w, i, f"{a}: stage {stage} has no stage {want} to talk to")
                raise _fail(
                    schedule, w, i, f"{a}: peer {a.peer} holds stage {a.peer // dp}, a {a.kind.name} needs stage {want}"
                )


def _check_order(schedule: Schedule) -> Counter:
    """Per-worker order rules; returns how often each (pipeline, stage, mb) ran forward."""
    last = schedule.pp - 1
    forwards: Counter = Counter()
    for w, actions in enumerate(schedule.workers):
        if w in schedule.failed:
            continue
        state: dict[tuple, str] = defaultdict(lambda: "done")  # done -> F -> B -> done
        count: Counter = Counter()  # (what, key) -> occurrences on this worker
        in_iteration: set[tuple] = set()
        reduced = False
        reduces = steps = 0
        tied_due = schedule.tied_groups_of(w // schedule.dp)
        tied_done: set[int] = set()  # tied groups reduced in this iteration
        for i, a in enumerate(actions):
            k, key = a.kind, a.key
            if k is ActionKind.TIED_REDUCE:
                g = a.microbatch
                if not reduced:
                    raise _fail(schedule, w, i, _early_tied_reduce(actions, i, steps))
                if g in tied_done:
                    raise _fail(
                        schedule, w, i, f"{a}: TIED_REDUCE({g}) twice in one iteration; exactly one per iteration"
                    )
                tied_done.add(g)  # type: ignore[arg-type]
                continue
            if reduced and (k.is_compute or k is ActionKind.REDUCE_GRAD):
                raise _fail(schedule, w, i, f"{a} between REDUCE_GRAD and OPT_STEP; the optimizer step must come next")
            if k is ActionKind.F:
                if state[key] != "done" or key in in_iteration:
                    raise _fail(schedule, w, i, f"{a}: forward of {_name(key)} runs twice in one iteration")
                if a.stage > 0 and count["ra", key] <= count["F", key]:
                    raise _fail(schedule, w, i, f"{a}: its input activation was not received before it")
                state[key] = "F"
                count["F", key] += 1
                in_iteration.add(key)
                forwards[key] += 1
            elif k in (ActionKind.B, ActionKind.BW):
                if state[key] != "F":
                    raise _fail(schedule, w, i, f"{a}: backward of {_name(key)} before its forward on this worker")
                if a.stage < last and count["rg", key] <= count["bwd", key]:
                    raise _fail(schedule, w, i, f"{a}: its output gradient was not received before it")
                state[key] = "B" if k is ActionKind.B else "done"
                count["bwd", key] += 1
            elif k is ActionKind.W:
                if state[key] != "B":
                    raise _fail(schedule, w, i, f"{a}: W of {_name(key)} before its B on this worker")
                state[key] = "done"
            elif k is ActionKind.RECV_ACT:
                count["ra", key] += 1
            elif k is ActionKind.RECV_GRAD:
                count["rg", key] += 1
            elif k is ActionKind.SEND_ACT:
                count["sa", key] += 1
                if count["sa", key] > count["F", key]:
                    raise _fail(schedule, w, i, f"{a}: sends an activation this worker has not computed")
            elif k is ActionKind.SEND_GRAD:
                count["sg", key] += 1
                if count["sg", key] > count["bwd", key]:
                    raise _fail(schedule, w, i, f"{a}: sends an input gradient this worker has not computed")
            elif k is ActionKind.REDUCE_GRAD:
                open_keys = sorted(_name(x) for x, st in state.items() if st != "done")
                if open_keys:
                    raise _fail(schedule, w, i, f"REDUCE_GRAD with backward still pending for {', '.join(open_keys[:4])}")
                reduced = True
                reduces += 1
            elif k is ActionKind.OPT_STEP:
                if not reduced:
                    raise _fail(schedule, w, i, "OPT_STEP without a REDUCE_GRAD before it in this iteration")
                missing = [g for g in tied_due if g not in tied_done]
                if missing:
                    g = missing[0]
                    late = _late_tied_reduce(actions, i, g)
                    if late is not None:
                        raise _fail(
                            schedule, w, late,
                            f"{actions[late]} after the iteration's OPT_STEP (step {i}); TIED_REDUCE({g}) must come "
                            f"after the worker's REDUCE_GRAD and before its OPT_STEP",
                        )
                    raise _fail(
                        schedule, w, i,
                        f"OPT_STEP without TIED_REDUCE({g}) before it: every surviving worker of a stage of tied "
                        f"group {g} {schedule.tied[g]} runs exactly one TIED_REDUCE({g}) per iteration, after its "
                        f"REDUCE_GRAD and before its OPT_STEP",
                    )
                tied_done.clear()
                reduced = False
                steps += 1
                in_iteration.clear()
        if reduces != schedule.iterations or steps != schedule.iterations or reduced:
            step = len(actions) - 1 if actions else None
            raise _fail(
                schedule,
                w,
                step,
                f"worker has {reduces} REDUCE_GRAD and {steps} OPT_STEP; expected one of each per iteration "
                f"({schedule.iterations}), OPT_STEP last",
            )
    return forwards


def _late_tied_reduce(actions: tuple, i: int, g: int) -> int | None:
    """The step of a TIED_REDUCE(g) that follows the OPT_STEP at ``i`` before any other work, if any."""
    for j in range(i + 1, len(actions)):
        x = actions[j]
        if x.kind is ActionKind.TIED_REDUCE and x.microbatch == g:
            return j
        if x.kind.is_compute or x.kind in (ActionKind.REDUCE_GRAD, ActionKind.OPT_STEP):
            return None
    return None


def _early_tied_reduce(actions: tuple, i: int, steps: int) -> str:
    """Why a TIED_REDUCE at step ``i`` (no REDUCE_GRAD yet in its iteration) is out of place."""
    a = actions[i]
    rest: list = []
    for x in actions[i + 1:]:
        if x.kind is ActionKind.OPT_STEP:
            break
        rest.append(x)
    rule = "it must come after all the worker's compute and its REDUCE_GRAD, before its OPT_STEP"
    if any(x.kind.is_compute for x in rest):
        return f"{a} before the worker's last compute action of the iteration; {rule}"
    if any(x.kind is ActionKind.REDUCE_GRAD for x in rest):
        return f"{a} before the worker's REDUCE_GRAD; {rule}"
    if steps > 0:
        return f"{a} after the iteration's OPT_STEP; {rule}"
    return f"{a} without a REDUCE_GRAD before it; {rule}"


def _name(key: tuple) -> str:
    p, s, m = key
    return f"p{p}s{s} mb{m}"


def _check_coverage(schedule: Schedule, forwards: Counter) -> None:
    expected = schedule.iterations
    for p in range(schedule.dp):
        for s in range(schedule.pp):
            for m in range(schedule.microbatches):
                got = forwards[(p, s, m)]
                if got != expected:
                    owner = schedule.index_of(p, s)
                    why = "never runs" if got == 0 else f"runs {got} times"
                    raise _fail(
                        schedule,
                        None if owner in schedule.failed else owner,
                        None,
                        f"micro-batch {m} of pipeline {p} at stage {s} {why}; expected {expected} (once per iteration)",
                    )


def _check_messages(schedule: Schedule) -> None:
    sends: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    recvs: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    sent_to: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> keys in send order
    received: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # (src, dst) -> keys in receive order
    for w, actions in enumerate(schedule.workers):
        for i, a in enumerate(actions):
            if a.kind.is_send:
                key = message_key(w, a)
                sends[key].append((w, i))
                sent_to[w, a.peer].append(key)
            elif a.kind.is_recv:
                key = message_key(w, a)
                recvs[key].append((w, i))
                received[a.peer, w].append(key)
    # only unmatched keys are sorted (for a deterministic first error): sorting all of them by
    # their text was a third of this check on large schedules
    bad = [key for key in set(sends) | set(recvs) if len(sends.get(key, ())) != len(recvs.get(key, ()))]
    for key in sorted(bad, key=repr):
        s, r = sends.get(key, []), recvs.get(key, [])
        if len(s) > len(r):
            w, i = s[len(r)]
            raise _fail(schedule, w, i, f"{schedule.workers[w][i]} has no matching receive on worker {key[5]}")
        if len(r) > len(s):
            w, i = r[len(s)]
            raise _fail(schedule, w, i, f"{schedule.workers[w][i]} has no matching send on worker {key[4]}")
    for (src, dst), order in sent_to.items():
        got = received[src, dst]
        if order != got:
            k = next(k for k, (x, y) in enumerate(zip(order, got)) if x != y)
            w, i = recvs[got[k]][0]
            raise _fail(
                schedule, w, i,
                f"{schedule.workers[w][i]}: worker {src} sends its messages to worker {dst} in another order "
                f"({_message_name(order[k])} before {_message_name(got[k])}); NCCL matches a pair's messages in "
                f"order and ignores tags, so every receive must come in its pair's send order",
            )


def _message_name(key: tuple) -> str:
    channel, p, m, stage = key[:4]
    return f"{channel} p{p}s{stage} mb{m}" if channel != "ckpt" else f"checkpoint chunk {m}"


def validate(schedule: Schedule, *, replayed: bool = False) -> Schedule:
    """Check every rule in the module docstring; return the schedule unchanged if it passes.

    Args:
        schedule: the schedule to check.
        replayed: the caller has already replayed this schedule to completion (under any costs,
            which cannot change whether it deadlocks), so rule 6 needs no second replay.

    Raises:
        ScheduleError: the first rule broken, with the per-worker grid and the failing step marked.
    """
    if not native.check(schedule):  # the C checks pass only what these pass; else they name the fault
        _check_shape(schedule)
        forwards = _check_order(schedule)
        _check_coverage(schedule, forwards)
        _check_messages(schedule)
    if replayed:
        return schedule
    fast = native.replay_times(schedule, CostModel.unit())
    if fast is not None and not fast.blocked:
        return schedule
    result = replay(schedule)
    if result.blocked:
        w, i = min(result.blocked.items())
        stuck = ", ".join(f"w{x}@{schedule.workers[x][j]}" for x, j in sorted(result.blocked.items())[:8])
        raise _fail(schedule, w, i, f"deadlock: no worker can proceed (waiting: {stuck})")
    return schedule
