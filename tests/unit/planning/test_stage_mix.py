"""Mixed schedules: the split variants fuse the backward on the stages whose B + W costs more than
their fused backward (ds_resilience.planning.stage_mix), planned, bounded and run live."""

from __future__ import annotations


import pytest

from ds_resilience.costs import CostModel
from ds_resilience.integrations.ds_reporting import plan_line
from ds_resilience.ir import ActionKind, validate
from ds_resilience.planning import planner
from ds_resilience.planning.memory import worker_peaks
from ds_resilience.planning.planner import plan
from ds_resilience.planning.stage_mix import as_split, costly_stages, fuse
from ds_resilience.topology import Topology, Worker

# stage 0 splits at no extra cost; stage 1 (the head and loss) pays 30% for it, as on the CPU
COSTLY_LAST = CostModel(name="costly-last", t_f=(1.0,), t_b=(1.0, 1.3), t_w=(1.0, 1.3), t_fused=(2.0, 2.0))


def _backwards(schedule) -> dict[int, set[str]]:
    kinds: dict[int, set[str]] = {}
    for actions in schedule.workers:
        for a in actions:
            if a.kind in (ActionKind.B, ActionKind.W, ActionKind.BW):
                kinds.setdefault(a.stage, set()).add(a.kind.value)
    return kinds


def test_costly_stages_are_those_whose_split_costs_more_than_fused():
    assert costly_stages(COSTLY_LAST, 2) == (1,)
    assert costly_stages(CostModel.unit(), 4) == ()  # no measured fused time: B + W is the fused time
    cheap = CostModel(t_b=(1.0,), t_w=(1.0,), t_fused=(2.5,))  # the split is cheaper: nothing to fuse
    assert costly_stages(cheap, 3) == ()


def test_as_split_reads_a_fused_stage_as_a_b_of_its_fused_time_and_a_free_w():
    recompute = CostModel(t_b=(1.0,), t_w=(1.0,), t_fused=(1.5,), t_recompute=(0.5,), state_bytes=(10.0,),
                          pending_w_bytes=(4.0,))
    mixed = as_split(recompute, (1,), 2)
    s0, s1 = mixed.stages(2)
    assert (s0.t_b, s0.t_w, s0.pending_w_bytes) == (1.5, 1.0, 4.0)  # untouched (recompute included)
    assert (s1.t_b, s1.t_w, s1.t_bw, s1.pending_w_bytes) == (2.0, 0.0, 2.0, 0.0)
    assert s1.t_bw == recompute.stage(1).t_bw
    assert as_split(recompute, (), 2) is recompute


@pytest.mark.parametrize("variant", ["decoupled", "recycle"])
@pytest.mark.parametrize("failed, mixed_wins", [([], True), ([Worker(pipeline=0, stage=1)], True),
                                                ([Worker(pipeline=1, stage=0)], False)])
def test_split_variants_fuse_the_costly_stage_when_it_is_faster(variant, failed, mixed_wins):
    """Fault-free and with stage 1 short of a worker, stage 1 is the bottleneck and fusing it wins;
    with stage 0 short, stage 0 is, stage 1's extra 0.6 per micro-batch hides in its idle time and
    the fully split schedule (first among equals) stays."""
    p = plan(2, 2, 6, failed, cost=COSTLY_LAST, variant=variant)
    validate(p.schedule, replayed=True)
    assert max(worker_peaks(p.schedule, COSTLY_LAST)) <= p.memory_cap + 1e-9
    assert p.lower_bound <= p.iteration_time + 1e-9 and p.degradation_vs_best >= -1e-12
    topology = Topology(dp=2, pp=2).without(failed)
    _, split_only = planner._list_candidates(topology, 6, COSTLY_LAST, variant, p.memory_cap, (), ())
    _, mixed_only = planner._list_candidates(topology, 6, COSTLY_LAST, variant, p.memory_cap, (), (1,))
    assert p.iteration_time == min(split_only, mixed_only)
    if mixed_wins:
        assert _backwards(p.schedule) == {0: {"B", "W"}, 1: {"BW"}} and mixed_only < split_only - 1e-9
        assert p.to_dict()["fused_stages"] == [1]
        assert "fused backward on stage(s) 1" in plan_line(p.to_dict(), "costly-last", "0:1")
    else:
        assert _backwards(p.schedule) == {0: {"B", "W"}, 1: {"B", "W"}} and split_only <= mixed_only + 1e-9
        assert "fused_stages" not in p.to_dict()


