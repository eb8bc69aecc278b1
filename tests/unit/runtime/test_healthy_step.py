"""The healthy path's optimizer step (issue 45): the gradient norm without a float64 copy, the
"ready" step of the stage that publishes its norm last, the pre-step copy only where a step may be
undone, and the re-plan after the self-profile without the CP-SAT solver."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ds_resilience.ir import Action, ActionKind
from ds_resilience.runtime.executor import Executor, ExecutorHooks, StageSpec, squared_norm
from ds_resilience.runtime.validation import StepValidator, clip_coefficient


def test_the_squared_norm_is_the_float64_sum_up_to_float32_rounding_and_deterministic():
    torch.manual_seed(0)
    grads = [torch.randn(1000, 37), torch.randn(5), torch.randn(3, 3, 7) * 1e-4]
    reference = sum(float(g.double().pow(2).sum()) for g in grads)
    assert squared_norm(grads) == pytest.approx(reference, rel=1e-6)
    assert squared_norm(grads) == squared_norm([g.clone() for g in grads])  # the same bits each time
    assert squared_norm([]) == 0.0


def test_a_float32_overflow_of_finite_values_is_summed_in_float64_and_a_real_inf_stays_inf():
    big = torch.full((4,), 1e30)  # finite, but its float32 square overflows
    assert math.isfinite(squared_norm([big, torch.ones(3)]))
    assert squared_norm([big, torch.ones(3)]) == pytest.approx(4e60 + 3, rel=1e-6)
    assert squared_norm([torch.tensor([1.0, math.inf])]) == math.inf
    assert math.isnan(squared_norm([torch.tensor([1.0, math.nan])]))


class RecordingHooks(ExecutorHooks):
    """Records the executor's before_step calls; an undo restores a copy taken at a speculative step."""

    def __init__(self, params) -> None:
        self.params = params
        self.calls: list[bool] = []
        self.saved = None

    def before_step(self, speculative: bool = False) -> None:
        self.calls.append(speculative)
        self.saved = [p.detach().clone() for p in self.params] if speculative else None

    def undo_step(self) -> None:
        assert self.saved is not None, "undo without a pre-step copy"
        with torch.no_grad():
            for p, s in zip(self.params, self.saved):
                p.copy_(s)


