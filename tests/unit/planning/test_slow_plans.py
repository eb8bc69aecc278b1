"""A slow worker planned as a partial failure (planning/stragglers.py, reroute.weighted_assignment,
and the per-worker speeds of the list scheduler and the replay)."""

from __future__ import annotations

from collections import Counter

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError
from ds_resilience.ir import ActionKind
from ds_resilience.ir.timeline import iteration_time
from ds_resilience.planning.planner import plan
from ds_resilience.planning.reroute import reroute_assignment, weighted_assignment
from ds_resilience.planning.stragglers import plan_slow, work_bound
from ds_resilience.topology import Topology, Worker

W = Worker


def _loads(assignment, n):
    c = Counter(assignment.values())
    return tuple(c.get(w, 0) for w in range(n))


@pytest.mark.parametrize("dp,pp,m", [(2, 2, 8), (3, 2, 6), (4, 3, 5)])
def test_weighted_assignment_deals_each_stage_by_speed_and_runs_every_microbatch_once(dp, pp, m):
    topology = Topology(dp=dp, pp=pp)
    slow = W(pipeline=1, stage=pp - 1)
    a = weighted_assignment(topology, m, {slow: 0.5})
    assert set(a) == {(p, s, k) for p in range(dp) for s in range(pp) for k in range(m)}  # each once
    loads = _loads(a, dp * pp)
    for s in range(pp):
        stage = loads[s * dp:(s + 1) * dp]
        assert sum(stage) == dp * m
        if s != slow.stage:
            assert stage == (m,) * dp  # the other stages keep their own
    idx = topology.worker_index(slow)
    ideal = dp * m * 0.5 / (dp - 0.5)
    assert abs(loads[idx] - ideal) < 1 and all(loads[i] >= m for i in range(idx - 1, idx + dp - 1) if i != idx)
    for (p, s, k), w in a.items():  # a worker keeps only its own micro-batches or takes a peer's of its stage
        assert w // dp == s


def test_weighted_assignment_without_slow_workers_is_the_reroute_and_takes_failures_too():
    topology = Topology(dp=3, pp=2)
    assert weighted_assignment(topology, 6, {}) == reroute_assignment(topology, 6)
    failed = topology.without([W(pipeline=0, stage=1)])
    a = weighted_assignment(failed, 6, {W(pipeline=1, stage=1): 0.5})
    loads = _loads(a, 6)
    assert loads[3] == 0 and loads[4] + loads[5] == 18 and loads[4] == 6 and loads[5] == 12
    with pytest.raises(PlanningError, match=r"speed of worker 1:0: 1.5; allowed: \(0, 1\]"):
        weighted_assignment(topology, 6, {W(pipeline=1, stage=0): 1.5})
    with pytest.raises(Exception, match="pipeline"):
        weighted_assignment(topology, 6, {W(pipeline=7, stage=0): 0.5})


def test_a_speed_scales_only_that_workers_compute_in_the_replay():
    healthy = plan(2, 2, 4, variant="decoupled")
    ones = (1.0,) * 4
    assert iteration_time(healthy.schedule, CostModel.unit(), "decoupled", ones) == healthy.iteration_time
    one_worker = plan(1, 1, 4, variant="decoupled")
    assert iteration_time(one_worker.schedule, CostModel.unit(), "decoupled", (0.5,)) == pytest.approx(
        2 * one_worker.iteration_time)


@pytest.mark.parametrize("variant", ["adaptive", "decoupled", "recycle"])
@pytest.mark.parametrize("speed", [0.5, 0.75])
def test_the_slow_plan_runs_the_same_microbatches_faster_than_the_unadapted_schedule(variant, speed):
    cost = CostModel.from_dict({"name": "gpt-ish", "t_f": 1.0, "t_b": 1.0, "t_w": 1.0, "p2p_latency": 0.1})
    slow = {W(pipeline=1, stage=0): speed}
    p = plan_slow(2, 3, 8, slow, cost=cost, variant=variant)
    forwards = Counter((a.pipeline, a.stage, a.microbatch) for acts in p.schedule.workers for a in acts
                       if a.kind in (ActionKind.F,))
    assert set(forwards.values()) == {1} and len(forwards) == 2 * 3 * 8  # the same micro-batches, once each
    assert sum(p.loads) == 2 * 3 * 8
    assert p.healthy_time == plan(2, 3, 8, cost=cost, variant=variant).iteration_time
    assert p.healthy_time < p.iteration_time <= p.unadapted_time  # never worse than not adapting
    assert p.iteration_time >= p.bound - 1e-9 and p.bound == work_bound(2, 3, 8, cost, slow)
    if variant != "adaptive":  # the decoupled backward fills the bubbles the moved work leaves
        assert p.loads[1] < 8 < p.loads[0]
        # more than half of what the slow worker costs is won back (measured: 59% at 0.5x, 65% at 0.75x)
        assert p.unadapted_time - p.iteration_time > 0.5 * (p.unadapted_time - p.healthy_time)
        assert 0.3 < p.recovered <= 1
    else:  # fused backward under 1F1B's activation cap: the list scheduler finds nothing better here
        assert p.iteration_time == p.unadapted_time


def test_slow_plan_rejects_a_bad_variant():
    with pytest.raises(PlanningError, match="variant 'auto'"):
        plan_slow(2, 2, 4, {W(pipeline=0, stage=0): 0.5}, variant="auto")
