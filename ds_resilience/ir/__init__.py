"""The schedule IR: actions, schedules, their renderings, the validator and the timed replay.

Pure Python (no torch): see ARCHITECTURE.md, layer L0.
"""

from .action import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, parse_action
from .render import format_grid, format_steps
from .replay import Replay, Transfer, message_key, replay
from .schedule import OPTIMIZER_MODES, Schedule
from .validate import validate

__all__ = [
    "Action",
    "ActionKind",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "OPTIMIZER_MODES",
    "Replay",
    "Schedule",
    "Transfer",
    "format_grid",
    "format_steps",
    "message_key",
    "parse_action",
    "replay",
    "validate",
]
