"""The unit of a schedule: one :class:`Action` that one worker performs.

Text form (round-trips through :func:`parse_action`)::

    p1s2F5       forward of micro-batch 5 of pipeline 1 at stage 2
    p1s2B5       input-gradient backward (B)       p1s2W5   weight-gradient backward (W)
    p1s2BW5      fused backward (B and W together)
    p1s2SA5>7    send the activation of p1/mb5 (output of stage 2) to worker 7
    p1s3RA5<6    receive the activation of p1/mb5 (input of stage 3) from worker 6
    p1s2SG5>3    send the input gradient of p1/mb5 at stage 2 to worker 3
    p1s1RG5<6    receive the output gradient of p1/mb5 at stage 1 from worker 6
    s2RD         reduce stage 2's gradients over its surviving data-parallel group
    s2OPT        optimizer step of stage 2
    s3TR0        sum the gradients of tied group 0's parameters (e.g. an embedding shared by stages 0
                 and 3) over the surviving workers of every stage of the group; the group index is
                 kept in ``microbatch``
    s2CS3>4      send checkpoint chunk 3 of stage 2 to worker 4    s2CR3<5  receive it

``pipeline`` is whose micro-batch it is: after a failure a worker runs other pipelines' work.
``stage`` is always the stage of the worker that performs the action. REDUCE_GRAD and
TIED_REDUCE are collectives (:data:`COLLECTIVE_KINDS`); OPT_STEP is one too under the ``global``
optimizer (a schedule-level choice, see :class:`~ds_resilience.ir.schedule.Schedule`). Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ..errors import ScheduleError

__all__ = ["ActionKind", "Action", "parse_action", "trusted_action", "COMPUTE_KINDS", "COMM_KINDS", "COLLECTIVE_KINDS"]


class ActionKind(str, Enum):
    """What an action does; the value is its code in the text form."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    REDUCE_GRAD = "RD"
    OPT_STEP = "OPT"
    TIED_REDUCE = "TR"
    CKPT_SEND = "CS"
    CKPT_RECV = "CR"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_collective(self) -> bool:
        """REDUCE_GRAD and TIED_REDUCE (OPT_STEP is a collective only under the global optimizer)."""
        return self in COLLECTIVE_KINDS

    @property
    def is_send(self) -> bool:
        return self in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self in RECV_KINDS


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
SEND_KINDS = frozenset({ActionKind.SEND_ACT, ActionKind.SEND_GRAD, ActionKind.CKPT_SEND})
RECV_KINDS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD, ActionKind.CKPT_RECV})
COMM_KINDS = frozenset(
    {
        ActionKind.SEND_ACT,
        ActionKind.RECV_ACT,
        ActionKind.SEND_GRAD,
        ActionKind.RECV_GRAD,
        ActionKind.CKPT_SEND,
        ActionKind.CKPT_RECV,
    }
)
COLLECTIVE_KINDS = frozenset({ActionKind.REDUCE_GRAD, ActionKind.TIED_REDUCE})
_STAGE_ONLY = frozenset({ActionKind.REDUCE_GRAD, ActionKind.OPT_STEP})
_CKPT = frozenset({ActionKind.CKPT_SEND, ActionKind.CKPT_RECV})
_NO_PIPELINE = _STAGE_ONLY | _CKPT | {ActionKind.TIED_REDUCE}
_NEEDS = {k: (k not in _STAGE_ONLY, k not in _NO_PIPELINE, k in COMM_KINDS) for k in ActionKind}
"""Per kind: whether it needs a micro-batch, a pipeline and a peer (the check of every action)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step of one worker.

    Args:
        kind: what the step does.
        stage: stage of the worker performing it.
        microbatch: micro-batch index within its pipeline (checkpoint chunk index for CKPT_*, tied
            group index for TIED_REDUCE); ``None`` for REDUCE_GRAD and OPT_STEP.
        pipeline: the pipeline whose micro-batch this is; ``None`` for REDUCE_GRAD, OPT_STEP,
            TIED_REDUCE, CKPT_*.
        peer: the other worker's index for sends and receives, else ``None``.
    """

    kind: ActionKind
    stage: int
    microbatch: int | None = None
    pipeline: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not ActionKind:
            kind = ActionKind(kind)
            object.__setattr__(self, "kind", kind)
        # fast path (schedules hold tens of thousands of actions): all fields as the kind needs
        need_mb, need_pipeline, need_peer = _NEEDS[kind]
        mb, pipeline, peer = self.microbatch, self.pipeline, self.peer
        if (self.stage >= 0
                and ((mb is not None and mb >= 0) if need_mb else mb is None)
                and ((pipeline is not None and pipeline >= 0) if need_pipeline else pipeline is None)
                and ((peer is not None and peer >= 0) if need_peer else peer is None)):
            return
        if self.stage < 0:
            raise ScheduleError(f"action {kind.value}: stage must be >= 0, got {self.stage}")
        needs_mb = kind not in _STAGE_ONLY
        needs_pipeline = kind not in _NO_PIPELINE
        needs_peer = kind in COMM_KINDS
        for name, needed, value in (
            ("microbatch", needs_mb, self.microbatch),
            ("pipeline", needs_pipeline, self.pipeline),
            ("peer", needs_peer, self.peer),
        ):
            if needed and (value is None or value < 0):
                if kind is ActionKind.TIED_REDUCE and name == "microbatch":
                    name = "the tied group index (microbatch)"
                raise ScheduleError(f"action {kind.name}: {name} must be an integer >= 0, got {value!r}")
            if not needed and value is not None:
                raise ScheduleError(f"action {kind.name}: takes no {name}, got {value!r}")

    @property
    def key(self) -> tuple[int | None, int, int | None]:
        """(pipeline, stage, microbatch): the identity of the work item."""
        return (self.pipeline, self.stage, self.microbatch)

    @property
    def tied_group(self) -> int | None:
        """The tied group's index of a TIED_REDUCE (its ``microbatch`` field), else ``None``."""
        return self.microbatch if self.kind is ActionKind.TIED_REDUCE else None

    def __str__(self) -> str:
        head = f"p{self.pipeline}" if self.pipeline is not None else ""
        mb = "" if self.microbatch is None else str(self.microbatch)
        tail = ""
        if self.peer is not None:
            tail = (">" if self.kind.is_send else "<") + str(self.peer)
        return f"{head}s{self.stage}{self.kind.value}{mb}{tail}"


