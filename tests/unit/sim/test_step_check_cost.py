"""The step check (clipping / fp16 overflow) in the cost model, the replay and the planner.

The runtime (``runtime/validation.py``) either puts a barrier at every step (``barrier``) or steps
speculatively and validates after the step (``speculative``): each stage publishes its norm, steps,
and before its next iteration waits for every stage's norm; a wrong speculation is undone and
redone. These tests pin what the replay charges for each, so plans and predictions with clipping
on are not the clipping-free ones.
"""

from dataclasses import replace

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import CostModelError
from ds_resilience.ir import ActionKind, simulate
from ds_resilience.ir.replay import replay
from ds_resilience.ir.timeline import STEADY_ITERATIONS, iteration_time, replayed_iteration_time
from ds_resilience.planning.planner import plan
from ds_resilience.planning.provider import ScheduleProvider
from ds_resilience.topology import Topology, Worker

BASE = CostModel(t_f=(1.0,), t_b=(1.0,), t_w=(1.0,), t_opt=(0.5,), t_reduce=(0.3,))


def _staggered():
    """A recycle plan (staggered optimizer) for one failure in a 2 x 4 grid, with twice 1F1B's memory
    so that its iterations overlap (at 1F1B's own cap this plan does not overlap them)."""
    p = plan(2, 4, 8, [Worker(pipeline=1, stage=1)], cost=BASE, memory_cap=8)
    assert p.schedule.optimizer == "staggered"
    return p.schedule


def _period(schedule, cost, mode):
    r = replay(schedule, cost, repeat=STEADY_ITERATIONS, mode=mode)
    assert not r.blocked
    return replayed_iteration_time(schedule, r.ends, r.makespan, STEADY_ITERATIONS)


def test_bad_step_check_fields_are_named():
    with pytest.raises(CostModelError, match="step_check must be one of none, barrier, speculative"):
        CostModel(step_check="sometimes")
    with pytest.raises(CostModelError, match="check_waits \\+ check_rollbacks"):
        CostModel(step_check="speculative", check_waits=0.7, check_rollbacks=0.5)
    with pytest.raises(CostModelError, match="t_sync must be a finite number >= 0"):
        CostModel(t_sync=-1.0)


def test_json_round_trip_and_unchanged_form_without_a_check():
    assert "step_check" not in BASE.to_dict() and "t_undo" not in BASE.to_dict()  # plan-table keys stay
    cost = replace(BASE, step_check="speculative", t_sync=0.01, t_undo=(0.2, 0.4), check_waits=0.25,
                   check_rollbacks=0.05)
    back = CostModel.from_dict(cost.to_dict())
    assert back == cost
    assert back.step_mix() == (("speculate", pytest.approx(0.7)), ("wait", 0.25), ("rollback", 0.05))


def test_barrier_is_the_global_optimizer_plus_one_all_reduce():
    schedule = _staggered()
    sync = 0.05
    barrier = _period(schedule, replace(BASE, step_check="barrier", t_sync=sync), "barrier")
    as_global = _period(replace(schedule, optimizer="global"), replace(BASE, t_opt=(0.5 + sync,)), "plain")
    plain = _period(schedule, BASE, "plain")
    assert barrier == pytest.approx(as_global)
    assert barrier > plain + 1e-9  # the barrier removes the staggered optimizer's overlap


def test_speculation_costs_less_than_the_barrier_and_waiting_as_much():
    schedule = _staggered()
    cost = replace(BASE, step_check="speculative", t_sync=0.0)
    plain, spec = _period(schedule, cost, "plain"), _period(schedule, cost, "speculate")
    barrier, wait = _period(schedule, cost, "barrier"), _period(schedule, cost, "wait")
    assert plain <= spec + 1e-9
    assert spec < barrier - 1e-9  # what speculation buys
    assert wait == pytest.approx(barrier)  # a step that waits is the barrier through the store


def test_no_worker_starts_an_iteration_before_every_norm_of_the_last_one_is_published():
    schedule = _staggered()
    cost = replace(BASE, step_check="speculative", t_sync=0.01)
    r = replay(schedule, cost, repeat=2, mode="speculate")
    alive = [w for w in range(len(schedule.workers)) if w not in schedule.failed]
    published = max(r.starts[w][len(schedule.workers[w]) - 1] for w in alive) + 2 * cost.t_sync
    for w in alive:
        n = len(schedule.workers[w])
        opt = n - 1
        assert schedule.workers[w][opt].kind is ActionKind.OPT_STEP
        assert r.ends[w][opt] >= published + 2 * schedule.pp * cost.t_sync - 1e-9  # validated: read every norm
        assert r.starts[w][n] >= published - 1e-9


def test_a_rollback_adds_the_undo_and_the_redone_step_to_one_iteration():
    schedule = _staggered()
    cost = replace(BASE, step_check="speculative", t_sync=0.01, t_undo=(0.4,))
    spec = replay(schedule, cost, mode="speculate").makespan
    rolled = replay(schedule, cost, mode="rollback").makespan
    assert rolled == pytest.approx(spec + 0.4 + 0.5)


def test_iteration_time_is_the_expectation_over_the_modes():
    schedule = _staggered()
    cost = replace(BASE, step_check="speculative", t_sync=0.01, t_undo=(0.4,), check_waits=0.3,
                   check_rollbacks=0.1)
    expected = sum(w * _period(schedule, cost, m) for m, w in (("speculate", 0.6), ("wait", 0.3), ("rollback", 0.1)))
    assert iteration_time(schedule, cost, "recycle") == pytest.approx(expected)
    assert simulate(schedule, cost, repeat=STEADY_ITERATIONS).iteration_time == pytest.approx(expected)
    # and the planner rates its plans with it
    p = plan(2, 4, 8, [Worker(pipeline=1, stage=1)], cost=cost)
    assert p.iteration_time == pytest.approx(iteration_time(p.schedule, cost, "recycle"))
    assert p.iteration_time > plan(2, 4, 8, [Worker(pipeline=1, stage=1)], cost=BASE).iteration_time


def test_the_provider_plans_with_the_step_check_it_is_given():
    cost = replace(BASE, step_check="barrier", t_sync=0.05)
    provider = ScheduleProvider(Topology(dp=2, pp=4), 8, cost, schedule="decoupled", variant="recycle",
                                solver="heuristic", time_limit_s=1.0, memory_cap=None)
    choice = provider.schedule_for([Worker(pipeline=1, stage=1)])
    assert choice.figures["iteration_time"] == pytest.approx(iteration_time(choice.schedule, cost, "recycle"))
