"""Failure traces: every shipped trace parses, malformed input names file and line, generators are
seeded and have the statistics they claim."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from ds_resilience.errors import ResilienceError
from ds_resilience.sim.traces import (
    SimulationError,
    Trace,
    TraceError,
    TraceEvent,
    add_slow_events,
    counts_trace,
    load_trace,
    parse_duration,
    parse_events,
    parse_samples,
    periodic_trace,
    poisson_trace,
    redraw_victims,
    slow_stretch,
)

TRACES = Path(__file__).resolve().parents[3] / "configs" / "traces"
SHIPPED = sorted(p.name for p in TRACES.iterdir())
PERIODIC = {"6h": 6 * 3600, "3h": 3 * 3600, "1h": 3600, "30m": 1800, "10m": 601.2, "5m": 298.8}


def test_all_published_traces_are_shipped():
    expected = {f"{k}.csv" for k in PERIODIC} | {
        "p3-trace.csv", "g4dn-trace.csv", "scale_p3-trace.csv", "scale_gcp-trace.csv",
        "gcp-a100x1-east1b.txt", "gcp-v100x1-east1c.txt",
    }
    assert expected <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_trace_parses_consistently(name):
    trace = load_trace(TRACES / name)
    assert isinstance(trace, Trace) and trace.events
    times = [e.time_s for e in trace.events]
    assert times == sorted(times)
    live: set[str] = set()
    for e in trace.events:  # replaying the events never adds a live node or removes a dead one
        assert (e.node not in live) if e.kind == "add" else (e.node in live)
        (live.add if e.kind == "add" else live.discard)(e.node)
    assert trace.live_counts()[-1][1] == len(live)
    if name.endswith(".csv"):  # one event per line
        lines = [ln for ln in (TRACES / name).read_text().splitlines() if ln.strip()]
        assert len(trace.events) == len(lines)
        assert trace.end_s == int(lines[-1].split(",")[0]) / 1000


@pytest.mark.parametrize("stem,gap", sorted(PERIODIC.items()))
def test_periodic_traces_remove_one_of_thirty_nodes_per_interval(stem, gap):
    trace = load_trace(TRACES / f"{stem}.csv")
    assert trace.additions == 30 and trace.removals == 15
    removals = [e.time_s for e in trace.events if e.kind == "remove"]
    assert removals == pytest.approx([gap * k for k in range(1, 16)], abs=1e-6)
    assert [n for _, n in trace.live_counts()] == list(range(30, 14, -1))


def test_gcp_samples_give_changes_at_the_first_line_of_each_value():
    lines = [
        "2021-12-10, 13:07:45, 80",
        "2021-12-10, 13:08:45, 80",
        "2021-12-10, 13:09:45, 80",
        "2021-12-10, 13:08:45, 70",  # the repeats of 80 ran past the change to 70: accepted
        "2021-12-10, 13:09:45, 70",
        "2021-12-10, 13:09:45, 60",
        "2021-12-11, 00:00:00, 62",
    ]
    trace = parse_samples(lines, source="s.txt")
    assert trace.live_counts() == ((0.0, 80), (60.0, 70), (120.0, 60), (10 * 3600 + 52 * 60 + 15.0, 62))
    removed = [e.node for e in trace.events if e.kind == "remove"]
    assert removed[:10] == [f"node{i}" for i in range(80, 70, -1)]  # newest first
    gcp = load_trace(TRACES / "gcp-v100x1-east1c.txt")
    assert gcp.live_counts()[0] == (0.0, 80) and gcp.max_nodes == 80


BAD_EVENTS = [
    (["0,add,node1", "10,explode,node1"], 2, "must be one of add, remove"),
    (["0,add,node1", "1.5,remove,node1"], 2, "non-negative integer of milliseconds"),
    (["0,add,node1", "-5,remove,node1"], 2, "non-negative integer"),
    (["0,add,node1", "10,remove"], 2, "expected 3 or 4 fields"),
    (["0,add,node1", "10,add,node2", "5,remove,node1"], 3, "before the previous event"),
    (["0,add,node1", "10,remove,node2"], 2, "node2 is removed but is not live"),
    (["0,add,node1", "10,add,node1"], 2, "node1 is added while already live"),
    (["0,add,"], 1, "node name is empty"),
    # fail-slow events
    (["0,add,node1", "10,slow,node1"], 2, "a slow event needs its speed"),
    (["0,add,node1", "10,slow,node1,half"], 2, "speed 'half' is not a number"),
    (["0,add,node1", "10,slow,node1,1.5"], 2, "must be > 0 and < 1"),
    (["0,add,node1", "10,slow,node1,0"], 2, "must be > 0 and < 1"),
    (["0,add,node1", "10,slow,node1,1"], 2, "'recover' restores full speed"),
    (["0,add,node1", "10,slow,node2,0.5"], 2, "node2 is slowed but is not live"),
    (["0,add,node1", "10,recover,node1"], 2, "node1 recovers but is not slow"),
    (["0,add,node1", "10,slow,node1,0.5", "20,remove,node1", "30,add,node1", "40,recover,node1"], 5, "node1 recovers but is not slow"),
    (["0,add,node1", "10,remove,node1,0.5"], 2, "only a slow event has a fourth field"),
    (["0,add,node1", "10,slow,node1,0.5,x"], 2, "expected 3 or 4 fields"),
]


@pytest.mark.parametrize("lines,lineno,message", BAD_EVENTS)
def test_malformed_event_lines_name_file_and_line(lines, lineno, message):
    with pytest.raises(TraceError, match=rf"bad\.csv:{lineno}:.*{message}"):
        parse_events(lines, source="bad.csv")


BAD_SAMPLES = [
    (["2021-12-10, 13:07:45, 80", "2021-12-10, 25:00:00, 70"], 2, "is not a 'YYYY-MM-DD HH:MM:SS' time"),
    (["2021-12-10, 13:07:45, 80", "2021-12-10, 13:08:45, many"], 2, "must be a non-negative integer"),
    (["2021-12-10, 13:07:45, 80", "2021-12-10, 13:08:45"], 2, "expected 3 fields"),
    (["2021-12-10, 13:07:45, 80", "2021-12-10, 13:09:45, 70", "2021-12-10, 13:08:00, 60"], 3, "before the previous change"),
]


@pytest.mark.parametrize("lines,lineno,message", BAD_SAMPLES)
def test_malformed_sample_lines_name_file_and_line(lines, lineno, message):
    with pytest.raises(TraceError, match=rf"s\.txt:{lineno}:.*{message}"):
        parse_samples(lines, source="s.txt")


def test_load_trace_errors_are_resilience_errors(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "missing.csv")
    (tmp_path / "empty.csv").write_text("\n\n")
    with pytest.raises(TraceError, match="is empty"):
        load_trace(tmp_path / "empty.csv")
    (tmp_path / "odd.csv").write_text("hello world\n")
    with pytest.raises(TraceError, match=r"odd\.csv:1: .* is neither"):
        load_trace(tmp_path / "odd.csv")
    (tmp_path / "bad.csv").write_text("0,add,node1\n7,remove,node9\n")
    with pytest.raises(ResilienceError, match=r"bad\.csv:2: .*node9 is removed but is not live"):
        load_trace(tmp_path / "bad.csv")


def test_trace_construction_checks_invariants():
    add = TraceEvent(time_s=0.0, kind="add", node="a")
    with pytest.raises(TraceError, match="time goes back"):
        Trace(name="t", events=(TraceEvent(time_s=5.0, kind="add", node="a"), TraceEvent(time_s=1.0, kind="remove", node="a")))
    with pytest.raises(TraceError, match="not live"):
        Trace(name="t", events=(add, TraceEvent(time_s=1.0, kind="remove", node="b")))
    with pytest.raises(TraceError, match="no events"):
        Trace(name="t", events=())


@pytest.mark.parametrize("text,seconds", [("30m", 1800.0), ("6h", 21600.0), ("90s", 90.0), ("1.5h", 5400.0),
                                          ("250ms", 0.25), ("45", 45.0), ("2d", 172800.0), (" 10 min ", 600.0), (12, 12.0)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["-5m", "0", "0s", "abc", "5 parsecs", "", True, -3])
def test_parse_duration_rejects_non_positive_or_malformed(text):
    with pytest.raises(SimulationError, match="duration"):
        parse_duration(text)


def test_poisson_generator_is_deterministic_per_seed():
    a = poisson_trace("30m", seed=7)
    assert a == poisson_trace("30m", seed=7)
    assert a != poisson_trace("30m", seed=8)
    assert a.removals == 15 and a.additions == 30


def test_poisson_mean_gap_matches_the_mtbf():
    # 4000 exponential gaps: the sample mean is within 5% of the MTBF with overwhelming probability
    for seed in (0, 1):
        trace = poisson_trace("30m", seed=seed, nodes=4001, failures=4000)
        removals = [e.time_s for e in trace.events if e.kind == "remove"]
        gaps = [b - a for a, b in zip([0.0] + removals, removals)]
        assert len(gaps) == 4000
        assert statistics.fmean(gaps) == pytest.approx(1800.0, rel=0.05)
        assert statistics.stdev(gaps) == pytest.approx(1800.0, rel=0.1)  # exponential: stdev = mean


def test_poisson_with_repair_returns_nodes_and_respects_the_floor():
    trace = poisson_trace("10m", seed=3, nodes=8, duration="24h", repair="30m", min_nodes=4)
    assert trace.end_s == pytest.approx(86400.0)
    assert min(n for _, n in trace.live_counts()) >= 4
    returned = [e.node for e in trace.events[8:] if e.kind == "add" and not e.node.startswith("end-marker")]
    assert returned and all(n.startswith("node") for n in returned)
    assert trace.removals > 50


def test_generators_reject_bad_arguments():
    with pytest.raises(SimulationError, match="must be > 0"):
        poisson_trace("-30m")
    with pytest.raises(SimulationError, match="nodes must be an integer >= 1"):
        poisson_trace("30m", nodes=0)
    with pytest.raises(SimulationError, match="fewer than nodes"):
        periodic_trace("1h", nodes=10, removals=10)


def test_periodic_trace_has_the_published_shape():
    trace = periodic_trace("2h", seed=1)
    assert trace.additions == 30 and trace.removals == 15 and trace.end_s == 30 * 3600


def test_redraw_victims_keeps_times_and_is_seeded():
    base = load_trace(TRACES / "1h.csv")
    a = redraw_victims(base, random.Random(5))
    assert [(e.time_s, e.kind) for e in a.events] == [(e.time_s, e.kind) for e in base.events]
    assert a == redraw_victims(base, random.Random(5))
    assert a != redraw_victims(base, random.Random(6))
    rejoin = counts_trace([(0, 3), (10, 2), (20, 3)])  # the redraw must cope with re-added names
    redraw_victims(rejoin, random.Random(0))


# --- fail-slow events ------------------------------------------------------------------------


def test_slow_events_parse_round_trip_and_load(tmp_path):
    lines = ["0,add,a", "0,add,b", "1000,slow,a,0.5", "2000,slow,a,0.75", "3000,recover,a", "4000,slow,b,0.5", "5000,remove,b",
             "6000,add,end"]
    trace = parse_events(lines, source="s.csv")
    assert [(e.kind, e.node, e.speed) for e in trace.events][2:6] == [("slow", "a", 0.5), ("slow", "a", 0.75),
                                                                        ("recover", "a", 1.0), ("slow", "b", 0.5)]
    assert trace.slowdowns == 3 and trace.removals == 1 and trace.live_counts()[-1] == (6.0, 2)
    assert trace.to_csv().splitlines() == lines
    assert trace.membership().slowdowns == 0 and len(trace.membership().events) == 4
    path = tmp_path / "slow.csv"
    path.write_text("0,slow,a,0.5\n")  # the format is told by the first line; the check names the line
    with pytest.raises(TraceError, match=r"slow\.csv:1: .*a is slowed but is not live"):
        load_trace(path)
    path.write_text(trace.to_csv())
    assert load_trace(path).events == trace.events


def test_trace_construction_checks_slow_invariants():
    add = TraceEvent(time_s=0.0, kind="add", node="a")
    with pytest.raises(TraceError, match=r"speed 1\.2 must be a number in \(0, 1\)"):
        Trace(name="t", events=(add, TraceEvent(time_s=1.0, kind="slow", node="a", speed=1.2)))
    with pytest.raises(TraceError, match="only a 'slow' event has a speed"):
        Trace(name="t", events=(add, TraceEvent(time_s=1.0, kind="remove", node="a", speed=0.5)))
    with pytest.raises(TraceError, match="only a live node can run slow"):
        Trace(name="t", events=(add, TraceEvent(time_s=1.0, kind="slow", node="b", speed=0.5)))
    with pytest.raises(TraceError, match="node is not slow"):
        Trace(name="t", events=(add, TraceEvent(time_s=1.0, kind="recover", node="a")))


@pytest.mark.parametrize("name", ["6h.csv", "10m.csv", "p3-trace.csv", "scale_gcp-trace.csv"])
def test_add_slow_events_keeps_the_membership_and_is_seeded(name):
    base = load_trace(TRACES / name)
    a = add_slow_events(base, seed=3)
    assert a == add_slow_events(base, seed=3) and a != add_slow_events(base, seed=4)
    assert a.membership().events == base.events  # recover, never die: the failure trace is unchanged
    assert a.slowdowns > 0 and a.end_s == base.end_s
    assert {e.speed for e in a.events if e.kind == "slow"} <= {0.5, 0.75}


def test_add_slow_events_slow_then_dead():
    base = load_trace(TRACES / "3h.csv")
    t = add_slow_events(base, seed=1, die_fraction=1.0)
    assert t.slowdowns > 0
    assert t.removals > base.removals  # every closed episode ends in a removal
    assert not any(e.kind == "recover" for e in t.events)


def test_slow_model_is_calibrated_to_falcon():
    """The default episodes stretch a job that runs at its slowest worker's pace by about FALCON's
    1.34x (a long trace, mean of 4 seeds)."""
    long = poisson_trace("1h", duration="480h", repair="1h")
    stretch = statistics.fmean(slow_stretch(add_slow_events(long, seed=k)) for k in range(4))
    assert 1.30 < stretch < 1.38
    assert slow_stretch(long) == 1.0
    half = parse_events(["0,add,a", "0,add,b", "0,slow,a,0.5", "3600000,recover,a", "7200000,add,c"])
    assert slow_stretch(half) == pytest.approx(7200 / (3600 * 0.5 + 3600))


def test_slow_generator_errors():
    base = load_trace(TRACES / "1h.csv")
    with pytest.raises(SimulationError, match=r"speeds must be numbers in \(0, 1\)"):
        add_slow_events(base, speeds=(0.5, 1.0))
    with pytest.raises(SimulationError, match=r"die_fraction must be a number in \[0, 1\]"):
        add_slow_events(base, die_fraction=2)
    with pytest.raises(SimulationError, match="must be > 0"):
        add_slow_events(base, mean_gap="0")
    with pytest.raises(SimulationError, match="already has slow events"):
        add_slow_events(add_slow_events(base))
    with pytest.raises(SimulationError, match="has slow events: redraw the victims of its membership"):
        redraw_victims(add_slow_events(base), random.Random(0))
