"""examples/megatron_gpt.py (Megatron-LM's pretrain_gpt.py shape), PP=2 x DP=2 on CPU: under
`ds-resilience run --no_local_rank` fault-free and with a rank SIGKILLed mid-run, and under torchrun
with a replica left idle; the losses printed are the healthy run's (up to summation order)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "4"]


# The Megatron example's agent starts each worker as a fresh interpreter (the default, as the
# deepspeed launcher does; the rest of the live tier forks them from conftest's DSR_PRELOAD server).
# Forked workers, with megatron.core preloaded or not, made the TP=2 SIGKILL test fail now and then:
# after rank 3's death ranks 0 and 7 (or 6) exit 1, one of them after a 30 s store wait for
# dsr/agree/2/1. A timing window in the Megatron TP recovery that faster starts expose; left open
# (see the closing note of the suite issue).
PRELOAD = ["--preload", ""]


def _run(extra, tmp_path, launcher="agent", args=ARGS, nproc=4):
    """The example under `ds-resilience run --no_local_rank` (live failure handling) or torchrun
    (no agent: simulate_failed is what-if only there)."""
    script = os.path.join(REPO, "examples", "megatron_gpt.py")
    if launcher == "agent":
        cmd = [sys.executable, "-m", "ds_resilience.cli", "run", *PRELOAD, "--no_local_rank", "--num_gpus", str(nproc),
               script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(_free_port()), script]
    out = subprocess.run(cmd + list(args) + list(extra), cwd=tmp_path, capture_output=True, text=True, timeout=300,
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
    from dist_harness import free_port

    return free_port()  # below the ephemeral range: see there


def _stopped(tmp_path, *, first: int, second: int, args, nproc: int, second_step: int = 2) -> subprocess.CompletedProcess:
    """The example under the agent with no restart allowed: rank ``first`` SIGKILLed mid-backward in
    iteration 1, rank ``second`` before the forward of iteration ``second_step``; the job must stop
    (exit code 3)."""
    config = tmp_path / "kill2.json"
    config.write_text(json.dumps({"max_failures": 1, "checkpoint": {"max_restarts": 0}, "fault_injection": [
        {"rank": first, "step": 1, "point": "mid_backward", "kind": "sigkill"},
        {"rank": second, "step": second_step, "point": "before_forward", "kind": "sigkill"}]}))
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", *PRELOAD, "--no_local_rank", "--num_gpus", str(nproc),
           os.path.join(REPO, "examples", "megatron_gpt.py"), *args, "--resilience-config", str(config)]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    """The example's fault-free run under the agent (PP=2 x DP=2), once for the tests that compare
    with its losses: (its output, its losses)."""
    return _run(["--resilience"], tmp_path_factory.mktemp("healthy"))


@pytest.mark.timeout(600)
def test_the_megatron_example_trains_and_a_failed_replica_leaves_its_losses_unchanged(tmp_path, healthy_run):
    text, healthy = healthy_run
    assert "[megatron_gpt] done: 4 iterations, TP=1 PP=2 DP=2" in text
    assert set(healthy) == {(i, p) for i in range(1, 5) for p in (0, 1)}
    assert float(healthy[(4, 0)][0]) < float(healthy[(1, 0)][0])  # it learns
    config = tmp_path / "fail.json"
    config.write_text(json.dumps({"simulate_failed": ["1:0"]}))
    text, degraded = _run(["--resilience-config", str(config)], tmp_path, launcher="torchrun")
    assert "failed 1:0: planner recycle schedule" in text
    _assert_same_losses(degraded, healthy)


@pytest.mark.timeout(600)
def test_a_sigkilled_rank_under_the_agent_is_rerouted_live_and_the_losses_stay_the_healthy_ones(tmp_path, healthy_run):
    """Rank 1 (replica p1s0) is SIGKILLed in the middle of iteration 1's backward: the agent publishes
    the failure, the survivors plan (the table's re-routing), install new groups and finish the run;
    every loss printed afterwards is the healthy run's (up to summation order)."""
    _, healthy = healthy_run
    config = tmp_path / "kill.json"
    config.write_text(json.dumps({"max_failures": 1, "fault_injection": [
        {"rank": 1, "step": 1, "point": "mid_backward", "kind": "sigkill"}]}))
    text, survived = _run(["--resilience-config", str(config)], tmp_path)
    assert "rank 1 crashed (killed by SIGKILL)" in text
    assert '"action": "continue"' in text and "failed 1:0: table recycle schedule" in text
    assert "exit code 0: all live workers finished (1 failed)" in text
    _assert_same_losses(survived, healthy)


@pytest.mark.timeout(600)
def test_a_megatron_rank_whose_main_thread_stalls_is_taken_for_hung_and_the_job_goes_on_without_it(tmp_path, healthy_run):
    """Rank 1's main thread stops in the middle of iteration 1's backward while its heartbeat thread
    runs on (a kernel or a device wait that never returns): its progress watch stops the heartbeat
    once the thread has not advanced for ``stall_timeout_s``, the agent takes the silence for a hang
    and kills it, and the survivors re-route its micro-batches to the end of the run with the
    healthy losses. The same live stage as DeepSpeed's (``runtime/live_stage.py``); before, the
    Megatron schedule gave neither its executor nor its coordinator the progress watch, and a
    stalled rank beat on until the store timeout."""
    _, healthy = healthy_run
    config = tmp_path / "stall.json"
    config.write_text(json.dumps({"max_failures": 1, "detector": {
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "stall_timeout_s": 1.5, "pg_timeout_s": 60.0},
        "fault_injection": [{"rank": 1, "step": 1, "point": "mid_backward", "kind": "stall"}]}))
    text, survived = _run(["--resilience-config", str(config)], tmp_path)
    assert "the main thread has not advanced" in text
    assert "rank 1 hung (no heartbeat for" in text
    assert '"action": "continue"' in text and "failed 1:0: table recycle schedule" in text
    assert "exit code 0: all live workers finished (1 failed)" in text
    _assert_same_losses(survived, healthy)


def _stop_dir(tmp_path, tag: str):
    """Where a stop wrote its checkpoint: ``./checkpoints/<job id>/<tag>`` (one job per test)."""
    found = list((tmp_path / "checkpoints").glob(f"*/{tag}"))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(600)
def test_beyond_tolerance_the_surviving_stage_is_saved_in_megatrons_layout_and_the_job_stops(tmp_path):
    """Both replicas of stage 0 die (rank 1 in iteration 1, rank 0 in iteration 2) and no restart is
    allowed: the agent stops the job (exit code 3), and stage 1's survivors write its shard in Megatron-LM's layout with a
    manifest naming what was saved and lost."""
    import torch

    out = _stopped(tmp_path, first=1, second=0, args=ARGS, nproc=4)
    assert "stopped cleanly after step 2" in out.stdout
    stop_dir = _stop_dir(tmp_path, "global_step2")
    manifest = json.loads((stop_dir / "manifest.json").read_text())
    assert manifest["stages_saved"] == [1] and manifest["stages_lost"] == [0]
    assert "Megatron-LM torch layout" in manifest["format"]
    shard = torch.load(stop_dir / "iter_0000002" / "mp_rank_00_001" /
                       "model_optim_rng.pt", weights_only=False)
    assert shard["iteration"] == 2 and shard["checkpoint_version"] == 3.0
    assert "output_layer.weight" in shard["model"] and shard["optimizer"]["state"]


TP2 = ["--tensor-model-parallel-size", "2", *ARGS]  # TP=2 x PP=2 x DP=2: 8 ranks


def _shards(directory):
    """{(tp, pp) shard: its Megatron checkpoint dict} of a checkpoint the example saved (--save)."""
    import torch

    return {path.parent.name: torch.load(path, weights_only=False)
            for path in sorted(directory.glob("iter_0000004/mp_rank_*/model_optim_rng.pt"))}


@pytest.mark.timeout(900)
def test_beyond_tolerance_with_restarts_every_worker_restores_from_memory_and_the_run_ends_healthy(tmp_path, healthy_run):
    """PP=2 x DP=2 with in-memory snapshots and one restart allowed: both replicas of stage 0 die
    (rank 1 in iteration 1, rank 0 in iteration 2). The agent restarts all four workers; each
    restores its stage's newest snapshot (weights, Adam moments, megatron-core's learning-rate
    schedule) in `resume()`, and the iterations after the restart print the healthy run's losses:
    a schedule restored one step off, or moments lost, would change them."""
    _, healthy = healthy_run
    config = tmp_path / "restart.json"
    config.write_text(json.dumps({"max_failures": 1, "checkpoint": {"max_restarts": 1}, "fault_injection": [
        {"rank": 1, "step": 1, "point": "mid_backward", "kind": "sigkill"},
        {"rank": 0, "step": 2, "point": "before_forward", "kind": "sigkill"}]}))
    text, restarted = _run(["--resilience-config", str(config)], tmp_path)
    assert "restarting all workers from the in-memory snapshots" in text
    match = re.search(r"restart 1: restored step (\d+) from the in-memory snapshots", text)
    assert match, text[-3000:]
    step = int(match.group(1))
    assert step in (1, 2)  # the newest step every rank's snapshot holds (rank 0's step 2 may not be committed)
    after = {k: v for k, v in restarted.items() if k[0] > step}
    assert set(after) == {(i, p) for i in range(step + 1, 5) for p in (0, 1)}
    _assert_same_losses(after, {k: healthy[k] for k in after})
