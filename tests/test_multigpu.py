"""GPU tests (skipped with a reason where the GPUs are missing; CI has none): NCCL groups, the
pair order under NCCL's real rules, abort as the release of a blocked wait, and the B/W split on
CUDA. Run them on a machine with the GPUs: ``pytest -c tests/pytest.ini tests/test_multigpu.py``."""

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
