"""benchmarks/gpu_engine_check.py, the one-GPU engine check of benchmarks/gpu_checks.sh, on the CPU.

Everything but the device: 4 workers of examples/train_gpt.py under the agent, every one told
``LOCAL_RANK=0`` (all ranks on device 0, as on the one GPU), DeepSpeed's FusedAdam (its CPU build),
bf16 with fp32 masters, in-memory snapshots every step replicated between two pretend machines,
rank 1 SIGKILLed mid-backward; the script's verdict is that the survivors' masters equal the
fault-free run's and that every rank took its snapshots. ``--device cuda`` (``torch.cuda.set_device(0)``
in every rank, the CUDA snapshot copy path, gloo staging CUDA tensors) runs only on a lent GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 400  # the script's own limit here; far above its run time on idle cores (the module's timeout adds 40 s)


@pytest.mark.timeout(LIMIT_S + 40)
def test_gpu_engine_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "gpu_engine_check.py"), "--device", "cpu", "--steps", "5",
         "--fault-step", "3", "--json", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the agent kills its workers on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"gpu_engine_check.py ran over {LIMIT_S} s:\n{stdout}\n{stderr[-6000:]}")
    verdict = [line for line in stdout.splitlines() if line.startswith("gpu_engine_check:")]
    assert proc.returncode == 0 and verdict and verdict[0].startswith("gpu_engine_check: PASS device=cpu"), (
        stdout + stderr[-6000:])
    figures = json.loads(out.read_text())
    assert figures["verdict"] == "PASS" and not figures["problems"]
    assert figures["fault"] == {"rank": 1, "step": 3, "point": "mid_backward", "kind": "sigkill"}
    assert figures["tensor_devices"] == ["cpu"] and figures["max_master_diff"] <= 1e-6
    assert figures["resume_step"] == [3] and 0 <= figures["recovery_s"] < 5.0
    assert figures["ref_wall_s"] > 0 and figures["kill_wall_s"] > 0 and figures["fused_adam_build_s"] > 0
    # every survivor snapshotted every step and sent replicas to the other pretend machine; on the CPU by host copies
    assert figures["snapshot_staging"] == ["host copy"]
    assert min(figures["snapshots_per_survivor"]) >= 3 and min(figures["replicas_sent_per_survivor"]) >= 1
