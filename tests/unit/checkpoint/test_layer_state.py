"""A stage's state cut into layers and joined as another partition's stages trains on exactly as
the unpartitioned model does: weights, Adam's moments and step, the scheduled learning rate."""

from __future__ import annotations

import pytest
import torch

from ds_resilience.checkpoint import StagingPipeline, unflatten
from ds_resilience.checkpoint.layer_state import inner_param_groups, layer_trees, stage_state
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


class MixedStage(Stage):
    """A :class:`Stage` in bf16 with fp32 masters (``runtime/precision.py``), as the engine's bf16 stage."""

    def __init__(self, layers: list[torch.nn.Module], first: int, last: int, stage: int) -> None:
        from ds_resilience.runtime.precision import MixedPrecisionOptimizer

        for m in layers[first:last]:
            m.to(torch.bfloat16)
        super().__init__(layers, first, last, stage)
        self.optimizer = MixedPrecisionOptimizer(self.optimizer, self.params)
        self.host = _Loose(self.params, self.optimizer, self.scheduler)

    def step(self) -> None:
        self.optimizer.accumulate()
        super().step()


def test_bf16_stages_regrid_with_their_fp32_masters():
    """A bf16 stage's layers carry their fp32 masters (and the wrapper's scaler state): the
    re-gridded stages' masters, moments and bf16 weights equal the stages that trained on whole."""
    def run(bounds_after):
        parts = [MixedStage(make_layers(), 0, 3, 0), MixedStage(make_layers(), 3, LAYERS, 1)]
        train_bf16(parts, 3, 0)
        if bounds_after is not None:
            trees = {}
            for st in parts:
                trees.update(layer_trees(capture(st.host, stage=st.stage, rank=st.stage), st.param_layers))
            assert all(len(t["masters"]) == len(t["params"]) for t in trees.values())
            like = capture(parts[0].host, stage=0, rank=0)
            parts = [MixedStage(make_layers(seed=99), a, b, s) for s, (a, b) in enumerate(zip(bounds_after, bounds_after[1:]))]
            for st in parts:
                mine = {k: v for k, v in trees.items() if st.first <= k < st.last}
                groups = inner_param_groups(st.optimizer.state_dict())
                state = stage_state(mine, st.param_layers, param_groups=groups, like=like, stage=st.stage, rank=st.stage)
                assert set(state.optimizer) == {"optimizer", "masters", "scaler", "skipped_steps"}
                apply(state, st.host, stage=st.stage)
        train_bf16(parts, 2, 3)
        return {(layer, k): (p.detach().clone(), st.optimizer.master_of[id(p)].detach().clone())
                for st in parts for k, (p, layer) in enumerate(zip(st.params, st.param_layers))}, parts

    ref, _ = run(None)
    got, parts = run([0, 2, 5, LAYERS])
    by_layer_ref, by_layer = {}, {}
    for (layer, _), v in ref.items():
        by_layer_ref.setdefault(layer, []).append(v)
    for (layer, _), v in got.items():
        by_layer.setdefault(layer, []).append(v)
    assert by_layer.keys() == by_layer_ref.keys()
    for layer in by_layer:
        for (p, m), (rp, rm) in zip(by_layer[layer], by_layer_ref[layer]):
            assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
            assert torch.equal(m, rm), f"layer {layer} master"
            assert torch.equal(p, rp), f"layer {layer} bf16 weight"


def train_bf16(stages: list[Stage], steps: int, start: int) -> None:
    for it in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + it)
        x = torch.randn(16, 8, generator=g).to(torch.bfloat16)
        for st in stages:
            for m in st.modules:
                x = m(x)
        x.float().pow(2).mean().backward()
        for st in stages:
            st.step()


def test_an_optimizer_counting_steps_per_group_gets_the_group_step_on_every_new_group():
    """DeepSpeed's FusedAdam steps a group with its last parameter's ``"step"`` and advances only
    that one: a new group whose last parameter was a middle one of its old group would restart at
    step 1's bias correction. With ``group_steps`` every parameter of a new group takes the old
    groups' step; without, the new first stage's groups (layers 0-1: no old last parameter) hold 0."""
    parts = [Stage(make_layers(), 0, 3, 0), Stage(make_layers(), 3, LAYERS, 1)]
    train(parts, 3, 0)
    trees = {}
    for st in parts:
        state = capture(st.host, stage=st.stage, rank=st.stage)
        for group in state.optimizer["param_groups"]:  # FusedAdam's bookkeeping: the group's last holds the step
            for i in group["params"][:-1]:
                state.optimizer["state"][i] = {**state.optimizer["state"][i], "step": 0}
            last = group["params"][-1]
            state.optimizer["state"][last] = {**state.optimizer["state"][last], "step": 3}
        trees.update(layer_trees(state, st.param_layers))
    like = capture(parts[0].host, stage=0, rank=0)
    new = Stage(make_layers(seed=99), 0, 2, 0)
    groups = new.optimizer.state_dict()["param_groups"]
    mine = {k: v for k, v in trees.items() if k < 2}
    moved = stage_state(mine, new.param_layers, param_groups=groups, like=like, stage=0, rank=0, group_steps=True)
    assert {int(s["step"]) for s in moved.optimizer["state"].values()} == {3}
    plain = stage_state(mine, new.param_layers, param_groups=groups, like=like, stage=0, rank=0)
    assert {int(plain.optimizer["state"][g["params"][-1]]["step"]) for g in plain.optimizer["param_groups"]} == {0}


def test_an_optimizer_numbering_its_parameters_group_after_group_is_renumbered_to_module_order():
    """A caller's optimizer with a decay and a no-decay group numbers its parameters group after
    group; ``renumber`` maps its state onto module positions (what the layer cut indexes) and back."""
    from ds_resilience.checkpoint.layer_state import inverse, renumber

    sd = {"state": {0: {"m": 10}, 1: {"m": 11}, 2: {"m": 12}},
          "param_groups": [{"lr": 1, "params": [0, 1]}, {"lr": 2, "params": [2]}]}
    positions = [0, 2, 1]  # the decay group holds module parameters 0 and 2, the other parameter 1
    moved = renumber(sd, positions)
    assert moved["state"] == {0: {"m": 10}, 2: {"m": 11}, 1: {"m": 12}}
    assert [g["params"] for g in moved["param_groups"]] == [[0, 2], [1]]
    assert renumber(moved, inverse(positions)) == sd
    wrapped = {"optimizer": sd, "masters": [], "scaler": None, "skipped_steps": 0}
    assert renumber(wrapped, positions)["optimizer"] == moved and renumber(sd, None) is sd
