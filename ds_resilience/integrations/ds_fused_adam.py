"""DeepSpeed's CPU FusedAdam keeps hidden state in its C++ op; a process that resumes mid-run walks it.

The CPU build of ``deepspeed.ops.adam.FusedAdam`` (``csrc/cpu/adam/fused_adam.cpp``) keeps one
process-wide optimizer object per Adam mode whose bias-correction powers ``beta1**t`` and
``beta2**t`` are *products*: each step one past the last multiplies them by the betas once, any
other step recomputes them with ``std::pow``. The two differ in the last bit of a float. A process
that trained from step 1 holds the product; one that starts at step ``n > 0`` (a re-joined worker
given a peer's state, every worker after a restart from the snapshots) would take ``pow`` at its
first step, so its first update differs from its peers' by rounding, enough for a bf16 parameter
to round the other way and the run to leave the fault-free one's trajectory.

:func:`align_bias_correction` walks the op through steps ``1..n`` on a one-element tensor before
such a process's first step, so it holds the very product a process that trained throughout holds.
The CUDA op recomputes the powers every step and needs nothing; the call is then a no-op.

A user's own ``load_checkpoint`` is different: there the reference is vanilla DeepSpeed resuming
from the same files, whose op takes whatever its process's history gives it, so after a load the
walk is skipped (:func:`resumed_as_loaded`) and the steps go on exactly as vanilla's.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["align_bias_correction", "counts_steps_per_group", "fused_cpu_adam", "resumed_as_loaded"]

_WALKED: dict[int, int] = {}  # Adam mode -> the step the op's powers were walked to or last stepped at


def fused_cpu_adam(optimizer: Any) -> Any | None:
    """The CPU FusedAdam inside ``optimizer`` (a mixed-precision or ZeRO-1 wrapper's), or ``None``."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if type(optimizer).__name__ == "FusedAdam" and hasattr(optimizer, "multi_tensor_adam"):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            return optimizer if params and params[0].device.type == "cpu" else None
        optimizer = getattr(optimizer, "stepper", None) or getattr(optimizer, "optimizer", None) \
            or getattr(optimizer, "inner", None)
    return None


def counts_steps_per_group(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the one a mixed-precision or ZeRO-1 wrapper steps) is DeepSpeed's
    ``FusedAdam`` on any device: it steps a whole parameter group with the ``"step"`` of the group's
    last parameter and advances only that one (``checkpoint/layer_state.py`` re-cuts such groups)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if type(optimizer).__name__ == "FusedAdam" and hasattr(optimizer, "multi_tensor_adam"):
            return True
        optimizer = getattr(optimizer, "stepper", None) or getattr(optimizer, "optimizer", None) \
            or getattr(optimizer, "inner", None)
    return False


def _step_count(adam: Any) -> int:
    """The step FusedAdam passes next minus one (it counts on the last parameter of each group)."""
    steps = [int(s["step"]) for s in adam.state.values() if "step" in s]
    return max(steps, default=0)


def align_bias_correction(optimizer: Any) -> int:
    """Before ``optimizer.step()``: make the CPU op's bias-correction powers the product over steps
    ``1..n`` when this process did not take steps up to ``n`` itself (``n``: the step count the
    optimizer resumes from). Returns how many steps were walked (0: nothing to do)."""
    adam = fused_cpu_adam(optimizer)
    if adam is None:
        return 0
    mode = int(adam.adam_w_mode)
    n = _step_count(adam)
    last = _WALKED.get(mode, 0)
    walked = 0
    if n > 0 and last not in (n, n + 1):  # n + 1: a rolled-back step redone, the op holds its powers
        group = adam.param_groups[0]
        beta1, beta2 = group["betas"]
        one = [[torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)]]
        flag = torch.zeros(1, dtype=torch.int)
        for t in range(1, n + 1):
            adam.multi_tensor_adam(2048 * 32, flag, one, 0.0, beta1, beta2, 1e-8, t, mode, 1, 0.0)
        walked = n
    _WALKED[mode] = n + 1  # the step about to be taken
    return walked


def resumed_as_loaded(optimizer: Any) -> None:
    """After a user's ``load_checkpoint``: the next steps go on as vanilla DeepSpeed's after its own
    load would (no walk), whatever step the checkpoint holds."""
    adam = fused_cpu_adam(optimizer)
    if adam is not None:
        _WALKED[int(adam.adam_w_mode)] = _step_count(adam)
