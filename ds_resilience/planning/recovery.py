"""Plan-then-execute recovery: one pure decision per membership epoch, shared by agent and workers.

When the agent publishes a membership epoch (``epochs.EpochRecord``), every surviving worker posts
how many optimizer steps it has taken, reads everyone's, and calls :func:`plan_recovery`. The
result, a :class:`RecoveryPlan`, is a value: identical on every survivor (same inputs), logged as
one JSON line, testable without processes. The runtime then applies it (roll back, build groups,
install the schedule, hand state to re-joining workers) and decides nothing on its own.

"Beyond tolerance" is decided by one function, :func:`lost_stages`, which the agent also calls on
its own view of the job (which ranks hold which stage) before it publishes a ``stop``.
Pure Python.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

from ..epochs import EpochRecord
from ..errors import PlanningError
from ..topology import Topology, Worker, format_worker

__all__ = ["ACTIONS", "RecoveryPlan", "lost_stages", "plan_recovery", "voters"]

ACTIONS = ("continue", "regrid", "restart", "stop")
"""``continue``: re-route around the failed set (or take back re-joined workers) and go on;
``regrid``: beyond re-routing, the survivors re-form a smaller grid in their running processes
(``planning/live_regrid.py`` plans it); ``restart``: beyond tolerance, every worker restarts from
the in-memory snapshots; ``stop``: beyond tolerance with no restart left, the survivors export what
they hold and the job stops."""


def lost_stages(stage_of: Mapping[int, int], failed: Iterable[int],
                replica_of: Mapping[int, Hashable] | None = None) -> tuple[int, ...]:
    """Stages every replica of which has failed (what makes a failure set beyond re-routing).

    Args:
        stage_of: global rank -> stage, for every rank of the job.
        failed: the failed global ranks.
        replica_of: global rank -> its replica (default: each rank is a replica). With tensor
            parallelism a replica is a tensor-parallel group: one dead rank takes its replica
            out, so a stage is lost once every replica has lost a rank.
    """
    gone = set(failed)
    replica_of = replica_of or {r: r for r in stage_of}
    replicas: dict[int, dict[Hashable, bool]] = {}  # stage -> replica -> still whole
    for rank, stage in stage_of.items():
        whole = replicas.setdefault(stage, {})
        key = replica_of[rank]
        whole[key] = whole.get(key, True) and rank not in gone
    return tuple(sorted(s for s, whole in replicas.items() if not any(whole.values())))


def voters(record: EpochRecord) -> tuple[int, ...]:
    """The ranks whose step counts decide where training resumes: the alive ones not joining."""
    joining = set(record.joining)
    return tuple(r for r in record.alive if r not in joining)


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """What every survivor does for one membership epoch.

    Attributes:
        epoch, kind: the epoch applied and its kind (``crash``, ``hang``, ``rejoin``, ``stop``).
        action: one of :data:`ACTIONS`.
        failed: the failed global ranks after this epoch; ``failed_workers`` the same as "p:s".
        resume_step: the optimizer step training resumes from (the fewest any survivor took).
        rollbacks: ranks that already took step ``resume_step`` and restore its pre-step state.
        lost_stages: stages with no surviving replica (non-empty exactly when beyond tolerance).
        schedule_source: ``"fault-free"``, ``"table"`` (a precomputed plan covers the set) or
            ``"planner"`` (planned on demand); ``None`` when training does not continue.
        groups: the process groups of the new generation, ``{"world": ranks, "stage<s>": ranks,
            "tied<g>": ranks}``.
        handovers: ``(donor, joiner)`` rank pairs: the donor sends its stage's state.
        reason: the agent's description of the change.
    """

    epoch: int
    kind: str
    action: str
    failed: tuple[int, ...]
    failed_workers: tuple[str, ...]
    resume_step: int
    rollbacks: tuple[int, ...]
    lost_stages: tuple[int, ...]
    schedule_source: str | None
    groups: dict[str, tuple[int, ...]]
    handovers: tuple[tuple[int, int], ...]
    reason: str = ""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise PlanningError(f"recovery action {self.action!r}; allowed: {', '.join(ACTIONS)}")

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-native values (lists, not tuples)."""
        return json.loads(json.dumps(asdict(self)))

    def to_json(self) -> str:
        """The plan as one JSON line (what the recovery log prints)."""
        return json.dumps(self.to_dict(), sort_keys=True)


