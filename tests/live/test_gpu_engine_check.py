"""benchmarks/gpu_engine_check.py, the one-GPU engine check of benchmarks/gpu_checks.sh, on the CPU.

Everything but the device: 4 workers of examples/train_gpt.py under the agent, DeepSpeed's FusedAdam
(its CPU build), bf16 with fp32 masters, in-memory snapshots, rank 1 SIGKILLed mid-backward; the
script's verdict is that the survivors' masters equal the fault-free run's. ``--device cuda`` (all
ranks on cuda:0, the CUDA snapshot path, gloo staging CUDA tensors) runs only on a lent GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)  # ~25 s with DeepSpeed's CPU FusedAdam built; its first JIT build adds ~40 s
def test_gpu_engine_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_engine_check.py"), "--device", "cpu", "--steps", "5",
         "--fault-step", "3", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=230)
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("gpu_engine_check:")]
    assert proc.returncode == 0 and verdict and verdict[0].startswith("gpu_engine_check: PASS device=cpu"), (
        proc.stdout + proc.stderr[-6000:])
    figures = json.loads(out.read_text())
    assert figures["verdict"] == "PASS" and not figures["problems"]
    assert figures["fault"] == {"rank": 1, "step": 3, "point": "mid_backward", "kind": "sigkill"}
    assert figures["tensor_devices"] == ["cpu"] and figures["max_master_diff"] <= 1e-6
    assert figures["resume_step"] == [3] and 0 <= figures["recovery_s"] < 5.0
    assert figures["ref_wall_s"] > 0 and figures["kill_wall_s"] > 0