_new = object.__new__
_SETTERS = tuple(getattr(Action, name).__set__ for name in ("kind", "stage", "microbatch", "pipeline", "peer"))


def trusted_action(kind: ActionKind, stage: int, microbatch: int | None = None, pipeline: int | None = None,
                   peer: int | None = None) -> Action:
    """An :class:`Action` built without its field checks, a third of the time: only for code that
    builds the fields right by construction (the list scheduler and the lowering, whose schedules
    the validator checks after). ``kind`` must be an :class:`ActionKind`. Equal to (and hashing
    like) ``Action(kind=kind, stage=stage, ...)``."""
    a = _new(Action)
    set_kind, set_stage, set_mb, set_pipeline, set_peer = _SETTERS
    set_kind(a, kind)
    set_stage(a, stage)
    set_mb(a, microbatch)
    set_pipeline(a, pipeline)
    set_peer(a, peer)
    return a


_CODES = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_PATTERN = re.compile(rf"^(?:p(\d+))?s(\d+)({_CODES})(\d+)?(?:([<>])(\d+))?$")


def parse_action(text: str) -> Action:
    """Parse the text form of an action (see the module docstring).

    Raises:
        ScheduleError: the text is not a valid action.
    """
    match = _PATTERN.match(text.strip())
    if not match:
        raise ScheduleError(f"cannot parse action {text!r}; expected e.g. 'p1s2F5', 'p0s1SA3>4', 's2OPT', 's3TR0'")
    pipeline, stage, code, mb, arrow, peer = match.groups()
    kind = ActionKind(code)
    if arrow is not None and ((arrow == ">") != kind.is_send):
        raise ScheduleError(f"action {text!r}: '>' is for sends and '<' for receives")
    return Action(
        kind=kind,
        stage=int(stage),
        microbatch=None if mb is None else int(mb),
        pipeline=None if pipeline is None else int(pipeline),
        peer=None if peer is None else int(peer),
    )
