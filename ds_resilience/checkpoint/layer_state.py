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

Mixed precision (``runtime/precision.py``'s ``MixedPrecisionOptimizer``, bf16/fp16): its state
dict wraps the torch optimizer's (``{"optimizer", "masters", "scaler", "skipped_steps"}``); a
layer's tree then carries each parameter's fp32 master beside its low-precision weight and
moments, and the new stage's wrapper takes the loss scaler and the skipped-step count (the same
on every stage: the overflow is agreed globally) from the survivor's state.

An optimizer that counts its steps per parameter group (DeepSpeed's ``FusedAdam``: it steps every
parameter of a group with the ``"step"`` of the group's *last* parameter and advances only that
one) gives a new group whose last parameter was a middle one of its old group a step count of 0:
its next update would take step 1's bias correction. Each parameter's tree therefore also carries
the largest step of its old group (``"group_step"``), and :func:`stage_state` with
``group_steps=True`` gives every parameter of a new group the largest of its members'.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .state import StageState, StateMismatch, clone_tree

__all__ = ["LAYER_FORMAT", "inner_param_groups", "inverse", "layer_trees", "renumber", "stage_state"]

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


def _mixed(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``MixedPrecisionOptimizer`` state dict (fp32 masters around a torch one)."""
    return isinstance(optimizer, Mapping) and "masters" in optimizer and "optimizer" in optimizer


def inner_param_groups(optimizer_state: Mapping[str, Any]) -> list[Any]:
    """The torch optimizer's ``param_groups`` of an engine optimizer's ``state_dict()`` (inside a
    mixed-precision wrapper's, if it is one)."""
    inner = optimizer_state["optimizer"] if _mixed(optimizer_state) else optimizer_state
    return inner["param_groups"]


def _step_of(param_state: Mapping[str, Any]) -> int | None:
    step = param_state.get("step") if isinstance(param_state, Mapping) else None
    if step is None:
        return None
    return int(step.item()) if torch.is_tensor(step) else int(step)


def renumber(optimizer_state: Any, positions: Sequence[int] | None) -> Any:
    """An optimizer ``state_dict`` (inside a mixed-precision wrapper's, if it is one) with parameter
    index ``j`` renamed ``positions[j]``. A torch optimizer numbers its parameters group after
    group; a stage state lists them in module order, which :func:`layer_trees` and
    :func:`stage_state` index by: ``positions`` (optimizer index -> module position) makes one the
    other. ``None``: the same order already."""
    if optimizer_state is None or positions is None:
        return optimizer_state
    if _mixed(optimizer_state):
        return {**optimizer_state, "optimizer": renumber(optimizer_state["optimizer"], positions)}
    state = {int(positions[int(j)]): v for j, v in optimizer_state["state"].items()}
    groups = [{**g, "params": [int(positions[int(j)]) for j in g["params"]]} for g in optimizer_state["param_groups"]]
    return {**optimizer_state, "state": state, "param_groups": groups}


def inverse(positions: Sequence[int] | None) -> list[int] | None:
    """The inverse of a :func:`renumber` map."""
    if positions is None:
        return None
    out = [0] * len(positions)
    for j, pos in enumerate(positions):
        out[int(pos)] = j
    return out


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
    optimizer, masters = state.optimizer, None
    if _mixed(optimizer):
        optimizer, masters = optimizer["optimizer"], list(optimizer["masters"])
        if len(masters) != len(state.params):
            raise StateMismatch(f"{len(masters)} fp32 masters for {len(state.params)} parameters")
    group_step: list[int | None] = []
    if optimizer is not None:
        group_of, hyper = _groups_of(optimizer, len(state.params))
        steps: dict[int, int] = {}
        for i, g in enumerate(group_of):
            step = _step_of(optimizer["state"].get(i, {}))
            if step is not None:
                steps[g] = max(steps.get(g, step), step)
        group_step = [steps.get(g) for g in group_of]
    for i, (param, layer) in enumerate(zip(state.params, param_layers)):
        tree = out.setdefault(int(layer), {"format": LAYER_FORMAT, "layer": int(layer), "params": [],
                                           "optimizer": [], "groups": []})
        tree["params"].append(param)
        if group_of is not None:
            tree["optimizer"].append(dict(optimizer["state"].get(i, {})))
            tree["groups"].append(hyper[group_of[i]])
            tree.setdefault("group_step", []).append(group_step[i])
            tree.setdefault("group_index", []).append(group_of[i])  # the old group (a rebuilt optimizer keeps the order)
        if masters is not None:
            tree.setdefault("masters", []).append(masters[i])
    return out


def stage_state(trees: Mapping[int, Mapping[str, Any]], param_layers: Sequence[int], *,
                param_groups: Sequence[Mapping[str, Any]] | None, like: StageState, stage: int,
                rank: int, group_steps: bool = False) -> StageState:
    """The state of a new stage whose ``i``-th parameter belongs to layer ``param_layers[i]``,
    from the trees of its layers (each layer's parameters in the order :func:`layer_trees` gave).

    Args:
        trees: ``{layer: tree}`` for every layer of the new stage (kept, received or restored).
        param_layers: the new stage's parameter -> layer, in its module order.
        param_groups: the new stage's torch optimizer's ``state_dict()["param_groups"]`` (which
            parameter indices form which group; :func:`inner_param_groups` of a mixed-precision
            one); each group takes the hyperparameters its layers carried (the learning rate the
            scheduler set, the betas, ...). ``None``: no optimizer.
        like: a survivor's state at the same step: the scheduler, counters and random generators
            (and, under mixed precision, the loss scaler: the new state is wrapped as ``like``'s is).
        stage, rank: the new stage and this worker's rank.
        group_steps: the optimizer counts steps per group (``FusedAdam``; module docstring):
            every parameter of a new group takes the largest step its layers' old groups had.

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
    mixed = _mixed(like.optimizer)
    taken = {layer: 0 for layer in wanted}
    params: list[torch.Tensor] = []
    masters: list[torch.Tensor] = []
    per_param: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    carried_steps: list[int | None] = []
    for layer in param_layers:
        tree, k = trees[int(layer)], taken[int(layer)]
        taken[int(layer)] = k + 1
        params.append(tree["params"][k])
        if mixed:
            if len(tree.get("masters") or ()) != len(tree["params"]):
                raise StateMismatch(f"layer {layer} carries no fp32 masters; the new stage trains in mixed precision")
            masters.append(tree["masters"][k])
        has_opt = bool(tree["optimizer"])
        per_param.append((tree["optimizer"][k] if has_opt else {}, tree["groups"][k] if has_opt else None))
        carried_steps.append((tree.get("group_step") or [None] * (k + 1))[k] if has_opt else None)
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
            top = max((carried_steps[i] for i in indices if carried_steps[i] is not None), default=None)
            if group_steps and top is not None:
                for i in indices:
                    if i in state and "step" in state[i]:
                        old = state[i]["step"]
                        state[i] = {**state[i], "step": torch.tensor(float(top), dtype=old.dtype)
                                    if torch.is_tensor(old) else top}
        optimizer = {"state": state, "param_groups": groups}
        if mixed:
            optimizer = {"optimizer": optimizer, "masters": masters,
                         "scaler": clone_tree(like.optimizer.get("scaler")),
                         "skipped_steps": like.optimizer.get("skipped_steps", 0)}
    return StageState(stage=stage, rank=rank, steps=like.steps, samples=like.samples, params=params,
                      optimizer=optimizer, lr_scheduler=like.lr_scheduler, rng=like.rng, extra={})
