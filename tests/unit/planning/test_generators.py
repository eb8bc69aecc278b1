"""Fault-free generators: 1F1B matches DeepSpeed and its closed-form bubble; decoupled cuts it to a third."""

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError
from ds_resilience.ir import ActionKind
from ds_resilience.planning import decoupled, generate, one_f_one_b, one_f_one_b_order
from ds_resilience.ir import simulate

GRID = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]


@pytest.mark.parametrize("pp,m", GRID)
def test_1f1b_bubble_ratio_closed_form(pp, m):
    t = simulate(one_f_one_b(2, pp, m))
    assert t.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert t.makespan == pytest.approx(3 * (m + pp - 1))


@pytest.mark.parametrize("pp,m", GRID)
def test_decoupled_bubble_at_most_a_third_and_memory_no_higher(pp, m):
    a = simulate(one_f_one_b(2, pp, m))
    b = simulate(decoupled(2, pp, m))
    idle_a = a.bubble_ratio * a.makespan
    idle_b = b.bubble_ratio * b.makespan
    assert idle_b <= idle_a / 3 + 1e-9
    assert all(x <= y for x, y in zip(b.stage_peak_activations(2, pp), a.stage_peak_activations(2, pp)))
    # W really is split off and deferred somewhere (not fused back into BW).
    kinds = {x.kind for w in decoupled(2, pp, m).workers for x in w}
    assert ActionKind.BW not in kinds and ActionKind.W in kinds


def _deepspeed_order(stage, pp, m):
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    sched = TrainSchedule(micro_batches=m, stages=pp, stage_id=stage)
    out = []
    for step, cmds in enumerate(sched.steps()):
        mb, _ = sched._step_to_micro_batch(step)
        for c in cmds:
            if isinstance(c, ForwardPass):
                out.append(("F", mb))
            elif isinstance(c, BackwardPass):
                out.append(("B", mb))
    return out


@pytest.mark.parametrize("pp,m", [(p, m) for p in range(2, 5) for m in range(p, 3 * p + 1)])
def test_1f1b_order_equals_deepspeed_train_schedule(pp, m):
    schedule = one_f_one_b(2, pp, m)
    for stage in range(pp):
        expected = _deepspeed_order(stage, pp, m)
        assert one_f_one_b_order(stage, pp, m) == expected
        for p in range(2):
            got = [
                ("F" if a.kind is ActionKind.F else "B", a.microbatch)
                for a in schedule.workers[schedule.index_of(p, stage)]
                if a.kind.is_compute
            ]
            assert got == expected


def test_reference_case_figures():
    a = simulate(generate("1f1b", 3, 4, 6))
    b = simulate(generate("decoupled", 3, 4, 6))
    assert a.makespan == 27
    assert round(a.bubble_ratio, 3) == 0.333
    assert b.bubble_ratio <= 0.143


def test_decoupled_follows_costs():
    # With an expensive W, deferring it still keeps the makespan at or below 1F1B's.
    cost = CostModel(t_f=(1.0,), t_b=(1.0,), t_w=(2.0,))
    a = simulate(one_f_one_b(1, 4, 8), cost)
    b = simulate(decoupled(1, 4, 8, cost), cost)
    assert b.makespan < a.makespan


@pytest.mark.parametrize("bad", [(0, 2, 2), (1, 0, 2), (1, 2, 0)])
def test_bad_grid(bad):
    with pytest.raises(PlanningError):
        one_f_one_b(*bad)


def test_unknown_schedule_name():
    with pytest.raises(PlanningError, match="allowed: 1f1b, decoupled"):
        generate("gpipe", 1, 2, 2)
