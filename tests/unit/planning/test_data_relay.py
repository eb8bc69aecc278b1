"""The relay plan: which surviving end of a pipeline hands a re-routed micro-batch to its runner."""

from __future__ import annotations

from ds_resilience.planning.data_relay import can_lose_both_ends, relay_plan, unfed_pipelines
from ds_resilience.planning.inference import inference_actions
from ds_resilience.topology import Topology, Worker


def W(p, s):
    return Worker(pipeline=p, stage=s)


def test_a_failed_first_stage_gets_its_micro_batches_from_the_last_stage_of_its_pipeline():
    topo = Topology(dp=2, pp=3).without([W(1, 0)])
    plan = relay_plan(topo, inference_actions(topo, 4))
    holder, runner = topo.worker_index(W(1, 2)), topo.worker_index(W(0, 0))
    assert [(t.pipeline, t.microbatch, t.stage, t.holder, t.runner) for t in plan.transfers] == \
           [(1, m, 0, holder, runner) for m in range(4)]
    assert plan.unserved == () and plan.sends(holder) == plan.receives(runner) == plan.transfers
    assert plan.sends(runner) == () and plan.receives(holder) == ()


def test_a_failed_last_stage_gets_them_from_the_first_and_a_middle_stage_needs_no_data():
    topo = Topology(dp=3, pp=3).without([W(2, 2), W(0, 1)])
    plan = relay_plan(topo, inference_actions(topo, 3))
    assert {t.holder for t in plan.transfers} == {topo.worker_index(W(2, 0))}
    assert {t.stage for t in plan.transfers} == {2} and {t.pipeline for t in plan.transfers} == {2}
    assert sorted(t.microbatch for t in plan.transfers) == [0, 1, 2]  # shared by the two surviving last stages
    assert {topo.worker(t.runner).stage for t in plan.transfers} == {2}


def test_both_ends_lost_or_one_stage_leaves_the_micro_batches_unserved():
    topo = Topology(dp=2, pp=2).without([W(1, 0), W(1, 1)])
    plan = relay_plan(topo, inference_actions(topo, 2))
    assert plan.transfers == () and plan.unserved == ((1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1))
    assert unfed_pipelines(topo) == (1,)
    single = Topology(dp=3, pp=1).without([W(0, 0)])
    plan = relay_plan(single, inference_actions(single, 2))
    assert plan.transfers == () and {(p, m) for p, m, _ in plan.unserved} == {(0, 0), (0, 1)}
    assert unfed_pipelines(single) == (0,) and unfed_pipelines(Topology(dp=2, pp=2).without([W(1, 0)])) == ()


def test_a_healthy_grid_relays_nothing_and_the_tolerance_rule():
    topo = Topology(dp=2, pp=2)
    assert not relay_plan(topo, inference_actions(topo, 4))
    assert can_lose_both_ends(1, 1) and not can_lose_both_ends(1, 0)
    assert not can_lose_both_ends(2, 1) and can_lose_both_ends(4, 2)
