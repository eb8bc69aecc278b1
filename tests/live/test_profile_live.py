"""The profile measured by real training runs: the engine's profile iterations, `ds-resilience profile`,
and the self-profile with its re-plan under the agent."""

from __future__ import annotations
import json
import subprocess
from dataclasses import replace
import sys
import pytest
from ds_resilience.costs import CostModel
from ds_resilience.errors import CostModelError
from ds_resilience.planning.memory import resolve_cap
from ds_resilience.planning.planner import plan
from ds_resilience.planning.profile import cost_from_profile, profile_summary
from ds_resilience.topology import Worker
from test_live import REPO, SCRIPT, assert_equal_to_reference, logs, run_job  # noqa: E402


@pytest.mark.timeout(600)
def test_profile_iterations_are_training_and_write_a_model_the_planner_uses(tmp_path, monkeypatch):
    """Under the agent, DSR_PROFILE_OUT makes the first 2 x 2 + 1 iterations the profile (fused and
    decoupled in turn); training goes on, and every rank ends where a run without the profile ends."""
    code, _, reference = run_job(tmp_path, name="ref")
    assert code == 0, logs(tmp_path, "ref")
    out = tmp_path / "profile.json"
    monkeypatch.setenv("DSR_PROFILE_OUT", str(out))
    monkeypatch.setenv("DSR_PROFILE_STEPS", "2")
    code, _, dumps = run_job(tmp_path, name="prof")
    assert code == 0, logs(tmp_path, "prof")
    assert_equal_to_reference(dumps, reference)
    data = json.loads(out.read_text())
    cost = CostModel.load(out)
    assert all(x > 0 for x in cost.t_f + cost.t_b + cost.t_w + cost.t_opt + cost.t_reduce)
    assert all(x > 0 for x in cost.state_bytes + cost.pending_w_bytes) and cost.activation_bytes[0] > 0
    assert cost.p2p_latency > 0 and cost.p2p_bandwidth > 0
    assert cost.split_noise is not None and cost.split_noise >= 0  # 2 ranks x 2 pairs of iterations per stage
    measured = data["measured"]
    assert all(x > 0 for x in measured["fused_backward"]) and measured["ranks"] == [0, 1, 2, 3]
    # 4 micro-batches per pipeline, 4 ranks: fused BW in 2 iterations, B and W in 2, F in all 4
    assert measured["samples"] == {"F": 4 * 4 * 4, "B": 4 * 2 * 4, "W": 4 * 2 * 4, "BW": 4 * 2 * 4}
    # memory in bytes: the default cap is 1F1B's peak (stage 0 holds 2 micro-batches' activations)
    assert resolve_cap(2, 2, 4, cost) == pytest.approx(max(2 * cost.state_bytes[0], cost.state_bytes[1]))
    p = plan(2, 2, 4, [Worker(pipeline=0, stage=1)], cost=cost, variant="decoupled", solver="heuristic")
    assert p.memory_unit == "bytes" and max(p.peak_memory) <= p.memory_cap
    assert p.iteration_time >= p.lower_bound - 1e-12
    # the engine plans with the profile, picks the variant it predicts fastest, and says so
    monkeypatch.delenv("DSR_PROFILE_OUT")
    fault = {"rank": 3, "step": 3, "point": "mid_backward", "kind": "sigkill"}
    code, _, dumps = run_job(tmp_path, name="auto", faults=[fault],
                             resilience={"variant": "auto", "cost_model": str(out),
                                         "planner": {"solver": "heuristic", "cache_dir": str(tmp_path / "plans")}})
    assert code == 0, logs(tmp_path, "auto")
    assert_equal_to_reference(dumps, reference, dead=[3])
    text = logs(tmp_path, "auto")
    line = next(x for x in text.splitlines() if "plan for failed 1:1" in x)
    assert "chosen among adaptive" in line and f"{cost.name} costs" in line
    chosen = line.split("variant ")[1].split(",")[0]
    times = {part.split()[0]: float(part.split()[1]) for part in line.split("chosen among ")[1].split(", ")}
    # the line prints 4 significant digits: two variants can print the same figure (a split variant
    # whose plan fuses every stage is adaptive's schedule), so the chosen one prints the smallest
    assert times[chosen] == min(times.values()), line


@pytest.mark.timeout(300)
def test_the_profile_command_writes_the_model_and_stops(tmp_path):
    out = tmp_path / "cost.json"
    cmd = [sys.executable, "-m", "ds_resilience.cli", "profile", "--out", str(out), "--profile-steps", "1",
           "--num_gpus", "4", "--log_dir", str(tmp_path / "logs"), str(SCRIPT), "--deepspeed_config",
           str(REPO / "configs" / "gpt_cpu_pp2_dp2.json"), "--steps", "40"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wrote" in proc.stdout and out.exists()
    assert CostModel.load(out).has_memory
    # it stopped after the profile (3 iterations), not after the script's 40 steps
    assert "step  39" not in proc.stdout + proc.stderr


@pytest.mark.timeout(600)
def test_the_engine_profiles_itself_and_replans_with_what_it_measured(tmp_path, monkeypatch):
    """With cost_model null the engine profiles by default (profile_steps null: 2, so the first 5
    iterations), every rank derives the same model and re-plans with it; a later death is planned
    with the profile, and with ``variant`` unset (the default) the profile picks the variant.
    (The suite turns the default off with DSR_SELF_PROFILE=0; not here.)"""
    code, _, reference = run_job(tmp_path, name="ref")
    assert code == 0, logs(tmp_path, "ref")
    monkeypatch.delenv("DSR_SELF_PROFILE", raising=False)
    fault = {"rank": 3, "step": 6, "point": "mid_backward", "kind": "sigkill"}
    out = tmp_path / "measured.json"
    code, _, dumps = run_job(tmp_path, name="self", faults=[fault],
                             resilience={"profile_out": str(out), "variant": None,  # the default: unset
                                         "planner": {"solver": "heuristic", "cache_dir": str(tmp_path / "plans")}})
    assert code == 0, logs(tmp_path, "self")
    assert_equal_to_reference(dumps, reference, dead=[3])
    text = logs(tmp_path, "self")
    assert "plans rebuilt with the profiled costs (profile-measured)" in text
    line = next(x for x in text.splitlines() if "plan for failed 1:1" in x)
    assert "(profile-measured costs" in line and "chosen among adaptive" in line
    assert CostModel.load(out).t_fused[0] > 0
