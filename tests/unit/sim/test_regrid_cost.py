"""The simulator's cost of a live re-grid (sim/regrid_cost.py): a fixed rebuild plus the busiest
receiver's bytes at the measured rate, scaled to the traces' network; the template tier pauses by
it for the profile's size, unless the profile sets ``regrid_s``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from ds_resilience.sim import load_model
from ds_resilience.sim import regrid_cost as rc
from ds_resilience.sim.jobsim import run_policy
from ds_resilience.sim.models import Grid, ModelProfileError, PlanCache, load_model as _load, profile_from_dict
from ds_resilience.sim.regrid_cost import RegridCost, RegridCostError, regrid_bytes
from ds_resilience.sim.systems import DsResilience, make_policy
from ds_resilience.sim.traces import SimulationError, parse_events


def test_the_pause_is_the_rebuild_plus_the_bytes_at_the_rate():
    cost = RegridCost(rebuild_s=0.25, bytes_per_s=2e9)
    assert cost.transfer_s(3e9) == pytest.approx(1.5)
    assert cost.pause_s(3e9) == pytest.approx(1.75)
    assert cost.pause_s(0) == pytest.approx(0.25)
    faster = cost.scaled(link_bytes_per_s=25e9, measured_link_bytes_per_s=0.5e9)  # a 50x faster link
    assert faster.bytes_per_s == pytest.approx(100e9) and faster.rebuild_s == 0.25
    assert regrid_bytes(1e9, 4) == pytest.approx(3.5e9)  # 14 bytes/param: bf16 + fp32 master + Adam, one stage
    assert regrid_bytes(1e9, 2, bytes_per_param=12.0) == pytest.approx(6e9)
    # the shipped cluster constants are the measured ones, per-byte part scaled by the links' ratio
    assert rc.CLUSTER.rebuild_s == rc.MEASURED.rebuild_s
    assert rc.CLUSTER.bytes_per_s == pytest.approx(
        rc.MEASURED.bytes_per_s * rc.CLUSTER_LINK_BYTES_PER_S / rc.MEASURED_LINK_BYTES_PER_S)
    assert rc.CLUSTER.bytes_per_s > rc.MEASURED.bytes_per_s


@pytest.mark.parametrize("kwargs, name", [
    ({"rebuild_s": -0.1, "bytes_per_s": 1e9}, "rebuild_s"),
    ({"rebuild_s": math.nan, "bytes_per_s": 1e9}, "rebuild_s"),
    ({"rebuild_s": "0.2", "bytes_per_s": 1e9}, "rebuild_s"),
    ({"rebuild_s": True, "bytes_per_s": 1e9}, "rebuild_s"),
    ({"rebuild_s": 0.2, "bytes_per_s": 0}, "bytes_per_s"),
    ({"rebuild_s": 0.2, "bytes_per_s": -5e8}, "bytes_per_s"),
    ({"rebuild_s": 0.2, "bytes_per_s": math.inf}, "bytes_per_s"),
    ({"rebuild_s": 0.2, "bytes_per_s": None}, "bytes_per_s"),
])
def test_bad_constants_are_refused_naming_the_constant(kwargs, name):
    with pytest.raises(RegridCostError, match=f"{name} must be a finite number"):
        RegridCost(**kwargs)


def test_bad_questions_are_refused():
    cost = RegridCost(rebuild_s=0.2, bytes_per_s=1e9)
    assert issubclass(RegridCostError, SimulationError)
    with pytest.raises(RegridCostError, match="bytes_moved"):
        cost.pause_s(-1.0)
    with pytest.raises(RegridCostError, match="link_bytes_per_s"):
        cost.scaled(link_bytes_per_s=0.0, measured_link_bytes_per_s=1e9)
    for stages in (0, 1.5, True):
        with pytest.raises(RegridCostError, match="stages must be an integer"):
            regrid_bytes(1e9, stages)
    with pytest.raises(RegridCostError, match="params"):
        regrid_bytes(math.nan, 2)


def test_a_profile_pauses_by_its_size_unless_it_sets_regrid_s():
    medium, big, bigger = (load_model(n) for n in ("gpt3-medium", "gpt3-2.7b", "gpt3-6.7b"))
    for m in (medium, big, bigger):
        assert m.regrid_s is None  # the shipped profiles take the measured cost
        assert m.regrid_pause_s() == pytest.approx(rc.CLUSTER.pause_s(m.params_billion * 1e9 * 14.0 / m.pp))
        assert m.regrid_pause_s(3) > m.regrid_pause_s(6)  # shallower stages hold more state
    assert medium.regrid_pause_s(6) < big.regrid_pause_s(6) < bigger.regrid_pause_s(6)  # a bigger model pauses longer
    slow = RegridCost(rebuild_s=1.0, bytes_per_s=1e8)
    assert bigger.regrid_pause_s(6, cost=slow) == pytest.approx(1.0 + 6.7e9 * 14.0 / 6 / 1e8)
    fixed = replace(bigger, regrid_s=4.8)  # the override: one pause whatever the size and depth
    assert fixed.regrid_pause_s() == fixed.regrid_pause_s(3) == fixed.regrid_pause_s(6, cost=slow) == 4.8


def test_regrid_s_in_a_profile_file_is_an_override_or_null():
    data = {"name": "x", "global_batch": 64, "layers": 24, "params_billion": 0.35, "anchor_throughput": 30.0}
    assert profile_from_dict(data).regrid_s is None
    assert profile_from_dict({**data, "regrid_s": None}).regrid_pause_s() == profile_from_dict(data).regrid_pause_s()
    assert profile_from_dict({**data, "regrid_s": 2.5}).regrid_pause_s(2) == 2.5
    for bad in (-1.0, "3", math.inf, True):
        with pytest.raises(ModelProfileError, match="regrid_s must be a number >= 0 or null"):
            profile_from_dict({**data, "regrid_s": bad})


def _stage_lost(model):
    """Every replica of stage 2 lost, and 2 of stage 4 (23 nodes left): re-routing cannot cover."""
    nodes = [f"n{i}" for i in range(30)]
    grid0 = Grid(model, model.dp, model.pp, nodes)
    victims = [grid0.slot[(p, 2)] for p in range(model.dp)] + [grid0.slot[(p, 4)] for p in range(2)]
    rows = [f"0,add,{n}" for n in nodes] + [f"{(600 + i) * 1000},remove,{v}" for i, v in enumerate(victims)]
    return parse_events(rows + [f"{4 * 3600 * 1000},add,end"], source="hand")


@pytest.mark.parametrize("tier", ["grid", "templates"])
def test_the_regrid_tiers_pause_by_the_model_size_through_the_cost_model(tier):
    medium = _load("gpt3-medium")
    store: dict = {}
    recovery, layouts = {}, {}
    # the same job and plans (layer units, same anchor), only the state a re-grid moves differs
    for name, model in (("small", medium), ("big", replace(medium, params_billion=2.0)),
                        ("fixed", replace(medium, regrid_s=60.0))):
        cache = PlanCache(model, store=store)
        policy = make_policy("ds_resilience", model, cache, regrid=tier)
        assert isinstance(policy, DsResilience)
        for layout in (Grid(model, 5, 6, [f"n{i}" for i in range(30)]), Grid(model, 7, 3, [f"n{i}" for i in range(21)])):
            assert policy.pause_s(layout) == pytest.approx(model.regrid_pause_s(layout.pp))
        result = run_policy(_stage_lost(model), policy, samples_per_iteration=float(model.global_batch),
                            boot_s=model.boot_s)
        recovery[name], layouts[name] = result.breakdown_dict["recovery"], dict(policy.layouts)
    assert layouts["small"] == layouts["big"]  # the same choices: the pause repays either way here
    assert recovery["small"] < recovery["big"] < recovery["fixed"]
    restart = make_policy("ds_resilience", medium, PlanCache(medium, store=store), regrid="restart")
    assert restart.pause_s(None) == medium.restart_s  # the restart tier is unchanged
