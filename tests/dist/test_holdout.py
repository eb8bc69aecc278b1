"""Hold-out check: a user's PipelineModule, their ``training_data`` and DeepSpeed's default config.

The program (``holdout_programs.py``) is written as DeepSpeed's documentation writes a pipeline:
stock torch layers (dropout in training mode), ``nn.CrossEntropyLoss``, a ``TensorDataset`` passed
as ``training_data``, ``"Adam"`` (DeepSpeed's FusedAdam) and ``gradient_clipping`` 1.0 from
``configs/default_resilience.json``, in fp32 (the template's bf16 turned off: parameters are compared
to 1e-6). Nothing in it is shaped for ds_resilience. PP=2 x DP=2, 4 processes on gloo.

* With clipping 1.0 (speculative clipping, validated, rolled back when wrong), a simulated failure
  of worker p1s1 ends with the survivors' parameters equal to our fault-free run.
* With clipping off and no dropout randomness, our engine equals vanilla DeepSpeed. (With dropout,
  DeepSpeed draws masks from one RNG stream in its own schedule order; ours keys them by
  (iteration, pipeline, micro-batch, stage) so a re-routed micro-batch draws the dead worker's
  masks: the two are different draws of the same distribution. With clipping on, DeepSpeed 0.19.8
  clips pipelines by the first stage's norm only, so we compare against our own global step.)

The live half (SIGKILL mid-backward under ``ds-resilience run``, ``--training-data``, clipping 1.0)
is ``test_live.py::test_training_data_with_default_clipping_survives_sigkill_mid_backward``.
"""

from __future__ import annotations

import pytest

from dist_harness import run_workers
from holdout_programs import train

STEPS = 8  # 16 samples a step over 96: crosses an epoch of DeepSpeed's sampler
TOL = 1e-6
"""Largest parameter difference allowed (parameters are O(0.1-1)). A re-routed micro-batch's
gradient is summed on the survivor in another order than the fault-free all-reduce sums it, so
fp32 results agree to rounding (measured: 1.5e-8), not bitwise."""

SCENARIOS = [
    {"name": "ours clip1", "engine": "resilient", "clip": 1.0},
    {"name": "ours clip1 failed", "engine": "resilient", "clip": 1.0, "failed": ["1:1"]},
    {"name": "vanilla clip0", "engine": "vanilla", "clip": 0.0, "dropout": 0.0},
    {"name": "ours clip0", "engine": "resilient", "clip": 0.0, "dropout": 0.0},
    {"name": "ours clip0 failed", "engine": "resilient", "clip": 0.0, "dropout": 0.0, "failed": ["0:0"]},
]


@pytest.fixture(scope="module")
def holdout():
    return run_workers(train, 4, args=(SCENARIOS, STEPS), timeout_s=400)


def _params(results, name):
    out = {}
    for r in results:
        rec = r[name]
        if rec["alive"]:
            out.setdefault(rec["stage"], []).append(rec["params"])
    return out


def _max_diff(results, a, b) -> float:
    pa, pb = _params(results, a), _params(results, b)
    assert set(pa) == set(pb) == {0, 1}
    worst = 0.0
    for stage, copies in pb.items():
        ref = pa[stage][0]
        for params in copies + pa[stage]:
            assert params.keys() == ref.keys()
            for n, t in params.items():
                worst = max(worst, (t - ref[n]).abs().max().item())
    return worst


def test_default_clipping_with_a_simulated_failure_equals_our_fault_free_run(holdout):
    assert _max_diff(holdout, "ours clip1", "ours clip1 failed") <= TOL
    # the run is not trivially unclipped: the global norm exceeded 1.0 and validation acted on it
    runs = [r["ours clip1"] for r in holdout if r["ours clip1"]["alive"]]
    assert all(r["validation"] is not None for r in runs)
    # clipping acted on some step (however it was decided: after a wait, a rollback, or at once)
    assert any(r["validation"]["clipped"] > 0 for r in runs), runs[0]["validation"]
    assert all(sum(r["validation"][k] for k in ("speculated", "rolled_back", "waited", "ready")) == STEPS
               for r in runs)
    # the failed run lost a worker and still trained every step, with the same losses
    assert sum(not r["ours clip1 failed"]["alive"] for r in holdout) == 1
    ref = holdout[0]["ours clip1"]["losses"]
    assert holdout[0]["ours clip1 failed"]["losses"] == pytest.approx(ref, rel=1e-6)
    # and training moved every survivor's parameters
    assert all(r["ours clip1 failed"]["moved"] > 1e-3 for r in holdout if r["ours clip1 failed"]["alive"])


def test_clipping_off_equals_vanilla_deepspeed_fault_free_and_with_a_failure(holdout):
    assert _max_diff(holdout, "vanilla clip0", "ours clip0") <= TOL
    assert _max_diff(holdout, "ours clip0", "ours clip0 failed") <= TOL
    van = holdout[0]["vanilla clip0"]["losses"]
    assert holdout[0]["ours clip0"]["losses"] == pytest.approx(van, rel=1e-5)
