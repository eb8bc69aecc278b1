"""What a schedule holds in memory, and the cap plans must respect.

A worker holds, per micro-batch, its activations from F to B and then, under the decoupled
backward, what the deferred W needs from B to W. The cost model says what each weighs
(:meth:`~ds_resilience.costs.CostModel.memory_weights`): bytes from a profile (``state_bytes``,
``pending_w_bytes``), or 1 per state for a model without memory figures. A worker's memory is
counted in action order, which is what it holds whatever the timing.

The default cap is what the job already fits in: the peak of fault-free 1F1B (what DeepSpeed runs),
the largest over its workers. A plan that needs more would be an out-of-memory error on the GPU the
fault-free job was sized for, so more is only used when the user raises the cap
(``resilience.planner.memory_cap``, ``--memory-cap``). Pure Python.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

from ..costs import CostModel, format_memory, parse_size
from ..errors import MemoryCapError, PlanningError
from ..ir import Action, ActionKind, Schedule, TiedGroups, native
from .generators import check_grid, one_f_one_b

__all__ = ["parse_memory", "worker_peaks", "fault_free_peak", "resolve_cap", "max_deferred_w", "format_memory"]


def parse_memory(value: object, *, what: str = "memory_cap") -> tuple[float, bool]:
    """:func:`~ds_resilience.costs.parse_size`, raising :class:`PlanningError`."""
    try:
        return parse_size(value, what=what)
    except ValueError as exc:
        raise PlanningError(str(exc)) from None


def _order_peak(actions: Sequence[Action], act_w: float, w_w: float) -> float:
    held = peak = 0.0
    for a in actions:
        kind = a.kind
        if kind is ActionKind.F:
            held += act_w
        elif kind is ActionKind.BW:
            held -= act_w
        elif kind is ActionKind.B:
            held += w_w - act_w
        elif kind is ActionKind.W:
            held -= w_w
        else:
            continue
        peak = max(peak, held)
    return peak


def worker_peaks(schedule: Schedule, cost: CostModel) -> tuple[float, ...]:
    """Per worker, the most memory its micro-batch states take at once (in ``cost.memory_unit``)."""
    weights = cost.memory_weights(schedule.pp)
    fast = native.peaks(schedule, weights)  # the same sums in C, where it builds
    if fast is not None:
        return fast[0]
    return tuple(
        _order_peak(actions, *weights[w // schedule.dp]) if actions else 0.0
        for w, actions in enumerate(schedule.workers)
    )


@lru_cache(maxsize=64)
def fault_free_peak(dp: int, pp: int, microbatches: int, cost: CostModel, tied: TiedGroups = (), *,
                    one_pipeline: bool = True) -> float:
    """The largest per-worker peak of fault-free 1F1B: the memory the job is known to fit in (cached:
    every plan of a table asks for it).

    Computed on one pipeline (``one_pipeline``, the default): fault-free, every pipeline runs its own
    micro-batches on its own workers in the first pipeline's order, and a worker's memory depends on
    its stage and its order only, so the largest peak of the ``dp x pp`` grid is the first
    pipeline's, bit for bit, for ``1 / dp`` of the work (``tests/unit/planning/
    test_fault_free_symmetry.py`` holds the two equal; ``one_pipeline=False`` is the whole grid)."""
    check_grid(dp, pp, microbatches)
    return max(worker_peaks(one_f_one_b(1 if one_pipeline else dp, pp, microbatches, tied=tied), cost))


def resolve_cap(
    dp: int, pp: int, microbatches: int, cost: CostModel, memory_cap: object = None, tied: TiedGroups = (),
    *, split_backward: bool = True,
) -> float:
    """The cap a plan must respect, in ``cost.memory_unit``.

    ``None``: fault-free 1F1B's peak. A number: taken in the cost model's unit. A size string
    (``"24GiB"``): bytes, which needs a cost model with ``state_bytes``.

    Raises:
        PlanningError: a bad cap, a size for a model without memory figures, or a cap (given or
            default) below one micro-batch's activations, or, with ``split_backward``, below one
            pending W, on some stage (those two: :class:`MemoryCapError`).
    """
    unit = cost.memory_unit
    if memory_cap is None:
        cap = fault_free_peak(dp, pp, microbatches, cost, tied)
        named = f"the default memory cap (fault-free 1F1B's peak, {format_memory(cap, unit)})"
    else:
        cap, in_bytes = parse_memory(memory_cap)
        if in_bytes and not cost.has_memory:
            raise PlanningError(
                f"memory_cap {memory_cap!r} is in bytes, but cost model {cost.name!r} has no memory figures "
                "(state_bytes): give a profiled cost model (ds-resilience profile) or a cap in micro-batch states")
        named = f"memory_cap {format_memory(cap, unit)}"
    weights = cost.memory_weights(pp)
    stage, act = max(enumerate(a for a, _ in weights), key=lambda x: x[1])
    if cap < act - 1e-9:
        raise MemoryCapError(f"{named} cannot hold one micro-batch's activations ({format_memory(act, unit)} on "
                            f"stage {stage}); allowed: a cap >= that")
    stage, pend = max(enumerate(w for _, w in weights), key=lambda x: x[1])
    if split_backward and cap < pend - 1e-9:
        raise MemoryCapError(f"{named} cannot hold one micro-batch's pending W ({format_memory(pend, unit)} on "
                            f"stage {stage}), which the decoupled backward needs: raise memory_cap to at least "
                            "that, or plan the adaptive (fused backward) variant")
    return cap


def max_deferred_w(cap: float, w_w: float, load: int) -> int:
    """The most W's a worker can still hold pending once its last B has run (no activation is held
    then): ``cap // w_w`` (``w_w``: what one pending W weighs), at most its ``load``."""
    if w_w <= 0:
        return load
    return min(load, int(math.floor(cap / w_w + 1e-9)))
