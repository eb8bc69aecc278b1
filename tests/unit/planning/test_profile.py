"""The profile: rows measured on the ranks -> one cost model; the engine's profile iterations are
real training; ``ds-resilience profile`` writes a model the planner plans with."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
import sys

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import CostModelError
from ds_resilience.planning.memory import resolve_cap
from ds_resilience.planning.planner import plan
from ds_resilience.planning.profile import cost_from_profile, profile_summary
from ds_resilience.topology import Worker

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_live import REPO, SCRIPT, assert_equal_to_reference, logs, run_job  # noqa: E402


def _row(rank, stage, f, b, w, bw, *, state=100, pending=40, act=10, latency=None, bandwidth=None):
    row = {"rank": rank, "stage": stage, "state_bytes": state, "pending_w_bytes": pending, "activation_bytes": act,
           "durations": {"F": f, "B": b, "W": w, "BW": bw, "OPT": [0.5], "RD": [0.25]}}
    if latency:
        row.update(p2p_latency=latency, p2p_bandwidth=bandwidth)
    return row


def test_rows_become_per_stage_medians():
    rows = [_row(0, 0, [1, 2, 9], [1], [2], [2.5], latency=0.1, bandwidth=100.0),
            _row(1, 0, [2, 2], [3], [2], [3.5], state=300, latency=0.3, bandwidth=300.0),
            _row(2, 1, [4], [5], [6], [10.0], act=0, pending=80)]
    cost = cost_from_profile(rows, 2, name="p")
    assert cost.t_f == (2.0, 4.0) and cost.t_b == (2.0, 5.0) and cost.t_w == (2.0, 6.0)
    assert cost.t_opt == (0.5, 0.5) and cost.t_reduce == (0.25, 0.25)
    assert cost.t_fused == (3.0, 10.0) and cost.stage(0).t_bw == 3.0  # fused plans use what was measured
    assert cost.state_bytes == (200.0, 100.0) and cost.pending_w_bytes == (40.0, 80.0)
    assert cost.p2p_latency == pytest.approx(0.2) and cost.p2p_bandwidth == pytest.approx(200.0)
    summary = profile_summary(rows, 2, cost)
    assert summary["measured"]["fused_backward"] == [3.0, 10.0]
    assert summary["measured"]["split_over_fused"] == [pytest.approx(4 / 3), pytest.approx(1.1)]
    # the file form loads back as the same model (the report rides along)
    assert CostModel.from_dict(json.loads(json.dumps(summary))) == cost


def test_the_profiles_noise_sets_the_split_margin_and_changes_the_plan():
    """The profile keeps each iteration's median fused backward and B + W; how far their ratio
    moves between iterations is the model's split_noise, and the planner's margin for keeping a
    fully split schedule over a mixed one. A quiet profile keeps a split predicted 4.7% faster; a
    noisy one, or a model that says nothing of its noise (5%), runs the mixed schedule."""
    from ds_resilience.planning.generators import decoupled, decoupled_candidates
    from ds_resilience.ir.timeline import iteration_time
    from ds_resilience.planning.stage_mix import MARGIN_RANGE, SPLIT_MARGIN, fused_in, split_margin

    rows = [_row(0, 0, [1], [1], [1], [2]), _row(1, 0, [1], [1], [1], [2]), _row(2, 1, [1], [1], [1], [2])]
    rows[0].update(fused_iters=[2.0, 2.0], split_iters=[2.0, 2.2])  # ratios 1.0, 1.1
    rows[1].update(fused_iters=[2.0], split_iters=[2.4])  # 1.2: stage 0 moves +-0.1 around 1.1
    rows[2].update(fused_iters=[4.0, 4.0], split_iters=[4.0, 4.1])  # stage 1: +-0.0125 around 1.0125
    cost = cost_from_profile(rows, 2)
    assert cost.split_noise == pytest.approx(0.1 / 1.1)
    assert CostModel.from_dict(json.loads(json.dumps(profile_summary(rows, 2, cost)))) == cost
    assert cost_from_profile([_row(0, 0, [1], [1], [1], [2]), _row(1, 1, [1], [1], [1], [2])], 2).split_noise is None
    # the margin: the noise, clamped; the fixed one for a model without it
    base = CostModel(name="close-call", t_f=(1.0,), t_b=(1.0,), t_w=(1.1,), t_fused=(2.0,))
    assert split_margin(base) == SPLIT_MARGIN
    assert [split_margin(CostModel(t_f=(1.0,), split_noise=n)) for n in (0.0, 0.03, 0.9)] == [
        MARGIN_RANGE[0], 0.03, MARGIN_RANGE[1]]
    split, mixed = decoupled_candidates(1, 2, 8, base)
    gain = iteration_time(mixed, base, "decoupled") / iteration_time(split, base, "decoupled") - 1
    assert MARGIN_RANGE[0] < gain < SPLIT_MARGIN  # 4.7%
    chosen = {noise: fused_in(decoupled(1, 2, 8, replace(base, split_noise=noise))) for noise in (None, 0.01, 0.2)}
    assert chosen == {None: [0, 1], 0.01: [], 0.2: [0, 1]}
    # the failure plans follow the same margin
    failed = [Worker(pipeline=0, stage=1)]
    plans = {noise: plan(2, 2, 4, failed, cost=replace(base, split_noise=noise), variant="decoupled")
             for noise in (None, 0.01)}
    assert fused_in(plans[None].schedule) == [0, 1] and fused_in(plans[0.01].schedule) == []
    assert plans[0.01].iteration_time < plans[None].iteration_time


def test_incomplete_profiles_are_named():
    with pytest.raises(CostModelError, match=r"no rank reported for stages \[1\]"):
        cost_from_profile([_row(0, 0, [1], [1], [1], [2])], 2)
    with pytest.raises(CostModelError, match=r"t_b was not measured on stages \[0\]"):
        cost_from_profile([_row(0, 0, [1], [], [1], [2])], 1)


def test_the_simulator_reads_a_profile_through_its_ratios(tmp_path, capsys):
    from ds_resilience.cli import main
    from ds_resilience.sim.cli import with_measured_ratios
    from ds_resilience.sim.models import load_model

    slow_w = tmp_path / "slow_w.json"
    slow_w.write_text(json.dumps({"name": "m", "t_f": [1.0, 3.0], "t_b": [2.0, 2.0], "t_w": [4.0, 8.0]}))
    model = with_measured_ratios(load_model("gpt2"), str(slow_w))
    assert model.backward_ratio == pytest.approx(1.0) and model.weight_ratio == pytest.approx(3.0)
    figures = []
    for extra in ([], ["--cost", str(slow_w)]):
        assert main(["simulate", "--mtbf", "2h", "--seed", "1", "--duration", "6h", "--model", "gpt2",
                     "--systems", "ds_resilience", "--json", *extra]) == 0
        figures.append(json.loads(capsys.readouterr().out)["systems"]["ds_resilience"]["throughput"])
    assert figures[0] != figures[1]


def test_self_profile_default_and_opt_outs():
    """profile_steps null profiles 2 steps when no cost model is given; a cost model (a file, an
    inline one, or "unit"), profile_steps 0 or DSR_SELF_PROFILE=0 turn it off; an explicit
    profile_steps is kept whatever the environment says."""
    from ds_resilience.config import ResilienceConfig

    assert ResilienceConfig().self_profile_steps({}) == 2
    assert ResilienceConfig().self_profile_steps({"DSR_SELF_PROFILE": "0"}) == 0
    assert ResilienceConfig(profile_steps=3).self_profile_steps({"DSR_SELF_PROFILE": "0"}) == 3
    assert ResilienceConfig(profile_steps=0).self_profile_steps({}) == 0
    assert ResilienceConfig(cost_model="unit").self_profile_steps({}) == 0
    assert ResilienceConfig(cost_model="unit").cost() == CostModel.unit()
    assert ResilienceConfig(cost_model=str(REPO / "configs" / "costs_gpt_example.json")).self_profile_steps({}) == 0


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_the_profile_alternates_fused_and_decoupled_iterations(steps, monkeypatch):
    """Fused and decoupled iterations take turns after the memory iteration, so a drift over the
    job's first iterations does not fall on the fused backward alone and skew (B + W) / fused,
    which decides the stages the split runs on. Each iteration's timings go to its own kind."""
    from types import SimpleNamespace

    from ds_resilience.integrations import ds_profile
    from ds_resilience.integrations.ds_profile import Profiler
    from ds_resilience.ir import ActionKind
    from ds_resilience.runtime.recovery import Generation
    from ds_resilience.topology import Topology

    topology = Topology(dp=2, pp=2)
    executor = SimpleNamespace(handlers={ActionKind.F: lambda action: None}, parameters=[], is_last=False,
                               count_w_bytes=False, stats=None)
    monkeypatch.setattr(ds_profile.dist, "get_rank", lambda: 0)  # no process group: one rank's driver alone
    engine = SimpleNamespace(topology=topology, tied_groups=(), micro_batches=4, executor=executor, stage_id=0,
                             generation=Generation(epoch=0, topology=topology, schedule=None, source="fault-free",
                                                   lookup_s=0.0, figures=None, groups=None))
    profiler = Profiler(engine, out=None, steps=steps)
    finished = []
    profiler._finish = lambda: finished.append(profiler.iteration)
    kinds = []
    for _ in range(2 * steps + 1):
        profiler.before()
        kinds_run = {a.kind for w in engine.generation.schedule.workers for a in w}
        backwards = kinds_run & {ActionKind.B, ActionKind.W, ActionKind.BW}
        kinds.append("fused" if backwards == {ActionKind.BW} else "split")
        assert backwards in ({ActionKind.BW}, {ActionKind.B, ActionKind.W})
        measured = "BW" if kinds[-1] == "fused" else "W"
        executor.stats = SimpleNamespace(durations={measured: [float(len(kinds))]}, peak_pending_w=0)
        profiler.after()
    assert kinds[1:] == ["fused", "split"] * steps  # kinds[0]: the memory iteration (fused 1F1B)
    assert finished == [2 * steps + 1]
    durations = profiler.row["durations"]
    assert durations["BW"] == [float(i + 1) for i in range(1, 2 * steps + 1, 2)]
    assert durations["W"] == [float(i + 1) for i in range(2, 2 * steps + 1, 2)]
