"""The executor in one process: activation recomputation, the no-gradient guard, and the data
iterator source that once looped forever after a checkpoint load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_resilience.errors import ResilienceError
from ds_resilience.ir import Action, ActionKind
from ds_resilience.runtime.executor import Executor, StageSpec


class Stage(nn.Module):
    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)
        self.detach = detach

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x.float())))
        out = self.b(h)
        return out.detach() if self.detach else out


def _executor(module, *, recompute=None):
    batches = {m: (torch.randn(4, 6, generator=torch.Generator().manual_seed(m)), torch.randn(4, 3)) for m in range(3)}
    return Executor(StageSpec(stage=0, pipeline=0, num_stages=1, dp=1, microbatches=3, seed=7),
                    module=module, parameters=[p for p in module.parameters()],
                    loss_fn=lambda out, y: (out - y).pow(2).mean(), batch_source=lambda p, i, m: batches[m],
                    rank_of=lambda i: 0, step=lambda: None, recompute=recompute)


def _run(executor, split: bool) -> list[torch.Tensor]:
    executor.begin_iteration(0)
    for m in range(3):
        executor.forward(Action(kind=ActionKind.F, stage=0, microbatch=m, pipeline=0))
        if split:
            executor.backward_input(Action(kind=ActionKind.B, stage=0, microbatch=m, pipeline=0))
        else:
            executor.backward_fused(Action(kind=ActionKind.BW, stage=0, microbatch=m, pipeline=0))
    if split:
        for m in range(3):
            executor.backward_weight(Action(kind=ActionKind.W, stage=0, microbatch=m, pipeline=0))
    return [p.grad.clone() for p in executor.parameters]


@pytest.mark.parametrize("split", [False, True])
def test_stage_recomputation_gives_the_gradients_of_the_plain_backward_bitwise(split):
    """Activation checkpointing at stage granularity: F under no_grad, B recomputes the forward under
    the micro-batch's own RNG stream (same dropout mask) and splits as usual."""
    plain = _run(_executor(Stage()), split)
    module = Stage()
    ex = _executor(module, recompute=module)
    recomputed = _run(ex, split)
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)
    assert ex.stats.losses == 3  # the loss is counted once per micro-batch, at F, not again in B


def test_a_stage_whose_parameters_get_no_gradient_is_an_error_not_silence():
    ex = _executor(Stage(detach=True))
    ex.begin_iteration(0)
    ex.forward(Action(kind=ActionKind.F, stage=0, microbatch=0, pipeline=0))
    ex.backward_fused(Action(kind=ActionKind.BW, stage=0, microbatch=0, pipeline=0))
    with pytest.raises(ResilienceError, match="none of the stage's 4 trainable parameters received a gradient"):
        ex.reduce_grads(Action(kind=ActionKind.REDUCE_GRAD, stage=0))


def test_the_iterator_source_survives_a_checkpoint_load_and_never_loops():
    """After load_checkpoint the step count goes back; the source once waited forever there for a
    micro-batch index it had already passed. It reads each iteration's micro-batches afresh, keeps
    them for a replay, and refuses a micro-batch it cannot serve."""
    from ds_resilience.integrations.ds_stage import IteratorSource

    items = iter(range(1000))
    engine = SimpleNamespace(me=SimpleNamespace(pipeline=0), data_iterator=items)
    source = IteratorSource(engine, microbatches=4)
    assert [source(0, 5, m) for m in range(4)] == [0, 1, 2, 3]
    assert source(0, 5, 2) == 2  # a replay of the same iteration reads the same micro-batch
    assert [source(0, 3, m) for m in range(4)] == [4, 5, 6, 7]  # back to step 3 after a load
    assert source(0, 4, 3) == 11  # an iteration that begins at its last micro-batch reads up to it
    with pytest.raises(ResilienceError, match="an iteration has 4"):
        source(0, 4, 4)
    with pytest.raises(ResilienceError, match="batch_source"):
        source(1, 4, 0)


