import json

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import CostModelError


def test_unit_defaults():
    c = CostModel.unit().stage(5)
    assert (c.t_f, c.t_b, c.t_w, c.t_opt) == (1.0, 1.0, 1.0, 0.0)


def test_per_stage_values_and_round_trip(tmp_path):
    cm = CostModel(name="x", t_f=(1, 2), t_b=(2, 4), t_w=1.5, p2p_latency=0.1, p2p_bandwidth=10.0)
    assert cm.stage(1).t_f == 2.0 and cm.stage(0).t_w == 1.5
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cm.to_dict()))
    assert CostModel.load(path) == cm
    assert cm.transfer_time(20) == 2.0
    assert "split_noise" not in cm.to_dict()  # a model without it keeps its form (and plan-cache key)
    noisy = CostModel(name="x", t_f=(1, 2), split_noise=0.07)
    assert CostModel.from_dict(json.loads(json.dumps(noisy.to_dict()))) == noisy


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"t_f": -1}, "t_f must hold finite numbers >= 0"),
        ({"t_f": [1, "a"]}, "t_f must hold finite numbers"),
        ({"tf": 1}, "unknown keys \\['tf'\\]"),
        ({"p2p_bandwidth": 0}, "p2p_bandwidth must be > 0"),
        ({"t_b": []}, "t_b is empty"),
        ({"t_f": 0}, "t_f must be > 0"),
        ({"split_noise": -0.1}, "split_noise must be a finite number >= 0 or null"),
        ({"split_noise": "5%"}, "split_noise must be a finite number >= 0 or null"),
    ],
)
def test_bad_values(data, fragment):
    with pytest.raises(CostModelError, match=fragment):
        CostModel.from_dict(data)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(CostModelError, match="does not exist"):
        CostModel.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(CostModelError, match="not valid JSON"):
        CostModel.load(bad)


def test_shipped_profiles_load():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("costs_*.json"))
    assert files, "configs/ ships cost profiles"
    for f in files:
        CostModel.load(f)


def test_recomputation_under_activation_checkpointing_lengthens_every_backward():
    """With activation checkpointing the runtime recomputes a stage's forward before its B (or fused
    BW): the cost model's t_recompute is part of B for every planner, bound and replay."""
    from ds_resilience.ir import replay
    from ds_resilience.planning import one_f_one_b

    base = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
    ckpt = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_recompute=(0.5, 1.0))
    assert ckpt.stage(0).t_b == 1.5 and ckpt.stage(1).t_b == 2.0 and ckpt.stage(1).t_recompute == 1.0
    schedule = one_f_one_b(1, 2, 4)
    plain, slow = replay(schedule, base), replay(schedule, ckpt)
    assert slow.makespan > plain.makespan
    assert CostModel.from_dict(ckpt.to_dict()) == ckpt