def test_without_a_costly_stage_plans_split_every_stage_as_before():
    for cost in (CostModel.unit(), CostModel(t_b=(1.0, 1.0), t_w=(1.0, 1.0), t_fused=(2.5, 2.0))):
        p = plan(2, 2, 6, [Worker(pipeline=0, stage=1)], cost=cost, variant="recycle")
        assert _backwards(p.schedule) == {0: {"B", "W"}, 1: {"B", "W"}}


def test_the_fault_free_decoupled_schedule_fuses_a_stage_where_the_split_does_not_pay():
    """``schedule: decoupled`` under a profile: the healthy run's schedule fuses the last stage
    (it is the bottleneck and pays 30% for the split) and keeps stage 0 split; the replay finds it
    faster than the fully split one. Under unit costs, or when the split pays, nothing changes."""
    from ds_resilience.ir.timeline import iteration_time
    from ds_resilience.planning.generators import _decoupled, decoupled, generate

    mixed = decoupled(2, 2, 6, COSTLY_LAST)
    split = _decoupled(2, 2, 6, COSTLY_LAST, (), ())
    validate(mixed, replayed=True)
    assert _backwards(mixed) == {0: {"B", "W"}, 1: {"BW"}} and _backwards(split) == {0: {"B", "W"}, 1: {"B", "W"}}
    assert iteration_time(mixed, COSTLY_LAST, "decoupled") < iteration_time(split, COSTLY_LAST, "decoupled") - 1e-9
    assert generate("decoupled", 2, 2, 6, COSTLY_LAST) == mixed
    for cost in (CostModel.unit(), CostModel(t_b=(1.0, 1.0), t_w=(1.0, 1.0), t_fused=(2.5, 2.0))):
        assert _backwards(decoupled(2, 2, 6, cost)) == {0: {"B", "W"}, 1: {"B", "W"}}
    # costly but hidden: stage 0 is the bottleneck (3x its forward), stage 1's split hides in its bubbles
    hidden = CostModel(t_f=(3.0, 1.0), t_b=(3.0, 1.0), t_w=(3.0, 0.2), t_fused=(6.0, 1.1))
    assert costly_stages(hidden, 2) == (1,)
    kept = decoupled(2, 2, 6, hidden)
    assert iteration_time(kept, hidden, "decoupled") <= iteration_time(_decoupled(2, 2, 6, hidden, (1,), ()),
                                                                       hidden, "decoupled") + 1e-9


# PP=2, 8 micro-batches, B + W 2.1 against a fused 2.0 on both stages: the replay finds the fully
# split schedule 4.7% faster than the mixed one (25.8 against 27.0), with B + W 2.04 6.6% faster
CLOSE_CALL = CostModel(name="close-call", t_f=(1.0,), t_b=(1.0,), t_w=(1.1,), t_fused=(2.0,))
CLEAR_GAIN = CostModel(name="clear-gain", t_f=(1.0,), t_b=(1.0,), t_w=(1.04,), t_fused=(2.0,))


