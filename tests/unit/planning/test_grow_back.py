"""Growing back (planning/grow_back.py): after a live re-grid, the survivors and the relaunched
workers re-form the first grid: every rank at its first position, the layers it lacks sent by the
small grid's holders, the data numbering the first grid's again; and when growing pays."""

from __future__ import annotations

import json

import pytest

from ds_resilience.errors import PlanningError
from ds_resilience.planning.grow_back import busiest_receiver_bytes, decide_grow, full_grid_time, plan_grow_back
from ds_resilience.planning.live_regrid import plan_live_regrid, uniform_bounds
from ds_resilience.topology import Topology


def small_grid(plan) -> Topology:
    """The grid the shrink formed, its workers named by their first ranks (as ds_regrid builds it)."""
    table = plan.rank_table()
    g = plan.grid
    return Topology(dp=g.dp, pp=g.pp, ranks=tuple(table[(p, k)] for k in range(g.pp) for p in range(g.dp)))


def compose(origin, table):
    """ds_regrid._compose, on plain tables."""
    return tuple(tuple(origin[p][i] for p, i in block) for block in table)


@pytest.mark.parametrize("dp,pp,m,stage,cap", [
    (2, 3, 4, 1, 3.0),    # the live test's case: both replicas of stage 1 killed, 2 x 2 on the survivors
    (2, 4, 2, 3, 4.0),    # the last stage lost
    (3, 3, 2, 1, None),   # three replicas lost, no memory cap
    (2, 3, 3, 0, 3.0),    # the first stage lost, an odd micro-batch count
])
def test_the_grow_back_reforms_the_first_grid_from_the_small_grids_layers(dp, pp, m, stage, cap):
    first = Topology(dp=dp, pp=pp)
    layers = 2 * pp
    bounds = uniform_bounds(layers, pp)
    lost = sorted(first.rank(w) for w in first.stage_peers(stage))
    weights = [1.0 + i for i in range(layers)]
    shrink = plan_live_regrid(first, lost, bounds, m, memory_cap=cap)  # the cap counts layers
    small = small_grid(shrink)
    grow = plan_grow_back(small, shrink.grid.bounds, shrink.grid.microbatches, first, bounds, m, lost,
                          idle=shrink.idle, layer_bytes=weights)
    # the first grid, every rank at its first position
    assert (grow.grid.dp, grow.grid.pp, grow.grid.bounds, grow.grid.microbatches) == (dp, pp, bounds, m)
    assert grow.rank_table() == {(w.pipeline, w.stage): first.rank(w) for w in first.workers()}
    assert grow.idle == () and grow.fetches == {} and grow.bytes_fetched == 0.0
    # every layer a rank's first position needs and it does not hold comes from a holder in the small grid
    held = {r: set() for r in range(dp * pp)}
    for w in small.workers():
        held[small.rank(w)] = set(range(shrink.grid.bounds[w.stage], shrink.grid.bounds[w.stage + 1]))
    got = {r: set() for r in held}
    for mv in grow.moves:
        assert mv.source in held and mv.layer in held[mv.source] and mv.layer not in held[mv.to]
        assert mv.nbytes == weights[mv.layer]
        got[mv.to].add(mv.layer)
    for r, pos in grow.positions.items():
        assert set(pos.layers()) == (held[r] & set(pos.layers())) | got[r]
        assert not got[r] - set(pos.layers())  # nothing sent that the position does not keep
    for r in lost:  # a joiner receives its whole first stage
        assert got[r] == set(grow.positions[r].layers())
    # the data numbering: through the shrink and the grow, every pipeline trains its first micro-batches
    assert compose(shrink.microbatches, grow.microbatches) == tuple(
        tuple((p, i) for i in range(m)) for p in range(dp))
    json.loads(grow.to_json())


def test_the_sends_are_spread_over_the_holders():
    # 2 x 3 lost stage 1; the 2 x 2 small grid holds layers 0-2 twice and 3-5 twice
    first = Topology(dp=2, pp=3)
    shrink = plan_live_regrid(first, [2, 3], [0, 2, 4, 6], 4, memory_cap=3.0)
    grow = plan_grow_back(small_grid(shrink), shrink.grid.bounds, 4, first, [0, 2, 4, 6], 4, [2, 3])
    sent = {}
    for mv in grow.moves:
        sent[mv.source] = sent.get(mv.source, 0) + 1
    assert max(sent.values()) - min(sent.values()) <= 1 and len(sent) == 4


