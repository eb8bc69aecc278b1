"""The DeepSpeed pipeline instruction that carries an IR action, and the schedule that yields them.

DeepSpeed's ``PipelineEngine._exec_schedule`` dispatches each instruction through
``_INSTRUCTION_MAP[type(instruction)]``. One instruction type, :class:`IRAction`, carries any IR
action; the engine maps it to one method that hands the action to the executor's table
(``ActionKind -> callable``): one dispatch, not one per layer.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds_schedule

from ..ir import Action

__all__ = ["ActionSchedule", "IRAction"]


class IRAction(ds_schedule.PipeInstruction):
    """A pipeline instruction carrying one IR action (``self.action``)."""

    def __init__(self, action: Action) -> None:
        super().__init__(action=action)


class ActionSchedule(ds_schedule.PipeSchedule):
    """A DeepSpeed ``PipeSchedule`` that yields one worker's IR actions, one per step."""

    def __init__(self, actions: tuple[Action, ...], micro_batches: int, stages: int, stage_id: int, buffers: int) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self._actions = actions
        self._buffers = buffers

    def steps(self):
        for action in self._actions:
            yield [IRAction(action)]

    def num_pipe_buffers(self) -> int:
        return max(2, self._buffers)