def _stage(clip: float, store: dict, lr: float = 0.5):
    """Stage 0 of a 2-stage job, run in one process: its own forward/backward, SGD, a validator
    over ``store`` (stage 1's value is put there by the test)."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)

    def step(zero_grad: bool = True, skip: bool = False) -> None:
        if not skip:
            opt.step()

    v = StepValidator(clip=clip, check_overflow=False, num_stages=2, key=lambda i, s: f"{i}/{s}",
                      publish=store.__setitem__, wait=lambda k: store[k].encode(), delete=lambda k: store.pop(k, None),
                      peek=lambda k: store[k].encode() if k in store else None)
    hooks = RecordingHooks(params)
    x, y = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)), torch.randn(4, 3)
    ex = Executor(StageSpec(stage=0, pipeline=0, num_stages=1, dp=1, microbatches=1, gradient_clipping=clip),
                  module=model, parameters=params, loss_fn=lambda out, t: (out - t).pow(2).mean() * 0.1,
                  batch_source=lambda p, i, m: (x, y), rank_of=lambda i: 0, step=step, hooks=hooks, validator=v)
    return ex, v, hooks, params


def _iteration(ex: Executor, iteration: int) -> None:
    ex.begin_iteration(iteration)
    ex.forward(Action(kind=ActionKind.F, stage=0, microbatch=0, pipeline=0))
    ex.backward_fused(Action(kind=ActionKind.BW, stage=0, microbatch=0, pipeline=0))
    ex.optimizer_step(Action(kind=ActionKind.OPT_STEP, stage=0))


def _exact(clip: float, other_sq: float) -> list[torch.Tensor]:
    """The globally clipped SGD step, computed by hand."""
    ex, _, _, params = _stage(clip, {})
    ex.begin_iteration(0)
    ex.forward(Action(kind=ActionKind.F, stage=0, microbatch=0, pipeline=0))
    ex.backward_fused(Action(kind=ActionKind.BW, stage=0, microbatch=0, pipeline=0))
    norm = math.sqrt(squared_norm([p.grad for p in params]) + other_sq)
    coef = clip_coefficient(norm, clip)
    return [(p - 0.5 * p.grad * coef).detach() for p in params]


@pytest.mark.parametrize("other_sq", [0.0, 1e4])  # the other stage's share: no clipping / clipping
def test_the_stage_that_publishes_last_steps_exactly_at_once_without_a_pre_step_copy(other_sq):
    store: dict = {}
    ex, v, hooks, params = _stage(1.0, store)
    v.publish(0, 1, other_sq, False)  # stage 1 published first
    _iteration(ex, 0)
    assert v.ready_steps == 1 and v.speculated == v.rollbacks == v.waited == 0
    assert ex.pending is None  # nothing left to validate
    assert hooks.calls == [False]  # a step no one may undo: no copy asked for
    for p, e in zip(params, _exact(1.0, other_sq)):
        assert torch.equal(p.detach(), e)
    assert ex.last_grad_norm is not None


def test_a_stage_that_publishes_first_speculates_with_a_copy_and_its_rollback_is_the_exact_step():
    store: dict = {}
    ex, v, hooks, params = _stage(1.0, store)
    _iteration(ex, 0)  # stage 1 has not published: speculate
    assert ex.pending == 0 and hooks.calls == [True] and v.ready_steps == 0
    v.publish(0, 1, 1e4, False)  # then it does, with a norm that needs clipping
    ex.resolve()
    assert v.rollbacks == 1
    for p, e in zip(params, _exact(1.0, 1e4)):
        assert torch.equal(p.detach(), e)


def test_the_ready_path_is_off_where_replicas_must_choose_alike():
    store: dict = {}
    ex, v, hooks, _ = _stage(1.0, store)
    ex.ready_path = False  # ZeRO-1 (ds_engine)
    v.publish(0, 1, 0.0, False)
    _iteration(ex, 0)
    assert v.ready_steps == 0 and ex.pending == 0 and hooks.calls == [True]


def test_the_tier_copies_the_pre_step_state_only_for_a_step_that_may_be_undone():
    from ds_resilience.checkpoint.tier import CheckpointTier

    params = [nn.Parameter(torch.randn(3))]
    opt = torch.optim.SGD(params, lr=0.1)

    class Host:
        parameters, optimizer, lr_scheduler = params, opt, None
        steps, samples = 0, 0

        def counters(self):
            return self.steps, self.samples

        def set_counters(self, steps, samples):
            self.steps, self.samples = steps, samples

    quiet = CheckpointTier(Host(), stage=0, rank=0, keep_pre_step=False)
    quiet.before_step()
    assert quiet._pre_step is None  # an exact step without live handling: no copy
    quiet.before_step(speculative=True)
    assert quiet._pre_step is not None
    live = CheckpointTier(Host(), stage=0, rank=0, keep_pre_step=True)
    live.before_step()
    assert live._pre_step is not None  # under live handling a recovery may roll back any step


def test_the_re_plan_after_the_profile_never_runs_the_cp_sat_solver(monkeypatch, tmp_path):
    """The re-plan's table is adopted an iteration after the profile, waited for there if need be
    (``ds_plans.BackgroundReplan``): CP-SAT (10 s per failure set) stopped a 4-rank job for 12-24 s
    when it planned on the training thread. A call into it now fails the test."""
    from ds_resilience.config import ResilienceConfig
    from ds_resilience.costs import CostModel
    from ds_resilience.integrations import ds_plans
    from ds_resilience.planning import cpsat
    from ds_resilience.topology import Topology

    def forbidden(*a, **k):
        raise AssertionError("the re-plan called CP-SAT")

    monkeypatch.setattr(cpsat, "improve", forbidden)
    config = ResilienceConfig.from_dict({"planner": {"solver": "cpsat", "cache_dir": str(tmp_path)}})
    settings = ds_plans.PlanSettings(config=config, topology=Topology(dp=2, pp=2), microbatches=4, tied=(),
                                     clipping=True, fp16=False)
    plans = ds_plans.EnginePlans(settings, rank=0, scope="local", coordinator=None, fire=lambda *a: None,
                                 step=lambda: 5)
    build = lambda: plans.build(1, cost=CostModel.unit(), solver=ds_plans.REPLAN_SOLVER)  # what the engine starts
    replan = ds_plans.BackgroundReplan(build, CostModel.unit(), rank=0, due=7, before=None, steps=lambda: 7,
                                       reporter=lambda: False).start()
    adopted = replan.table_at(7)
    assert adopted.solver == "heuristic"
    assert adopted.table is not None and len(adopted.table) > 1  # every failure set planned


def test_a_pre_step_copy_fills_the_last_ones_buffers_and_a_rollback_restores_the_exact_state():
    from ds_resilience.checkpoint.tier import CheckpointTier

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)

    class Host:
        parameters, optimizer, lr_scheduler = params, opt, None
        steps, samples = 0, 0

        def counters(self):
            return self.steps, self.samples

        def set_counters(self, steps, samples):
            self.steps, self.samples = steps, samples

    host = Host()
    tier = CheckpointTier(host, stage=0, rank=0, keep_pre_step=False)

    def step(speculative: bool):
        model(torch.randn(3, 8)).pow(2).sum().backward()
        tier.before_step(speculative=speculative)
        opt.step()
        opt.zero_grad()
        host.steps += 1

    step(True)
    step(True)  # Adam's moments exist now: the copy holds them
    first = tier._pre_step
    buffers = [t.data_ptr() for t in first.params] + [
        v.data_ptr() for s in first.optimizer["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    before = ([p.detach().clone() for p in params],
              {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()})
    step(True)  # the third copy fills the second one's buffers
    again = tier._pre_step
    assert [t.data_ptr() for t in again.params] + [
        v.data_ptr() for s in again.optimizer["state"].values() for v in s.values() if torch.is_tensor(v) and v.dim()
    ] == buffers
    tier.undo_step()
    assert host.steps == 2
    assert all(torch.equal(p, b) for p, b in zip(params, before[0]))
    for k, s in opt.state_dict()["state"].items():
        assert all(torch.equal(v, before[1][k][n]) for n, v in s.items())


def test_clipped_steps_are_counted_whichever_way_they_were_decided():
    store: dict = {}
    ex, v, _, _ = _stage(1.0, store)
    v.publish(0, 1, 1e4, False)
    _iteration(ex, 0)  # ready, clipped
    assert v.ready_steps == 1 and v.clipped == 1
    ex2, v2, _, _ = _stage(1.0, {})
    _iteration(ex2, 0)  # speculated
    v2.publish(0, 1, 0.0, False)
    ex2.resolve()  # held: not clipped
    assert v2.speculated == 1 and v2.clipped == 0
