"""The schedule IR: actions, schedules, their renderings, the validator, the timed replay and the
timeline measured from it (iteration time, idle spans, memory peaks).

Pure Python (no torch): layer L0 (docs/reference/layers.md, generated from
tests/unit/test_layering.py). :mod:`.windows` (replication windows) and :mod:`.gantt` (PNG charts,
matplotlib imported lazily) are imported on their own.
"""

from .action import COLLECTIVE_KINDS, COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, parse_action
from .layout import LayerSegment, PipelineGroup, PipelineLayout, PipelineLayoutError, rng_key
from .render import format_grid, format_steps
from .replay import Replay, Transfer, message_key, replay
from .schedule import OPTIMIZER_MODES, Schedule, TiedGroups, check_tied, format_tied, parse_tied
from .timeline import (
    STEADY_ITERATIONS,
    Timeline,
    complement,
    iteration_ends,
    iteration_time,
    memory_peaks,
    merge_spans,
    simulate,
    steady_period,
)
from .validate import validate

__all__ = [
    "PipelineGroup",
    "PipelineLayout",
    "PipelineLayoutError",
    "LayerSegment",
    "rng_key",
    "Action",
    "ActionKind",
    "COLLECTIVE_KINDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "OPTIMIZER_MODES",
    "Replay",
    "STEADY_ITERATIONS",
    "Schedule",
    "TiedGroups",
    "Timeline",
    "Transfer",
    "check_tied",
    "complement",
    "format_grid",
    "format_steps",
    "format_tied",
    "iteration_ends",
    "iteration_time",
    "memory_peaks",
    "merge_spans",
    "message_key",
    "parse_action",
    "parse_tied",
    "replay",
    "simulate",
    "steady_period",
    "validate",
]