def test_a_rollback_restores_the_fp32_masters_not_only_the_low_precision_weights():
    """Under bf16 the optimizer steps fp32 masters; a rollback that restored only the bf16 weights
    would leave the masters one step ahead, and the next step would silently build on them."""
    from ds_resilience.checkpoint.state import apply, capture
    from ds_resilience.runtime.precision import MixedPrecisionOptimizer

    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    params = list(model.parameters())
    opt = MixedPrecisionOptimizer(torch.optim.Adam(params, lr=1e-2), params)

    class Host:
        parameters, optimizer, lr_scheduler = params, opt, None
        steps, samples = 0, 0

        def counters(self):
            return self.steps, self.samples

        def set_counters(self, steps, samples):
            self.steps, self.samples = steps, samples

    host = Host()

    def step():
        model(torch.randn(3, 8).to(torch.bfloat16)).float().pow(2).sum().backward()
        opt.accumulate()
        opt.step()
        opt.zero_grad()
        host.steps += 1

    step()
    before = capture(host, stage=0, rank=0).clone()
    masters = [m.detach().clone() for m in opt.masters]
    step()
    assert any(not torch.equal(m, b) for m, b in zip(opt.masters, masters))
    apply(before, host, stage=0)
    assert all(torch.equal(m, b) for m, b in zip(opt.masters, masters)), "the fp32 masters were not rolled back"
    assert all(torch.equal(p, b.to(p.dtype)) for p, b in zip(params, masters))
    assert opt.masters[0].dtype == torch.float32 and params[0].dtype == torch.bfloat16


@pytest.mark.parametrize("fast", [True, False])
def test_resilience_fast_w_reaches_the_split(monkeypatch, fast):
    """``resilience.fast_w: false`` (the engine sets ``executor.fast_w``) sends every W through
    autograd, so hooks on a parameter's gradient-accumulator node fire; the gradients are the same."""
    from ds_resilience.config import ResilienceConfig
    from ds_resilience.runtime import executor as executor_module

    seen = []
    real = executor_module.backward_input

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fast_linear"))
        return real(*args, **kwargs)

    monkeypatch.setattr(executor_module, "backward_input", spy)
    ex = _executor(Stage())
    ex.fast_w = ResilienceConfig.from_dict({"fast_w": fast}).fast_w
    grads = _run(ex, split=True)
    assert seen == [fast] * 3
    assert all(torch.equal(a, b) for a, b in zip(grads, _run(_executor(Stage()), split=False)))


def test_an_evaluation_sums_each_pipelines_losses_as_its_own_last_stage_would():
    """A worker that evaluates a failed peer's micro-batches too: each pipeline's losses are summed
    in micro-batch order in their dtype, as that pipeline's last stage sums them fault-free, and
    only then the pipelines' sums, in float64. One float32 running sum over both pipelines' values
    (in the order they ran, interleaved) rounds differently, and the mean printed to 6 decimals
    then differs from the fault-free run's."""
    from ds_resilience.runtime.executor import EvalResult

    gen = torch.Generator().manual_seed(0)
    losses = {p: [torch.tensor(2.0 + torch.rand(1, generator=gen).item() * 1e-3) for _ in range(4)] for p in (0, 1)}
    result = EvalResult()
    for m in (3, 1, 0, 2):  # whatever order the schedule ran them in
        for p in (1, 0):
            result.by_pipeline.setdefault(p, {})[m] = losses[p][m]
    fault_free = []
    for p in (0, 1):  # each pipeline's own last stage: its 4 values in micro-batch order, float32
        acc = losses[p][0].clone()
        for v in losses[p][1:]:
            acc = acc + v
        fault_free.append(acc.to(torch.float64))
    assert torch.equal(result.total, fault_free[0] + fault_free[1])
    assert result.total.dtype == torch.float64
    assert EvalResult().total is None
