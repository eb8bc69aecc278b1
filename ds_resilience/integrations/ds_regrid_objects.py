"""The caller's optimizer and LR scheduler objects around a re-formed grid's stage (issue 46).

An object passed to ``initialize`` belongs to the old stage's parameters. :func:`rebuilt_optimizer`
and :func:`repointed_scheduler` are the callables (``model_parameters -> optimizer``,
``optimizer -> scheduler``) the new stage's engine is built with; the moved layers' optimizer and
scheduler state is loaded into what they build afterwards (``ds_regrid.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ResilienceError

__all__ = ["RebuildError", "rebuilt_optimizer", "repointed_scheduler"]


class RebuildError(ResilienceError):
    """The caller's optimizer or scheduler object cannot be rebuilt for the new stage."""


def rebuilt_optimizer(optimizer: Any, module: Any, trees: dict[int, Any]) -> Callable[[Any], Any]:
    """The user's optimizer object, rebuilt around the new stage's parameters: its class and
    constructor defaults (and its plain attributes, e.g. FusedAdam's ``adam_w_mode``), one parameter
    group per old group the stage's layers came from, in the old groups' order, with the
    hyperparameters they carried (the scheduled learning rate included); the state is loaded after."""
    from .ds_stage import param_layers

    trainable = [p for p in module.parameters() if p.requires_grad]
    layers = param_layers(module)
    if layers is None:
        raise RebuildError("a parameter of the new stage belongs to no layer")
    taken: dict[int, int] = {}
    groups: dict[int, tuple[dict, list]] = {}
    for p, layer in zip(trainable, layers):
        k = taken.get(layer, 0)
        taken[layer] = k + 1
        tree = trees[layer]
        if not tree["groups"]:
            raise RebuildError(f"layer {layer} carries no optimizer parameter groups")
        index = (tree.get("group_index") or [0] * (k + 1))[k]
        groups.setdefault(int(index), (dict(tree["groups"][k]), []))[1].append(p)

    import inspect

    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    # the defaults the constructor takes (torch's AdamW records "decoupled_weight_decay", which it does not)
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}

    def build(_model_parameters: Any) -> Any:
        try:
            new = type(optimizer)([{**hyper, "params": ps} for _, (hyper, ps) in sorted(groups.items())],
                                  **defaults)
        except TypeError as exc:
            raise RebuildError(f"{type(optimizer).__name__}(param_groups, **defaults) cannot rebuild the optimizer "
                              f"object: {exc}") from exc
        for key, value in vars(optimizer).items():
            if key in vars(new) and isinstance(value, (bool, int, float, str)):
                setattr(new, key, value)
        return new

    return build


def repointed_scheduler(scheduler: Any) -> Callable[[Any], Any]:
    """The user's LR scheduler object, copied and pointed at the new stage's optimizer (its state,
    the step count and learning rates, is loaded after); per-group lists must match the groups."""
    import copy

    def build(optimizer: Any) -> Any:
        new = copy.copy(scheduler)
        new.optimizer = optimizer
        for key, value in vars(scheduler).items():
            if key.endswith(("lrs", "lr_lambdas", "_last_lr")) and isinstance(value, list) \
                    and len(value) != len(optimizer.param_groups):
                raise RebuildError(f"the LR scheduler's {key} has {len(value)} entries, the new stage's optimizer "
                                  f"{len(optimizer.param_groups)} parameter groups")
            if isinstance(value, (list, dict)):
                setattr(new, key, copy.copy(value))
        return new

    return build
