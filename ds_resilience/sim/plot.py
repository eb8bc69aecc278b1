"""Throughput-over-time plot of simulated runs (matplotlib, imported lazily, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .jobsim import Result
from .traces import Trace

__all__ = ["binned", "plot_throughput"]

_COLORS = {
    "ds_resilience": "#d62728",
    "recycle": "#9467bd",
    "oobleck": "#FF8A1D",
    "bamboo": "#008000",
    "varuna": "#000000",
    "checkpoint_restart": "#7f7f7f",
}


def binned(result: Result, start: float, end: float, bins: int = 300) -> tuple[list[float], list[float]]:
    """Bin centres (hours) and the average samples/s in each bin (iterations that counted, spread
    over their duration; pauses, checkpoints and lost work contribute 0)."""
    bins = max(1, bins)
    width = (end - start) / bins if end > start else 1.0
    acc = [0.0] * bins
    for t0, t1, rate in result.series:
        if rate <= 0:
            continue
        first, last = int((t0 - start) // width), int((t1 - start) // width)
        for b in range(max(first, 0), min(last, bins - 1) + 1):
            lo, hi = start + b * width, start + (b + 1) * width
            acc[b] += rate * max(0.0, min(t1, hi) - max(t0, lo))
    xs = [(start + (b + 0.5) * width) / 3600.0 for b in range(bins)]
    return xs, [a / width for a in acc]


def plot_throughput(results: Sequence[Result], trace: Trace, path: str | Path, *, title: str = "") -> Path:
    """Write a PNG: each system's throughput over time in 300 bins (top) and the live nodes, and the
    slow ones if the trace has fail-slow events (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for r in results:
        xs, ys = binned(r, 0.0, trace.end_s)
        color = _COLORS.get(r.system)
        top.plot(xs, ys, linewidth=0.8, color=color, label=f"{r.system} (avg {r.throughput:.3g})")
        top.hlines(r.throughput, r.start_s / 3600.0, r.end_s / 3600.0, colors=color, linestyles="dotted", linewidth=0.8)
    top.set_ylabel("samples/s")
    top.set_ylim(bottom=0)
    top.legend(loc="upper right", fontsize=8)
    top.set_title(title or f"throughput over trace {trace.name}")
    counts = trace.live_counts()
    xs = [t / 3600.0 for t, _ in counts] + [trace.end_s / 3600.0]
    ys = [n for _, n in counts] + [counts[-1][1]]
    bottom.step(xs, ys, where="post", color="#1f77b4", linewidth=0.8, label="live")
    if trace.slowdowns:  # fail-slow: how many live nodes run slow
        slow: set[str] = set()
        sx, sy = [0.0], [0]
        for e in trace.events:
            if e.kind == "slow":
                slow.add(e.node)
            elif e.kind in ("recover", "remove"):
                slow.discard(e.node)
            sx.append(e.time_s / 3600.0)
            sy.append(len(slow))
        bottom.step(sx, sy, where="post", color="#d62728", linewidth=0.8, label="slow")
        bottom.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("nodes")
    bottom.set_xlabel("time (hours)")
    bottom.set_ylim(bottom=0)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
