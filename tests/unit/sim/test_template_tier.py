"""The simulator's three tiers beyond re-routing: restart from memory, re-grid onto a dp x pp grid,
re-grid onto pipeline templates (heterogeneous pipelines rated by the real planner)."""

from __future__ import annotations

import math

import pytest

from ds_resilience.planning.planner import plan
from ds_resilience.sim import load_model
from ds_resilience.sim.jobsim import run_policy
from ds_resilience.sim.models import PlanCache
from ds_resilience.sim.systems import DsResilience, make_policy
from ds_resilience.sim.template_tier import TemplateTier
from ds_resilience.sim.traces import SimulationError, parse_events
from ds_resilience.topology import Worker


def events(*rows):
    return parse_events([f"{int(t * 1000)},{k},{n}" for t, k, n in rows], source="hand")


@pytest.fixture(scope="module")
def medium():
    model = load_model("gpt3-medium")
    return model, PlanCache(model)


def test_template_layout_is_rated_by_the_planner(medium):
    model, cache = medium
    tier = TemplateTier(cache)
    seconds, choice = tier.best(23)
    assert choice is not None and sum(p.nodes for p in choice.pipelines) <= 23
    assert sum(p.microbatches for p in choice.pipelines) == model.total_microbatches  # the batch unchanged
    assert len(choice.pipelines) >= 2 and min(p.nodes for p in choice.pipelines) >= model.min_stages
    slowest = max(plan(1, p.nodes, p.microbatches, cost=tier.templates[p.nodes].cost_model(tier.profile)).iteration_time
                  for p in choice.pipelines)
    assert seconds == pytest.approx(slowest * cache.layer_ms / 1000.0)
    assert tier.best(1) == (math.inf, None)  # not even two pipelines of the smallest template


def test_template_layout_reroutes_inside_a_template_group(medium):
    model, cache = medium
    tier = TemplateTier(cache)
    layout = tier.layout([f"n{i}" for i in range(23)])
    n, (count, m) = max(layout.groups.items(), key=lambda kv: kv[1][0])
    assert count >= 2
    healthy = layout.seconds()
    victim = layout.slot[(n, 0, 1)]
    assert layout.vacate(victim) and layout.covered()
    cost = tier.templates[n].cost_model(tier.profile)
    rerouted = plan(count, n, m, {Worker(pipeline=0, stage=1)}, cost=cost).iteration_time * cache.layer_ms / 1000.0
    assert layout.seconds() == pytest.approx(max(rerouted, healthy))
    assert layout.seconds() > healthy
    assert layout.fill("new") and layout.slot[(n, 0, 1)] == "new" and layout.seconds() == pytest.approx(healthy)
    for q in range(count):  # every replica of one stage of the group: re-routing cannot cover
        layout.vacate(layout.slot[(n, q, 0)])
    assert not layout.covered() and layout.seconds() == math.inf


def _run(model, cache, trace, regrid):
    policy = make_policy("ds_resilience", model, cache, regrid=regrid)
    return run_policy(trace, policy, samples_per_iteration=float(model.global_batch), boot_s=model.boot_s), policy


def test_three_tiers_when_a_stage_loses_every_replica(medium):
    """All 5 replicas of stage 2 lost, and 2 of stage 4 (23 nodes left): re-routing cannot cover. A
    restart from memory pauses restart_s, a re-grid regrid_s; templates (7 pipelines of 3 stages
    and one of 2, measured) use the 23 nodes better than any dp x pp grid."""
    model, cache = medium
    nodes = [f"n{i}" for i in range(30)]
    grid0 = DsResilience(model, cache)._best(type("J", (), {"live": nodes})())[1]
    victims = [grid0.slot[(p, 2)] for p in range(model.dp)] + [grid0.slot[(p, 4)] for p in range(2)]
    rows = [(0, "add", n) for n in nodes] + [(600 + i, "remove", v) for i, v in enumerate(victims)]
    trace = events(*rows, (4 * 3600, "add", "end"))
    got = {tier: _run(model, cache, trace, tier) for tier in ("restart", "grid", "templates")}
    recovery = {tier: r.breakdown_dict["recovery"] for tier, (r, _) in got.items()}
    assert recovery["restart"] >= model.restart_s > recovery["grid"]
    assert any(name.startswith("templates") for name in got["templates"][1].layouts)
    assert not any(name.startswith("templates") for name in got["grid"][1].layouts)
    throughput = {tier: r.throughput for tier, (r, _) in got.items()}
    assert throughput["restart"] < throughput["grid"] < throughput["templates"], throughput


def test_a_voluntary_regrid_waits_for_the_iteration_boundary(medium):
    """Nodes joining a running job: the better layout is adopted at the end of an iteration, so
    nothing is lost (before, the in-flight iteration was dropped)."""
    model, cache = medium
    rows = [(0, "add", f"n{i}") for i in range(12)] + [(1200 + 600 * i, "add", f"m{i}") for i in range(18)]
    trace = events(*rows, (6 * 3600, "add", "end"))
    for tier in ("grid", "templates"):
        result, policy = _run(model, cache, trace, tier)
        assert sum(policy.layouts.values()) >= 2, policy.layouts  # it did change layout
        assert result.breakdown_dict["lost"] == 0.0, (tier, result.breakdown_dict)
    result, policy = _run(model, cache, trace, "restart")
    assert sum(policy.layouts.values()) == 1  # the engine today restarts only when it must


def test_unknown_tier_is_rejected(medium):
    model, cache = medium
    with pytest.raises(SimulationError, match="allowed: restart, grid, templates"):
        DsResilience(model, cache, regrid="oobleck")
