"""Mixed schedules (fused backward on the stages where the split does not pay) run live under the agent."""

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
from test_stage_mix import _backwards  # noqa: F401


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


@pytest.mark.timeout(600)
def test_a_self_profiled_decoupled_run_re_lists_its_healthy_schedule_and_stays_exact(tmp_path):
    """``schedule: decoupled`` with no cost model, in the user's configuration: the job profiles
    itself (steps 0-2), re-plans, re-lists its healthy schedule with what it measured (on this CPU
    the last stage's split costs more than its fused backward: it runs fused from step 3), then
    loses rank 3 mid-backward at step 6; the survivors end with the masters of a run that never
    failed (a fused-1F1B one), whichever backward each stage ran at each step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_live import TRAINING_DATA, USER_CONFIG, assert_masters_equal, logs, run_job

    steps = 10
    extra = [*TRAINING_DATA, "--activation-checkpoint-interval", "1"]
    code, _, reference = run_job(tmp_path, name="ref", deepspeed=USER_CONFIG, extra=extra, steps=steps)
    assert code == 0, logs(tmp_path, "ref")
    fault = {"rank": 3, "step": 6, "point": "mid_backward", "kind": "sigkill"}
    out = tmp_path / "profile.json"
    code, _, dumps = run_job(tmp_path, name="job", faults=[fault], deepspeed=USER_CONFIG, extra=extra, steps=steps,
                             resilience={"schedule": "decoupled", "variant": None, "profile_steps": 1,
                                         "profile_out": str(out), "planner": {"solver": "heuristic"}})
    text = logs(tmp_path, "job")
    assert code == 0, text
    assert_masters_equal(dumps, reference, dead=[3], steps=steps)
    # what the measured model says the healthy run should fuse (the engine prices clipping's step check in)
    from dataclasses import replace

    from ds_resilience.planning.generators import generate

    cost = replace(CostModel.load(out), step_check="speculative")
    expected = _backwards(generate("decoupled", 2, 2, 4, cost))
    fused = sorted(s for s, kinds in expected.items() if kinds == {"BW"})
    replan = next(x for x in (tmp_path / "job-logs" / "rank0.0.log").read_text().splitlines()
                  if "plans rebuilt with the profiled costs" in x)
    if fused:  # on this CPU, the last stage (head and loss): its B + W costs more than its fused backward
        assert f"re-listed with them (fused backward on stage(s) {', '.join(map(str, fused))}; " in replan, replan
    else:
        assert "fused backward" not in replan, replan
