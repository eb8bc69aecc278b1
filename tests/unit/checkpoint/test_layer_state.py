"""A stage's state cut into layers and joined as another partition's stages trains on exactly as
the unpartitioned model does: weights, Adam's moments and step, the scheduled learning rate."""

from __future__ import annotations

import pytest
import torch

from ds_resilience.checkpoint import StagingPipeline, unflatten
from ds_resilience.checkpoint.layer_state import layer_trees, stage_state
from ds_resilience.checkpoint.state import StateMismatch, apply, capture
from ds_resilience.checkpoint.state import _Loose

LAYERS = 6


def make_layers(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) if i % 2 == 0 else
            torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8, bias=False)) for i in range(LAYERS)]


class Stage:
    """Layers ``first..last-1`` with their own Adam (two groups: weights decay, the rest not) and
    scheduler, as a pipeline engine holds a stage."""

    def __init__(self, layers: list[torch.nn.Module], first: int, last: int, stage: int) -> None:
        self.first, self.last, self.stage = first, last, stage
        self.modules = layers[first:last]
        named = [(i, p) for i, m in zip(range(first, last), self.modules) for p in m.parameters()]
        self.params = [p for _, p in named]
        self.param_layers = [i for i, _ in named]
        decay = [p for p in self.params if p.dim() == 2]
        rest = [p for p in self.params if p.dim() != 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                           lr=1e-2, betas=(0.8, 0.95))
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        order = {id(p): k for k, p in enumerate(self.params)}  # module order, as StageState keeps it
        flat = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.param_layers = [self.param_layers[order[id(p)]] for p in flat]
        self.params = flat
        self.host = _Loose(self.params, self.optimizer, self.scheduler)

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.host.steps += 1


def train(stages: list[Stage], steps: int, start: int) -> None:
    for it in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + it)
        x = torch.randn(16, 8, generator=g)
        for st in stages:
            for m in st.modules:
                x = m(x)
        x.pow(2).mean().backward()
        for st in stages:
            st.step()


def regrid(old: list[Stage], bounds: list[int], through_staging: bool = False) -> list[Stage]:
    """Cut every old stage into layers, join them into stages with ``bounds`` (fresh modules and
    optimizers, as the engine builds them), and apply."""
    trees = {}
    for st in old:
        trees.update(layer_trees(capture(st.host, stage=st.stage, rank=st.stage), st.param_layers))
    if through_staging:  # what the transfer sends: flattened, then read back
        staging = StagingPipeline()
        trees = {layer: unflatten(staged.layout, staged.payload.clone())
                 for layer, staged in ((k, staging.flatten(t)) for k, t in trees.items())}
    like = capture(old[0].host, stage=0, rank=0)
    fresh = make_layers(seed=99)  # other weights: everything must come from the trees
    new = [Stage(fresh, a, b, s) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    for st in new:
        mine = {k: v for k, v in trees.items() if st.first <= k < st.last}
        state = stage_state(mine, st.param_layers, param_groups=st.optimizer.state_dict()["param_groups"], like=like,
                            stage=st.stage, rank=st.stage)
        apply(state, st.host, stage=st.stage)
    return new


@pytest.mark.parametrize("through_staging", [False, True])
def test_a_regridded_partition_trains_on_bitwise_as_the_whole_model(through_staging):
    whole = [Stage(make_layers(), 0, LAYERS, 0)]
    train(whole, 5, 0)
    parts = [Stage(make_layers(), 0, 3, 0), Stage(make_layers(), 3, LAYERS, 1)]
    train(parts, 3, 0)
    new = regrid(parts, [0, 2, 5, LAYERS], through_staging)
    assert [st.host.steps for st in new] == [3, 3, 3]
    train(new, 2, 3)
    assert sum(len(st.params) for st in new) == len(whole[0].params)
    ref_by_layer = {}
    for p, layer in zip(whole[0].params, whole[0].param_layers):
        ref_by_layer.setdefault(layer, []).append(p)
    for st in new:
        by_layer = {}
        for p, layer in zip(st.params, st.param_layers):
            by_layer.setdefault(layer, []).append(p)
        for layer, ps in by_layer.items():
            assert len(ps) == len(ref_by_layer[layer])
            for a, b in zip(ps, ref_by_layer[layer]):
                assert torch.equal(a, b), f"layer {layer}"
                sa, sb = st.optimizer.state[a], whole[0].optimizer.state[b]
                assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
                assert float(sa["step"]) == float(sb["step"]) == 5.0
        assert [g["lr"] for g in st.optimizer.param_groups] == [g["lr"] for g in whole[0].optimizer.param_groups]
        assert [g["weight_decay"] for g in st.optimizer.param_groups] == [0.1, 0.0]
        assert st.scheduler.state_dict()["last_epoch"] == whole[0].scheduler.state_dict()["last_epoch"] == 5


def test_without_the_regrid_the_fresh_stages_would_differ():
    """The comparison above has teeth: stages built fresh (no state moved) end elsewhere."""
    whole = [Stage(make_layers(), 0, LAYERS, 0)]
    train(whole, 2, 0)
    fresh = [Stage(make_layers(seed=99), 0, LAYERS, 0)]
    fresh[0].host.steps = 0
    train(fresh, 2, 0)
    assert not all(torch.equal(a, b) for a, b in zip(whole[0].params, fresh[0].params))


def test_bad_input_is_named():
    st = Stage(make_layers(), 0, 2, 0)
    train([st], 1, 0)
    state = capture(st.host, stage=0, rank=0)
    with pytest.raises(StateMismatch, match="layer indices for"):
        layer_trees(state, st.param_layers[:-1])
    trees = layer_trees(state, st.param_layers)
    with pytest.raises(StateMismatch, match=r"no state for layer\(s\) \[2\]"):
        stage_state(trees, st.param_layers + [2], param_groups=None, like=state, stage=0, rank=0)
    with pytest.raises(StateMismatch, match="carries 2 parameters, the new stage gives it 3"):
        stage_state(trees, [0, 0, 0] + [1] * 3, param_groups=None, like=state, stage=0, rank=0)
    wrapped = capture(st.host, stage=0, rank=0)
    wrapped.optimizer = {"masters": [], "inner": wrapped.optimizer}
    with pytest.raises(StateMismatch, match="cannot be cut into layers"):
        layer_trees(wrapped, st.param_layers)
    other = Stage(make_layers(), 2, 4, 1)
    other.optimizer.param_groups[0]["lr"] = 0.5  # a layer whose group was scheduled elsewhere
    mixed = {**trees, **layer_trees(capture(other.host, stage=1, rank=1), other.param_layers)}
    joined = Stage(make_layers(), 0, 4, 0)
    with pytest.raises(StateMismatch, match="hyperparameters differ"):
        stage_state(mixed, joined.param_layers, param_groups=joined.optimizer.state_dict()["param_groups"],
                    like=state, stage=0, rank=0)
