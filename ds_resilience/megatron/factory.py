"""Installing the resilient forward-backward where Megatron's training loop looks for it.

Megatron-LM's ``megatron/training/training.py`` imports ``get_forward_backward_func`` from
``megatron.core.pipeline_parallel`` by name when it is imported, then calls the factory each
iteration (main today passes ``schedule_pg_collection=`` too). :func:`install` replaces the factory
in megatron-core and in every loaded module holding megatron-core's (or a previous install's), so
whichever was imported first, the loop gets the resilient function; :func:`uninstall` undoes it.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

from ..errors import ConfigError

__all__ = ["install", "uninstall"]

_ORIGINAL: dict[str, Any] = {}


def install(forward_backward: Any) -> Callable[..., Any]:
    """Make ``get_forward_backward_func()`` return ``forward_backward``: in
    ``megatron.core.pipeline_parallel`` (and its ``schedules`` module) and in every loaded module that
    imported the factory by name (Megatron-LM's training module); a module imported later gets
    it from the package. Returns the factory installed.
    """
    import megatron.core.pipeline_parallel as package
    import megatron.core.pipeline_parallel.schedules as schedules

    original = _ORIGINAL.setdefault("factory", schedules.get_forward_backward_func)

    def get_forward_backward_func(pp_size: int | None = None, vp_size: int | None = None,
                                  schedule_pg_collection: Any = None) -> Any:
        """ds_resilience's factory (megatron-core's and Megatron-LM's keywords)."""
        if vp_size not in (None, 1):
            raise ConfigError("--num-layers-per-virtual-pipeline-stage", f"virtual pipeline size {vp_size}: "
                                                                         f"interleaving is not supported yet")
        return forward_backward

    get_forward_backward_func.ds_resilience = forward_backward  # type: ignore[attr-defined]
    for module in _holders(lambda f: f is original or _ours(f)):
        module.get_forward_backward_func = get_forward_backward_func
    package.get_forward_backward_func = get_forward_backward_func
    schedules.get_forward_backward_func = get_forward_backward_func
    return get_forward_backward_func


def _ours(function: Any) -> bool:
    return isinstance(function, types.FunctionType) and "ds_resilience" in function.__dict__


def _holders(test: Callable[[Any], bool]) -> list[types.ModuleType]:
    """Loaded modules whose global ``get_forward_backward_func`` passes ``test`` (read from the
    module's namespace: a module's own ``__getattr__`` is never triggered)."""
    out = []
    for module in list(sys.modules.values()):
        if isinstance(module, types.ModuleType):
            space = getattr(module, "__dict__", None)
            if isinstance(space, dict) and test(space.get("get_forward_backward_func")):
                out.append(module)
    return out


def uninstall() -> None:
    """Put megatron-core's own factory back wherever :func:`install` replaced it."""
    original = _ORIGINAL.get("factory")
    if original is None:
        return
    for module in _holders(_ours):
        module.get_forward_backward_func = original
