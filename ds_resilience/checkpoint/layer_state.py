"""A stage's state cut into layers, and layers put back together as another partition's stage.

A re-grid (issue 18, part 4) moves layers, not stages: a survivor keeps the layers its new
position shares with its old one and receives the others (``layer_transfer.transfer``). This module
is the cut and the join, for any engine whose stage state is a :class:`~.state.StageState` with a
torch-style optimizer ``state_dict`` (``{"state": {index: {...}}, "param_groups": [...]}``: Adam's
moments and step, SGD's momentum buffer, anything kept per parameter):

* :func:`layer_trees`: ``{layer: tree}`` from a stage state and the layer of each of its
  parameters. A tree holds the layer's parameters, their per-parameter optimizer state and the
  hyperparameters of their parameter groups (the learning rate the scheduler set included), all
  in a form the staging pipeline flattens (tensors, lists, dicts, plain values).
* :func:`stage_state`: a new stage's :class:`~.state.StageState` from the trees of its layers,
  laid out for the new stage's parameters and optimizer (its ``param_groups``, built by the engine
  for the new stage as it builds any stage), ready for :func:`~.state.apply`.

Moved this way, a layer trains on exactly as it would have: same weights, same moments, same step
counts, same learning rate (Oobleck re-initializes the optimizer and the schedule instead).
What is not per layer (the scheduler, the step and sample counters, the random generators) is the
same on every stage and comes from any survivor's state.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .state import StageState, StateMismatch, clone_tree

__all__ = ["LAYER_FORMAT", "layer_trees", "stage_state"]

LAYER_FORMAT = 1


def _groups_of(optimizer: Mapping[str, Any], count: int) -> tuple[list[int], list[dict[str, Any]]]:
    """(group index of each parameter, each group's hyperparameters), checking the state dict's form."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    if not isinstance(groups, list) or not isinstance(optimizer.get("state"), Mapping):
        raise StateMismatch("the optimizer state is not a torch optimizer state_dict ({'state', 'param_groups'}); "
                            "a wrapped optimizer (mixed precision, ZeRO) cannot be cut into layers")
    group_of: dict[int, int] = {}
    for g, group in enumerate(groups):
        for index in group.get("params", ()):
            if index in group_of:
                raise StateMismatch(f"optimizer parameter {index} is in two parameter groups")
            group_of[index] = g
    if sorted(group_of) != list(range(count)):
        raise StateMismatch(f"the optimizer's parameter groups index {len(group_of)} parameters, the stage has {count}")
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return [group_of[i] for i in range(count)], hyper


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def layer_trees(state: StageState, param_layers: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Cut ``state`` into its layers; ``param_layers[i]`` is the layer of ``state.params[i]``.

    Raises:
        StateMismatch: ``param_layers`` does not name one layer per parameter, or the optimizer
            state is not a plain torch one.
    """
    if len(param_layers) != len(state.params):
        raise StateMismatch(f"{len(param_layers)} layer indices for {len(state.params)} parameters")
    out: dict[int, dict[str, Any]] = {}
    group_of: list[int] | None = None
    hyper: list[dict[str, Any]] = []
    if state.optimizer is not None:
        group_of, hyper = _groups_of(state.optimizer, len(state.params))
    for i, (param, layer) in enumerate(zip(state.params, param_layers)):
        tree = out.setdefault(int(layer), {"format": LAYER_FORMAT, "layer": int(layer), "params": [],
                                           "optimizer": [], "groups": []})
        tree["params"].append(param)
        if group_of is not None:
            tree["optimizer"].append(dict(state.optimizer["state"].get(i, {})))
            tree["groups"].append(hyper[group_of[i]])
    return out


def stage_state(trees: Mapping[int, Mapping[str, Any]], param_layers: Sequence[int], *,
                param_groups: Sequence[Mapping[str, Any]] | None, like: StageState, stage: int,
                rank: int) -> StageState:
    """The state of a new stage whose ``i``-th parameter belongs to layer ``param_layers[i]``,
    from the trees of its layers (each layer's parameters in the order :func:`layer_trees` gave).

    Args:
        trees: ``{layer: tree}`` for every layer of the new stage (kept, received or restored).
        param_layers: the new stage's parameter -> layer, in its module order.
        param_groups: the new stage's optimizer ``state_dict()["param_groups"]`` (which parameter
            indices form which group); each group takes the hyperparameters its layers carried
            (the learning rate the scheduler set, the betas, ...). ``None``: no optimizer.
        like: a survivor's state at the same step: the scheduler, counters and random generators.
        stage, rank: the new stage and this worker's rank.

    Raises:
        StateMismatch: a layer is missing, holds another number of parameters than the new stage
            gives it, or its groups' hyperparameters disagree within one new group.
    """
    wanted: dict[int, int] = {}
    for layer in param_layers:
        wanted[int(layer)] = wanted.get(int(layer), 0) + 1
    missing = sorted(set(wanted) - set(trees))
    if missing:
        raise StateMismatch(f"no state for layer(s) {missing} of the new stage (has {sorted(trees)})")
    for layer, count in wanted.items():
        tree = trees[layer]
        if not isinstance(tree, Mapping) or tree.get("format") != LAYER_FORMAT or tree.get("layer") != layer:
            raise StateMismatch(f"the tree given for layer {layer} is not a layer state of format {LAYER_FORMAT}")
        if len(tree["params"]) != count:
            raise StateMismatch(f"layer {layer} carries {len(tree['params'])} parameters, the new stage gives it {count}")
    taken = {layer: 0 for layer in wanted}
    params: list[torch.Tensor] = []
    per_param: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for layer in param_layers:
        tree, k = trees[int(layer)], taken[int(layer)]
        taken[int(layer)] = k + 1
        params.append(tree["params"][k])
        has_opt = bool(tree["optimizer"])
        per_param.append((tree["optimizer"][k] if has_opt else {}, tree["groups"][k] if has_opt else None))
    optimizer = None
    if param_groups is not None:
        state: dict[int, Any] = {}
        groups = []
        for g, group in enumerate(param_groups):
            indices = list(group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            carried = [per_param[i][1] for i in indices if per_param[i][1] is not None]
            for other in carried[1:]:
                if not _same(other, carried[0]):
                    raise StateMismatch(f"parameter group {g} of the new stage gathers layers whose optimizer "
                                        f"hyperparameters differ: {carried[0]} and {other}")
            if carried:
                hyper.update(carried[0])
            groups.append({**clone_tree(hyper), "params": indices})
            for i in indices:
                if per_param[i][0]:
                    state[i] = per_param[i][0]
        optimizer = {"state": state, "param_groups": groups}
    return StageState(stage=stage, rank=rank, steps=like.steps, samples=like.samples, params=params,
                      optimizer=optimizer, lr_scheduler=like.lr_scheduler, rng=like.rng, extra={})
