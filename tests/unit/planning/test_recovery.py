"""Plan-then-execute recovery: the pure decision every survivor (and the agent) takes per epoch."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from ds_resilience.epochs import EpochRecord
from ds_resilience.errors import PlanningError
from ds_resilience.planning.recovery import lost_stages, plan_recovery, voters
from ds_resilience.topology import Topology, Worker

GRID = Topology(dp=3, pp=2)  # ranks: stage * dp + pipeline -> stage 0 = {0, 1, 2}, stage 1 = {3, 4, 5}


def record(epoch=2, failed=(), joining=(), kind="crash", restart=False):
    alive = tuple(r for r in range(GRID.world_size) if r not in failed)
    return EpochRecord(epoch=epoch, failed=failed, alive=alive, joining=joining, kind=kind, stop=kind == "stop",
                       restart=restart, reason="test")


def test_a_crash_resumes_at_the_fewest_steps_and_rolls_back_the_stages_ahead():
    steps = {0: 7, 1: 7, 2: 7, 3: 8, 5: 8}  # stage 1 stepped already (staggered optimizer)
    plan = plan_recovery(record(failed=(4,)), GRID, steps, covered=lambda failed: True)
    assert plan.action == "continue" and plan.resume_step == 7
    assert plan.rollbacks == (3, 5)
    assert plan.failed == (4,) and plan.failed_workers == ("1:1",)
    assert plan.schedule_source == "table" and plan.lost_stages == ()
    assert plan.groups == {"world": (0, 1, 2, 3, 5), "stage0": (0, 1, 2), "stage1": (3, 5)}
    assert plan.handovers == ()


def test_the_source_is_the_planner_when_the_table_lacks_the_set():
    plan = plan_recovery(record(failed=(0, 4)), GRID, {r: 3 for r in (1, 2, 3, 5)},
                         covered=lambda failed: len(failed) <= 1)
    assert plan.schedule_source == "planner"
    assert plan_recovery(record(failed=(0,)), GRID, {r: 3 for r in range(1, 6)}).schedule_source == "planner"


def test_a_survivor_two_steps_ahead_is_an_error_not_a_silent_skip():
    with pytest.raises(PlanningError, match="more than one step"):
        plan_recovery(record(failed=(4,)), GRID, {0: 5, 1: 5, 2: 5, 3: 7, 5: 5})
    with pytest.raises(PlanningError, match="no step count"):
        plan_recovery(record(failed=(4,)), GRID, {0: 5})


@pytest.mark.parametrize("restart, action", [(True, "restart"), (False, "stop")])
def test_a_stage_without_replicas_is_beyond_tolerance(restart, action):
    plan = plan_recovery(record(failed=(3, 4, 5), kind="stop", restart=restart), GRID, {0: 4, 1: 4, 2: 4})
    assert plan.action == action and plan.lost_stages == (1,)
    assert plan.schedule_source is None and plan.groups == {}
    # the same set published as a plain crash is still beyond tolerance: one decision, not two
    assert plan_recovery(record(failed=(3, 4, 5)), GRID, {0: 4, 1: 4, 2: 4}).action == "stop"


@pytest.mark.parametrize("regrid", [False, True])
def test_a_pipeline_that_lost_both_ends_without_an_addressable_source_is_beyond_tolerance(regrid):
    """Pipeline 1 lost stage 0 and stage 1 (ranks 1 and 4): each stage keeps replicas, but with
    data from data_iter alone nobody can read pipeline 1's micro-batches (``unfed``): the job
    stops with every stage saved; a re-formed grid would need the same data, so it is not chosen."""
    from ds_resilience.planning.data_relay import unfed_pipelines

    def unfed(failed):
        lost = unfed_pipelines(GRID.without(failed))
        return f"pipeline(s) {list(lost)} starved" if lost else None

    steps = {0: 4, 2: 4, 3: 4, 5: 4}
    plan = plan_recovery(record(failed=(1, 4)), GRID, steps, unfed=unfed, regrid=regrid)
    assert plan.action == "stop" and plan.lost_stages == () and plan.groups == {}
    assert plan.reason == "test; pipeline(s) [1] starved"
    # one end left: re-routing continues (the other end relays its data)
    plan = plan_recovery(record(failed=(1, 3)), GRID, steps | {4: 4}, unfed=unfed, regrid=regrid)
    assert plan.action == "continue" and plan.reason == "test"


def test_a_rejoin_names_the_donor_and_excludes_the_joiner_from_the_vote():
    rec = record(epoch=5, failed=(1,), joining=(4,), kind="rejoin")
    assert voters(rec) == (0, 2, 3, 5)
    plan = plan_recovery(rec, GRID, {0: 9, 2: 9, 3: 9, 5: 9})
    assert plan.handovers == ((3, 4),)
    assert plan.groups["stage1"] == (3, 4, 5)
    assert plan.resume_step == 9


def test_the_plan_is_one_json_line_and_the_same_on_every_survivor():
    rec = record(failed=(2,))
    steps = {0: 1, 1: 1, 3: 2, 4: 2, 5: 2}
    plans = {plan_recovery(rec, GRID, dict(steps)).to_json() for _ in range(3)}
    assert len(plans) == 1
    (line,) = plans
    assert "\n" not in line and json.loads(line)["rollbacks"] == [3, 4, 5]


def test_lost_stages_is_the_topology_rule_on_every_failure_set():
    """The agent decides "beyond tolerance" on registrations with :func:`lost_stages`; the workers'
    plans do on the topology: both agree on every failure set of a small grid."""
    grid = Topology(dp=2, pp=3)
    stage_of = {grid.rank(w): w.stage for w in grid.workers()}
    for k in range(grid.world_size + 1):
        for failed in itertools.combinations(range(grid.world_size), k):
            workers = [grid.coord(r)[0] for r in failed]
            assert lost_stages(stage_of, failed) == grid.without(workers).uncovered_stages(), failed


def test_with_tensor_parallel_replicas_one_dead_rank_takes_its_replica_out():
    """A replica of TP ranks (the agent keys it by the (pipeline, stage) the ranks registered): a stage
    is lost once each of its replicas lost a rank, even with ranks of it still alive; with one rank
    per replica the rule is the plain one."""
    stage_of = {r: r // 4 for r in range(8)}  # 2 stages x 2 replicas x 2 tensor-parallel ranks
    replica_of = {r: (r // 2) % 2 for r in range(8)}
    replica_of = {r: (replica_of[r], stage_of[r]) for r in range(8)}
    assert lost_stages(stage_of, [1], replica_of) == ()
    assert lost_stages(stage_of, [1, 3], replica_of) == (0,)  # ranks 0 and 2 live, neither replica is whole
    assert lost_stages(stage_of, [0, 1], replica_of) == ()  # one replica, both its ranks
    assert lost_stages(stage_of, [1, 3]) == ()  # the plain rule counts ranks


def test_random_epochs_never_step_a_stage_twice():
    rng = random.Random(3)
    for _ in range(200):
        failed = tuple(sorted(rng.sample(range(GRID.world_size), rng.randint(0, 2))))
        base = rng.randint(0, 50)
        steps = {r: base + rng.randint(0, 1) for r in range(GRID.world_size) if r not in failed}
        plan = plan_recovery(record(failed=failed), GRID, steps)
        assert plan.resume_step == min(steps.values())
        assert all(steps[r] == plan.resume_step + 1 for r in plan.rollbacks)
        assert all(steps[r] == plan.resume_step for r in steps if r not in plan.rollbacks)
        assert (plan.action == "continue") == (not plan.lost_stages)


def test_workers_of_the_record_must_be_in_the_grid():
    with pytest.raises(Exception):
        plan_recovery(record(failed=(4,)), Topology(dp=1, pp=2), {0: 1})
    assert Worker(pipeline=1, stage=1) == GRID.coord(4)[0]


def test_with_regrid_a_lost_stage_is_a_regrid_unless_the_agent_stopped_the_job():
    steps = {0: 4, 1: 4, 2: 4}
    plan = plan_recovery(record(failed=(3, 4, 5)), GRID, steps, regrid=True)
    assert plan.action == "regrid" and plan.lost_stages == (1,) and plan.groups == {} and plan.resume_step == 4
    assert plan_recovery(record(failed=(3, 4, 5), kind="stop", restart=True), GRID, steps, regrid=True).action == "restart"
    assert plan_recovery(record(failed=(3, 4, 5)), GRID, steps, regrid=False).action == "stop"


def test_piled_failures_regrid_only_when_the_engine_prefers_it():
    steps = {r: 6 for r in (2, 3, 4)}
    asked = []

    def prefer(failed):
        asked.append(failed)
        return len(failed) >= 3

    piled = plan_recovery(record(failed=(0, 1, 5)), GRID, steps, regrid=True, prefer_regrid=prefer)
    assert piled.action == "regrid" and piled.lost_stages == ()
    assert asked[-1] == frozenset({Worker(pipeline=0, stage=0), Worker(pipeline=1, stage=0), Worker(pipeline=2, stage=1)})
    one = plan_recovery(record(failed=(5,)), GRID, {r: 6 for r in range(5)}, regrid=True, prefer_regrid=prefer)
    assert one.action == "continue"
    assert plan_recovery(record(failed=(0, 1, 5)), GRID, steps, prefer_regrid=prefer).action == "continue"  # regrid off
    rejoin = record(epoch=5, failed=(0, 1), joining=(5,), kind="rejoin")
    assert plan_recovery(rejoin, GRID, {r: 6 for r in (2, 3, 4)}, regrid=True,
                         prefer_regrid=lambda failed: True).action == "continue"  # a re-join never re-grids
