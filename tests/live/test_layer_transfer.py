"""A re-grid's state transfer between live survivors (checkpoint/layer_transfer.py), in real
processes over gloo: both replicas of a stage are killed, the survivors take their template grid
positions, receive the layers they lack from surviving holders (or the snapshots when none
survives) and end with every layer's parameters and Adam state bitwise equal to what its holders
had. A survivor killed during the transfer makes its peers fail fast with a CommError."""

from __future__ import annotations

import pytest

import regrid_programs as prog
from dist_harness import run_workers


@pytest.mark.timeout(180)
def test_survivors_take_their_new_positions_with_optimizer_state():
    world = prog.DP * prog.PP
    results = run_workers(prog.regrid, world, timeout_s=150, allow_exit=set(prog.DEAD))
    live = {r: res for r, res in enumerate(results) if r not in prog.DEAD}
    assert sorted(live) == [0, 1, 4, 5, 6, 7]
    positions = set()
    for rank, res in live.items():
        pipeline, stage, first, last = res["position"]
        positions.add((pipeline, stage))
        assert res["layers"] == list(range(first, last))  # exactly its new layers
        assert all(res["same"].values()), res["same"]  # parameters and Adam moments, bitwise
        assert set(res["kept"]) == set(prog.stage_layers(rank)) & set(range(first, last))
        # only layers no survivor held (the dead stage's 2 and 3) come from the snapshots
        assert set(res["restored"]) == {2, 3} & set(range(first, last)) - set(prog.stage_layers(rank))
    plan = prog.the_plan(sorted(live))
    assert positions == {(p.pipeline, p.stage) for p in plan.assignment.values()} and len(positions) == len(live)
    assert sum(r["received"] for r in live.values()) == sum(r["sent"] for r in live.values()) > 0
    assert sum(r["received"] > 0 for r in live.values()) >= 2  # survivors received from survivors


@pytest.mark.timeout(120)
def test_a_survivor_lost_during_the_transfer_fails_its_peers_fast():
    results = run_workers(prog.regrid, prog.DP * prog.PP, args=(4,), timeout_s=100, allow_exit={*prog.DEAD, 4})
    waiting = [res for r, res in enumerate(results) if r not in (*prog.DEAD, 4) and res is not None]
    assert waiting and any("error" in res for res in waiting), waiting
