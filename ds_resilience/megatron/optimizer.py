"""The optimizer wrapper of the resilient forward-backward: each stage steps inside the schedule.

Megatron-LM's training loop calls ``optimizer.step()`` after the forward-backward and expects
``(update_successful, grad_norm, num_zeros_in_grad)``. Under the staggered optimizer each stage has
stepped already, at its OPT_STEP; :class:`ResilientOptimizer` takes that step (:meth:`run_step`, the
executor's step function) and its ``step()`` returns what it did.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError, ResilienceError

__all__ = ["ResilientOptimizer"]


class ResilientOptimizer:
    """A megatron-core (or torch) optimizer whose step the resilient schedule takes per stage.

    Inside the schedule, at the stage's OPT_STEP, :meth:`run_step` steps the wrapped optimizer
    (gradients already reduced over the survivors and clipped by the global norm). The training
    loop's own ``optimizer.step()`` afterwards returns what that step did, as megatron-core's
    optimizers do: ``(update_successful, grad_norm, num_zeros_in_grad)``. Everything else
    (``zero_grad``, ``state_dict``, ``param_groups``, ...) is the wrapped optimizer's.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self._result: tuple[bool, float | None, int | None] | None = None
        self.grad_norm: Callable[[], float | None] = lambda: None
        self.steps = 0
        # megatron-core's optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params): their step
        # clips by a norm all-reduced over the model-parallel group (a barrier across stages that a
        # dead rank hangs) and fp16's loss scaler all-reduces its overflow flag the same way
        self.megatron = all(hasattr(optimizer, a) for a in ("prepare_grads", "step_with_ready_grads", "config"))
        if self.megatron:
            if getattr(optimizer, "grad_scaler", None) is not None:
                raise ConfigError("--fp16", "megatron-core's loss scaler all-reduces its overflow flag over the "
                                            "model-parallel group, which a staggered step cannot wait for; use "
                                            "--bf16 (no loss scaling) or fp32")
            self.megatron_clip_grad = float(optimizer.config.clip_grad)
            optimizer.config.clip_grad = 0.0  # the schedule clips by the global norm over the survivors

    def run_step(self, *, zero_grad: bool = True, skip: bool = False) -> None:
        """The stage's step, called by the executor (gradients reduced and clipped already)."""
        ok = not skip
        if not skip:
            if self.megatron:  # its gradient preparation (bf16: copy into the fp32 main grads) and update
                ok = not self.optimizer.prepare_grads() and bool(self.optimizer.step_with_ready_grads())
            else:
                self.optimizer.step()
            self.steps += 1
        self._result = (ok, self.grad_norm(), None)
        if zero_grad:
            self.optimizer.zero_grad()

    def step(self, *args: Any, **kwargs: Any) -> tuple[bool, float | None, int | None]:
        """What the training loop calls after the forward-backward: the schedule's step result.

        Raises:
            ResilienceError: no step was taken since the last call (the resilient forward-backward
                did not run, or ran ``forward_only``).
        """
        if self._result is None:
            raise ResilienceError("optimizer.step() without a resilient forward-backward before it: the schedule "
                                  "steps each stage itself; call the function get_forward_backward_func() returns")
        result, self._result = self._result, None
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)