def test_the_split_is_kept_only_when_the_replay_finds_it_faster_by_more_than_the_margin():
    """A profile's noise is larger than a few percent (SPLIT_MARGIN's comment), so a split predicted
    only slightly faster than the mixed schedule is not worth its pending-W memory: the mixed one
    runs. A clear gain keeps the split, fault-free and in the planner's failure plans alike."""
    from ds_resilience.ir.timeline import iteration_time
    from ds_resilience.planning.generators import decoupled, decoupled_candidates
    from ds_resilience.planning.stage_mix import SPLIT_MARGIN, prefer_mixed

    assert prefer_mixed(1.0, 1.0) and prefer_mixed(1.0 + SPLIT_MARGIN / 2, 1.0)
    assert not prefer_mixed(1.0 + 2 * SPLIT_MARGIN, 1.0)
    for cost, gain, mixed_runs in ((CLOSE_CALL, (0.0, SPLIT_MARGIN), True), (CLEAR_GAIN, (SPLIT_MARGIN, 1.0), False)):
        split, mixed = decoupled_candidates(1, 2, 8, cost)
        assert _backwards(mixed) == {0: {"BW"}, 1: {"BW"}}  # both stages costly: both fused
        t_split, t_mixed = (iteration_time(s, cost, "decoupled") for s in (split, mixed))
        assert gain[0] < t_mixed / t_split - 1 < gain[1]  # the replay's predicted gain of the split
        chosen = decoupled(1, 2, 8, cost)
        assert _backwards(chosen) == ({0: {"BW"}, 1: {"BW"}} if mixed_runs else {0: {"B", "W"}, 1: {"B", "W"}})
        assert max(worker_peaks(chosen, cost)) <= max(worker_peaks(split, cost)) + 1e-9
    # the failure plans follow the same rule; the best fault-free figure stays the fastest replay
    # (the split one), so a degradation is measured against what the grid could really do
    # (one worker of stage 1 lost: the split is 0.8% faster on 2 stages, 6.5% on 4)
    for pp, kinds in ((2, {"BW"}), (4, {"B", "W"})):
        failed = [Worker(pipeline=0, stage=1)]
        p = plan(2, pp, 8, failed, cost=CLOSE_CALL, variant="decoupled")
        topology = Topology(dp=2, pp=pp).without(failed)
        _, split_only = planner._list_candidates(topology, 8, CLOSE_CALL, "decoupled", p.memory_cap, (), ())
        _, mixed_only = planner._list_candidates(topology, 8, CLOSE_CALL, "decoupled", p.memory_cap, (),
                                                 tuple(range(pp)))
        assert (mixed_only / split_only - 1 < SPLIT_MARGIN) == (kinds == {"BW"})
        assert set(_backwards(p.schedule)) == set(range(pp))
        assert all(k == kinds for k in _backwards(p.schedule).values())
        assert p.iteration_time == (mixed_only if kinds == {"BW"} else split_only)
        _, split_healthy = planner._list_candidates(Topology(dp=2, pp=pp), 8, CLOSE_CALL, "decoupled", p.memory_cap,
                                                    (), ())
        assert p.best_fault_free_iteration_time <= split_healthy + 1e-9
        assert p.degradation_vs_best >= 0


