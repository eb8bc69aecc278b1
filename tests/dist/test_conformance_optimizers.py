"""Conformance, optimizers: every optimizer DeepSpeed gives a pipeline engine trains as vanilla
DeepSpeed's, and through a simulated failure exactly as our own fault-free run.

The config's sections: ``"Adam"`` as DeepSpeed's own pipeline tests write it (no ``torch_adam``:
DeepSpeed's FusedAdam, a JIT-built op on CPU), ``"Adam"`` with ``torch_adam``, ``"AdamW"``
(FusedAdam in AdamW mode), ``"SGD"``, ``"Adagrad"``; and a client's ``optimizer=``: a
``torch.optim`` object, a callable DeepSpeed calls with the parameters, and a
``torch.optim.Optimizer`` subclass whose ``zero_grad(self)`` takes no argument and whose
``step(self)`` takes no closure (as FusedLion's and FusedLamb's, which do not run on CPU).
Clipping is off for exactness against vanilla; DeepSpeed's default clipping (1.0) is checked once,
with FusedAdam, against our own fault-free run (vanilla clips a pipeline by its first stage's norm
alone, see docs/deepspeed.md, "Switching from deepspeed.initialize").

Before 5d30b83, FusedAdam (``"Adam"`` without ``torch_adam``, ``"AdamW"``) and the bare subclass
failed in their first step: ``zero_grad()`` was called with ``set_to_none``.
"""

from __future__ import annotations

import pytest

from conformance_programs import run_case
from dist_harness import run_workers
from test_conformance import WORLD, assert_same_params, assert_same_training

# name -> the optimizer class the engine must then hold ("Adam" is AdamW unless adam_w_mode is false)
EXPECTED = {"ds_adam": "FusedAdam", "adam": "AdamW", "adamw": "FusedAdam", "sgd": "SGD", "adagrad": "Adagrad",
            "client_object": "AdamW", "client_callable": "RMSprop", "client_bare": "BareMomentum"}


@pytest.mark.timeout(500)
def test_every_optimizer_trains_as_vanilla_and_through_a_failure_as_fault_free():
    variants = {}
    for i, name in enumerate(EXPECTED):
        variants[name] = {"optimizer": name}
        # a failed worker on the first stage or on the last, by turns
        variants[f"{name}-failed"] = {"optimizer": name, "engines": ["resilient"], "failed": ["1:1" if i % 2 else "0:0"]}
    clip = {"optimizer": "ds_adam", "clip": 1.0, "engines": ["resilient"], "steps": 5}
    variants["clip"] = clip
    variants["clip-failed"] = {**clip, "failed": ["1:0"]}
    # a limit the norms cross both ways: steps speculated, rolled back (FusedAdam's state and step
    # count restored) and waited for
    variants["clip1.5"] = {**clip, "clip": 1.5, "steps": 8}
    variants["clip1.5-barrier"] = {**clip, "clip": 1.5, "steps": 8, "resilience": {"clipping": "barrier"}}
    results = run_workers(run_case, WORLD, args=({"model": "gpt", "pp": 2, "steps": 3, "variants": variants},),
                          timeout_s=450)
    for name, cls in EXPECTED.items():
        for r in results:
            for key in (f"{name}/vanilla", f"{name}/resilient", f"{name}-failed/resilient"):
                if r[key]["alive"]:
                    assert r[key]["optimizer"] == cls, (key, r[key]["optimizer"])
        assert_same_training(results, f"{name}/vanilla", f"{name}/resilient")
        assert_same_params(results, f"{name}/resilient", f"{name}-failed/resilient")
        for r in results:
            if r[f"{name}-failed/resilient"]["alive"]:
                assert r[f"{name}-failed/resilient"]["losses"] == pytest.approx(r[f"{name}/resilient"]["losses"],
                                                                                rel=1e-5)
    # DeepSpeed's default clipping with FusedAdam: a failure changes nothing (Adam's step is about lr
    # whatever the gradient's size: where a gradient is near eps, a failure's other summation order
    # moves it by a little more than a 1e-7 atol)
    assert_same_params(results, "clip/resilient", "clip-failed/resilient", atol=1e-6)
    counts = [r["clip/resilient"]["validation"] for r in results]
    # every step decided exactly, at once (the stage that publishes last: "ready") or after a wait
    # or a rollback; the norm stays above 1.0, so the stages that publish first never keep a speculation
    assert all(sum(c.values()) == 5 and c["waited"] + c["rolled back"] + c["ready"] == 5 for c in counts), counts
    assert any(c["waited"] + c["rolled back"] for c in counts), counts
    # the speculative steps and their rollbacks (and the steps taken at once when every stage's norm
    # was in) equal the barrier's bitwise
    assert_same_params(results, "clip1.5-barrier/resilient", "clip1.5/resilient", rtol=0, atol=0)
    counts = [r["clip1.5/resilient"]["validation"] for r in results]
    assert all(sum(c.values()) == 8 for c in counts), counts
    assert any(c["speculated"] and c["rolled back"] for c in counts), counts
