"""PNG Gantt chart of a replayed schedule: one row per worker, compute bars, sends underneath.

Compute actions are bars coloured by kind (the reduces, REDUCE_GRAD and TIED_REDUCE ``TRg``, and
the optimizer step too); work re-routed from another pipeline (an action whose
``pipeline`` differs from the worker's own, ``w % dp``) is hatched; the micro-batch number is
written inside bars wide enough to hold it. Each worker's sends are thin bars just under its row
(a tick where a message occupies the link for no time). Failed workers are a grey band.

matplotlib is imported only inside :func:`render_gantt` and only its Agg canvas is used (no
pyplot, no global backend switch), so importing :mod:`ds_resilience.ir.gantt` stays light.
"""

from __future__ import annotations

from pathlib import Path

from ..costs import CostModel
from ..errors import ResilienceError
from .action import ActionKind
from .replay import replay
from .schedule import Schedule
from .timeline import Timeline

__all__ = ["render_gantt", "KIND_COLORS"]

KIND_COLORS: dict[ActionKind, str] = {
    ActionKind.F: "#4C72B0",
    ActionKind.B: "#DD8452",
    ActionKind.W: "#55A868",
    ActionKind.BW: "#C44E52",
    ActionKind.REDUCE_GRAD: "#8172B3",
    ActionKind.TIED_REDUCE: "#DA8BC3",
    ActionKind.OPT_STEP: "#222222",
}
"""Bar colour of each compute-like kind."""

_COMM_COLORS: dict[ActionKind, str] = {
    ActionKind.SEND_ACT: "#1F77B4",
    ActionKind.SEND_GRAD: "#FF7F0E",
    ActionKind.CKPT_SEND: "#7F7F7F",
}
_KIND_LABELS = {
    ActionKind.F: "F (forward)",
    ActionKind.B: "B (input grad)",
    ActionKind.W: "W (weight grad)",
    ActionKind.BW: "BW (fused backward)",
    ActionKind.REDUCE_GRAD: "REDUCE_GRAD",
    ActionKind.TIED_REDUCE: "TIED_REDUCE (tied grads)",
    ActionKind.OPT_STEP: "OPT_STEP",
    ActionKind.SEND_ACT: "send activation",
    ActionKind.SEND_GRAD: "send gradient",
    ActionKind.CKPT_SEND: "send checkpoint",
}
_BAR_H = 0.56  # compute bar height (row pitch is 1)
_COMM_H = 0.14  # send bar height
_MIN_LABEL_IN = 0.16  # a bar narrower than this (inches) gets no micro-batch number


def _load_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - exercised only without matplotlib
        raise ResilienceError(
            "render_gantt needs matplotlib, which is not installed; install it with "
            "'pip install matplotlib' to draw Gantt charts"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def render_gantt(
    schedule: Schedule,
    timeline: Timeline,
    path: str | Path,
    *,
    title: str | None = None,
    cost: CostModel | None = None,
) -> None:
    """Write a PNG Gantt chart of ``schedule`` as replayed in ``timeline`` to ``path``.

    Args:
        schedule: the schedule that was simulated.
        timeline: its :func:`~ds_resilience.ir.simulate` result (per-action starts and ends).
        path: output file (PNG); parent directories must exist.
        title: chart title (default: the schedule's name and its grid).
        cost: the cost model the timeline was simulated with (unit costs when ``None``); used to
            replay the messages for the send bars.

    Raises:
        ResilienceError: matplotlib is not installed, or the timeline does not fit the schedule.
    """
    Figure, FigureCanvasAgg, Patch = _load_matplotlib()
    if len(timeline.starts) != len(schedule.workers) or any(
        len(s) != len(a) for s, a in zip(timeline.starts, schedule.workers)
    ):
        raise ResilienceError("render_gantt: the timeline does not match the schedule (simulate this schedule)")
    transfers = replay(schedule, cost).transfers
    n = len(schedule.workers)
    span = max(timeline.makespan, max((t.arrival for t in transfers), default=0.0), 1e-9)
    width_in = min(24.0, max(9.0, 0.35 * span + 3.0))
    plot_in = width_in - 2.2  # rough width of the axes area, for label fitting
    fig = Figure(figsize=(width_in, 1.0 + 0.55 * n + 0.9))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    seen: set[ActionKind] = set()
    rerouted_seen = False
    for w, actions in enumerate(schedule.workers):
        y = float(w)
        own = w % schedule.dp
        if w in schedule.failed:
            ax.axhspan(y - 0.45, y + 0.45, color="#BBBBBB", alpha=0.6, lw=0)
            ax.text(span / 2, y, "failed", ha="center", va="center", fontsize=10, color="#444444", style="italic")
            continue
        for a, s, e in zip(actions, timeline.starts[w], timeline.ends[w]):
            color = KIND_COLORS.get(a.kind)
            if color is None:
                continue
            seen.add(a.kind)
            rerouted = a.pipeline is not None and a.pipeline != own
            rerouted_seen |= rerouted
            top = y - _BAR_H / 2
            if e <= s:  # zero-time step (e.g. a free optimizer step): a thin tick
                ax.plot([s, s], [top, top + _BAR_H], color=color, lw=2.0, solid_capstyle="butt")
                continue
            ax.broken_barh(
                [(s, e - s)], (top, _BAR_H), facecolors=color, edgecolors="white" if not rerouted else "black",
                linewidth=0.6, hatch="///" if rerouted else None,
            )
            if a.microbatch is not None and (e - s) / span * plot_in >= _MIN_LABEL_IN:
                text = f"TR{a.microbatch}" if a.kind is ActionKind.TIED_REDUCE else str(a.microbatch)
                ax.text((s + e) / 2, y, text, ha="center", va="center", fontsize=7,
                        color="white", fontweight="bold")
    comm_seen: set[ActionKind] = set()
    for t in transfers:
        color = _COMM_COLORS.get(t.kind, "#7F7F7F")
        comm_seen.add(t.kind)
        top = t.src + _BAR_H / 2 + 0.04
        if t.end > t.start:
            ax.broken_barh([(t.start, t.end - t.start)], (top, _COMM_H), facecolors=color, linewidth=0)
        else:
            ax.plot([t.start, t.start], [top, top + _COMM_H], color=color, lw=1.0)

    ax.set_ylim(n - 0.5, -0.5)  # worker 0 on top
    ax.set_xlim(0, span * 1.01)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"w{w} p{w % schedule.dp}/s{w // schedule.dp}" for w in range(n)], fontsize=8)
    ax.set_xlabel("time")
    ax.grid(axis="x", color="#DDDDDD", lw=0.5)
    ax.set_axisbelow(True)
    if title is None:
        name = schedule.name or "schedule"
        title = (f"{name}: dp={schedule.dp} pp={schedule.pp} mb={schedule.microbatches}, "
                 f"makespan {timeline.makespan:g}, bubble {timeline.bubble_ratio:.0%}")
    ax.set_title(title, fontsize=10)

    handles = [Patch(facecolor=KIND_COLORS[k], label=_KIND_LABELS[k]) for k in KIND_COLORS if k in seen]
    if rerouted_seen:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="re-routed work"))
    handles += [Patch(facecolor=_COMM_COLORS[k], label=_KIND_LABELS[k]) for k in _COMM_COLORS if k in comm_seen]
    if schedule.failed:
        handles.append(Patch(facecolor="#BBBBBB", label="failed worker"))
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(n, 1)),
                  ncol=min(len(handles), 5), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