def plan_recovery(record: EpochRecord, topology: Topology, steps: Mapping[int, int], *,
                  covered: Callable[[frozenset[Worker]], bool] | None = None,
                  tied: Sequence[Sequence[int]] = (), regrid: bool = False,
                  prefer_regrid: Callable[[frozenset[Worker]], bool] | None = None,
                  unfed: Callable[[frozenset[Worker]], str | None] | None = None) -> RecoveryPlan:
    """Turn an epoch record, the job's topology and the survivors' step counts into a plan.

    Args:
        record: the epoch to apply.
        topology: the full grid (``record.failed`` are global ranks of it).
        steps: optimizer steps taken, for every rank of :func:`voters` (others are ignored).
        covered: whether the plan table holds a schedule for a failed set (default: never).
        tied: the model's tied groups (stage tuples): their groups are built too (``tied<g>``).
        regrid: the survivors can re-form the grid: a lost stage is a ``regrid``, not a
            ``restart`` (unless the agent stopped the job).
        prefer_regrid: with ``regrid``, whether re-forming the grid beats re-routing around a
            failed set re-routing could cover (failures piled up); the same answer on every
            survivor (a function of the set and the plans every survivor holds).
        unfed: why the failed set leaves micro-batches no worker can load (a pipeline lost both
            ends and its data has no addressable source), or ``None``; then the job stops with a
            checkpoint of every stage (the agent, which does not know the data path, published
            the set as one re-routing covers, so it is no restart).

    Raises:
        PlanningError: a voter's count is missing, or a survivor is more than one step ahead
            (the staggered optimizer lets a stage step at most once before a failure is seen).
    """
    ranks = voters(record)
    missing = [r for r in ranks if r not in steps]
    if missing:
        raise PlanningError(f"epoch {record.epoch}: no step count from ranks {missing}")
    resume = min(steps[r] for r in ranks) if ranks else 0
    ahead = {r: steps[r] for r in ranks if steps[r] > resume}
    if any(v != resume + 1 for v in ahead.values()):
        raise PlanningError(f"epoch {record.epoch}: ranks {sorted(ahead)} are at steps {ahead}, more than one step "
                            f"past the resume step {resume}; a stage cannot step twice before a failure is seen")
    failed_workers = frozenset(topology.coord(r)[0] for r in record.failed)
    stage_of = {topology.rank(w): w.stage for w in topology.workers()}
    lost = lost_stages(stage_of, record.failed)
    piled = (regrid and not lost and not record.stop and not record.joining and bool(failed_workers)
             and prefer_regrid is not None and prefer_regrid(failed_workers))
    starved = None if lost or record.stop or unfed is None or not failed_workers else unfed(failed_workers)
    reason = record.reason if starved is None else f"{record.reason}; {starved}".lstrip("; ")
    if lost or record.stop or piled or starved:
        # a re-formed grid would still need the starved pipeline's data: restart or stop instead
        action = ("regrid" if regrid and not record.stop and not starved else "restart" if record.restart
                  else "stop")
        source = None
        groups: dict[str, tuple[int, ...]] = {}
        handovers: tuple[tuple[int, int], ...] = ()
    else:
        action = "continue"
        target = topology.without(failed_workers)
        source = "fault-free" if not failed_workers else ("table" if covered is not None and covered(failed_workers)
                                                         else "planner")
        groups = {"world": tuple(topology.rank(w) for w in target.alive_workers())}
        for s in range(topology.pp):
            groups[f"stage{s}"] = tuple(topology.rank(w) for w in target.stage_peers(s))
        for g, stages in enumerate(tied):
            groups[f"tied{g}"] = tuple(sorted(topology.rank(w) for s in stages for w in target.stage_peers(s)))
        joining = set(record.joining)
        pairs = []
        for joiner in sorted(joining):
            stage = topology.coord(joiner)[0].stage
            donors = [topology.rank(w) for w in target.stage_peers(stage) if topology.rank(w) not in joining]
            if not donors:
                raise PlanningError(f"epoch {record.epoch}: re-joining rank {joiner} has no surviving peer in stage {stage}")
            pairs.append((donors[0], joiner))
        handovers = tuple(pairs)
    return RecoveryPlan(
        epoch=record.epoch, kind=record.kind, action=action, failed=tuple(record.failed),
        failed_workers=tuple(format_worker(w) for w in sorted(failed_workers)), resume_step=resume,
        rollbacks=tuple(sorted(ahead)), lost_stages=lost, schedule_source=source, groups=groups,
        handovers=handovers, reason=reason,
    )