def test_bad_input_is_named():
    first = Topology(dp=2, pp=3)
    shrink = plan_live_regrid(first, [2, 3], [0, 2, 4, 6], 4, memory_cap=3.0)
    small = small_grid(shrink)
    with pytest.raises(PlanningError, match="every rank of the first grid"):
        plan_grow_back(small, shrink.grid.bounds, 4, first, [0, 2, 4, 6], 4, [2])  # rank 3 not back
    with pytest.raises(PlanningError, match="every rank of the first grid"):
        plan_grow_back(small, shrink.grid.bounds, 4, first, [0, 2, 4, 6], 4, [2, 3, 0])  # rank 0 twice
    with pytest.raises(PlanningError, match="global batch"):
        plan_grow_back(small, shrink.grid.bounds, 4, first, [0, 2, 4, 6], 2, [2, 3])
    with pytest.raises(PlanningError, match="layers"):
        plan_grow_back(small, shrink.grid.bounds, 4, first, [0, 2, 4, 7], 4, [2, 3])
    with pytest.raises(PlanningError, match="recover them first"):
        plan_grow_back(small.without([small.worker(0)]), shrink.grid.bounds, 4, first, [0, 2, 4, 6], 4, [2, 3])
    with pytest.raises(PlanningError, match="tensor-parallel"):
        plan_grow_back(small, shrink.grid.bounds, 4, Topology(dp=2, pp=3, tp=2), [0, 2, 4, 6], 4, [2, 3])


def test_growing_pays_when_the_iterations_left_save_more_than_the_pause():
    d = decide_grow(small_s=1.5, full_s=1.0, pause_s=2.0, iterations_left=5)
    assert d.pays and d.saved_s == 0.5 and json.loads(d.to_json())["iterations_left"] == 5
    assert not decide_grow(1.5, 1.0, 2.0, 4).pays        # 4 x 0.5 == the pause: does not pay
    assert not decide_grow(1.5, 1.0, 0.1, 0).pays        # nothing left to train
    assert not decide_grow(1.0, 1.2, 0.0, 100).pays      # the first grid is not faster
    assert decide_grow(1.5, 1.0, 50.0, None).pays        # length unknown: faster pays
    assert decide_grow(1.5, 1.0, 50.0, None).saved_s is None
    for bad in (dict(small_s=-1.0), dict(pause_s=float("inf")), dict(iterations_left=-1),
                dict(iterations_left=2.5), dict(full_s=True)):
        args = dict(small_s=1.5, full_s=1.0, pause_s=1.0, iterations_left=3) | bad
        with pytest.raises(PlanningError):
            decide_grow(**args)


def test_the_decisions_figures_the_busiest_receiver_and_the_first_grids_time():
    first = Topology(dp=2, pp=3)
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    shrink = plan_live_regrid(first, [2, 3], [0, 2, 4, 6], 4, memory_cap=3.0)  # 2 x 2: layers [0, 3), [3, 6)
    grow = plan_grow_back(small_grid(shrink), shrink.grid.bounds, 4, first, [0, 2, 4, 6], 4, [2, 3],
                          layer_bytes=weights)
    # a joiner receives its whole first stage, layers 2 and 3 (7 bytes); the busiest receiver bounds the pause
    got = {}
    for mv in grow.moves:
        got[mv.to] = got.get(mv.to, 0.0) + mv.nbytes
    assert busiest_receiver_bytes(grow) == max(got.values()) >= 7.0
    # small grid: stages of 6 and 15 (bytes as time), (4 + 1) x 15 = 75; first grid: stages 3, 7, 11, (4 + 2) x 11 = 66
    assert full_grid_time(1.5, (0, 3, 6), 4, grow) == pytest.approx(1.5 * 66 / 75)
    assert full_grid_time(1.5, (0, 3, 6), 4, grow, layer_cost=[1.0] * 6) == pytest.approx(1.5 * 12 / 15)
    with pytest.raises(PlanningError, match="do not fit"):
        full_grid_time(1.5, (0, 3, 7), 4, grow)
    with pytest.raises(PlanningError):
        full_grid_time(-1.0, (0, 3, 6), 4, grow)
