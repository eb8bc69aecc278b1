"""The fault-free reference figures from one pipeline equal the whole grid's, bit for bit.

Fault-free, every pipeline is a copy of the first one, so the planner computes fault-free 1F1B's
time and memory peak and the best fault-free schedule's time on one pipeline (``one_pipeline=True``,
the default) instead of the whole ``dp x pp`` grid. Each figure, and each ingredient of the best
fault-free time (the decoupled generator's candidates, the heuristic's candidates for the empty
failure set), is compared here with ``==`` against the whole grid's over small shapes, variants,
memory caps, tied groups and cost models chosen to exercise what could break the symmetry: link
latency and bandwidth, per-stage costs, reduce and optimizer times, costly (fused) stages, a step
check (collectives, and the speculative step's validations), and memory in bytes with weightless
pending W's (where the heuristic's caps depend on ``dp``).
"""

from dataclasses import replace

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError
from ds_resilience.ir.timeline import iteration_time
from ds_resilience.planning import planner
from ds_resilience.planning.generators import decoupled_candidates, one_f_one_b
from ds_resilience.planning.memory import fault_free_peak, resolve_cap, worker_peaks
from ds_resilience.planning.planner import VARIANTS, one_f_one_b_time, plan
from ds_resilience.topology import Topology, Worker

UNIT = CostModel.unit()
LINKED = CostModel(name="linked", t_f=(1.0, 1.5, 1.25, 2.0), t_b=(1.0, 1.75, 1.0, 2.5), t_w=(0.5, 1.0, 0.75, 1.5),
                   t_opt=(0.25, 0.5, 0.25, 0.75), t_reduce=(0.5, 0.25, 1.0, 0.5), t_tied_reduce=(0.3,),
                   activation_bytes=(3.0, 5.0, 7.0, 2.0), p2p_latency=0.1, p2p_bandwidth=10.0)
FUSED = replace(LINKED, name="fused", t_fused=(1.2, 2.0, 1.5, 3.0))  # B + W dearer than fused: stages fused
BARRIER = replace(LINKED, name="barrier", step_check="barrier", t_sync=0.05)
SPECULATIVE = replace(LINKED, name="speculative", step_check="speculative", t_sync=0.05, t_undo=(0.2,),
                      check_waits=0.25, check_rollbacks=0.125)
BYTES = replace(LINKED, name="bytes", state_bytes=(4.0, 3.0, 2.0, 1.0))  # pending W weigh nothing
BYTES_W = replace(BYTES, name="bytes-w", pending_w_bytes=(1.0, 2.0, 1.0, 0.5))
COSTS = [UNIT, LINKED, FUSED, BARRIER, SPECULATIVE, BYTES, BYTES_W]

SHAPES = [(2, 1, 3), (2, 2, 1), (2, 2, 4), (3, 3, 5), (2, 4, 8), (4, 4, 6), (3, 4, 16), (5, 2, 7)]


def _tied(pp):
    return [(), ((0, pp - 1),)] if pp > 1 else [()]


def _caps(dp, pp, m, cost, tied):
    """The default cap (fault-free 1F1B's peak) and a roomier one."""
    cap = resolve_cap(dp, pp, m, cost, None, tied, split_backward=False)
    return [cap, 3 * cap]


def _fits(cost, pp):
    return all(len(getattr(cost, f)) in (1, pp) for f in ("t_f", "t_b", "t_w", "t_opt", "t_reduce", "state_bytes",
                                                          "pending_w_bytes", "t_fused", "activation_bytes"))


CASES = [(dp, pp, m, cost, tied) for dp, pp, m in SHAPES for cost in COSTS if _fits(cost, pp) for tied in _tied(pp)]


