"""The optimizer and scheduler wrappers of the resilient forward-backward: each stage steps inside
the schedule.

Megatron-LM's training loop calls ``optimizer.step()`` after the forward-backward and expects
``(update_successful, grad_norm, num_zeros_in_grad)``. Under the staggered optimizer each stage has
stepped already, at its OPT_STEP; :class:`ResilientOptimizer` takes that step (:meth:`run_step`, the
executor's step function) and its ``step()`` returns what it did. :class:`ResilientScheduler` does
the same for megatron-core's ``OptimizerParamScheduler``: the schedule steps it right after the
stage's update (so a snapshot or a rollback holds weights, moments and learning-rate schedule of
one and the same step), and the loop's ``opt_param_scheduler.step(increment=...)`` is checked and
otherwise a no-op.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError, ResilienceError

__all__ = ["ResilientOptimizer", "ResilientScheduler"]


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

    @classmethod
    def with_fp32_masters(cls, optimizer: Any, model: Any) -> "ResilientOptimizer":
        """A bf16/fp16 chunk's optimizer over fp32 master weights (``runtime.precision``): each
        micro-batch's low-precision gradient is accumulated into the masters' fp32 gradient, the
        clipping and the update run on the masters, which are copied back into the chunk. The
        torch ``optimizer`` is built over ``model.parameters()`` as usual; its moments are fp32."""
        from ..runtime.precision import MixedPrecisionOptimizer

        params = [p for p in model.parameters() if p.requires_grad]
        return cls(MixedPrecisionOptimizer(optimizer, params))

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


class ResilientScheduler:
    """megatron-core's ``OptimizerParamScheduler`` (or any scheduler with ``step(increment)``,
    ``state_dict()`` and ``load_state_dict()``), stepped by the resilient schedule.

    Give it to :class:`~ds_resilience.megatron.schedule.ResilientForwardBackward` (``scheduler=``):
    right after each successful update of the stage the schedule calls the wrapped scheduler's
    ``step(increment=global batch size)``, which is what Megatron-LM's ``train_step`` does after
    ``optimizer.step()``; the loop's own call then only checks its increment. Everything else is
    the wrapped scheduler's.
    """

    def __init__(self, scheduler: Any) -> None:
        for name in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(scheduler, name, None)):
                raise TypeError(f"ResilientScheduler wraps a scheduler with step(increment), state_dict() and "
                                f"load_state_dict(); {type(scheduler).__name__} has no {name}()")
        self.scheduler = scheduler
        self.increment: int | None = None  # the global batch size (set by the forward-backward)

    def run_step(self) -> None:
        """The schedule's scheduler step, right after the stage's update."""
        if self.increment is None:
            raise ResilienceError("ResilientScheduler stepped before a resilient forward-backward adopted it")
        self.scheduler.step(increment=self.increment)

    def step(self, increment: int | None = None, *args: Any, **kwargs: Any) -> None:
        """The training loop's call: the schedule stepped already; a different increment (a batch-size
        ramp-up, which this schedule does not run) is an error."""
        if increment is not None and self.increment is not None and increment != self.increment:
            raise ConfigError("--rampup-batch-size", f"opt_param_scheduler.step(increment={increment}) but the "
                                                     f"resilient schedule steps it by the global batch size "
                                                     f"{self.increment} per iteration")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)
