"""The one state transport (JSON header, raw bytes) and the JSON layouts it carries.

Pure tests check the layout codec; process tests (gloo over loopback, bounded by timeouts) hand a
stage's state from one rank to another, and play a rogue peer that sends pickles where a header or
a layout belongs: the receiver refuses every one without running it, keeps the stream in step, and
still accepts the honest message that follows.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict

import pytest
import torch

import transport_programs as prog
from dist_harness import run_workers
from ds_resilience.checkpoint.layout import Layout, LayoutError, plan_layout, unflatten
from ds_resilience.checkpoint.staging import StagingPipeline
from ds_resilience.checkpoint.state import StageState, StateMismatch


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),  # an OrderedDict
        "optimizer": opt.state_dict(),  # int keys, tensors, floats, tuples (betas), bools, None
        "nested": [1, (2.5, None), {"k": b"\x00\xff"}, True, "text"],
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0],
        "dtype": torch.bfloat16,
        "big": 2**70,
    }


def test_layout_json_round_trip_keeps_types_and_bits():
    state = _state()
    staged = StagingPipeline().flatten(state)
    layout = Layout.from_json(staged.layout.to_json())
    back = unflatten(layout, staged.payload)
    assert isinstance(back["model"], OrderedDict) and list(back["model"]) == list(state["model"])
    for k, v in state["model"].items():
        assert torch.equal(back["model"][k], v)
    assert set(back["optimizer"]["state"]) == {0, 1}  # int keys stay ints
    assert back["optimizer"]["param_groups"][0]["betas"] == state["optimizer"]["param_groups"][0]["betas"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert back["nested"] == state["nested"] and isinstance(back["nested"][1], tuple)
    assert all(type(a) is type(b) for a, b in zip(back["nested"], state["nested"]))
    f = back["floats"]
    assert f[0] != f[0] and f[1:3] == [float("inf"), -float("inf")] and str(f[3]) == "-0.0"
    assert back["dtype"] is torch.bfloat16 and back["big"] == 2**70


def test_a_pickle_is_never_a_layout(tmp_path):
    sentinel = tmp_path / "ran"
    with pytest.raises(LayoutError, match="JSON"):
        Layout.from_json(prog.malicious_pickle(str(sentinel)))
    assert not sentinel.exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format=1), "format"),
    (lambda d: d["tensors"][0].__setitem__(0, "Tensor"), "dtype"),
    (lambda d: d["tensors"][1].__setitem__(2, 0), "overlap"),
    (lambda d: d["tensors"][0].__setitem__(3, 7), "bytes for"),
    (lambda d: d.update(tree={"tensor": 99}), "outside"),
    (lambda d: d.update(tree={"__reduce__": ["os.system", "true"]}), "unknown tag"),
    (lambda d: d.update(tree={"dict": [[{"list_is_unhashable": []}, 1]]}), "unknown tag"),
    (lambda d: d.update(tree={"namedtuple": ["not an identifier!", ["a"], [1]]}), "named tuple"),
    (lambda d: d.update(extra=1), "layout is an object"),
])
def test_malformed_layouts_are_refused_with_the_reason(mutate, message):
    layout, _ = plan_layout({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.int64), "c": [1, 2]})
    data = json.loads(layout.to_json())
    mutate(data)
    with pytest.raises(LayoutError, match=message):
        Layout.from_json(json.dumps(data))


def test_a_value_no_layout_can_carry_is_refused_at_capture_naming_its_path():
    with pytest.raises(LayoutError, match=r"state\['opt'\]\[0\].*object"):
        plan_layout({"opt": [object()]})


def test_stage_state_tree_is_checked():
    with pytest.raises(StateMismatch, match="format"):
        StageState.from_tree({"format": 1})
    with pytest.raises(StateMismatch, match="lacks"):
        StageState.from_tree({"format": 2, "stage": 0})


@pytest.mark.timeout(120)
def test_handover_moves_a_stage_state_bitwise():
    r0, r1 = run_workers(prog.handover, 2, timeout_s=90)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    for a, b in zip(r0["exp_avg"], r1["exp_avg"]):
        assert torch.equal(a, b)
    assert r0["lr"] == r1["lr"] and r1["steps"] == (3, 12) and r1["state_steps"] == 3


@pytest.mark.timeout(120)
def test_a_rogue_peer_cannot_run_code_and_the_stream_stays_in_step(tmp_path):
    sentinel = str(tmp_path / "pwned")
    _, out = run_workers(prog.rogue_sender, 2, args=(sentinel, str(tmp_path)), timeout_s=90)
    assert "not JSON" in out["a"] and "refused" in out["a"]
    assert out["b"].startswith("refused") and "JSON" in out["b"]
    assert "not a stage state" not in out["c"] and "JSON" in out["c"]
    assert out["d"].startswith("refused") and "checksum" in out["d"]
    assert out["e"] == "committed" and out["held"] == {"w0": [5]}
    assert out["e_value"] == list(range(100))
    assert not out["sentinel_exists"] and not os.path.exists(sentinel), "a pickle from a peer ran"


@pytest.mark.timeout(60)
def test_every_wait_has_a_timeout_that_names_what_it_waited_for():
    _, out = run_workers(prog.silent_peer, 2, timeout_s=45)
    assert out["error"] is not None and "waiting for a message from rank 0" in out["error"]
    assert out["waited_s"] < 10


@pytest.mark.timeout(60)
def test_json_collectives_carry_values_not_pickles():
    results = run_workers(prog.json_collectives, 3, timeout_s=45)
    expected = [{"rank": r, "steps": [r] * r, "name": "é" * r} for r in range(3)]
    for r in results:
        assert r["gathered"] == expected
        assert r["told"] == {"from": 2, "x": [1.5, None]}


def test_the_malicious_pickle_really_runs_when_unpickled(tmp_path):
    """The control: the same bytes do run code when a process unpickles them."""
    sentinel = tmp_path / "ran"
    pickle.loads(prog.malicious_pickle(str(sentinel)))
    assert sentinel.exists()
