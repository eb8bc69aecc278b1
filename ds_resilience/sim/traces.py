"""Failure traces: membership changes of a cluster over time, parsed, generated and checked.

Two file formats are read (:func:`load_trace` tells them apart by their first line):

* **events** (``*.csv``): ``ms,add|remove,nodeN`` per line, times in milliseconds, non-decreasing;
  the Bamboo/Oobleck spot-instance traces (``p3-trace.csv``, ``6h.csv``, ...). Two more kinds
  describe fail-slow workers: ``ms,slow,nodeN,SPEED`` (the live node runs at ``SPEED`` of its
  speed, ``0 < SPEED < 1``, from then on; a second ``slow`` changes the speed) and
  ``ms,recover,nodeN`` (the slow node is back at full speed). A slow node that is removed dies
  slow: the removal is an ordinary failure and ends the slowdown.
* **samples** (``gcp-*.txt``): ``YYYY-MM-DD, HH:MM:SS, N`` per line, the number of live nodes
  observed at that time. A change of N is a membership change at the first line that reports the new
  value; the files repeat each value a few times and the repeats may step back in time, so only the
  times of the changes must be non-decreasing. Nodes get synthetic names; a drop removes the most
  recently added live nodes first (deterministic).

Generators: :func:`periodic_trace` (one removal every interval, like the published ``6h``/``1h``/
``10m`` traces), :func:`poisson_trace` (exponential gaps with a mean time between failures, seeded,
optional repair), :func:`redraw_victims` (same times, victims drawn again uniformly) and
:func:`add_slow_events` (seeded fail-slow episodes over any trace, see its docstring for the model).
Every problem raises :class:`TraceError` naming the file and line. Pure Python.
"""

from __future__ import annotations

import datetime as _dt
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..errors import ResilienceError

__all__ = [
    "SimulationError",
    "TraceError",
    "TraceEvent",
    "Trace",
    "parse_duration",
    "load_trace",
    "parse_events",
    "parse_samples",
    "periodic_trace",
    "poisson_trace",
    "redraw_victims",
    "counts_trace",
    "add_slow_events",
    "slow_stretch",
    "SLOW_GAP",
    "SLOW_DURATION",
    "SLOW_SPEEDS",
]

KINDS = ("add", "remove")
"""Membership changes."""
SLOW_KINDS = ("slow", "recover")
"""Speed changes of a live node (fail-slow)."""
ALL_KINDS = KINDS + SLOW_KINDS


class SimulationError(ResilienceError, ValueError):
    """A failure-trace simulation input is invalid (trace, model profile, system or option)."""


