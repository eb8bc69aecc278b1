"""The live re-grid plan (planning/live_regrid.py): the grid, the partition, the micro-batches, the
positions and the snapshot fetches, checked against brute force and DeepSpeed's own partition."""

from __future__ import annotations

import itertools

import pytest

from ds_resilience.errors import PlanningError
from ds_resilience.planning.live_regrid import (
    choose_grid, microbatch_map, one_f_one_b_time, plan_live_regrid, regrid_pays, uniform_bounds)
from ds_resilience.topology import Topology


def test_uniform_bounds_are_deepspeeds_partition_uniform():
    from deepspeed.runtime.utils import partition_uniform

    for layers in range(0, 23):
        for parts in range(1, 9):
            assert list(uniform_bounds(layers, parts)) == list(partition_uniform(layers, parts)), (layers, parts)


def brute_force_grid(survivors, layers, total, cost, memory, cap):
    best = None
    for pp in range(1, min(survivors, layers) + 1):
        bounds = uniform_bounds(layers, pp)
        if cap is not None and max(sum(memory[a:b]) for a, b in zip(bounds, bounds[1:])) > cap:
            continue
        for dp in range(1, survivors // pp + 1):
            if total % dp:
                continue
            t = one_f_one_b_time(bounds, total // dp, cost)
            key = (round(t, 9), survivors - dp * pp, pp)
            if best is None or key < best[0]:
                best = (key, (dp, pp))
    return best[1] if best else None


@pytest.mark.parametrize("survivors,layers,total", [(4, 6, 8), (5, 6, 8), (7, 12, 12), (6, 8, 9), (3, 10, 7), (8, 16, 16)])
@pytest.mark.parametrize("cap", [None, 4.0, 6.0])
def test_the_grid_is_the_brute_force_best_under_the_memory_cap(survivors, layers, total, cap):
    cost = [1.0 + (i % 3) * 0.5 for i in range(layers)]
    memory = [1.0 + (i % 2) for i in range(layers)]
    expected = brute_force_grid(survivors, layers, total, cost, memory, cap)
    if expected is None:
        with pytest.raises(PlanningError, match="memory cap"):
            choose_grid(survivors, layers, total, layer_cost=cost, layer_memory=memory, memory_cap=cap)
        return
    got = choose_grid(survivors, layers, total, layer_cost=cost, layer_memory=memory, memory_cap=cap)
    assert (got.dp, got.pp) == expected
    assert got.microbatches * got.dp == total and got.bounds == uniform_bounds(layers, got.pp)


def test_the_grid_uses_the_callers_partition_and_time():
    got = choose_grid(4, 6, 8, bounds_for=lambda pp: (0, 1, 6) if pp == 2 else uniform_bounds(6, pp),
                      time_of=lambda dp, pp, bounds, m: 1.0 if (dp, pp) == (2, 2) else 5.0)
    assert (got.dp, got.pp, got.bounds, got.predicted) == (2, 2, (0, 1, 6), 1.0)
    with pytest.raises(PlanningError, match="non-empty ranges"):
        choose_grid(4, 6, 8, bounds_for=lambda pp: (0, 6) if pp == 1 else (0, 0, 6))
    with pytest.raises(PlanningError, match="no survivor"):
        choose_grid(0, 6, 8)


@pytest.mark.parametrize("old_dp,m,new_dp", [(3, 4, 2), (2, 4, 4), (2, 6, 3), (4, 2, 1)])
def test_every_sample_is_trained_once_in_order(old_dp, m, new_dp):
    got = microbatch_map(old_dp, m, new_dp)
    assert len(got) == new_dp and len({len(q) for q in got}) == 1
    flat = [pair for q in got for pair in q]
    assert flat == [(p, i) for p in range(old_dp) for i in range(m)]
    with pytest.raises(PlanningError, match="evenly"):
        microbatch_map(3, 3, 2)


def fewest_moved(topology, failed, old_bounds, plan):
    """Brute force: the fewest layers any assignment of the survivors (fetchers holding their stage)
    to the plan's positions would receive."""
    stage_of = {topology.rank(w): w.stage for w in topology.workers()}
    alive = [r for r in stage_of if r not in failed]
    held = {r: set(range(old_bounds[stage_of[r]], old_bounds[stage_of[r] + 1])) for r in alive}
    for s, (_, receiver) in plan.fetches.items():
        held[receiver] |= set(range(*plan.lost_layers[s]))
    targets = list(plan.positions.values())
    best = None
    for perm in itertools.permutations(alive, len(targets)):
        moved = sum(len(set(t.layers()) - held[r]) for r, t in zip(perm, targets))
        best = moved if best is None else min(best, moved)
    return best, held


@pytest.mark.parametrize("dp,pp,m,dead,cap", [
    (2, 3, 4, "stage1", 3.0),      # both replicas of stage 1 killed
    (3, 2, 4, (0, 4), 3.0),        # piled failures past re-routing's advantage (two pipelines hit)
    (2, 4, 2, "stage3", 4.0),      # the last stage lost
    (3, 3, 2, (1, 4, 7), None),    # stage 1 lost entirely, no memory cap: the fastest grid
])
def test_the_plan_covers_every_position_from_survivors_and_snapshots(dp, pp, m, dead, cap):
    topology = Topology(dp=dp, pp=pp)
    layers = 2 * pp
    old_bounds = uniform_bounds(layers, pp)
    if isinstance(dead, str):
        s = int(dead[len("stage"):])
        failed = [topology.rank(w) for w in topology.stage_peers(s)]
    else:
        failed = [topology.rank(topology.worker(i)) for i in dead]
    plan = plan_live_regrid(topology, failed, old_bounds, m, memory_cap=cap)
    grid = plan.grid
    alive = sorted(set(range(dp * pp)) - set(failed))
    # positions: the whole grid, once each, on survivors only
    assert sorted((p.pipeline, p.stage) for p in plan.positions.values()) == [
        (q, k) for q in range(grid.dp) for k in range(grid.pp)]
    assert set(plan.positions) | set(plan.idle) == set(alive) and not set(plan.positions) & set(plan.idle)
    # a lost stage is fetched from one of its dead ranks' snapshots by a survivor
    lost = {topology.coord(r)[0].stage for r in failed} - {topology.coord(r)[0].stage for r in alive}
    assert set(plan.fetches) == lost
    for s, (deadrank, receiver) in plan.fetches.items():
        assert deadrank in failed and topology.coord(deadrank)[0].stage == s and receiver in alive
    # every layer of every position is kept, fetched or received from a survivor that holds it
    best, held = fewest_moved(topology, failed, old_bounds, plan)
    received = {}
    for mv in plan.moves:
        assert mv.source in alive and mv.layer in held[mv.source] and mv.to in plan.positions
        received.setdefault(mv.to, set()).add(mv.layer)
    for r, pos in plan.positions.items():
        assert set(pos.layers()) <= held[r] | received.get(r, set())
        assert not (received.get(r, set()) & held[r])
    assert len(plan.moves) == best  # the Hungarian matching moves the fewest layers
    assert [pair for q in plan.microbatches for pair in q] == [(p, i) for p in range(dp) for i in range(m)]
    assert plan.to_dict()["grid"]["dp"] == grid.dp and plan.rank_table()[(0, 0)] in alive


def test_the_pp3_dp2_case_reforms_two_pipelines_of_two_stages():
    topology = Topology(dp=2, pp=3)
    plan = plan_live_regrid(topology, [2, 3], [0, 2, 4, 6], 4, memory_cap=3.0)
    assert (plan.grid.dp, plan.grid.pp, plan.grid.bounds, plan.grid.microbatches) == (2, 2, (0, 3, 6), 4)
    assert plan.fetches == {1: (2, plan.fetches[1][1])} and plan.bytes_fetched == 2.0
    assert plan.bytes_moved == 3.0  # layer 2 to the other first stage, layer 3 to both last stages
    assert plan.idle == ()


def test_bad_input_is_named():
    t = Topology(dp=2, pp=3)
    with pytest.raises(PlanningError, match="non-empty increasing"):
        plan_live_regrid(t, [2], [0, 2, 6], 4)
    with pytest.raises(PlanningError, match="layer sizes"):
        plan_live_regrid(t, [2], [0, 2, 4, 6], 4, layer_bytes=[1.0] * 5)
    with pytest.raises(PlanningError, match="tensor-parallel"):
        plan_live_regrid(Topology(dp=2, pp=3, tp=2), [2], [0, 2, 4, 6], 4)


def test_regrid_pays_only_when_faster_over_the_horizon():
    assert regrid_pays(None, 9.0, 100.0, 1)  # re-routing cannot cover: always
    assert regrid_pays(12.0, 10.0, 30.0, 20)  # 200 + 30 < 240
    assert not regrid_pays(12.0, 10.0, 50.0, 20)  # 250 > 240
    with pytest.raises(PlanningError, match="horizon"):
        regrid_pays(1.0, 1.0, 0.0, 0)


def test_a_stage_count_without_a_fitting_partition_is_skipped():
    """bounds_for answers None (the template planner found no partition under the memory cap)."""
    got = choose_grid(4, 6, 8, bounds_for=lambda pp: None if pp < 3 else uniform_bounds(6, pp))
    assert got.pp >= 3
    with pytest.raises(PlanningError, match="memory cap"):
        choose_grid(4, 6, 8, bounds_for=lambda pp: None)


def test_the_engines_template_partition_balances_the_layers_state():
    from ds_resilience.integrations.ds_regrid import _templates

    sizes = [1.0, 6.0, 6.0, 6.0, 6.0, 1.0]  # an embedding, four blocks, a head
    bounds_for = _templates(sizes, cap=13.0)
    assert bounds_for(1) is None  # 26 does not fit 13
    assert bounds_for(2) == (0, 3, 6) and bounds_for(4) == (0, 2, 3, 4, 6)
