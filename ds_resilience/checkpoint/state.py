"""One stage's training state: the one value that rollback, snapshots, re-join and restore move.

:class:`StageState` holds everything a worker needs to resume exactly where it was after ``steps``
optimizer steps:

* ``params``: the stage's trainable parameters, in module order;
* ``optimizer``: the optimizer's ``state_dict`` (moments, step counts, param groups and LR);
* ``lr_scheduler``: the scheduler's ``state_dict`` (or ``None``);
* ``steps`` and ``samples``: the engine's ``global_steps`` and ``global_samples``;
* ``rng``: the torch CPU, Python and NumPy generators, and each device's generator of the
  machine's accelerator when the process initialized it (keyed by device type), as plain values;
* ``sampler``: the data position. Micro-batches are addressed by ``(pipeline, iteration,
  micro-batch)``, so the position is the iteration: ``steps``.

:func:`capture` takes it from a live stage (tensors are the live ones, not copies: the snapshot
store copies them; :meth:`StageState.clone` makes the pre-step copy a rollback needs, in host
memory when asked: a second copy of a GPU stage's weights and moments would not fit beside them);
:func:`apply` puts one back. :meth:`StageState.to_tree` is the nest the staging pipeline flattens
into a payload and a JSON layout, and :meth:`StageState.from_tree` reads one back, checking it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..accelerator import on_device, rng_states, set_rng_states, wait_current_stream
from ..errors import ResilienceError

__all__ = ["STATE_FORMAT", "StageHost", "StageState", "StateMismatch", "apply", "apply_tree", "capture", "clone_tree", "collect", "refill_tree",
           "tree_nbytes"]

STATE_FORMAT = 2
_KEYS = ("format", "rank", "stage", "steps", "samples", "params", "optimizer", "lr_scheduler", "rng", "sampler", "extra")


class StateMismatch(ResilienceError):
    """A state does not fit the worker it is applied to (other stage, other parameter shapes), or a
    tree is not a stage state of this format."""


class StageHost(Protocol):
    """What a training engine exposes for its stage's state (DeepSpeed's and Megatron's adapters)."""

    parameters: Sequence[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: Any

    def counters(self) -> tuple[int, int]:
        """``(steps, samples)``: optimizer steps and samples trained so far."""

    def set_counters(self, steps: int, samples: int) -> None:
        """Set the engine's step and sample counters (after a state was applied)."""


def tree_nbytes(obj: Any) -> int:
    """Bytes of the tensors in a nest of dicts, lists and tuples."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tree_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tree_nbytes(v) for v in obj)
    return 0


def clone_tree(obj: Any, *, host: bool = False) -> Any:
    """A deep copy of a nest of containers, tensors (cloned) and plain values. ``host``: tensors
    on an accelerator are copied into (page-locked) host memory instead, asynchronously; the
    caller synchronizes once (:func:`_host_copy` explains)."""
    if torch.is_tensor(obj):
        return _host_copy(obj) if host and on_device(obj) else obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_tree(v, host=host)) for k, v in obj.items())
    if isinstance(obj, list):
        return [clone_tree(v, host=host) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v, host=host) for v in obj)
    return obj


def refill_tree(obj: Any, into: Any, *, host: bool = False) -> Any:
    """:func:`clone_tree`, reusing the tensors of ``into`` (an earlier clone of a nest of the same
    shape) where they match in shape, dtype and place: a copy into memory already mapped, where a
    fresh clone of a stage's parameters and moments pays the allocation and its page faults each
    step (most of the 0.3 s a 200 MB pre-step copy took on a loaded CPU). Anything that does not
    match is cloned."""
    if torch.is_tensor(obj):
        src = obj.detach()
        if (torch.is_tensor(into) and into.shape == src.shape and into.dtype == src.dtype
                and (into.device == src.device if not (host and on_device(src)) else not on_device(into))):
            into.copy_(src, non_blocking=host and on_device(src))
            return into
        return clone_tree(obj, host=host)
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return type(obj)((k, refill_tree(v, prev.get(k), host=host)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        prev = into if isinstance(into, (list, tuple)) and len(into) == len(obj) else [None] * len(obj)
        out = [refill_tree(v, q, host=host) for v, q in zip(obj, prev)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into fresh page-locked host memory on the current stream (non-blocking:
    the copy is ordered after the work that produced the tensor and before later in-place
    updates on the same stream; :meth:`StageState.clone` waits for it once)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    out.copy_(tensor.detach(), non_blocking=True)
    return out


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    rng.update(rng_states())  # {"cuda": [one state per device]} on a GPU machine
    return rng


def _set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, internal, gauss = rng["python"]
    random.setstate((int(version), tuple(int(x) for x in internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    set_rng_states({k: v for k, v in rng.items() if k not in ("torch", "python", "numpy")})


@dataclass
class StageState:
    """A stage's training state (see the module docstring)."""

    stage: int
    rank: int
    steps: int
    samples: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it holds."""
        return tree_nbytes([self.params, self.optimizer, self.lr_scheduler, self.extra])

    def clone(self, *, host: bool = False, reuse: "StageState | None" = None) -> "StageState":
        """A deep copy: later in-place optimizer updates never reach it. ``host``: tensors on an
        accelerator go to host memory (the pre-step copy of a GPU stage), with one synchronization
        for the whole state; :func:`apply` copies them back onto the stage's device. ``reuse``: an
        earlier clone no one reads any more, whose tensors are filled instead of allocated
        (:func:`refill_tree`)."""
        if reuse is not None:
            copy = replace(self, params=refill_tree(list(self.params), reuse.params, host=host),
                           optimizer=refill_tree(self.optimizer, reuse.optimizer, host=host),
                           lr_scheduler=refill_tree(self.lr_scheduler, reuse.lr_scheduler, host=host),
                           rng=clone_tree(self.rng), extra=refill_tree(self.extra, reuse.extra, host=host))
        else:
            copy = replace(self, params=[clone_tree(p, host=host) for p in self.params],
                           optimizer=clone_tree(self.optimizer, host=host),
                           lr_scheduler=clone_tree(self.lr_scheduler, host=host), rng=clone_tree(self.rng),
                           extra=clone_tree(self.extra, host=host))
        for device in ({p.device for p in self.params if on_device(p)} if host else ()):
            wait_current_stream(device)  # the host copies were queued on it: one wait per device
        return copy

    def to_tree(self) -> dict[str, Any]:
        """The nest the staging pipeline flattens (tensors plus plain values)."""
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "stage": self.stage,
            "steps": self.steps,
            "samples": self.samples,
            "params": list(self.params),
            "optimizer": self.optimizer,
            "lr_scheduler": self.lr_scheduler,
            "rng": self.rng,
            "sampler": {"iteration": self.steps},
            "extra": self.extra,
        }

    @classmethod
    def from_tree(cls, tree: Any) -> "StageState":
        """Read :meth:`to_tree`'s nest back (from a snapshot, a peer, or disk).

        Raises:
            StateMismatch: another format, or a missing or malformed field.
        """
        if not isinstance(tree, dict) or tree.get("format") != STATE_FORMAT:
            got = tree.get("format") if isinstance(tree, dict) else type(tree).__name__
            raise StateMismatch(f"snapshot format {got!r}, this version reads {STATE_FORMAT}")
        missing = [k for k in _KEYS if k not in tree]
        if missing:
            raise StateMismatch(f"snapshot lacks {missing}")
        ints = {k: tree[k] for k in ("rank", "stage", "steps", "samples")}
        bad = [k for k, v in ints.items() if isinstance(v, bool) or not isinstance(v, int)]
        if bad or not isinstance(tree["params"], list) or not all(torch.is_tensor(p) for p in tree["params"]):
            raise StateMismatch(f"snapshot fields {bad or ['params']} are malformed")
        return cls(stage=tree["stage"], rank=tree["rank"], steps=tree["steps"], samples=tree["samples"],
                   params=tree["params"], optimizer=tree["optimizer"], lr_scheduler=tree["lr_scheduler"],
                   rng=tree["rng"], extra=tree["extra"] or {})


def capture(host: StageHost, *, stage: int, rank: int) -> StageState:
    """The stage's state as live tensors plus plain values (copy it before training goes on).

    A host that knows the model layer of each parameter (``param_layers``, a pipeline engine's
    stage) records it in ``extra["param_layers"]``: a re-grid cuts a snapshot into layers with it
    (``layer_state.py``), also one of a stage no survivor runs any more."""
    steps, samples = host.counters()
    layers = getattr(host, "param_layers", None)
    extra = {"param_layers": [int(i) for i in layers]} if layers is not None else {}
    groups = getattr(host, "zero_groups", None)  # ZeRO-1: each group's parameters in flat order (a re-grid unshards)
    if groups is not None:
        extra["zero_groups"] = [[int(i) for i in g] for g in groups]
    order = getattr(host, "optimizer_order", None)  # the optimizer numbers parameters in another order than the module
    if order is not None:
        extra["optimizer_order"] = [int(i) for i in order]
    return StageState(
        stage=stage, rank=rank, steps=steps, samples=samples,
        params=[p.detach() for p in host.parameters],
        optimizer=host.optimizer.state_dict() if host.optimizer is not None else None,
        lr_scheduler=host.lr_scheduler.state_dict() if host.lr_scheduler is not None else None,
        rng=_rng_state(),
        extra=extra,
    )


def apply(state: StageState, host: StageHost, *, stage: int) -> None:
    """Copy ``state`` into the live stage (gradients dropped) and set the engine's counters.

    The optimizer and scheduler load copies, so ``state`` stays reusable.

    Raises:
        StateMismatch: another stage, or parameters of other count or shape.
    """
    if state.stage != stage:
        raise StateMismatch(f"snapshot is of stage {state.stage}, this worker runs stage {stage}")
    params = list(host.parameters)
    saved = state.params
    if len(saved) != len(params) or any(s.shape != p.shape for s, p in zip(saved, params)):
        raise StateMismatch(
            f"snapshot has {len(saved)} parameters {[tuple(s.shape) for s in saved][:4]}..., the stage has "
            f"{len(params)} {[tuple(p.shape) for p in params][:4]}...")
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    if host.optimizer is not None and state.optimizer is not None:
        host.optimizer.load_state_dict(clone_tree(state.optimizer))
    if host.lr_scheduler is not None and state.lr_scheduler is not None:
        host.lr_scheduler.load_state_dict(clone_tree(state.lr_scheduler))
    _set_rng_state(state.rng)
    host.set_counters(state.steps, state.samples)


# --- keyword helpers over plain objects (tests, benchmarks) ---------------------------------------------
@dataclass
class _Loose:
    parameters: Sequence[torch.nn.Parameter]
    optimizer: Any
    lr_scheduler: Any
    steps: int = 0
    samples: int = 0

    def counters(self) -> tuple[int, int]:
        return self.steps, self.samples

    def set_counters(self, steps: int, samples: int) -> None:
        self.steps, self.samples = steps, samples


def collect(*, params: Sequence[torch.Tensor], optimizer: Any, lr_scheduler: Any, steps: int, samples: int,
            stage: int, rank: int) -> dict[str, Any]:
    """:func:`capture` of loose objects, as the tree a snapshot store saves."""
    host = _Loose(list(params), optimizer, lr_scheduler, steps, samples)
    return capture(host, stage=stage, rank=rank).to_tree()


def apply_tree(tree: Any, *, params: Sequence[torch.nn.Parameter], optimizer: Any, lr_scheduler: Any,
               stage: int) -> tuple[int, int]:
    """:func:`apply` of a saved tree to loose objects; returns ``(steps, samples)``."""
    host = _Loose(list(params), optimizer, lr_scheduler)
    apply(StageState.from_tree(tree), host, stage=stage)
    return host.steps, host.samples