class TraceError(SimulationError):
    """A trace file or generated trace is malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceEvent:
    """One change at ``time_s``: ``node`` joins (``add``), leaves (``remove``), runs at ``speed`` of
    its speed (``slow``, ``0 < speed < 1``) or is back at full speed (``recover``)."""

    time_s: float
    kind: str
    node: str
    speed: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A checked, time-ordered sequence of membership changes.

    Invariants (checked on construction): times finite, >= 0 and non-decreasing; a node is added
    only when absent and removed only when present; ``slow`` only of a live node with a speed in
    (0, 1), ``recover`` only of a slow one; membership events have speed 1.
    """

    name: str
    events: tuple[TraceEvent, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        live: set[str] = set()
        slow: set[str] = set()
        last = 0.0
        for i, e in enumerate(self.events):
            where = f"trace {self.name!r} event {i} ({e.time_s:g} s {e.kind} {e.node})"
            if e.kind not in ALL_KINDS:
                raise TraceError(f"{where}: kind must be one of {', '.join(ALL_KINDS)}")
            if not math.isfinite(e.time_s) or e.time_s < 0:
                raise TraceError(f"{where}: time must be a finite number >= 0")
            if e.time_s < last:
                raise TraceError(f"{where}: time goes back from {last:g} s; events must be in time order")
            last = e.time_s
            if e.kind == "slow":
                if isinstance(e.speed, bool) or not isinstance(e.speed, (int, float)) or not 0 < e.speed < 1:
                    raise TraceError(f"{where}: speed {e.speed!r} must be a number in (0, 1)")
            elif e.speed != 1.0:
                raise TraceError(f"{where}: only a 'slow' event has a speed (got {e.speed!r})")
            if e.kind == "add":
                if e.node in live:
                    raise TraceError(f"{where}: node is already live")
                live.add(e.node)
            elif e.kind == "remove":
                if e.node not in live:
                    raise TraceError(f"{where}: node is not live")
                live.discard(e.node)
                slow.discard(e.node)
            elif e.kind == "slow":
                if e.node not in live:
                    raise TraceError(f"{where}: only a live node can run slow")
                slow.add(e.node)
            else:
                if e.node not in slow:
                    raise TraceError(f"{where}: node is not slow")
                slow.discard(e.node)
        if not self.events:
            raise TraceError(f"trace {self.name!r} has no events")

    @property
    def end_s(self) -> float:
        """Time of the last event: the simulation stops there (as the published simulators do)."""
        return self.events[-1].time_s

    @property
    def slowdowns(self) -> int:
        """Number of ``slow`` events."""
        return sum(1 for e in self.events if e.kind == "slow")

    def membership(self) -> "Trace":
        """The trace without its speed events (the failure trace it was built on)."""
        return Trace(name=self.name, events=tuple(e for e in self.events if e.kind in KINDS))

    @property
    def removals(self) -> int:
        return sum(1 for e in self.events if e.kind == "remove")

    @property
    def additions(self) -> int:
        return sum(1 for e in self.events if e.kind == "add")

    def live_counts(self) -> tuple[tuple[float, int], ...]:
        """``(time, live nodes after the changes at that time)``, one entry per distinct time."""
        out: list[tuple[float, int]] = []
        n = 0
        for e in self.events:
            if e.kind not in KINDS:
                continue
            n += 1 if e.kind == "add" else -1
            if out and out[-1][0] == e.time_s:
                out[-1] = (e.time_s, n)
            else:
                out.append((e.time_s, n))
        return tuple(out)

    @property
    def max_nodes(self) -> int:
        return max(n for _, n in self.live_counts())

    def to_csv(self) -> str:
        """The events format (milliseconds), one line per event."""
        return "".join(f"{round(e.time_s * 1000)},{e.kind},{e.node}" + (f",{e.speed:g}" if e.kind == "slow" else "") + "\n"
                       for e in self.events)


_DURATION = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(text: str | float | int) -> float:
    """``"30m"`` -> 1800.0 seconds. Units: ms, s, m/min, h, d; a bare number is seconds.

    Raises:
        SimulationError: not a positive finite duration (e.g. ``"-5m"``, ``"0"``, ``"abc"``).
    """
    if isinstance(text, bool):
        raise SimulationError(f"duration {text!r} is not a number with a unit (e.g. 30m, 6h, 90s)")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise SimulationError(
                f"duration {text!r} is not a number with an optional unit (ms, s, m, min, h, d; e.g. 30m, 6h, 90s)"
            )
        value = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not math.isfinite(value) or value <= 0:
        raise SimulationError(f"duration {text!r} must be > 0 (e.g. 30m, 6h, 90s)")
    return value


# --- parsing ---------------------------------------------------------------------------------


def load_trace(path: str | Path) -> Trace:
    """Read a trace file in either format (see the module docstring).

    Raises:
        TraceError: missing or empty file, or a malformed line (file and line named).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise TraceError(f"trace file {str(path)!r} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace file {str(path)!r} cannot be read: {exc}") from exc
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise TraceError(f"trace file {str(path)!r} is empty")
    fields = [f.strip() for f in first.split(",")]
    if len(fields) in (3, 4) and fields[1] in ALL_KINDS:
        return parse_events(lines, source=str(path), name=path.stem)
    if len(fields) == 3 and re.match(r"^\d{4}-\d{2}-\d{2}$", fields[0]):
        return parse_samples(lines, source=str(path), name=path.stem)
    raise TraceError(
        f"{path}:1: {first.strip()!r} is neither 'ms,add|remove|slow|recover,node[,speed]' nor "
        "'YYYY-MM-DD, HH:MM:SS, live_nodes'"
    )


def _records(lines: Iterable[str], source: str, form: str, counts: tuple[int, ...] = (3,)) -> Iterator[tuple[str, list[str]]]:
    """(location for messages, the comma-separated fields) of each line that is not blank or a
    ``#`` comment; raises :class:`TraceError` naming ``form`` for a line with another field count."""
    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{lineno}: {line!r}"
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in counts:
            expected = " or ".join(str(c) for c in counts)
            raise TraceError(f"{where}: expected {expected} fields {form}, got {len(parts)}")
        yield where, parts


def parse_events(lines: Iterable[str], *, source: str = "<trace>", name: str = "trace") -> Trace:
    """Parse ``ms,add|remove,node``, ``ms,slow,node,speed`` and ``ms,recover,node`` lines (blank
    lines and ``#`` comments are skipped); every problem names the source and line."""
    events: list[TraceEvent] = []
    live: set[str] = set()
    slow: set[str] = set()
    last = 0
    form = "'ms,add|remove|recover,node' or 'ms,slow,node,speed'"
    for where, parts in _records(lines, source, form, counts=(3, 4)):
        ms_text, kind, node = parts[:3]
        if not re.fullmatch(r"\d+", ms_text):
            raise TraceError(f"{where}: time {ms_text!r} must be a non-negative integer of milliseconds")
        if kind not in ALL_KINDS:
            raise TraceError(f"{where}: event {kind!r} must be one of {', '.join(ALL_KINDS)}")
        if not node:
            raise TraceError(f"{where}: node name is empty")
        speed = 1.0
        if kind == "slow":
            if len(parts) != 4:
                raise TraceError(f"{where}: a slow event needs its speed: 'ms,slow,node,speed' (e.g. 0.5)")
            try:
                speed = float(parts[3])
            except ValueError:
                raise TraceError(f"{where}: speed {parts[3]!r} is not a number (a fraction of full speed, e.g. 0.5)") from None
            if not 0 < speed < 1:
                raise TraceError(f"{where}: speed {parts[3]} must be > 0 and < 1 (a fraction of full speed; "
                                 "'recover' restores full speed, 'remove' a dead node)")
        elif len(parts) != 3:
            raise TraceError(f"{where}: only a slow event has a fourth field (its speed)")
        ms = int(ms_text)
        if ms < last:
            raise TraceError(f"{where}: time {ms} ms is before the previous event ({last} ms); lines must be in time order")
        last = ms
        if kind == "add" and node in live:
            raise TraceError(f"{where}: {node} is added while already live")
        if kind in ("remove", "slow") and node not in live:
            raise TraceError(f"{where}: {node} is {'removed' if kind == 'remove' else 'slowed'} but is not live")
        if kind == "recover" and node not in slow:
            raise TraceError(f"{where}: {node} recovers but is not slow")
        if kind == "add":
            live.add(node)
        elif kind == "remove":
            live.discard(node)
            slow.discard(node)
        elif kind == "slow":
            slow.add(node)
        else:
            slow.discard(node)
        events.append(TraceEvent(time_s=ms / 1000.0, kind=kind, node=node, speed=speed))
    if not events:
        raise TraceError(f"{source}: no events")
    return Trace(name=name, events=tuple(events))


def parse_samples(lines: Iterable[str], *, source: str = "<trace>", name: str = "trace") -> Trace:
    """Parse ``YYYY-MM-DD, HH:MM:SS, N`` live-node samples into add/remove events (see module doc)."""
    changes: list[tuple[float, int]] = []
    t0: _dt.datetime | None = None
    current: int | None = None
    for where, parts in _records(lines, source, "'YYYY-MM-DD, HH:MM:SS, live_nodes'"):
        try:
            stamp = _dt.datetime.fromisoformat(f"{parts[0]} {parts[1]}")
        except ValueError:
            raise TraceError(f"{where}: {parts[0]} {parts[1]} is not a 'YYYY-MM-DD HH:MM:SS' time") from None
        if not re.fullmatch(r"\d+", parts[2]):
            raise TraceError(f"{where}: live node count {parts[2]!r} must be a non-negative integer")
        count = int(parts[2])
        if t0 is None:
            t0 = stamp
        t = (stamp - t0).total_seconds()
        if current is None or count != current:
            if t < 0 or (changes and t < changes[-1][0]):
                raise TraceError(f"{where}: the count changes at a time before the previous change")
            changes.append((t, count))
            current = count
    if not changes:
        raise TraceError(f"{source}: no samples")
    events: list[TraceEvent] = []
    live: list[str] = []
    next_id = 1
    for t, count in changes:
        while len(live) < count:
            node = f"node{next_id}"
            next_id += 1
            live.append(node)
            events.append(TraceEvent(time_s=t, kind="add", node=node))
        while len(live) > count:
            events.append(TraceEvent(time_s=t, kind="remove", node=live.pop()))
    if not events:
        raise TraceError(f"{source}: every sample reports 0 live nodes")
    return Trace(name=name, events=tuple(events))


# --- generators ------------------------------------------------------------------------------


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SimulationError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _initial(nodes: int) -> list[TraceEvent]:
    return [TraceEvent(time_s=0.0, kind="add", node=f"node{i}") for i in range(1, nodes + 1)]


def periodic_trace(interval: str | float, *, nodes: int = 30, removals: int = 15, seed: int = 0) -> Trace:
    """``nodes`` live at time 0, then one removal every ``interval``, ``removals`` times.

    The victims are drawn uniformly among the live nodes with ``random.Random(seed)``. This is the
    shape of the published ``6h``/``3h``/``1h``/``30m``/``10m``/``5m`` traces.
    """
    step = parse_duration(interval)
    _check_count("nodes", nodes, 1)
    _check_count("removals", removals, 0)
    if removals >= nodes:
        raise SimulationError(f"removals ({removals}) must be fewer than nodes ({nodes})")
    rng = random.Random(seed)
    events = _initial(nodes)
    live = [e.node for e in events]
    for k in range(1, removals + 1):
        victim = live.pop(rng.randrange(len(live)))
        events.append(TraceEvent(time_s=k * step, kind="remove", node=victim))
    return Trace(name=f"every-{interval}", events=tuple(events))


def poisson_trace(
    mtbf: str | float,
    *,
    seed: int = 0,
    nodes: int = 30,
    failures: int | None = None,
    duration: str | float | None = None,
    repair: str | float | None = None,
    min_nodes: int = 1,
) -> Trace:
    """Failures as a Poisson process of the whole cluster with mean gap ``mtbf``.

    Args:
        mtbf: mean time between failures (cluster-wide), e.g. ``"30m"``.
        seed: seeds ``random.Random``; the same arguments give the same trace.
        nodes: nodes live at time 0.
        failures: stop after this many removals (default ``nodes // 2`` when ``duration`` is unset).
        duration: or stop at this time (the trace ends with a no-op marker of the job's end).
        repair: if set, each removed node returns after an exponential time with this mean.
        min_nodes: a failure is skipped while only this many nodes are live.

    Raises:
        SimulationError: a non-positive duration, or counts out of range.
    """
    gap = parse_duration(mtbf)
    _check_count("nodes", nodes, 1)
    _check_count("min_nodes", min_nodes, 1)
    horizon = parse_duration(duration) if duration is not None else None
    if failures is None and horizon is None:
        failures = nodes // 2
    if failures is not None:
        _check_count("failures", failures, 0)
    mttr = parse_duration(repair) if repair is not None else None
    rng = random.Random(seed)
    events = _initial(nodes)
    live = [e.node for e in events]
    returns: list[tuple[float, str]] = []  # (time, node), kept sorted
    t, removed = 0.0, 0
    while True:
        t += rng.expovariate(1.0 / gap)
        while returns and returns[0][0] <= t and (horizon is None or returns[0][0] <= horizon):
            when, node = returns.pop(0)
            events.append(TraceEvent(time_s=when, kind="add", node=node))
            live.append(node)
        if horizon is not None and t > horizon:
            break
        if len(live) <= min_nodes:
            continue
        victim = live.pop(rng.randrange(len(live)))
        events.append(TraceEvent(time_s=t, kind="remove", node=victim))
        removed += 1
        if mttr is not None:
            returns.append((t + rng.expovariate(1.0 / mttr), victim))
            returns.sort()
        if failures is not None and removed >= failures:
            break
    if horizon is not None and events[-1].time_s < horizon:
        # a removal-and-return pair would change the cluster; mark the end with a spare node instead
        marker = f"end-marker-{seed}"
        events += [TraceEvent(time_s=horizon, kind="add", node=marker), TraceEvent(time_s=horizon, kind="remove", node=marker)]
    name = f"poisson-{mtbf}-seed{seed}"
    return Trace(name=name, events=tuple(events))


def redraw_victims(trace: Trace, rng: random.Random) -> Trace:
    """The same times and kinds with each removal's victim drawn uniformly among the live nodes.

    The published periodic traces were generated with an unseeded draw of the victims; systems
    whose outcome depends on which node fails (Bamboo) are reported as the mean over redraws.
    """
    if trace.slowdowns:
        raise SimulationError(f"trace {trace.name!r} has slow events: redraw the victims of its membership() "
                              "and add the slow events to the redrawn trace (add_slow_events)")
    live: list[str] = []
    out: list[TraceEvent] = []
    fresh = 0
    for e in trace.events:
        if e.kind == "add":
            node = e.node
            if node in live:  # the original re-adds a node that the redraw kept alive
                fresh += 1
                node = f"{e.node}~{fresh}"
            live.append(node)
            out.append(TraceEvent(time_s=e.time_s, kind="add", node=node))
        else:
            victim = live.pop(rng.randrange(len(live)))
            out.append(TraceEvent(time_s=e.time_s, kind="remove", node=victim))
    return Trace(name=f"{trace.name}-redrawn", events=tuple(out))


def counts_trace(points: Sequence[tuple[float, int]], *, name: str = "counts") -> Trace:
    """Build a trace from ``(time_s, live nodes)`` points (adds new names, removes newest first)."""
    events: list[TraceEvent] = []
    live: list[str] = []
    next_id = 1
    for t, count in points:
        _check_count("live nodes", count, 0)
        while len(live) < count:
            live.append(f"node{next_id}")
            events.append(TraceEvent(time_s=float(t), kind="add", node=live[-1]))
            next_id += 1
        while len(live) > count:
            events.append(TraceEvent(time_s=float(t), kind="remove", node=live.pop()))
    return Trace(name=name, events=tuple(events))


# --- fail-slow episodes ----------------------------------------------------------------------

SLOW_GAP = "30m"
"""Default mean gap between fail-slow onsets, cluster-wide (see :func:`add_slow_events`)."""
SLOW_DURATION = "30m"
"""Default mean length of a fail-slow episode."""
SLOW_SPEEDS = (0.5, 0.75)
"""Default speeds of a slow worker (a fraction of its full speed), drawn uniformly."""


def add_slow_events(
    trace: Trace,
    *,
    seed: int = 0,
    mean_gap: str | float = SLOW_GAP,
    mean_duration: str | float = SLOW_DURATION,
    speeds: Sequence[float] = SLOW_SPEEDS,
    die_fraction: float = 0.0,
) -> Trace:
    """``trace`` with seeded fail-slow episodes added (its membership events are kept unchanged).

    The model: episodes start as a Poisson process of the whole cluster with mean gap ``mean_gap``;
    each slows one node drawn uniformly among the live nodes at full speed, to a speed drawn
    uniformly from ``speeds``, for an exponential time of mean ``mean_duration``; it then recovers,
    or with probability ``die_fraction`` the node is removed (slow, then dead). An episode on a
    node the trace removes ends there; episodes still running at the trace's end are not closed;
    an onset with no node at full speed is skipped. Every random number is drawn up front from
    ``random.Random(seed)``, so the same arguments give the same trace.

    The defaults (one onset every 30 minutes on average, 30 minutes long, 0.5x or 0.75x) are an
    assumption calibrated to the one figure we have, FALCON (2024): fail-slows stretched average
    job completion on a >10,000-GPU cluster by 1.34x. A synchronous job that runs at its slowest
    worker's pace is stretched by :func:`slow_stretch` 1.33x over a 480-hour trace (mean of 6 seeds) with
    these defaults (1.23-1.35x on the shipped traces, mean of 8 seeds); neither the rates nor the lengths are published in
    what we could read.

    Raises:
        SimulationError: a non-positive gap or duration, a speed outside (0, 1), a fraction outside
            [0, 1], or a trace that already has slow events.
    """
    gap = parse_duration(mean_gap)
    length = parse_duration(mean_duration)
    speeds = tuple(speeds)
    if not speeds or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1 for v in speeds):
        raise SimulationError(f"slow speeds must be numbers in (0, 1), got {list(speeds)!r}")
    if isinstance(die_fraction, bool) or not isinstance(die_fraction, (int, float)) or not 0 <= die_fraction <= 1:
        raise SimulationError(f"die_fraction must be a number in [0, 1], got {die_fraction!r}")
    if trace.slowdowns:
        raise SimulationError(f"trace {trace.name!r} already has slow events")
    rng = random.Random(seed)
    end = trace.end_s
    episodes: list[tuple[float, float, float, bool, float]] = []  # onset, speed, length, dies, victim draw
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / gap)
        if t >= end:
            break
        episodes.append((t, speeds[rng.randrange(len(speeds))], rng.expovariate(1.0 / length),
                         rng.random() < die_fraction, rng.random()))
    out: list[TraceEvent] = []
    live: list[str] = []
    slow: dict[str, tuple[float, bool]] = {}  # node -> (end of its episode, dies)

    def close_until(time: float, *, inclusive: bool) -> None:
        while slow:
            node, (stop, dies) = min(slow.items(), key=lambda kv: (kv[1][0], kv[0]))
            if stop > time or (stop == time and not inclusive):
                return
            del slow[node]
            if dies:
                live.remove(node)
            out.append(TraceEvent(time_s=stop, kind="remove" if dies else "recover", node=node))

    pending = list(reversed(episodes))
    for e in trace.events:
        while pending and pending[-1][0] < e.time_s:
            onset, speed, span, dies, draw = pending.pop()
            close_until(onset, inclusive=True)
            fast = [n for n in live if n not in slow]
            if not fast:
                continue
            node = fast[min(int(draw * len(fast)), len(fast) - 1)]
            out.append(TraceEvent(time_s=onset, kind="slow", node=node, speed=float(speed)))
            if onset + span < end:
                slow[node] = (onset + span, dies)
            else:
                slow[node] = (math.inf, False)
        close_until(e.time_s, inclusive=False)
        if e.kind == "add":
            if e.node in live:  # a node that the trace re-adds after a slow-then-dead episode took it
                continue
            live.append(e.node)
        elif e.kind == "remove":
            if e.node not in live:  # died slow already
                continue
            live.remove(e.node)
            slow.pop(e.node, None)
        out.append(e)
    return Trace(name=f"{trace.name}+slow{seed}", events=tuple(out))


def slow_stretch(trace: Trace) -> float:
    """How much longer a job that runs at its slowest live node's pace takes over ``trace``: the
    window over the work it gets done, ``end / integral of min(speed of the live nodes) dt``
    (1.0 with no slow events). The yardstick of :func:`add_slow_events`'s calibration."""
    speeds: dict[str, float] = {}
    live: set[str] = set()
    work, last = 0.0, 0.0
    for e in trace.events:
        pace = min((speeds.get(n, 1.0) for n in live), default=1.0)
        work += (e.time_s - last) * pace
        last = e.time_s
        if e.kind == "add":
            live.add(e.node)
        elif e.kind == "remove":
            live.discard(e.node)
            speeds.pop(e.node, None)
        elif e.kind == "slow":
            speeds[e.node] = e.speed
        else:
            speeds.pop(e.node, None)
    return trace.end_s / work if work > 0 else 1.0
