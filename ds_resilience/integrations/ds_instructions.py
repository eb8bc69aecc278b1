"""DeepSpeed pipeline instructions carrying IR actions, and the schedule that yields them.

One ``PipeInstruction`` subclass per action kind, so the engine's ``_INSTRUCTION_MAP`` dispatches
each kind to its own ``_exec_*`` method, and :class:`ActionSchedule`, a ``PipeSchedule`` that yields
one worker's actions one per step.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule

from ..ir import Action, ActionKind

__all__ = [
    "ActionSchedule",
    "INSTRUCTIONS",
    "ForwardMicroBatch",
    "BackwardInput",
    "BackwardWeight",
    "BackwardFused",
    "SendActivationTo",
    "RecvActivationFrom",
    "SendGradTo",
    "RecvGradFrom",
    "ReduceStageGrads",
    "StageOptimizerStep",
]


class _ActionInstruction(ds_schedule.PipeInstruction):
    """A pipeline instruction carrying one IR action."""

    def __init__(self, action: Action) -> None:
        super().__init__(action=action)


class ForwardMicroBatch(_ActionInstruction):
    """F: forward of (pipeline, micro-batch)."""


class BackwardInput(_ActionInstruction):
    """B: input gradient only."""


class BackwardWeight(_ActionInstruction):
    """W: weight gradient of an earlier B."""


class BackwardFused(_ActionInstruction):
    """BW: full backward."""


class SendActivationTo(_ActionInstruction):
    """Send an activation to any global rank."""


class RecvActivationFrom(_ActionInstruction):
    """Receive an activation from any global rank."""


class SendGradTo(_ActionInstruction):
    """Send an input gradient to any global rank."""


class RecvGradFrom(_ActionInstruction):
    """Receive an output gradient from any global rank."""


class ReduceStageGrads(_ActionInstruction):
    """Sum gradients over this stage's surviving replicas."""


class StageOptimizerStep(_ActionInstruction):
    """This stage's optimizer step."""


INSTRUCTIONS: dict[ActionKind, type[_ActionInstruction]] = {
    ActionKind.F: ForwardMicroBatch,
    ActionKind.B: BackwardInput,
    ActionKind.W: BackwardWeight,
    ActionKind.BW: BackwardFused,
    ActionKind.SEND_ACT: SendActivationTo,
    ActionKind.RECV_ACT: RecvActivationFrom,
    ActionKind.SEND_GRAD: SendGradTo,
    ActionKind.RECV_GRAD: RecvGradFrom,
    ActionKind.REDUCE_GRAD: ReduceStageGrads,
    ActionKind.OPT_STEP: StageOptimizerStep,
}


class ActionSchedule(ds_schedule.PipeSchedule):
    """A DeepSpeed ``PipeSchedule`` that yields one worker's IR actions, one per step."""

    def __init__(self, actions: tuple[Action, ...], micro_batches: int, stages: int, stage_id: int, buffers: int) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self._actions = actions
        self._buffers = buffers

    def steps(self):
        for action in self._actions:
            yield [INSTRUCTIONS[action.kind](action)]

    def num_pipe_buffers(self) -> int:
        return max(2, self._buffers)
