"""What a snapshot holds: everything one worker needs to resume exactly where it was.

:func:`collect` gathers a worker's training state as a nest of live tensors and plain values (the
snapshot store copies the tensors, so nothing is cloned here); :func:`apply` puts a loaded state
back. The state of step ``s`` is taken right after the worker's optimizer step ``s``:

* ``params``: the stage's trainable parameters, in module order;
* ``optimizer``: the optimizer's ``state_dict`` (moments, step counts, param groups and LR);
* ``lr_scheduler``: the scheduler's ``state_dict`` (or ``None``);
* ``steps`` and ``samples``: DeepSpeed's ``global_steps`` and ``global_samples``;
* ``rng``: the torch CPU (and, when present, CUDA), Python and NumPy generators;
* ``sampler``: the data position. Micro-batches are addressed by ``(pipeline, iteration,
  micro-batch)`` through ``batch_source``, so the position is the iteration: ``steps``.
"""

from __future__ import annotations

import pickle
import random
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ResilienceError
from ..runtime.snapshot import load_into

__all__ = ["STATE_FORMAT", "StateMismatch", "apply", "collect"]

STATE_FORMAT = 1


class StateMismatch(ResilienceError):
    """A snapshot does not fit the worker it is applied to (other stage, other parameter shapes)."""


def collect(*, params: Sequence[torch.Tensor], optimizer: Any, lr_scheduler: Any, steps: int, samples: int,
            stage: int, rank: int) -> dict[str, Any]:
    """The worker's state as live tensors plus plain values (copy it before training goes on)."""
    # the Python and NumPy states pickled whole: one plain value each, not 625 ints to walk
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": pickle.dumps(random.getstate()),
                           "numpy": pickle.dumps(np.random.get_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "format": STATE_FORMAT,
        "rank": rank,
        "stage": stage,
        "steps": steps,
        "samples": samples,
        "params": [p.detach() for p in params],
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "rng": rng,
        "sampler": {"iteration": steps},
    }


def apply(state: dict[str, Any], *, params: Sequence[torch.nn.Parameter], optimizer: Any, lr_scheduler: Any,
          stage: int) -> tuple[int, int]:
    """Copy ``state`` into the live objects; returns ``(steps, samples)`` for the engine's counters.

    Raises:
        StateMismatch: other format, other stage, or parameters of other count or shape.
    """
    if state.get("format") != STATE_FORMAT:
        raise StateMismatch(f"snapshot format {state.get('format')!r}, this version reads {STATE_FORMAT}")
    if state["stage"] != stage:
        raise StateMismatch(f"snapshot is of stage {state['stage']}, this worker runs stage {stage}")
    saved = state["params"]
    if len(saved) != len(params) or any(s.shape != p.shape for s, p in zip(saved, params)):
        raise StateMismatch(
            f"snapshot has {len(saved)} parameters {[tuple(s.shape) for s in saved][:4]}..., the stage has "
            f"{len(params)} {[tuple(p.shape) for p in params][:4]}...")
    load_into(params, saved, optimizer, state["optimizer"], lr_scheduler, state["lr_scheduler"])
    rng = state["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(pickle.loads(rng["python"]))
    np.random.set_state(pickle.loads(rng["numpy"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(state["steps"]), int(state["samples"])
