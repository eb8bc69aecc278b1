"""Mixed precision for one stage: bf16/fp16 compute, fp32 master weights, fp32 gradient accumulation.

:class:`MixedPrecisionOptimizer` wraps the user's (DeepSpeed-built) optimizer, what DeepSpeed's
``BF16_Optimizer`` / ``FP16_Optimizer`` do for a pipeline stage, but with no collective of its own:
the executor reduces, clips and validates over the survivors' groups, so the stage still steps on
its own and after a failure nothing waits for a dead rank.

* The module's parameters stay in low precision (``bf16``/``fp16``): forward, backward and the
  activations and gradients sent between stages are in that precision.
* Each trainable parameter has an fp32 master; the wrapped optimizer's ``param_groups`` point at the
  masters, so its moments are fp32 and the learning-rate scheduler drives it as before.
* After every micro-batch's weight gradient (W, or a fused BW), :meth:`accumulate` adds the
  low-precision ``.grad`` into the master's fp32 ``.grad`` (unscaled by the fp16 loss scale) and
  drops the low-precision one: gradient accumulation is fp32.
* :meth:`step` steps the masters and copies them back into the low-precision parameters.
* fp16: a dynamic loss scale (DeepSpeed's rules: halve on overflow, grow by ``scale_factor`` after
  ``loss_scale_window`` good steps, ``hysteresis``, ``min_loss_scale``); the scale is multiplied into
  the last stage's loss; an overflow anywhere skips the step on every stage (the executor's
  validation decides it globally and calls :meth:`skip`), and every stage updates its scale from
  the same global outcome, so all scales stay equal.
* :meth:`state_dict` holds the masters, the wrapped optimizer's state and the scaler: a rollback
  or a snapshot restores the fp32 masters, never only the low-precision weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from ..errors import ConfigError

__all__ = ["DynamicLossScaler", "MixedPrecisionOptimizer"]


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scaling with DeepSpeed's rules (``fp16`` section: ``initial_scale_power``,
    ``loss_scale_window``, ``hysteresis``, ``min_loss_scale``; ``loss_scale`` > 0 is static)."""

    scale: float = 2.0 ** 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    dynamic: bool = True
    good_steps: int = 0
    hysteresis_left: int = 2

    @classmethod
    def from_config(cls, fp16: dict[str, Any]) -> "DynamicLossScaler":
        static = float(fp16.get("loss_scale", 0) or 0)
        if static > 0:
            return cls(scale=static, dynamic=False)
        hysteresis = int(fp16.get("hysteresis", 2))
        return cls(scale=2.0 ** int(fp16.get("initial_scale_power", 16)), window=int(fp16.get("loss_scale_window", 1000)),
                   hysteresis=hysteresis, min_scale=float(fp16.get("min_loss_scale", 1)), hysteresis_left=hysteresis)

    def update(self, overflow: bool) -> None:
        """The outcome of one step (the same on every stage)."""
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / self.factor, self.min_scale)
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= self.factor
            self.hysteresis_left = self.hysteresis


class MixedPrecisionOptimizer:
    """A stage's optimizer over fp32 masters of low-precision parameters (see the module docstring).

    Args:
        optimizer: the wrapped optimizer, built over ``params`` (its ``param_groups`` are re-pointed
            at the masters here).
        params: the stage's trainable low-precision parameters.
        scaler: the fp16 loss scaler (``None`` for bf16).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], *,
                 scaler: DynamicLossScaler | None = None) -> None:
        self.optimizer = optimizer
        self.lp_params = list(params)
        self.masters = [p.detach().clone().float().requires_grad_(True) for p in self.lp_params]
        master_of = {id(p): m for p, m in zip(self.lp_params, self.masters)}
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if id(p) not in master_of]
            if missing:
                raise ConfigError("optimizer", f"{len(missing)} optimizer parameters are not trainable stage "
                                  f"parameters; mixed precision needs the optimizer built over the stage's parameters")
            group["params"] = [master_of[id(p)] for p in group["params"]]
        optimizer.state.clear()
        self.stepper: Any = optimizer  # what steps and holds the state: the optimizer, or its ZeRO-1 shard
        self.scaler = scaler
        self.master_of = master_of
        self.skipped_steps = 0

    # --- what DeepSpeed's engine and the LR scheduler read -------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:  # DeepSpeed's FP16_Optimizer attribute name
        return self.loss_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.lp_params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    # --- the stage's gradients and step -----------------------------------------------------------
    def accumulate(self) -> None:
        """Fold the low-precision gradients of one micro-batch into the fp32 masters."""
        inv = 1.0 / self.loss_scale
        for p, m in zip(self.lp_params, self.masters):
            if p.grad is None:
                continue
            g = p.grad.detach().float()
            if inv != 1.0:
                g = g.mul_(inv)
            if m.grad is None:
                m.grad = g
            else:
                m.grad.add_(g)
            p.grad = None

    def overflow(self) -> bool:
        """Whether any master gradient is inf or nan (fp16's overflow test)."""
        return any(m.grad is not None and not bool(torch.isfinite(m.grad).all()) for m in self.masters)

    def shard(self, sharded: Any) -> None:
        """Step through ``sharded`` (``runtime.zero.ShardedOptimizer`` over this optimizer's masters);
        ``optimizer`` stays the torch optimizer the LR scheduler drives."""
        self.stepper = sharded

    def step(self, closure=None) -> None:
        self.stepper.step()
        with torch.no_grad():
            for p, m in zip(self.lp_params, self.masters):
                p.copy_(m.to(p.dtype))

    def skip(self) -> None:
        """A step skipped by a global overflow: nothing changes but the count."""
        self.skipped_steps += 1

    # --- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.stepper.state_dict(), "masters": [m.detach() for m in self.masters],
                "scaler": asdict(self.scaler) if self.scaler is not None else None, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any], load_optimizer_states: bool = True) -> None:
        """``load_optimizer_states``: DeepSpeed's keyword (it calls this only to load them)."""
        self.stepper.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
        if self.scaler is not None and state.get("scaler") is not None:
            for key, value in state["scaler"].items():
                setattr(self.scaler, key, value)
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        scale = f", loss scale {self.loss_scale:g}" if self.scaler is not None else ""
        dtype = self.lp_params[0].dtype if self.lp_params else "?"
        return f"MixedPrecisionOptimizer({type(self.optimizer).__name__}, {dtype} params, fp32 masters{scale})"
