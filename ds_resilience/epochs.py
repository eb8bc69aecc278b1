"""Membership records: the agent's epochs and the workers' registrations, as JSON values.

The agent (``supervisor/agent.py``) publishes one :class:`EpochRecord` per membership change; each
worker publishes one :class:`WorkerInfo` when it starts. Both are frozen values that check
themselves on construction and travel through the store as JSON (never pickled). Pure Python:
the recovery planner (``planning/recovery.py``) reads them without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ResilienceError

__all__ = ["EPOCH_KINDS", "STOP_KINDS", "SWITCH_KINDS", "EpochRecord", "MembershipError", "SlowRequest", "WorkerInfo"]

EPOCH_KINDS = ("start", "crash", "hang", "rejoin", "stop", "interrupt", "slow")
STOP_KINDS = ("stop", "interrupt")
SWITCH_KINDS = ("rejoin", "slow")
"""Epochs that interrupt nothing in flight: each rank applies them at its next training iteration's
boundary (a re-join; a switch of schedule for slow workers)."""


class MembershipError(ResilienceError):
    """A membership record is malformed, or the agent's store cannot be reached in time."""


def _ranks(value: Any, name: str) -> tuple[int, ...]:
    ranks = tuple(value)
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise MembershipError(f"{name} must be non-negative integer ranks, got {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise MembershipError(f"{name} has duplicate ranks: {ranks!r}")
    return tuple(sorted(ranks))


@dataclass(frozen=True, kw_only=True)
class EpochRecord:
    """One membership epoch, as published by the agent.

    Attributes:
        epoch: 1 at launch, +1 for every change.
        failed: global ranks gone at this epoch (cumulative; a re-joined rank leaves it).
        alive: global ranks that are members (disjoint from ``failed``).
        joining: ranks (a subset of ``alive``) that re-join in this epoch and need state.
        stop: the job must stop (a stage lost every replica, or the job was interrupted): save a
            checkpoint and exit 0.
        restart: with ``stop``: the agent restarts every worker from the in-memory snapshots, so
            survivors only make sure their newest snapshot is committed, then exit 0.
        reason: a human-readable cause, e.g. ``"rank 2 crashed (killed by SIGKILL)"``.
        detected_at: the agent's ``time.time()`` when it detected the change.
        kind: ``"start" | "crash" | "hang" | "rejoin" | "stop" | "interrupt" | "slow"`` (a graceful
            stop on SIGTERM or SIGINT: every stage saves; ``slow``: the membership is unchanged, the
            schedule switches to the plan for ``speeds``).
        speeds: with ``slow``: the workers found slow, ``(rank, speed)`` sorted by rank, each speed
            in (0, 1) (its stage peers' pace over its own); empty: none is slow any more (back to
            the schedule of the failed set). Empty for every other kind.
        grows: with ``rejoin``: the survivors re-formed the grid without the joining ranks (a live
            re-grid), and the joiners and they re-form the first grid (``integrations/ds_grow.py``)
            instead of the joiners taking a peer's state; the agent publishes it only once the
            survivors' re-grid is done and every rank left out came back.
    """

    epoch: int
    failed: tuple[int, ...]
    alive: tuple[int, ...]
    joining: tuple[int, ...] = ()
    stop: bool = False
    reason: str = ""
    detected_at: float = 0.0
    kind: str = "start"
    restart: bool = False
    speeds: tuple[tuple[int, float], ...] = ()
    grows: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "speeds", _speeds(self.speeds))
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 1:
            raise MembershipError(f"epoch must be an integer >= 1, got {self.epoch!r}")
        for name in ("failed", "alive", "joining"):
            object.__setattr__(self, name, _ranks(getattr(self, name), name))
        if set(self.failed) & set(self.alive):
            raise MembershipError(f"ranks both failed and alive: {sorted(set(self.failed) & set(self.alive))}")
        if not set(self.joining) <= set(self.alive):
            raise MembershipError(f"joining ranks {self.joining} must be alive ({self.alive})")
        if self.kind not in EPOCH_KINDS:
            raise MembershipError(f"kind must be one of {EPOCH_KINDS}, got {self.kind!r}")
        if bool(self.stop) != (self.kind in STOP_KINDS):
            raise MembershipError(f"stop={self.stop!r} contradicts kind={self.kind!r}")
        if self.restart and not self.stop:
            raise MembershipError("restart=True needs stop=True")
        if self.speeds and self.kind != "slow":
            raise MembershipError(f"speeds {self.speeds!r} only go with kind 'slow', got {self.kind!r}")
        if not isinstance(self.grows, bool):
            raise MembershipError(f"grows must be true or false, got {self.grows!r}")
        if self.grows and self.kind != "rejoin":
            raise MembershipError(f"grows=True only goes with kind 'rejoin', got kind {self.kind!r}")
        if not {r for r, _ in self.speeds} <= set(self.alive):
            raise MembershipError(f"slow ranks {[r for r, _ in self.speeds]} must be alive ({self.alive})")

    def to_json(self) -> str:
        """The record as a JSON object string."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "EpochRecord":
        """Parse :meth:`to_json`'s output; raise :class:`MembershipError` if malformed."""
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise MembershipError(f"malformed epoch record {text!r}: {exc}") from exc


