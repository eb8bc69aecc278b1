"""Human renderings of a schedule: the step list (for errors) and the time grid (for people).

``format_steps`` prints each worker's actions in order and marks one step; every
:class:`ScheduleError` from the validator carries it. ``format_grid`` draws compute actions on a time
axis (one column per time unit, scaled so the shortest compute action fills one cell). Pure Python.
"""

from __future__ import annotations

from typing import Sequence

from .action import ActionKind
from .schedule import Schedule

__all__ = ["format_steps", "format_grid", "cell_label"]

_MARK = "<-- ERROR HERE"
_SHOWN = frozenset({ActionKind.OPT_STEP, ActionKind.TIED_REDUCE})  # drawn besides compute, when they take time


def _worker_label(schedule: Schedule, index: int) -> str:
    w = schedule.worker_of(index)
    return f"w{index} (p{w.pipeline},s{w.stage})"


def format_steps(schedule: Schedule, *, mark: tuple[int, int] | None = None, context: int = 6) -> str:
    """Per-worker action lists; ``mark=(worker, step)`` brackets that step and points at it.

    Long lists are cut to ``context`` steps either side of the mark.
    """
    labels = [_worker_label(schedule, i) for i in range(len(schedule.workers))]
    width = max(len(label) for label in labels)
    lines = []
    for index, actions in enumerate(schedule.workers):
        if index in schedule.failed:
            lines.append(f"{labels[index]:<{width}} | (failed)")
            continue
        tokens = [str(a) for a in actions]
        lo, hi = 0, len(tokens)
        if mark is not None and mark[0] == index:
            step = mark[1]
            if 0 <= step < len(tokens):
                tokens[step] = f">>{tokens[step]}<<"
            lo, hi = max(0, step - context), min(len(tokens), step + context + 1)
        body = " ".join(tokens[lo:hi])
        if lo > 0:
            body = "... " + body
        if hi < len(tokens):
            body += " ..."
        suffix = f"   {_MARK} (step {mark[1]})" if mark is not None and mark[0] == index else ""
        lines.append(f"{labels[index]:<{width}} | {body}{suffix}")
    return "\n".join(lines)


def cell_label(schedule: Schedule, index: int, kind: ActionKind, pipeline: int | None, mb: int | None) -> str:
    """Grid label of a compute action: ``F3``; re-routed work (another pipeline's) gets ``'``.

    An optimizer step is ``O``, a tied-gradient reduce of group g ``Tg`` (``T0``).
    """
    code = {"BW": "B", "OPT": "O", "TR": "T"}.get(kind.value, kind.value)
    label = f"{code}{'' if mb is None else mb}"
    if pipeline is not None and pipeline != schedule.worker_of(index).pipeline:
        label += "'"
    return label


def format_grid(
    schedule: Schedule,
    starts: Sequence[Sequence[float]],
    ends: Sequence[Sequence[float]],
    *,
    max_columns: int = 160,
) -> str:
    """Compute actions on a time axis, one row per worker (``.`` = idle); optimizer steps (``O``)
    and tied-gradient reduces (``T0``) too when they take time.

    A cell is the shortest compute duration; an action spanning k cells repeats its label's first
    cell and fills the rest with ``=`` (fused backward BW shows as ``B`` over two cells).
    """
    durations = [
        e - s
        for w, acts in enumerate(schedule.workers)
        for a, s, e in zip(acts, starts[w], ends[w])
        if a.kind.is_compute and e > s
    ]
    if not durations:
        return "(empty schedule)"
    unit = min(durations)
    horizon = max((e[-1] for e in ends if e), default=0.0)
    columns = int(round(horizon / unit))
    labels = [_worker_label(schedule, i) for i in range(len(schedule.workers))]
    width = max(len(lb) for lb in labels)
    rows: list[list[str]] = []
    for w, acts in enumerate(schedule.workers):
        row = ["."] * columns
        if w in schedule.failed:
            row = ["x"] * columns
        for a, s, e in zip(acts, starts[w], ends[w]):
            if not (a.kind.is_compute or a.kind in _SHOWN) or e <= s:
                continue
            c0, c1 = int(round(s / unit)), max(int(round(e / unit)), int(round(s / unit)) + 1)
            label = cell_label(schedule, w, a.kind, a.pipeline, a.microbatch)
            for c in range(c0, min(c1, columns)):
                row[c] = label if c == c0 else "="
        rows.append(row)
    cell = max(len(c) for row in rows for c in row)
    lines = []
    for w, row in enumerate(rows):
        shown = row[:max_columns]
        body = "".join(f"{c:<{cell}}" for c in shown).rstrip()
        more = f" ... (+{len(row) - len(shown)})" if len(row) > len(shown) else ""
        lines.append(f"{labels[w]:<{width}} |{body}{more}")
    lines.append(f"{'':<{width}}  one cell = {unit:g} time units; ' = re-routed micro-batch; x = failed")
    return "\n".join(lines)
