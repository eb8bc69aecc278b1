"""Mixed schedules: the split variants fuse the backward on the stages whose B + W costs more than
their fused backward (ds_resilience.planning.stage_mix), planned, bounded and run live."""

from __future__ import annotations

import json

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


def test_fuse_turns_bs_into_bws_and_drops_ws_on_the_chosen_stages_only():
    p = plan(2, 2, 4, [], cost=CostModel.unit(), variant="decoupled")
    fused = fuse(p.schedule, (0,))
    assert _backwards(fused) == {0: {"BW"}, 1: {"B", "W"}}
    validate(fused)
    assert fuse(p.schedule, ()) is p.schedule
    per_worker = [sum(a.kind is ActionKind.BW for a in actions) for actions in fused.workers]
    assert per_worker == [4, 4, 0, 0]  # stage 0's two workers, each its 4 micro-batches


@pytest.mark.timeout(600)
def test_a_mixed_plan_runs_live_in_the_users_configuration(tmp_path):
    """A hand-written cost model makes stage 1's split dear: the engine's recycle plans run fused BW
    on stage 1 and B/W on stage 0. In the user's configuration (DeepSpeed's default Adam and
    clipping 1.0, bf16 with fp32 masters, their own data loader, activation checkpointing on every
    block), rank 3 (stage 1) is SIGKILLed mid-backward, and the survivors end with the masters of a
    run that never failed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_live import TRAINING_DATA, USER_CONFIG, assert_masters_equal, logs, run_job

    extra = [*TRAINING_DATA, "--activation-checkpoint-interval", "1"]
    code, _, reference = run_job(tmp_path, name="ref", deepspeed=USER_CONFIG, extra=extra)
    assert code == 0, logs(tmp_path, "ref")
    model = tmp_path / "costly_last.json"
    model.write_text(json.dumps({"name": "costly-last", "t_f": [1.0, 1.0], "t_b": [1.0, 2.0], "t_w": [1.0, 2.0],
                                 "t_fused": [2.0, 2.0]}))
    # what the engine will plan for the failure, and run (4 micro-batches per pipeline)
    assert _backwards(plan(2, 2, 4, [Worker(pipeline=1, stage=1)], cost=CostModel.load(model),
                           variant="recycle").schedule) == {0: {"B", "W"}, 1: {"BW"}}
    fault = {"rank": 3, "step": 3, "point": "mid_backward", "kind": "sigkill"}
    code, _, dumps = run_job(tmp_path, name="mixed", faults=[fault], deepspeed=USER_CONFIG, extra=extra,
                             resilience={"variant": "recycle", "cost_model": str(model),
                                         "planner": {"solver": "heuristic", "cache_dir": str(tmp_path / "plans")}})
    assert code == 0, logs(tmp_path, "mixed")
    assert_masters_equal(dumps, reference, dead=[3])
    line = next(x for x in logs(tmp_path, "mixed").splitlines() if "plan for failed 1:1" in x)
    assert "variant recycle" in line and "fused backward on stage(s) 1" in line, line
