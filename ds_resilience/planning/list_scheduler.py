"""Greedy list scheduling: compute orders for any placement of micro-batches on workers.

An event-driven simulation in which every free worker picks, at each instant, the most urgent task
it can run: a ready backward first (it unblocks the stages before it), then a ready forward (if the
worker's in-flight activation cap allows), then a deferred weight-gradient W (filling what would be
idle time). A W is also forced before a new B when the worker's pending-W cap is reached, which
bounds the memory held by deferred W work.

It is used for the fault-free decoupled schedule and, with re-routed placements, by the planner. It
runs in milliseconds and never fails on a feasible input; the timeline replay of the lowered
schedule is the judge of its timing. The loop runs in C (``csrc/schedule_core.c``, through
:func:`ds_resilience.ir.native.list_orders`) where the library builds, with the same choices in the
same order (the orders are equal, ``tests/unit/ir/test_native.py``); this module's Python loop is the
reference and the fallback.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..costs import CostModel
from ..errors import PlanningError
from ..ir import Action, ActionKind, native
from ..ir.action import trusted_action

__all__ = ["ListResult", "list_schedule"]

Key = tuple[int, int, int]  # (pipeline, stage, microbatch)


@dataclass(frozen=True, slots=True, kw_only=True)
class ListResult:
    """Per-worker compute orders and the makespan the greedy simulation predicts."""

    orders: tuple[tuple[Action, ...], ...]
    makespan: float


def list_schedule(
    *,
    dp: int,
    pp: int,
    microbatches: int,
    cost: CostModel,
    assignment: Mapping[Key, int],
    split_backward: bool,
    act_caps: Sequence[int],
    w_caps: Sequence[int | None],
    mem_caps: Sequence[float | None] | None = None,
    start_times: Sequence[float] | None = None,
    mem_weights: Sequence[tuple[float, float]] | None = None,
    speeds: Sequence[float] | None = None,
) -> ListResult:
    """Order every worker's F/B/W for the given placement.

    Args:
        dp, pp, microbatches: the grid.
        cost: per-stage times and the link model.
        assignment: (pipeline, stage, microbatch) -> worker index that runs it (all three passes).
        split_backward: emit B and W separately (decoupled backward); else fused BW.
        act_caps: per worker, the most micro-batches between F and B (activation memory).
        w_caps: per worker, the most B's whose W is still pending (``None``: no cap).
        mem_caps: per worker, the most memory its micro-batch states take at once, activations (F to
            B) and pending W (B to W) together (``None``: no cap beyond the two above).
        start_times: per worker, the earliest time it may start (default 0).
        mem_weights: per worker, what one held activation and one pending W weigh against
            ``mem_caps`` (default 1 each: the caps count states).
        speeds: per worker, the fraction of its stage's compute speed it runs at (a straggler's
            below 1; the Python loop then); ``None``: all at full speed.

    Returns:
        The orders and predicted makespan.

    Raises:
        PlanningError: the caps make the placement unschedulable (e.g. a cap of 0).
    """
    n = dp * pp
    fast = None if speeds is not None else native.list_orders(
        dp=dp, pp=pp, microbatches=microbatches, cost=cost, assignment=assignment, split_backward=split_backward,
        act_caps=act_caps, w_caps=w_caps, mem_caps=mem_caps, start_times=start_times, mem_weights=mem_weights)
    if fast is not None:  # the same loop in C (csrc/schedule_core.c), where it builds
        return ListResult(orders=tuple(tuple(o) for o in fast[0]), makespan=fast[1])
    comm = cost.p2p_latency
    todo: list[list[Key]] = [[] for _ in range(n)]
    for key, w in sorted(assignment.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        todo[w].append(key)
    free_at = list(start_times) if start_times is not None else [0.0] * n
    in_flight = [0] * n
    orders: list[list[Action]] = [[] for _ in range(n)]
    # ready work as heaps ordered like the selection rule: forwards by (input arrival, micro-batch,
    # pipeline), backwards by (gradient arrival, micro-batch, pipeline); an entry goes in when its
    # input is sent (its arrival time is then known) and is ready once that time has come
    f_heap: list[list[tuple[float, int, int, Key]]] = [[] for _ in range(n)]
    b_heap: list[list[tuple[float, int, int, Key]]] = [[] for _ in range(n)]
    f_left = [len(ks) for ks in todo]  # forwards not started (for the error message)
    for w, keys in enumerate(todo):
        for key in keys:
            if key[1] == 0:
                f_heap[w].append((0.0, key[2], key[0], key))
        heapq.heapify(f_heap[w])
    w_pending: list[list[Key]] = [[] for _ in range(n)]
    remaining = sum(len(ks) for ks in todo) * (3 if split_backward else 2)
    # (time, worker): the worker may have something new to do at that time (it became free, or a
    # message arrived for it). Only those workers are looked at, which keeps this O(tasks log tasks).
    events: list[tuple[float, int]] = [(free_at[w], w) for w in range(n) if todo[w]]
    heapq.heapify(events)
    last = pp - 1
    weights = list(mem_weights) if mem_weights is not None else [(1.0, 1.0)] * n
    held = [0.0] * n  # memory of the states each worker holds now, in the caps' unit

    stage_costs = cost.stages(pp)
    links = [comm + cost.transfer_time(c.activation_bytes) for c in stage_costs]

    def transfer(stage: int) -> float:
        return links[stage]

    slow = [1.0] * n if speeds is None else [1.0 / v for v in speeds]

    def emit(w: int, kind: ActionKind, key: Key, t: float, duration: float) -> float:
        p, s, m = key
        orders[w].append(trusted_action(kind, s, m, p))
        end = t + duration * slow[w]
        free_at[w] = end
        heapq.heappush(events, (end, w))
        return end

    makespan = 0.0
    while remaining:
        if not events:
            stuck = {w: (f_left[w], in_flight[w], len(w_pending[w])) for w in range(n) if todo[w]}
            raise PlanningError(f"list scheduling cannot proceed (caps too tight?); per worker (F, B, W) left: {stuck}")
        t, first = heapq.heappop(events)
        woken = {first}
        while events and events[0][0] <= t:
            woken.add(heapq.heappop(events)[1])
        for w in sorted(woken):
            if free_at[w] > t:
                continue
            c = stage_costs[w // dp]
            bh, fh = b_heap[w], f_heap[w]
            has_b = bool(bh) and bh[0][0] <= t
            has_f = bool(fh) and fh[0][0] <= t
            w_cap = w_caps[w]
            must_w = split_backward and w_pending[w] and w_cap is not None and len(w_pending[w]) >= w_cap
            mem_cap = mem_caps[w] if mem_caps is not None else None
            act_w, w_w = weights[w]
            # an activation reserves what its pending W will need if that is more, so a B never
            # raises the memory held
            act_w = max(act_w, w_w) if split_backward else act_w
            mem_full = mem_cap is not None and held[w] + act_w > mem_cap + 1e-9
            if has_b and not must_w:
                key = heapq.heappop(bh)[3]
                in_flight[w] -= 1
                if split_backward:
                    end = emit(w, ActionKind.B, key, t, c.t_b)
                    w_pending[w].append(key)
                    held[w] += w_w - act_w
                else:
                    end = emit(w, ActionKind.BW, key, t, c.t_bw)
                    held[w] -= act_w
                remaining -= 1
                if key[1] > 0:
                    prev = (key[0], key[1] - 1, key[2])
                    arrival = end + transfer(key[1] - 1)  # the boundary below this stage
                    owner = assignment[prev]
                    heapq.heappush(b_heap[owner], (arrival, prev[2], prev[0], prev))
                    heapq.heappush(events, (arrival, owner))
            elif has_f and in_flight[w] < act_caps[w] and not mem_full:
                key = heapq.heappop(fh)[3]
                f_left[w] -= 1
                in_flight[w] += 1
                held[w] += act_w
                end = emit(w, ActionKind.F, key, t, c.t_f)
                if key[1] == last:  # its backward needs no gradient: ready once this forward ends
                    heapq.heappush(bh, (0.0, key[2], key[0], key))
                remaining -= 1
                if key[1] < last:
                    nxt = (key[0], key[1] + 1, key[2])
                    arrival = end + transfer(key[1])
                    owner = assignment[nxt]
                    heapq.heappush(f_heap[owner], (arrival, nxt[2], nxt[0], nxt))
                    heapq.heappush(events, (arrival, owner))
            elif w_pending[w]:
                key = w_pending[w].pop(0)
                held[w] -= w_w
                end = emit(w, ActionKind.W, key, t, c.t_w)
                remaining -= 1
            else:
                continue
            makespan = max(makespan, end)
    return ListResult(orders=tuple(tuple(o) for o in orders), makespan=makespan)