def _id(case):
    dp, pp, m, cost, tied = case
    return f"{dp}x{pp}x{m}-{cost.name}" + ("-tied" if tied else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_one_f_one_b_figures_from_one_pipeline_equal_the_grid(case):
    dp, pp, m, cost, tied = case
    assert fault_free_peak(dp, pp, m, cost, tied) == fault_free_peak(dp, pp, m, cost, tied, one_pipeline=False)
    assert (one_f_one_b_time(dp, pp, m, cost, tied=tied)
            == one_f_one_b_time(dp, pp, m, cost, tied=tied, one_pipeline=False))
    # the schedule itself: each worker's peak is its stage's, whatever its pipeline
    grid = worker_peaks(one_f_one_b(dp, pp, m, tied=tied), cost)
    one = worker_peaks(one_f_one_b(1, pp, m, tied=tied), cost)
    assert grid == tuple(one[w // dp] for w in range(dp * pp))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_best_fault_free_time_from_one_pipeline_equals_the_grid(case, variant):
    dp, pp, m, cost, tied = case
    # every figure of the decoupled generator's candidates, whichever the best keeps
    for one, whole in zip(decoupled_candidates(1, pp, m, cost, tied=tied), decoupled_candidates(dp, pp, m, cost, tied=tied)):
        assert (one is None) == (whole is None)
        if one is None:
            continue
        assert max(worker_peaks(one, cost)) == max(worker_peaks(whole, cost))
        if variant == "recycle":
            one, whole = replace(one, optimizer="staggered"), replace(whole, optimizer="staggered")
        assert iteration_time(one, cost, variant) == iteration_time(whole, cost, variant)
    for cap in _caps(dp, pp, m, cost, tied):
        if variant != "adaptive" and cap < max(w for _, w in cost.memory_weights(pp)):
            continue  # the planner refuses a split variant this cap (resolve_cap's MemoryCapError)
        topology = Topology(dp=dp, pp=pp)
        one = planner._heuristic_candidates(topology, m, cost, variant, cap, tied, one_pipeline=True)
        whole = planner._heuristic_candidates(topology, m, cost, variant, cap, tied)
        assert [t for _, t in one] == [t for _, t in whole]
        assert [s.dp for s, _ in one] == [1] * len(one)
        # the whole grid's schedule is the one pipeline's, copied to every pipeline
        for (s1, _), (sd, _) in zip(one, whole):
            for w, actions in enumerate(sd.workers):
                stage, p = divmod(w, dp)
                assert [(a.kind, a.stage, a.microbatch) for a in actions] == [
                    (a.kind, a.stage, a.microbatch) for a in s1.workers[stage]]
                assert {a.pipeline for a in actions if a.pipeline is not None} <= {p}
        assert (planner._best_fault_free_time(dp, pp, m, cost, variant, tied, cap)
                == planner._best_fault_free_time(dp, pp, m, cost, variant, tied, cap, False))


@pytest.mark.parametrize("variant", VARIANTS)
def test_plans_carry_the_same_figures_either_way(variant, monkeypatch):
    """A whole plan's fault-free figures (1F1B, best, the default cap) are the ones the whole grid gives."""
    failed = [Worker(pipeline=0, stage=1), Worker(pipeline=2, stage=3)]
    fast = plan(3, 4, 6, failed, cost=LINKED, variant=variant)
    for f in (planner.one_f_one_b_time, planner._best_fault_free_time, fault_free_peak):
        f.cache_clear()
    whole = {"one_pipeline": False}
    monkeypatch.setattr(planner, "one_f_one_b_time", lambda *a, **k: one_f_one_b_time(*a, **{**k, **whole}))
    best = planner._best_fault_free_time
    monkeypatch.setattr(planner, "_best_fault_free_time", lambda *a: best(*a, False))
    monkeypatch.setattr(planner, "resolve_cap", lambda *a, **k: _whole_cap(*a, **k))
    slow = plan(3, 4, 6, failed, cost=LINKED, variant=variant)
    assert replace(fast, solver=None) == replace(slow, solver=None)  # all but the planning time


def _whole_cap(dp, pp, m, cost, memory_cap, tied, *, split_backward):
    assert memory_cap is None
    cap = fault_free_peak(dp, pp, m, cost, tied, one_pipeline=False)
    return resolve_cap(dp, pp, m, cost, cap, tied, split_backward=split_backward)


def test_one_pipeline_is_refused_with_a_failure():
    topology = Topology(dp=2, pp=2).without([Worker(pipeline=0, stage=1)])
    with pytest.raises(PlanningError, match="one pipeline"):
        planner._heuristic_candidates(topology, 2, UNIT, "recycle", 4.0, one_pipeline=True)


def test_bad_grids_are_still_refused():
    with pytest.raises(PlanningError, match="dp"):
        fault_free_peak(0, 2, 2, UNIT)
    with pytest.raises(PlanningError, match="dp"):
        one_f_one_b_time(0, 2, 2, UNIT)