def test_the_solver_applies_the_same_margin_to_its_schedules():
    """CP-SAT searches each family the heuristic listed (fully split; mixed, as split schedules
    under as_split, fused back) and the margin picks between their best. Before, it searched fully
    split schedules only and took any that beat the heuristic's pick, so a split 4.4% faster than
    the mixed plan the margin had kept displaced it under ``--solver cpsat`` (and its "optimal"
    ignored the mixed family)."""
    from ds_resilience.planning.stage_mix import SPLIT_MARGIN, fused_in

    failed = [Worker(pipeline=0, stage=1)]
    topology = Topology(dp=2, pp=2).without(failed)
    heuristic = plan(2, 2, 4, failed, cost=CLOSE_CALL, variant="decoupled", solver="heuristic")
    (split, t_split), (mixed, t_mixed) = planner._heuristic_candidates(topology, 4, CLOSE_CALL, "decoupled",
                                                                       heuristic.memory_cap, ())
    assert 0 < t_mixed / t_split - 1 < SPLIT_MARGIN and fused_in(heuristic.schedule) == [0, 1]
    solved = plan(2, 2, 4, failed, cost=CLOSE_CALL, variant="decoupled", solver="cpsat", time_limit_s=5)
    assert fused_in(solved.schedule) == [0, 1] and solved.iteration_time <= t_mixed + 1e-9
    assert solved.solver.status == "feasible"  # the faster split family is not the one that runs
    assert solved.degradation_vs_best >= 0 and max(solved.peak_memory) <= solved.memory_cap + 1e-9
    # where the solver's split is faster by more than the margin, the split runs, improved
    failed = [Worker(pipeline=0, stage=1)]
    topology = Topology(dp=2, pp=3).without(failed)
    heuristic = plan(2, 3, 6, failed, cost=CLEAR_GAIN, variant="decoupled", solver="heuristic")
    solved = plan(2, 3, 6, failed, cost=CLEAR_GAIN, variant="decoupled", solver="cpsat", time_limit_s=5)
    _, t_mixed = planner._heuristic_candidates(topology, 6, CLEAR_GAIN, "decoupled", heuristic.memory_cap, ())[1]
    assert fused_in(solved.schedule) == [] and solved.iteration_time < heuristic.iteration_time - 1e-9
    assert t_mixed > solved.iteration_time * (1 + SPLIT_MARGIN)
    validate(solved.schedule, replayed=True)


@pytest.mark.parametrize("schedule_name, failed, switched", [("decoupled", (), True), ("1f1b", (), False),
                                                            ("decoupled", (Worker(pipeline=1, stage=1),), False)])
def test_after_the_profile_a_healthy_run_switches_to_the_profiled_fault_free_schedule(schedule_name, failed, switched):
    """The engine's re-plan (``_replan``, after the self-profile; ``ds_plans.healthy_schedule``) re-lists a healthy run's schedule
    with the profiled costs: ``schedule: decoupled`` starts fully split (unit costs) and runs the
    mixed schedule from the next iteration, and says so. 1F1B does not change, and a run that is
    re-routing around a failure keeps its plan (the profile is only taken when healthy)."""
    from ds_resilience.integrations.ds_plans import healthy_schedule
    from ds_resilience.planning.generators import generate
    from ds_resilience.planning.provider import ScheduleProvider
    from ds_resilience.runtime.recovery import Generation

    topology = Topology(dp=2, pp=2)
    start = generate(schedule_name, 2, 2, 6, CostModel.unit())
    generation = Generation(epoch=0, topology=topology.without(failed), schedule=start,
                            source="planner" if failed else "fault-free", lookup_s=0.0, figures=None, groups=None)
    provider = ScheduleProvider.build(topology, 6, COSTLY_LAST, schedule=schedule_name, variant="recycle",
                                             solver="heuristic", time_limit_s=1.0, memory_cap=None, max_failures=0,
                                             all_coverable=False, cache_dir=None, workers=1)
    # what the engine's _adopt_plans does with the re-plan's table
    generation, said = healthy_schedule(generation, provider)
    if switched:
        assert _backwards(generation.schedule) == {0: {"B", "W"}, 1: {"BW"}}
        assert said == ("; the healthy decoupled schedule re-listed with them (fused backward on stage(s) 1; "
                        "a split must be predicted 5.0% faster to run (fixed margin))")
        assert generation.epoch == 0 and generation.source == "fault-free"
    else:
        assert said == "" and generation.schedule is start


def test_fuse_turns_bs_into_bws_and_drops_ws_on_the_chosen_stages_only():
    p = plan(2, 2, 4, [], cost=CostModel.unit(), variant="decoupled")
    fused = fuse(p.schedule, (0,))
    assert _backwards(fused) == {0: {"BW"}, 1: {"B", "W"}}
    validate(fused)
    assert fuse(p.schedule, ()) is p.schedule
    per_worker = [sum(a.kind is ActionKind.BW for a in actions) for actions in fused.workers]
    assert per_worker == [4, 4, 0, 0]  # stage 0's two workers, each its 4 micro-batches


