"""Fail-slow workers in the failure-trace simulator: the baselines run at the pace of the slowest
node they use; ds_resilience re-plans a slow worker as a partial failure at an iteration boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_resilience.sim import SYSTEMS, load_model, load_trace, simulate_system
from ds_resilience.sim.jobsim import run_policy
from ds_resilience.sim.models import PlanCache, profile_from_dict
from ds_resilience.sim.systems import make_policy
from ds_resilience.sim.traces import add_slow_events, parse_events
from ds_resilience.topology import Worker

TRACES = Path(__file__).resolve().parents[3] / "configs" / "traces"


def events(*rows):
    return parse_events([",".join([str(int(r[0] * 1000)), *map(str, r[1:])]) for r in rows], source="hand")


def tiny_oobleck():
    return profile_from_dict({"name": "tiny", "global_batch": 100, "layers": 4, "params_billion": 0.1, "nodes": 2,
                              "boot_s": 0.0, "dp": 1, "pp": 2, "microbatches": 2, "anchor_throughput": 10.0,
                              "systems": {"oobleck": {"throughput": [10.0, 5.0], "reconfigure_s": 2.0}}})


def test_a_baseline_runs_at_the_slowest_nodes_pace_by_hand():
    # 10 s iterations from 2 s; b at half speed from 15 s: the rest of the iteration in flight (7 s)
    # takes 14 s (ends 29), the next one 20 s (29-49); b recovers at 59, halfway through the work
    # of the iteration started at 49: its last 5 s of work take 5 s (ends 64); then 10 s again
    trace = events((0, "add", "a"), (0, "add", "b"), (15, "slow", "b", 0.5), (59, "recover", "b"), (100, "add", "end"))
    r = simulate_system(trace, tiny_oobleck(), "oobleck")
    assert [(round(a, 6), round(b, 6)) for a, b, _ in r.series] == [
        (2, 12), (12, 29), (29, 49), (49, 64), (64, 74), (74, 84), (84, 94)]
    assert (r.iterations, r.end_s) == (7, 94.0) and r.throughput == pytest.approx(700 / 92)
    assert r.failures == 0 and r.breakdown_dict["useful"] == pytest.approx(92.0)


def test_slow_then_dead_is_an_ordinary_failure():
    trace = events((0, "add", "a"), (0, "add", "b"), (15, "slow", "b", 0.5), (40, "remove", "b"), (100, "add", "end"))
    plain = events((0, "add", "a"), (0, "add", "b"), (40, "remove", "b"), (100, "add", "end"))
    r, p = simulate_system(trace, tiny_oobleck(), "oobleck"), simulate_system(plain, tiny_oobleck(), "oobleck")
    assert r.failures == p.failures == 1
    assert r.breakdown_dict["recovery"] == 2.0 and r.breakdown_dict["lost"] == pytest.approx(11.0)  # 29-40 lost
    assert r.series[-1][1] - r.series[-1][0] == pytest.approx(20.0)  # one node left, at full speed


def test_a_slow_spare_does_not_slow_a_grid():
    model = load_model("gpt2")
    cache = PlanCache(model)
    nodes = [(0, "add", f"n{i}") for i in range(31)]  # 30 in the grid, n30 spare
    trace = events(*nodes, (600, "slow", "n30", 0.5), (3600, "add", "end"))
    for system in ("recycle", "ds_resilience", "checkpoint_restart"):
        slow = simulate_system(trace, model, system, cache=cache)
        fast = simulate_system(events(*nodes, (3600, "add", "end")), model, system, cache=cache)
        assert slow.throughput == pytest.approx(fast.throughput), system


@pytest.fixture(scope="module")
def gpt2():
    model = load_model("gpt2")
    return model, PlanCache(model)


@pytest.mark.parametrize("speed", [0.5, 0.75])
def test_ds_resilience_replans_a_slow_worker_and_back(speed, gpt2):
    model, cache = gpt2
    nodes = [(0, "add", f"n{i}") for i in range(30)]
    trace = events(*nodes, (1800, "slow", "n7", speed), (5400, "recover", "n7"), (7200, "add", "end"))
    policy = make_policy("ds_resilience", model, cache, regrid="restart")  # re-routing only: no change of layout
    r = run_policy(trace, policy, samples_per_iteration=float(model.global_batch), boot_s=model.boot_s)
    healthy = cache.plan_s(model.dp, model.pp, ())
    (stage,) = [s for (p, s), n in policy.grid.slot.items() if n == "n7"]
    hole = cache.plan_s(model.dp, model.pp, {Worker(pipeline=0, stage=stage)})
    adapted = policy.adapted_s(policy.grid, {"n7": speed})
    # the planner's plans bracket the weighted plan: healthy < adapted < one hole, and below the
    # un-adapted schedule at the slow worker's pace; interpolated in 1 / capacity (5 replicas)
    share = (1 / (5 - (1 - speed)) - 1 / 5) / (1 / 4 - 1 / 5)
    assert adapted == pytest.approx(healthy + (hole - healthy) * share)
    assert healthy < adapted < min(hole, healthy / speed)
    durations = [(a, b - a) for a, b, _ in r.series]
    during = [d for a, d in durations if 1800 < a and a + d < 5400]
    # after the iteration the slowdown cuts into, the detector's window (5 whole iterations, the
    # engine's default detector.straggler_window) at the slow pace, then the weighted plan
    assert policy.straggler_window == 5
    assert during[:5] == pytest.approx([healthy / speed] * 5)
    assert during[5:] == pytest.approx([adapted] * (len(during) - 5))
    after = [d for a, d in durations if a > 5400]
    # a recovery shows in one fast iteration: the weighted plan for it, then the fault-free plan
    assert after[0] == pytest.approx(adapted) and after[1:] == pytest.approx([healthy] * (len(after) - 1))
    assert r.failures == 0 and r.breakdown_dict["recovery"] == 0.0  # no pause: nothing stops, nothing moves
    # beyond re-routing, a layout without the slow worker competes (it repays its pause here)
    templates = make_policy("ds_resilience", model, cache)
    t = run_policy(trace, templates, samples_per_iteration=float(model.global_batch), boot_s=model.boot_s)
    assert t.throughput >= r.throughput * (1 - 1e-9) and t.failures == 0


def test_every_system_under_slow_events(gpt2):
    """The ordering under the default fail-slow model: ds_resilience re-plans, every baseline loses
    about the pace-of-the-slowest share; breakdowns still sum to the window."""
    model, cache = gpt2
    base = load_trace(TRACES / "3h.csv")
    slow = add_slow_events(base, seed=0)
    got = {s: simulate_system(slow, model, s, cache=cache) for s in SYSTEMS}
    ref = {s: simulate_system(base, model, s, cache=cache) for s in SYSTEMS}
    for s, r in got.items():
        assert sum(v for _, v in r.breakdown) == pytest.approx(r.wall_s, rel=1e-9, abs=1e-6), s
        assert r.throughput < ref[s].throughput, s
    keep = {s: got[s].throughput / ref[s].throughput for s in SYSTEMS if s != "bamboo"}
    assert keep["ds_resilience"] > 0.9  # the weighted plans keep most of the throughput
    assert all(keep["ds_resilience"] > v + 0.1 for s, v in keep.items() if s != "ds_resilience"), keep
    assert got["ds_resilience"].throughput > max(got[s].throughput for s in SYSTEMS if s != "ds_resilience")


def test_cli_slow_options(capsys):
    import argparse
    import json

    from ds_resilience.sim.cli import add_parser
    from ds_resilience.sim.traces import SimulationError

    def cli(*argv):
        parser = argparse.ArgumentParser(prog="ds-resilience")
        add_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["simulate", *argv])
        return args.handler(args)

    base = ("--trace", str(TRACES / "10m.csv"), "--model", "gpt2", "--systems", "oobleck,ds_resilience", "--json")
    assert cli(*base, "--slow", "--slow-seed", "2", "--slow-speeds", "0.5") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["slowdowns"] > 0 and out["trace"]["name"] == "10m+slow2"
    assert cli(*base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["trace"]["slowdowns"] == 0
    assert out["systems"]["oobleck"]["throughput"] < plain["systems"]["oobleck"]["throughput"]
    with pytest.raises(SimulationError, match="--slow-speeds 'fast' must be comma-separated numbers"):
        cli(*base, "--slow", "--slow-speeds", "fast")
    with pytest.raises(SimulationError, match="die_fraction must be a number in"):
        cli(*base, "--slow", "--slow-die", "1.5")
