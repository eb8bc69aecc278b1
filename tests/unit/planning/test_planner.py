"""The ReCycle planner: valid schedules, claims equal to the simulator, bounds, memory, errors."""

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError
from ds_resilience.ir import validate
from ds_resilience.planning.bounds import lower_bound
from ds_resilience.planning.planner import STEADY_ITERATIONS, VARIANTS, plan
from ds_resilience.ir import simulate
from ds_resilience.topology import Topology, Worker

W = Worker


def simulated_time(p):
    """The simulator's judgement, computed independently of the planner's own evaluation."""
    if p.variant == "recycle":
        return simulate(p.schedule, repeat=STEADY_ITERATIONS).iteration_time
    return simulate(p.schedule).makespan


GRID = [
    (dp, pp, m, (W(pipeline=dp - 1, stage=s),))
    for dp in (2, 3)
    for pp in (2, 3, 4)
    for m in (pp, 2 * pp)
    for s in range(pp)
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dp,pp,m,failed", GRID)
def test_plans_are_valid_and_claims_equal_the_simulator(variant, dp, pp, m, failed):
    p = plan(dp, pp, m, failed, variant=variant)
    validate(p.schedule)
    assert p.iteration_time == pytest.approx(simulated_time(p))
    assert p.iteration_time >= p.lower_bound - 1e-9
    assert max(p.peak_state) <= p.memory_cap
    # the failed worker runs nothing and its micro-batches run on same-stage peers
    dead = failed[0].stage * dp + failed[0].pipeline
    assert p.schedule.workers[dead] == ()
    runners = {w for w, acts in enumerate(p.schedule.workers) for a in acts if a.kind.is_compute and a.pipeline == failed[0].pipeline and a.stage == failed[0].stage}
    assert runners and all(w // dp == failed[0].stage for w in runners)


def test_two_failures_in_one_stage_and_in_two_stages():
    for failed in ([W(pipeline=0, stage=1), W(pipeline=2, stage=1)], [W(pipeline=0, stage=0), W(pipeline=1, stage=3)]):
        for variant in VARIANTS:
            p = plan(3, 4, 6, failed, variant=variant)
            validate(p.schedule)
            assert p.iteration_time == pytest.approx(simulated_time(p))
            assert p.iteration_time >= p.lower_bound - 1e-9


@pytest.mark.parametrize("stage", range(4))
def test_reference_case_targets(stage):
    """3 pipelines x 4 stages, 6 micro-batches each, unit costs, one failure at each position, with
    twice the memory fault-free 1F1B holds (8 states; at 1F1B's own cap see test_memory_plans.py)."""
    failed = [W(pipeline=1, stage=stage)]
    a = plan(3, 4, 6, failed, variant="adaptive", memory_cap=8)
    b = plan(3, 4, 6, failed, variant="decoupled", memory_cap=8)
    c = plan(3, 4, 6, failed, variant="recycle", memory_cap=8)
    assert a.fault_free_iteration_time == 27
    # the bounds of the worked example (fused backward: 27 + 3s is the tighter valid one,
    # except at stage 0, where 8 forwards do not cover the 9-unit round trip: 27 + 2 idle)
    assert b.lower_bound == 27 + stage
    assert c.lower_bound == 27
    assert a.lower_bound == max(27 + 3 * stage, 29)
    assert c.degradation <= 0.08
    assert c.gap_to_bound <= 0.01
    assert b.iteration_time <= a.iteration_time and c.iteration_time <= b.iteration_time
    assert b.degradation <= 0.12


def test_cpsat_improves_the_heuristic_and_reports():
    failed = [W(pipeline=1, stage=0)]
    heuristic = plan(3, 4, 6, failed, variant="adaptive", solver="heuristic")
    solved = plan(3, 4, 6, failed, variant="adaptive", solver="cpsat", time_limit_s=20)
    assert solved.iteration_time < heuristic.iteration_time
    assert solved.solver.name == "cpsat" and solved.solver.status in ("optimal", "feasible")
    assert solved.solver.gap is not None and solved.solver.seconds > 0
    validate(solved.schedule)
    assert solved.iteration_time == pytest.approx(simulated_time(solved))
    assert max(solved.peak_state) <= solved.memory_cap


def test_memory_cap_is_respected_when_tight():
    for cap in (2, 3, 5):
        for variant in VARIANTS:
            p = plan(2, 3, 6, [W(pipeline=0, stage=1)], variant=variant, memory_cap=cap)
            assert max(p.peak_state) <= cap
            validate(p.schedule)


def test_fault_free_plan_matches_the_generators():
    assert plan(3, 4, 6, variant="adaptive").iteration_time == 27
    # the decoupled generator holds pp + 1 = 5 states: it needs a cap above 1F1B's 4
    assert plan(3, 4, 6, variant="decoupled", memory_cap=8).iteration_time == 21


def test_costs_flow_through():
    cost = CostModel(t_f=(1.0, 2.0), t_b=(1.0, 2.0), t_w=(1.0, 2.0), p2p_latency=0.5)
    p = plan(2, 2, 4, [W(pipeline=0, stage=1)], cost=cost, variant="decoupled")
    assert p.iteration_time == pytest.approx(simulate(p.schedule, cost).makespan)
    assert p.lower_bound == pytest.approx(lower_bound(Topology(dp=2, pp=2).without([W(pipeline=0, stage=1)]), 4, cost, variant="decoupled"))


def test_uncoverable_stage_named():
    with pytest.raises(PlanningError, match="stage 1 lost every replica.*cannot cover"):
        plan(2, 3, 3, [W(pipeline=0, stage=1), W(pipeline=1, stage=1)])


@pytest.mark.parametrize(
    "bad, fragment",
    [(W(pipeline=5, stage=0), "pipeline 5 out of range, allowed 0..2"), (W(pipeline=0, stage=4), "stage 4 out of range, allowed 0..3")],
)
def test_out_of_range_named(bad, fragment):
    with pytest.raises(PlanningError, match=fragment):
        plan(3, 4, 6, [bad])


def test_bad_options():
    with pytest.raises(PlanningError, match="allowed: adaptive, decoupled, recycle"):
        plan(2, 2, 2, variant="fast")
    with pytest.raises(PlanningError, match="allowed: heuristic, cpsat"):
        plan(2, 2, 2, solver="gurobi")


def test_plan_round_trips_through_json():
    from ds_resilience.planning.planner import Plan

    p = plan(3, 4, 6, [W(pipeline=2, stage=2)])
    q = Plan.from_dict(p.to_dict())
    assert q.schedule == p.schedule and q.iteration_time == p.iteration_time and q.failed == p.failed


def test_cpsat_with_a_single_survivor_places_rerouted_work_on_it():
    # dp=2: the failed worker's micro-batches have exactly one possible peer.
    p = plan(2, 4, 4, [W(pipeline=1, stage=2)], variant="adaptive", solver="cpsat", time_limit_s=10)
    validate(p.schedule)
    assert p.schedule.workers[2 * 2 + 1] == ()
    assert p.iteration_time == pytest.approx(simulated_time(p))
