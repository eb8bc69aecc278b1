"""Device operations go through DeepSpeed's accelerator (or the torch module of the device type),
and the CPU path stays the plain one."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ds_resilience import accelerator
from ds_resilience.checkpoint.state import StageState, apply, capture


class _FakeAccelerator:
    """DeepSpeed's accelerator interface, recording what is asked of it (a two-device 'cuda')."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.states = {0: torch.tensor([1, 2], dtype=torch.uint8), 1: torch.tensor([3], dtype=torch.uint8)}

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def device(self, device_index=None):
        self.calls.append(("device", device_index))
        return contextlib.nullcontext()

    def get_rng_state(self, device_index=None):
        return self.states[device_index].clone()

    def set_rng_state(self, new_state, device_index=None):
        self.calls.append(("set_rng_state", device_index, new_state.tolist()))


@pytest.fixture
def fake(monkeypatch):
    acc = _FakeAccelerator()
    monkeypatch.setattr(accelerator, "_deepspeed_accelerator", lambda: acc)
    return acc


def test_host_memory_has_no_accelerator_and_the_cpu_guard_is_a_no_op():
    with pytest.raises(ValueError, match="host memory"):
        accelerator.for_device("cpu")
    assert isinstance(accelerator.guard("cpu"), contextlib.nullcontext)
    assert not accelerator.on_device(torch.zeros(1))
    if not torch.cuda.is_available():
        assert accelerator.device_count() == 0
        assert accelerator.rng_states() == {}


def test_deepspeeds_accelerator_drives_its_device_type_and_torch_stands_in_for_others(fake):
    assert accelerator.for_device("cuda:1") is fake
    with accelerator.guard("cuda:1"):
        pass
    assert fake.calls == [("device", 1)]
    other = accelerator.for_device("xpu:0")  # not what DeepSpeed drives here: torch.xpu stands in
    assert other is not fake and other.device_name(0) == "xpu:0"
    assert accelerator.device_count() == 2


def test_device_rng_streams_round_trip_through_a_stage_state(fake, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    states = accelerator.rng_states()
    assert list(states) == ["cuda"] and [t.tolist() for t in states["cuda"]] == [[1, 2], [3]]
    layer = torch.nn.Linear(3, 2)
    state = capture(type("Host", (), {"parameters": list(layer.parameters()), "optimizer": None,
                                      "lr_scheduler": None, "counters": lambda self: (4, 40),
                                      "set_counters": lambda self, s, n: None})(), stage=0, rank=0)
    assert [t.tolist() for t in state.rng["cuda"]] == [[1, 2], [3]]
    restored = StageState.from_tree(state.to_tree())  # through the staging pipeline's nest
    fake.calls.clear()
    apply(restored, type("Host", (), {"parameters": list(layer.parameters()), "optimizer": None,
                                      "lr_scheduler": None, "set_counters": lambda self, s, n: None})(), stage=0)
    assert fake.calls == [("set_rng_state", 0, [1, 2]), ("set_rng_state", 1, [3])]


def test_a_cpu_stage_clone_for_the_host_is_an_independent_copy():
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    opt.step()
    host = type("Host", (), {"parameters": list(layer.parameters()), "optimizer": opt, "lr_scheduler": None,
                             "counters": lambda self: (1, 1), "set_counters": lambda self, s, n: None})()
    copy = capture(host, stage=0, rank=0).clone(host=True)
    before = [p.detach().clone() for p in layer.parameters()]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    assert all(torch.equal(c, b) and c.device.type == "cpu" for c, b in zip(copy.params, before))


@pytest.mark.gpu
def test_a_gpu_stages_pre_step_copy_lives_in_pinned_host_memory_and_rolls_back_exactly():
    layer = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.ones(8, 64, device="cuda")).sum().backward()
    opt.step()
    host = type("Host", (), {"parameters": list(layer.parameters()), "optimizer": opt, "lr_scheduler": None,
                             "counters": lambda self: (1, 1), "set_counters": lambda self, s, n: None})()
    copy = capture(host, stage=0, rank=0).clone(host=True)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in copy.params)
    moments = [v for st in copy.optimizer["state"].values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    assert moments and all(v.device.type == "cpu" for v in moments)
    before = [p.detach().clone() for p in layer.parameters()]
    layer(torch.ones(8, 64, device="cuda")).sum().backward()
    opt.step()
    apply(copy, host, stage=0)
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
    assert all(v.device.type == "cuda" for st in opt.state.values() for v in st.values() if v.dim())


@pytest.mark.gpu
def test_a_gpu_stages_micro_batch_rng_is_forked_on_its_device():
    """Dropout on a GPU draws from the device's generator: the stage's fork reseeds it per
    micro-batch (a re-routed or recomputed forward draws the same mask) and restores it after."""
    from ds_resilience.runtime.executor import _fork_rng

    torch.cuda.manual_seed(7)
    before = torch.cuda.get_rng_state()
    masks = []
    for _ in range(2):
        with _fork_rng("cuda:0"):
            torch.manual_seed(3)
            masks.append(torch.nn.functional.dropout(torch.ones(4096, device="cuda"), 0.5))
        assert torch.equal(torch.cuda.get_rng_state(), before)
    assert torch.equal(masks[0], masks[1])
