"""Device operations through DeepSpeed's accelerator abstraction.

The runtime touches a device in a few places only: the snapshot path's copy and drain streams and
their events, page-locking the host store, the device guard around a kernel launch, the device RNG
streams a snapshot carries, the stage's RNG fork, the device count the agent launches over. They go
through ``deepspeed.accelerator.get_accelerator()``, so an accelerator DeepSpeed supports takes the
same path as CUDA. Where DeepSpeed is absent (the planning tools) or its accelerator is not the
tensors' device type, the ``torch.<type>`` module (``torch.cuda``, ``torch.xpu``) stands in with the
same methods. A CPU tensor never needs any of this: callers keep the plain CPU path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

__all__ = ["device_count", "for_device", "guard", "on_device", "rng_states", "set_rng_states", "wait_current_stream"]


def on_device(tensor: torch.Tensor) -> bool:
    """The tensor lives on an accelerator (not in host memory)."""
    return tensor.device.type not in ("cpu", "meta")


class _TorchModule:
    """DeepSpeed's accelerator methods over ``torch.<device type>`` (what its CUDA accelerator does)."""

    def __init__(self, name: str):
        self._name = name
        self._mod = getattr(torch, name, None)

    def device_name(self, device_index=None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def is_available(self) -> bool:
        return self._mod is not None and bool(self._mod.is_available())

    def device_count(self) -> int:
        return int(self._mod.device_count()) if self.is_available() else 0

    def device(self, device_index=None):
        return self._mod.device(device_index)

    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return self._mod.Stream

    @property
    def Event(self):  # noqa: N802
        return self._mod.Event

    def stream(self, stream):
        return self._mod.stream(stream)

    def current_stream(self, device_index=None):
        return self._mod.current_stream(device_index)

    def get_rng_state(self, device_index=None):
        return self._mod.get_rng_state() if device_index is None else self._mod.get_rng_state(device_index)

    def set_rng_state(self, new_state, device_index=None):
        if device_index is None:
            return self._mod.set_rng_state(new_state)
        return self._mod.set_rng_state(new_state, device_index)

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        if self._name != "cuda":
            return False
        return int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)) == 0

    def unregister_host_memory(self, address: int) -> None:
        if self._name == "cuda":
            torch.cuda.cudart().cudaHostUnregister(address)


@functools.lru_cache(maxsize=None)
def _deepspeed_accelerator() -> Any:
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return None
    return get_accelerator()


@functools.lru_cache(maxsize=None)
def _stand_in(name: str) -> _TorchModule:
    return _TorchModule(name)


def for_device(device: torch.device | str) -> Any:
    """The accelerator object for ``device``'s type: DeepSpeed's when it drives that type, else
    the ``torch.<type>`` stand-in.

    Raises:
        ValueError: ``device`` is the CPU (there is nothing to drive: use the plain path).
    """
    kind = torch.device(device).type
    if kind in ("cpu", "meta"):
        raise ValueError(f"{device} is host memory: no accelerator operations apply")
    acc = _deepspeed_accelerator()
    if acc is not None and acc.device_name() == kind:
        return acc
    return _stand_in(kind)


def guard(device: torch.device | str):
    """A context that makes ``device`` current (a kernel launch goes to it); nothing on the CPU."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    return for_device(device).device(device.index)


def wait_current_stream(device: torch.device | str) -> None:
    """Block until the work queued so far on ``device``'s current stream is done."""
    device = torch.device(device)
    if device.type not in ("cpu", "meta"):
        for_device(device).current_stream(device.index).synchronize()


def _default_kind() -> str | None:
    acc = _deepspeed_accelerator()
    kind = acc.device_name() if acc is not None else ("cuda" if torch.cuda.is_available() else None)
    return None if kind in (None, "cpu") else kind


def device_count() -> int:
    """Accelerators on this machine (0 without one)."""
    kind = _default_kind()
    return for_device(kind).device_count() if kind is not None else 0


def rng_states() -> dict[str, list[torch.Tensor]]:
    """Every device's RNG state of this machine's accelerator, ``{type: [state per device]}``; empty
    when the process never initialized it (a CPU run on a GPU machine creates no context)."""
    kind = _default_kind()
    if kind is None:
        return {}
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "is_initialized") and not module.is_initialized():
        return {}
    acc = for_device(kind)
    return {kind: [acc.get_rng_state(i) for i in range(acc.device_count())]}


def set_rng_states(states: dict[str, list[torch.Tensor]]) -> None:
    """Restore :func:`rng_states` (device types or devices this machine lacks are left alone)."""
    for kind, per_device in states.items():
        try:
            acc = for_device(kind)
        except (ValueError, RuntimeError):
            continue
        if not acc.is_available():
            continue
        for index, state in enumerate(per_device[: acc.device_count()]):
            acc.set_rng_state(state, index)
