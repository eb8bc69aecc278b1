"""examples/megatron_gpt.py (Megatron-LM's pretrain_gpt.py shape), PP=2 x DP=2 on CPU: under
`ds-resilience run --no_local_rank` fault-free and with a rank SIGKILLed mid-run, and under torchrun
with a replica left idle; the losses printed are the healthy run's (up to summation order)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "4"]


def _run(extra, tmp_path, launcher="agent"):
    """The example under `ds-resilience run --no_local_rank` (live failure handling) or torchrun
    (no agent: simulate_failed is what-if only there)."""
    script = os.path.join(REPO, "examples", "megatron_gpt.py")
    if launcher == "agent":
        cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--no_local_rank", "--num_gpus", "4", script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
               str(_free_port()), script]
    out = subprocess.run(cmd + ARGS + list(extra), cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = re.findall(r"iteration +(\d+)/4 \| pipeline (\d) \| lm loss ([0-9.]+) \| grad norm ([0-9.]+)", out.stdout)
    return out.stdout + out.stderr, {(int(i), int(p)): (loss, norm) for i, p, loss, norm in lines}


def _assert_same_losses(got, healthy):
    """The same losses and norms up to summation order (a stage's gradients summed over one replica
    instead of two): printed to six and four decimals, they differ in the last digit at most."""
    assert set(got) == set(healthy)
    for key, (loss, norm) in healthy.items():
        assert abs(float(got[key][0]) - float(loss)) <= 2e-6, (key, got[key], loss)
        assert abs(float(got[key][1]) - float(norm)) <= 2e-4, (key, got[key], norm)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(600)
def test_the_megatron_example_trains_and_a_failed_replica_leaves_its_losses_unchanged(tmp_path):
    text, healthy = _run(["--resilience"], tmp_path)
    assert "[megatron_gpt] done: 4 iterations, TP=1 PP=2 DP=2" in text
    assert set(healthy) == {(i, p) for i in range(1, 5) for p in (0, 1)}
    assert float(healthy[(4, 0)][0]) < float(healthy[(1, 0)][0])  # it learns
    config = tmp_path / "fail.json"
    config.write_text(json.dumps({"simulate_failed": ["1:0"]}))
    text, degraded = _run(["--resilience-config", str(config)], tmp_path, launcher="torchrun")
    assert "failed 1:0: planner recycle schedule" in text
    _assert_same_losses(degraded, healthy)


@pytest.mark.timeout(600)
def test_a_sigkilled_rank_under_the_agent_is_rerouted_live_and_the_losses_stay_the_healthy_ones(tmp_path):
    """Rank 1 (replica p1s0) is SIGKILLed in the middle of iteration 1's backward: the agent publishes
    the failure, the survivors plan (the table's re-routing), install new groups and finish the run;
    every loss printed afterwards is the healthy run's (up to summation order)."""
    _, healthy = _run(["--resilience"], tmp_path)
    config = tmp_path / "kill.json"
    config.write_text(json.dumps({"max_failures": 1, "fault_injection": [
        {"rank": 1, "step": 1, "point": "mid_backward", "kind": "sigkill"}]}))
    text, survived = _run(["--resilience-config", str(config)], tmp_path)
    assert "rank 1 crashed (killed by SIGKILL)" in text
    assert '"action": "continue"' in text and "failed 1:0: table recycle schedule" in text
    assert "exit code 0: all live workers finished (1 failed)" in text
    _assert_same_losses(survived, healthy)


@pytest.mark.timeout(600)
def test_beyond_tolerance_the_surviving_stage_is_saved_in_megatrons_layout_and_the_job_stops(tmp_path):
    """Both replicas of stage 0 die (rank 1 in iteration 1, rank 0 in iteration 2): the agent stops
    the job (exit code 3), and stage 1's survivors write its shard in Megatron-LM's layout with a
    manifest naming what was saved and lost."""
    import torch

    config = tmp_path / "kill2.json"
    config.write_text(json.dumps({"max_failures": 1, "fault_injection": [
        {"rank": 1, "step": 1, "point": "mid_backward", "kind": "sigkill"},
        {"rank": 0, "step": 2, "point": "before_forward", "kind": "sigkill"}]}))
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--no_local_rank", "--num_gpus", "4",
           os.path.join(REPO, "examples", "megatron_gpt.py"), *ARGS, "--resilience-config", str(config)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped cleanly after step 2" in out.stdout
    manifest = json.loads((tmp_path / "checkpoints" / "global_step2" / "manifest.json").read_text())
    assert manifest["stages_saved"] == [1] and manifest["stages_lost"] == [0]
    assert "Megatron-LM torch layout" in manifest["format"]
    shard = torch.load(tmp_path / "checkpoints" / "global_step2" / "iter_0000002" / "mp_rank_00_001" /
                       "model_optim_rng.pt", weights_only=False)
    assert shard["iteration"] == 2 and shard["checkpoint_version"] == 3.0
    assert "output_layer.weight" in shard["model"] and shard["optimizer"]["state"]
