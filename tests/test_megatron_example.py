"""examples/megatron_gpt.py (Megatron-LM's pretrain_gpt.py shape) under `ds-resilience run
--no_local_rank`: PP=2 x DP=2 on CPU, fault-free and with a replica left idle, print the same losses
(up to summation order)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "4"]


def _run(extra, tmp_path):
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--no_local_rank", "--num_gpus", "4",
           os.path.join(REPO, "examples", "megatron_gpt.py"), *ARGS, *extra]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = re.findall(r"iteration +(\d+)/4 \| pipeline (\d) \| lm loss ([0-9.]+) \| grad norm ([0-9.]+)", out.stdout)
    return out.stdout, {(int(i), int(p)): (loss, norm) for i, p, loss, norm in lines}


@pytest.mark.timeout(600)
def test_the_megatron_example_trains_and_a_failed_replica_leaves_its_losses_unchanged(tmp_path):
    text, healthy = _run(["--resilience"], tmp_path)
    assert "[megatron_gpt] done: 4 iterations, TP=1 PP=2 DP=2" in text
    assert set(healthy) == {(i, p) for i in range(1, 5) for p in (0, 1)}
    assert float(healthy[(4, 0)][0]) < float(healthy[(1, 0)][0])  # it learns
    config = tmp_path / "fail.json"
    config.write_text(json.dumps({"simulate_failed": ["1:0"]}))
    text, degraded = _run(["--resilience-config", str(config)], tmp_path)
    assert "failed 1:0: planner recycle schedule" in text
    # the same losses and norms up to summation order (the stage's gradients are summed over one
    # replica instead of two): printed to six and four decimals, they differ in the last digit at most
    assert set(degraded) == set(healthy)
    for key, (loss, norm) in healthy.items():
        assert abs(float(degraded[key][0]) - float(loss)) <= 2e-6, (key, degraded[key], loss)
        assert abs(float(degraded[key][1]) - float(norm)) <= 2e-4, (key, degraded[key], norm)
