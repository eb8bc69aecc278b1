"""A process that resumes DeepSpeed's CPU FusedAdam mid-run steps exactly as one that trained
throughout (``integrations/ds_fused_adam.py``): its op's bias-correction powers are walked to the
product the trained process holds. Before, a re-joined worker's first update differed by rounding,
a bf16 parameter rounded the other way, and the run left the fault-free trajectory (CI: masters
1.5e-4 apart after a re-join in the user's configuration)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.timeout(600)  # the first use builds DeepSpeed's FusedAdam op (about a minute)

PROGRAM = textwrap.dedent("""
    import sys, torch
    from deepspeed.ops.adam import FusedAdam
    from ds_resilience.integrations.ds_fused_adam import align_bias_correction
    role, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    p0 = torch.randn(5000)
    grads = [torch.randn(5000) * 1e-2 for _ in range(40)]

    def train(p, opt, steps):
        for g in steps:
            align_bias_correction(opt)  # what the resilient engine's step does
            p.grad = g.clone()
            opt.step()

    if role == "throughout":
        p = torch.nn.Parameter(p0.clone()); opt = FusedAdam([p], lr=1e-3)
        train(p, opt, grads[:23])
        torch.save({"p": p.detach().clone(), "opt": opt.state_dict()}, path + ".mid")
        train(p, opt, grads[23:])
        torch.save(p.detach().clone(), path)
    else:
        mid = torch.load(path + ".mid", weights_only=False)
        p = torch.nn.Parameter(mid["p"].clone()); opt = FusedAdam([p], lr=1e-3)
        opt.load_state_dict(mid["opt"])
        train(p, opt, grads[23:])
        torch.save(p.detach().clone(), path + ".resumed")
""")


def _run(role: str, path: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM, role, path], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_process_resuming_at_step_23_steps_bit_for_bit_as_one_that_trained_throughout(tmp_path):
    path = str(tmp_path / "params.pt")
    _run("throughout", path)
    _run("resumed", path)  # a fresh process: the op's state starts empty
    throughout, resumed = torch.load(path), torch.load(path + ".resumed")
    assert torch.equal(throughout, resumed), f"max difference {(throughout - resumed).abs().max():.3e}"


def test_nothing_to_align_without_cpu_fused_adam():
    from ds_resilience.integrations.ds_fused_adam import align_bias_correction, fused_cpu_adam

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([p])
    assert fused_cpu_adam(opt) is None and align_bias_correction(opt) == 0