def _speeds(value: Any) -> tuple[tuple[int, float], ...]:
    """``(rank, speed)`` pairs (a mapping or pairs, as JSON gives them back), sorted by rank."""
    try:
        pairs = [(r, s) for r, s in (value.items() if isinstance(value, dict) else value)]
    except (TypeError, ValueError) as exc:
        raise MembershipError(f"speeds must be (rank, speed) pairs, got {value!r}") from exc
    out = []
    for rank, speed in pairs:
        if isinstance(rank, str) and rank.isdigit():
            rank = int(rank)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise MembershipError(f"speeds: rank must be a non-negative integer, got {rank!r}")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < 1:
            raise MembershipError(f"speeds: rank {rank}'s speed must be in (0, 1), got {speed!r}")
        out.append((rank, float(speed)))
    if len({r for r, _ in out}) != len(out):
        raise MembershipError(f"speeds name a rank twice: {value!r}")
    return tuple(sorted(out))


@dataclass(frozen=True, kw_only=True)
class SlowRequest:
    """The reporting rank's request for a ``slow`` epoch (``runtime/stragglers.py``), posted to the
    agent's store: the agent publishes the epoch (it alone seals epoch records).

    Attributes:
        seq: 1 for the first request of the job, +1 for each next (the agent acts on each once).
        speeds: every worker slow now, ``(rank, speed)``; empty: none is slow any more.
        reason: the decision, for the epoch's reason.
    """

    seq: int
    speeds: tuple[tuple[int, float], ...] = ()
    reason: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 1:
            raise MembershipError(f"seq must be an integer >= 1, got {self.seq!r}")
        object.__setattr__(self, "speeds", _speeds(self.speeds))
        if not isinstance(self.reason, str):
            raise MembershipError(f"reason must be a string, got {self.reason!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "SlowRequest":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as exc:
            raise MembershipError(f"malformed slow-worker request {text!r}: {exc}") from exc


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A worker's registration: where it sits in the grid and which process it is."""

    rank: int
    pipeline: int
    stage: int
    pid: int
    incarnation: int = 0
    dp: int = 0  # the grid, when the worker knows it (0: unknown)
    pp: int = 0
    heartbeat_interval_s: float | None = None  # the rate it actually beats at
    grid: int = 0  # how many times the survivors re-formed the grid before this registration
    # what the agent needs of the worker's resilience config, however the script was given it
    # (``max_restarts``, ``regrid``, ``host_dir``): see ``runtime/live_stage.agent_settings``
    settings: dict | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerInfo":
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as exc:
            raise MembershipError(f"malformed worker registration {text!r}: {exc}") from exc
