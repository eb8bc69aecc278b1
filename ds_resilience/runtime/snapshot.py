"""A stage's training state in host memory: parameters, optimizer state, LR scheduler, step count.

Two uses: the pre-step snapshot a stage keeps until the iteration is known complete everywhere (so a
stage that stepped before a peer failed can roll back and replay the iteration), and the state a
surviving data-parallel peer hands to a re-joining worker. Copies are deep (``clone``), so later
in-place optimizer updates never reach a snapshot.
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["StageSnapshot", "load_into", "take_snapshot", "restore_snapshot", "snapshot_to_bytes", "snapshot_from_bytes"]


@dataclass
class StageSnapshot:
    """Everything needed to put a stage back to where it was after ``steps`` optimizer steps."""

    steps: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any] | None
    lr_scheduler: dict[str, Any] | None

    @property
    def nbytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.params)
        for state in (self.optimizer or {}).get("state", {}).values():
            for v in state.values():
                if torch.is_tensor(v):
                    total += v.numel() * v.element_size()
        return total


def _clone_state(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_state(v) for v in obj)
    return copy.deepcopy(obj)


def take_snapshot(params: Sequence[torch.nn.Parameter], optimizer: Any, lr_scheduler: Any, steps: int) -> StageSnapshot:
    """Deep-copy the stage's state."""
    return StageSnapshot(
        steps=steps,
        params=[p.detach().clone() for p in params],
        optimizer=_clone_state(optimizer.state_dict()) if optimizer is not None else None,
        lr_scheduler=_clone_state(lr_scheduler.state_dict()) if lr_scheduler is not None else None,
    )


def load_into(params: Sequence[torch.nn.Parameter], saved: Sequence[torch.Tensor], optimizer: Any,
              optimizer_state: dict[str, Any] | None, lr_scheduler: Any, scheduler_state: dict[str, Any] | None) -> None:
    """Copy saved parameters into the live ones (gradients dropped) and load the optimizer and
    scheduler states; the states are loaded as given (pass copies if they are kept for reuse)."""
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    if optimizer is not None and optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if lr_scheduler is not None and scheduler_state is not None:
        lr_scheduler.load_state_dict(scheduler_state)


def restore_snapshot(snapshot: StageSnapshot, params: Sequence[torch.nn.Parameter], optimizer: Any, lr_scheduler: Any) -> int:
    """Copy ``snapshot`` back into the live objects; returns its step count (the snapshot stays
    reusable: its optimizer and scheduler states are loaded from copies)."""
    if len(snapshot.params) != len(params):
        raise ValueError(f"snapshot has {len(snapshot.params)} parameters, the stage has {len(params)}")
    load_into(params, snapshot.params, optimizer, _clone_state(snapshot.optimizer), lr_scheduler,
              _clone_state(snapshot.lr_scheduler))
    return snapshot.steps


def snapshot_to_bytes(snapshot: StageSnapshot) -> torch.Tensor:
    """Serialize to a uint8 tensor (to send to a re-joining peer)."""
    buf = io.BytesIO()
    torch.save({"steps": snapshot.steps, "params": snapshot.params, "optimizer": snapshot.optimizer,
                "lr_scheduler": snapshot.lr_scheduler}, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def snapshot_from_bytes(data: torch.Tensor) -> StageSnapshot:
    raw = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    return StageSnapshot(steps=raw["steps"], params=raw["params"], optimizer=raw["optimizer"], lr_scheduler=raw["lr_scheduler"])
