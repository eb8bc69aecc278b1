"""The resilient engine on real processes (gloo over loopback), against vanilla DeepSpeed.

Every job runs several scenarios one after the other in the same processes and compares the
parameters each rank ends with: the resilient engine must reproduce vanilla DeepSpeed's training
exactly (up to summation order), whatever schedule it runs and whichever workers it routes around.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers
from engine_programs import train_scenarios


def by_stage(results, scenario):
    """stage -> parameters of any alive replica of that stage in ``scenario``."""
    out = {}
    for rank_result in results:
        r = rank_result[scenario]
        if r["alive"]:
            out.setdefault(r["stage"], r["params"])
    return out


def assert_params_close(results, a, b, *, rtol, atol=0.0):
    pa, pb = by_stage(results, a), by_stage(results, b)
    assert set(pa) == set(pb), f"{b} lost a whole stage"
    for stage in pa:
        for name, ta in pa[stage].items():
            tb = pb[stage][name]
            assert torch.allclose(ta, tb, rtol=rtol, atol=atol), (
                f"{a} vs {b}: stage {stage} {name} differs by {(ta - tb).abs().max().item():.3e}"
            )


def assert_replicas_agree(results, scenario, *, rtol):
    """All alive replicas of a stage hold the same parameters (the reduce really happened)."""
    seen = {}
    for rank_result in results:
        r = rank_result[scenario]
        if not r["alive"]:
            continue
        if r["stage"] in seen:
            for name, t in r["params"].items():
                assert torch.allclose(t, seen[r["stage"]][name], rtol=rtol, atol=0), f"{scenario}: replicas disagree on {name}"
        else:
            seen[r["stage"]] = r["params"]


def losses_of(results, scenario):
    for rank_result in results:
        r = rank_result[scenario]
        if r["alive"] and r["losses"] and r["losses"][0] is not None:
            return r["losses"]
    raise AssertionError(f"no losses for {scenario}")


def assert_matching(results, scenario, matching):
    """Every alive rank ran ``scenario`` with ``matching``; NCCL's FIFO rule needed early receive
    posts somewhere (1F1B's steady state crosses an activation and a gradient on each pair)."""
    alive = [r[scenario] for r in results if r[scenario]["alive"]]
    assert {r["matching"] for r in alive} == {matching}
    assert sum(r["early_posts"] for r in alive) > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("pp,world,matching", [(2, 4, "tags"), (3, 3, "tags"), (2, 4, "fifo")])
def test_fault_free_matches_vanilla_deepspeed(pp, world, matching):
    """``fifo``: the p2p messages matched as NCCL matches them (tags ignored, in posting order)."""
    scenarios = [
        {"name": "vanilla", "engine": "vanilla"},
        {"name": "1f1b", "engine": "resilient", "schedule": "1f1b"},
        {"name": "decoupled", "engine": "resilient", "schedule": "decoupled"},
    ]
    results = run_workers(train_scenarios, world, args=(pp, 4, scenarios), timeout_s=380,
                          env={"DSR_P2P_MATCHING": matching})
    assert_matching(results, "decoupled", matching)
    v, r = losses_of(results, "vanilla"), losses_of(results, "1f1b")
    assert r == pytest.approx(v, rel=1e-5)
    assert v[-1] < v[0]  # it trains
    assert_params_close(results, "vanilla", "1f1b", rtol=1e-5, atol=1e-7)
    assert_params_close(results, "1f1b", "decoupled", rtol=1e-5, atol=1e-7)
    assert_replicas_agree(results, "decoupled", rtol=1e-6)


RE_ROUTED = [
    {"name": "first", "failed": ["1:0"]},
    {"name": "middle", "failed": ["0:1"]},
    {"name": "last", "failed": ["1:2"]},
    {"name": "two", "failed": ["0:0", "1:2"]},
]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("matching", ["tags", "fifo"])
def test_rerouting_is_exact_fp32(matching):
    scenarios = [{"name": "healthy", "engine": "resilient", "schedule": "1f1b", "optimizer": "sgd"}]
    for variant in ("recycle", "adaptive"):
        for case in RE_ROUTED:
            scenarios.append(
                {"engine": "resilient", "variant": variant, "optimizer": "sgd", **case, "name": f"{variant}-{case['name']}"}
            )
    results = run_workers(train_scenarios, 6, args=(3, 3, scenarios), timeout_s=480, env={"DSR_P2P_MATCHING": matching})
    assert_matching(results, "recycle-two", matching)
    for sc in scenarios[1:]:
        assert_params_close(results, "healthy", sc["name"], rtol=1e-5, atol=1e-7)
        assert_replicas_agree(results, sc["name"], rtol=1e-6)
        assert losses_of(results, sc["name"]) == pytest.approx(losses_of(results, "healthy"), rel=1e-5)
    # the failed workers really ran nothing and their peers ran extra micro-batches
    for rank_result in results:
        r = rank_result["recycle-middle"]
        if not r["alive"]:
            assert (r["pipeline"], r["stage"]) == (0, 1)
        elif r["stage"] == 1:
            assert r["stats"][0]["rerouted"] == 3 and r["stats"][0]["forwards"] == 6


@pytest.mark.timeout(400)
def test_rerouting_is_exact_fp64():
    scenarios = [{"name": "healthy", "engine": "resilient", "schedule": "1f1b", "optimizer": "sgd"}]
    scenarios += [{"engine": "resilient", "variant": "recycle", "optimizer": "sgd", **c, "name": c["name"]} for c in RE_ROUTED[1:]]
    results = run_workers(train_scenarios, 6, args=(3, 3, scenarios, 3, "float64", 3), timeout_s=380)
    for sc in scenarios[1:]:
        assert_params_close(results, "healthy", sc["name"], rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(400)
def test_staggered_optimizer_with_global_norm_clipping_equals_a_global_step():
    """Per-stage steps with clipping by the norm over all stages equal one global step.

    Vanilla DeepSpeed 0.19.8 is not the reference here: with pipeline parallelism its
    clip_grad_norm_ counts only model-parallel rank 0's parameters, i.e. the first stage's
    gradients (see docs/deepspeed.md, "Switching from deepspeed.initialize"), so its "global" norm is not the global norm.
    """
    clip = 0.02  # small enough that every step clips
    sgd = {"optimizer": "sgd"}
    scenarios = [
        {"name": "global", "engine": "resilient", "schedule": "1f1b", "clip": clip, **sgd},
        {"name": "staggered", "engine": "resilient", "variant": "recycle", "failed": ["1:1"], "clip": clip, **sgd},
        {"name": "staggered-decoupled", "engine": "resilient", "schedule": "decoupled", "clip": clip, **sgd},
        {"name": "noclip", "engine": "resilient", "schedule": "1f1b", **sgd},
    ]
    results = run_workers(train_scenarios, 4, args=(2, 4, scenarios), timeout_s=380)
    assert_params_close(results, "global", "staggered", rtol=1e-5, atol=1e-7)
    assert_params_close(results, "global", "staggered-decoupled", rtol=1e-5, atol=1e-7)
    # clipping was active: without it training goes elsewhere
    with pytest.raises(AssertionError):
        assert_params_close(results, "global", "noclip", rtol=1e-5, atol=1e-7)
    # and the plans were rated with the step check the engine ran (speculation), not without one
    assert {r["staggered"]["step_check"] for r in results} == {"speculative"}
    assert {r["noclip"]["step_check"] for r in results} == {"none"}


@pytest.mark.timeout(400)
def test_config_keys_that_choose_the_engine_and_the_schedule_source_are_honoured(tmp_path):
    """``enabled: false`` is DeepSpeed's own engine; a simulated failure set within ``max_failures``
    takes its schedule from the plan table (built in ``planner.cache_dir``), one beyond it from the
    planner; both schedules train the same parameters."""
    cache = str(tmp_path / "plans")
    scenarios = [
        {"name": "vanilla", "engine": "vanilla"},
        {"name": "disabled", "engine": "resilient", "enabled": False},
        {"name": "table", "engine": "resilient", "failed": ["1:1"], "optimizer": "sgd", "max_failures": 1,
         "planner": {"cache_dir": cache}},
        {"name": "planner", "engine": "resilient", "failed": ["1:1"], "optimizer": "sgd", "max_failures": 0,
         "planner": {"cache_dir": cache}},
    ]
    results = run_workers(train_scenarios, 4, args=(2, 4, scenarios), timeout_s=380)
    assert {r["disabled"]["engine_class"] for r in results} == {"PipelineEngine"}
    assert_params_close(results, "vanilla", "disabled", rtol=0, atol=0)
    assert {r["table"]["schedule_source"] for r in results} == {"table"}
    assert {r["planner"]["schedule_source"] for r in results} == {"planner"}
    assert_params_close(results, "table", "planner", rtol=1e-6, atol=1e-8)
    import pathlib

    assert list(pathlib.Path(cache).glob("plans-*.json.gz")), "the plan table is cached where the config says"
