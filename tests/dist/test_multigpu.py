"""GPU tests (skipped with a reason where the GPUs are missing; CI has none): NCCL groups, the
pair order under NCCL's real rules, abort as the release of a blocked wait, and the B/W split on
CUDA. Run them on a machine with the GPUs: ``pytest -c tests/pytest.ini tests/dist/test_multigpu.py``."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers


@pytest.mark.multigpu(2)
@pytest.mark.timeout(300)
def test_nccl_pair_crossing_runs_with_the_early_post_and_abort_releases_a_wait():
    from multigpu_programs import nccl_crossing_and_abort

    results = run_workers(nccl_crossing_and_abort, 2, timeout_s=240)
    assert results[0]["backend"] == "nccl" and results[0]["matching"] == "fifo"
    assert results[0]["grads"] == [10.0, 11.0]
    assert results[1]["acts"] == [0.0, 1.0, 2.0]
    assert results[1]["released"] is not None and results[1]["released"] < 10.0, results[1]


@pytest.mark.gpu
def test_bw_split_on_cuda_equals_autograd():
    """B then W (the fast linear W included) give the bits of one autograd backward on the GPU."""
    from ds_resilience.runtime.bw_split import backward_input, backward_weight

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 64)).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    y.backward(g)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_x = x.grad.clone()
    for p in model.parameters():
        p.grad = None
    x2 = x.detach().clone().requires_grad_(True)
    y2 = model(x2)
    (dx,), pending = backward_input(y2, g, (x2,), list(model.parameters()))
    backward_weight(pending)
    torch.cuda.synchronize()
    assert torch.equal(dx, ref_x)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n


@pytest.mark.multigpu(4)
@pytest.mark.timeout(900)
def test_pp2_dp2_bf16_on_nccl_matches_vanilla_and_reroutes_exactly():
    """PP=2 x DP=2 on 4 GPUs over NCCL in bf16: this engine's 1F1B equals vanilla DeepSpeed, and a
    re-routed run (worker 1:1 idle) equals the fault-free one (SGD: summation order only)."""
    from engine_programs import train_scenarios
    from test_engine import assert_params_close, losses_of

    scenarios = [
        {"name": "vanilla", "engine": "vanilla", "bf16": True},
        {"name": "1f1b", "engine": "resilient", "schedule": "1f1b", "bf16": True},
        {"name": "healthy", "engine": "resilient", "schedule": "1f1b", "optimizer": "sgd", "bf16": True},
        {"name": "rerouted", "engine": "resilient", "variant": "recycle", "optimizer": "sgd", "bf16": True,
         "failed": ["1:1"]},
    ]
    results = run_workers(train_scenarios, 4, args=(2, 4, scenarios), timeout_s=850, env={"DSR_TEST_BACKEND": "nccl"})
    assert losses_of(results, "1f1b") == pytest.approx(losses_of(results, "vanilla"), rel=1e-2)
    assert_params_close(results, "vanilla", "1f1b", rtol=1e-2, atol=1e-3)
    assert_params_close(results, "healthy", "rerouted", rtol=1e-2, atol=1e-3)
    for r in results:
        if r["rerouted"]["alive"]:
            assert r["rerouted"]["matching"] == "fifo"  # NCCL groups


@pytest.mark.multigpu(4)
@pytest.mark.timeout(900)
def test_megatron_resilient_pp2_dp2_on_nccl_matches_megatron_cores_own_schedule(tmp_path):
    """megatron-core's GPTModel on its CUDA path: the reference trains on one GPU with megatron-core's
    own forward_backward_func; the resilient forward-backward trains PP=2 x DP=2 on four GPUs over
    NCCL, fault-free and with replica p1s0 idle (re-routed); both end at the reference's weights."""
    import megatron_programs as mp

    init = str(tmp_path / "init.pt")
    ref = run_workers(mp.reference, 1, args=(init, 3, 2, 4, 0.6, "sgd", "cuda"), timeout_s=400)[0]
    for failed in ([], ["1:0"]):
        results = run_workers(mp.pipelined, 4, args=(init, 3, 2, 4, 0.6, failed, True, "recycle", 1, "sgd", "cuda"),
                              timeout_s=400)
        for r in results:
            if r["results"][0] is None:
                continue
            for name, value in r["params"].items():
                assert torch.allclose(value, ref["params"][name], rtol=1e-4, atol=1e-5), (failed, name)
