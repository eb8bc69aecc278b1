"""Live recovery of one worker: plan, then execute.

After the agent publishes a new epoch (``runtime/coordinator.py``):

1. the watcher latches the epoch and poisons the current generation's groups: a blocked receive or
   collective fails within milliseconds and the iteration is abandoned (its partial gradients and
   pending messages dropped);
2. every survivor posts its optimizer-step count and reads everyone's; the pure planner
   (``planning/recovery.py: plan_recovery``) turns (epoch record, topology, step counts) into a
   :class:`~ds_resilience.planning.recovery.RecoveryPlan`, the same value on every survivor, which
   is logged as one JSON line;
3. this module applies it and decides nothing else: stages ahead of the resume step roll back
   (``CheckpointTier.rollback``); beyond tolerance the worker gets its snapshot ready for a restart
   (or exports what it holds) and raises :class:`BeyondTolerance`; otherwise the schedule comes from
   the plan table or the planner (the log says which, and how long it took), the new generation's
   groups are built and installed, and donors hand their stage's state to re-joining workers over
   the state transport. The interrupted iteration is then replayed from its micro-batches.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from .. import store_keys as keys
from ..checkpoint.handover import recv_state, send_state
from ..checkpoint.state import apply
from ..checkpoint.tier import CheckpointTier
from ..comm.groups import CommError, GenerationGroups, build_groups
from ..durable import write_durably
from ..epochs import SWITCH_KINDS, EpochRecord
from ..errors import ResilienceError
from ..ir import Schedule
from ..logs import get_logger
from ..planning.provider import ScheduleProvider
from ..planning.recovery import RecoveryPlan, plan_recovery, voters
from ..topology import Topology, Worker
from .coordinator import Coordinator, Reconfigure
from .executor import Executor

__all__ = ["BeyondTolerance", "Generation", "JobInterrupted", "LiveRecovery", "RankView", "RecoveryHooks", "STICKY_CUDA_ERRORS", "SurvivorView",
           "is_failure", "is_fatal"]

logger = get_logger("ds_resilience.recovery")


class BeyondTolerance(ResilienceError):
    """A stage lost every replica: training stopped cleanly after saving what survived.

    Attributes:
        checkpoint_dir: where the surviving stages were saved (``None`` with ``restart``).
        step: the optimizer step the checkpoint holds.
        lost_stages: the stages that could not be saved.
        restart: the agent restarts every worker from the in-memory snapshots; the script should
            just exit (status 0).
    """

    def __init__(self, message: str, *, checkpoint_dir: str | None, step: int, lost_stages: list[int],
                 restart: bool = False) -> None:
        super().__init__(message)
        self.checkpoint_dir = checkpoint_dir
        self.step = step
        self.lost_stages = lost_stages
        self.restart = restart


class JobInterrupted(BeyondTolerance, SystemExit):
    """The job was interrupted (SIGTERM or SIGINT to the agent or a worker) and stopped gracefully:
    every stage saved the newest step they all committed to ``checkpoint_dir``. Uncaught, it ends
    the script with status 0 (a ``SystemExit``); a loop that catches :class:`BeyondTolerance` sees
    it too."""

    code = 0


STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "misaligned address", "uncorrectable ECC error", "illegal instruction", "hardware stack error")
"""CUDA errors that poison the context for good: the process cannot go on, in-process recovery
included; it must die (the agent then sees a crash and the peers recover as from any death)."""


def is_fatal(exc: BaseException) -> bool:
    """A sticky CUDA error (:data:`STICKY_CUDA_ERRORS`): no recovery in this process."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and "CUDA" in text and any(m in text for m in STICKY_CUDA_ERRORS)


def is_failure(exc: BaseException) -> bool:
    """Errors that may mean a peer failed (they prompt an epoch check, nothing more); never a
    sticky CUDA error (:func:`is_fatal`): that one ends this process."""
    return isinstance(exc, (Reconfigure, CommError, RuntimeError)) and not is_fatal(exc)


@dataclass(frozen=True)
class Generation:
    """The membership a worker trains in: who is alive, its schedule and its process groups.

    Attributes:
        epoch: the membership epoch (0 before any change).
        topology: the grid with its failed workers.
        schedule: the schedule every member runs.
        source: where the schedule came from (``fault-free``, ``table``, ``planner``).
        lookup_s: how long getting the schedule took.
        figures: the plan's predicted figures (``None`` when fault-free).
        groups: this worker's groups (``None`` for a worker left idle).
        speeds: the slow workers the schedule is planned for (``source`` ``slow-table`` or ``slow-plan``), each with
            its fraction of full speed; empty otherwise.
    """

    epoch: int
    topology: Topology
    schedule: Schedule
    source: str
    lookup_s: float
    figures: dict[str, Any] | None
    groups: GenerationGroups | None
    speeds: tuple[tuple[Worker, float], ...] = ()


class RankView:
    """How the agent's global ranks map onto the grid's workers (replicas): one rank per worker,
    the worker's grid rank (the default, DeepSpeed's pipelines). A job whose replica is a group of
    ranks (a tensor-parallel group) overrides it: one dead rank takes its whole replica out, the
    replica's other ranks leave the membership, and each rank recovers its own shard.

    Attributes:
        rank: this process's global rank (its keys in the agent's store).
        leader: whether this rank writes what a replica writes once (the stop's manifest).
    """

    leader = True

    def __init__(self, topology: Topology, me: Worker) -> None:
        self.rank = topology.rank(me)

    def workers(self, record: EpochRecord) -> EpochRecord:
        """``record`` with grid ranks (workers) for global ranks."""
        return record

    def ranks(self, worker_ranks: Any) -> list[int]:
        """The global ranks of the workers ``worker_ranks``."""
        return list(worker_ranks)

    def worker_steps(self, steps: dict[int, int]) -> dict[int, int]:
        """Each worker's step count from its ranks' (the fewest: where the replica may resume)."""
        return dict(steps)


class SurvivorView(RankView):
    """The ranks of a grid the survivors re-formed (a :class:`~ds_resilience.topology.Topology` with
    a rank table): the agent's records still name every rank of the job, so the ranks lost before
    the re-grid, which hold no position in it, are left out of what the plans see."""

    def __init__(self, topology: Topology, me: Worker) -> None:
        super().__init__(topology, me)
        self.topology = topology

    def workers(self, record: EpochRecord) -> EpochRecord:
        keep = self.topology.has_rank
        return replace(record, failed=tuple(r for r in record.failed if keep(r)),
                       alive=tuple(r for r in record.alive if keep(r)),
                       joining=tuple(r for r in record.joining if keep(r)))


_DEEPSPEED_EXPORT = ("deepspeed checkpoint (layer_XX-model_states.pt + mp_rank_XX_model_states.pt per stage, "
                     "`latest` beside the tag; ZeRO-1: the optimizer in stageN-pipelineP-optim_states.pt, each "
                     "replica's shard)")


@dataclass
class RecoveryHooks:
    """What a recovery asks of the front end.

    Attributes:
        export: ``export(directory, step, writer=True)`` writes this stage in the front end's own
            checkpoint layout (when the job stops beyond tolerance without a restart, or on an
            interrupt); the other replicas of the stage call it with ``writer=False`` (their
            ZeRO-1 optimizer shards).
        exported: ``exported(directory, step)``, called once by the leader when every stage's
            export is written (DeepSpeed's: ``latest`` names it).
        export_format: what ``export`` writes, for the stop's manifest (default: DeepSpeed's layout).
        adopted: called with each new :class:`Generation` once the stage adopted it (reporting).
        on_membership: ``on_membership(record, plan, previous, generation, joining=...)`` after the
            new groups are installed and the handovers done: state that depends on the membership
            (ZeRO-1's optimizer shards) moves here. ``previous`` is the topology before the epoch
            (``None`` for a re-joining worker).
        groups_for: ``groups_for(target, epoch)`` builds this rank's groups of a new generation
            (default: :func:`~ds_resilience.comm.groups.build_groups` for ``me``).
        view: how global ranks map onto workers (default :class:`RankView`: one rank per worker).
        regrid: ``regrid(record, plan)`` re-forms the grid on the survivors when a stage lost every
            replica (the engine's; ``None``: that is a restart or a stop).
        prefer_regrid: whether re-forming the grid beats re-routing around a failed set that
            re-routing covers (``planning.recovery.plan_recovery``).
        unfed: why a failed set leaves micro-batches no worker can load (``None``: none).
        grow: ``grow(record, plan)`` re-forms the first grid when ranks a re-grid left out come back
            (a ``rejoin`` epoch naming ranks outside the re-formed grid): the survivors call it with
            their plan, the joiners with ``None`` (the engine's; ``None``: such a re-join is refused).
    """

    export: Callable[..., None]
    export_format: str | None = None
    exported: Callable[[str, int], None] | None = None
    adopted: Callable[[Generation], None] | None = None
    on_membership: Callable[..., None] | None = None
    groups_for: Callable[[Topology, int], GenerationGroups] | None = None
    view: RankView | None = None
    regrid: Callable[[EpochRecord, RecoveryPlan], None] | None = None
    prefer_regrid: Callable[[frozenset[Worker]], bool] | None = None
    unfed: Callable[[frozenset[Worker]], str | None] | None = None
    grow: Callable[[EpochRecord, RecoveryPlan | None], None] | None = None


class LiveRecovery:
    """Applies recovery plans for one worker under the agent (see the module docstring).

    Args:
        topology, me: the full grid and this worker's position in it.
        coordinator: heartbeats, the latched epochs and the store.
        executor: runs the schedule; reset and given new groups here.
        tier: the stage's saved states (rollback, restart readiness).
        provider: the plan table and the planner.
        session: names the process groups; ``timeout_s`` bounds their operations.
        grace_s: how long an in-band error may wait for the agent's epoch before it is a real error.
        adopt: installs a new :class:`Generation` in the stage.
        persistent_dir: where a stop's export goes (``global_step<N>`` in it; default ``./checkpoints``).
        fault_hook: ``fault_hook(point, step)`` at ``in_recovery`` and ``in_rejoin`` (tests).
        hooks: what the front end does in a recovery (:class:`RecoveryHooks`).
    """

    def __init__(self, *, topology: Topology, me: Worker, coordinator: Coordinator, executor: Executor,
                 tier: CheckpointTier, provider: ScheduleProvider, session: str, timeout_s: float, grace_s: float,
                 adopt: Callable[[Generation], None], persistent_dir: str | None, hooks: RecoveryHooks,
                 fault_hook: Callable[[str, int], None] | None = None) -> None:
        view, groups_for, regrid, prefer_regrid, unfed = (hooks.view, hooks.groups_for, hooks.regrid,
                                                          hooks.prefer_regrid, hooks.unfed)
        export, on_membership, export_format = hooks.export, hooks.on_membership, hooks.export_format
        self.exported = hooks.exported
        self.topology, self.me = topology, me
        self.view = view or RankView(topology, me)
        self.rank = self.view.rank
        self.groups_for = groups_for
        self.regrid = regrid
        self.prefer_regrid = prefer_regrid
        self.unfed = unfed
        self.grow = hooks.grow
        self.growing: EpochRecord | None = None  # a joiner's re-join epoch that grows the grid back (join)
        self.retired = False  # this rank's replica failed while it lives on (tensor parallelism): it idles
        self._steps: dict[int, int] = {}  # the step counts of the last plan
        self.coordinator = coordinator
        self.executor = executor
        self.tier = tier
        self.provider = provider
        self.session = session
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.adopt = adopt
        self.export = export
        self.persistent_dir = persistent_dir
        self.fault_hook = fault_hook or (lambda point, step: None)
        self.on_membership = on_membership
        self.export_format = export_format or _DEEPSPEED_EXPORT
        self.current: Topology = topology  # the membership applied last
        self.log: list[dict[str, Any]] = []

    # --- the generation for a set of failed workers -------------------------------------------------
    def generation(self, epoch: int, failed: frozenset[Worker], *, build: bool = True,
                   joining: bool = False, speeds: dict[Worker, float] | None = None) -> Generation:
        """The schedule and (with ``build``) this worker's groups for ``failed``. ``joining``: this
        worker re-joins, its peers come when they reach an iteration boundary (up to one iteration
        late), so it waits for them up to the process-group timeout rather than the store's.
        ``speeds``: slow workers (a ``slow`` epoch): with no failed worker, the weighted plan for
        them (``ScheduleProvider.schedule_for_slow``); with failed ones the failure plan, which
        does not weigh speeds (a slow worker beside a dead one runs the failure plan as is)."""
        speeds = dict(speeds or {}) if not failed else {}
        choice = self.provider.schedule_for_slow(speeds) if speeds else self.provider.schedule_for(failed)
        target = self.topology.without(failed)
        groups = None
        if build:
            self._arrive(epoch, self.view.ranks(self.topology.rank(w) for w in target.alive_workers()),
                         timeout_s=max(self.timeout_s, self.coordinator.store_timeout_s) if joining else None)
            if self.groups_for is not None:
                groups = self.groups_for(target, epoch)
            else:
                groups = build_groups(target, self.me, session=self.session, generation=epoch,
                                      timeout_s=self.timeout_s, store=self.coordinator.store, tied=self.provider.tied,
                                      device=self.executor.spec.device)
        return Generation(epoch=epoch, topology=target, schedule=choice.schedule, source=choice.source,
                          lookup_s=choice.seconds, figures=choice.figures, groups=groups,
                          speeds=tuple(sorted(speeds.items())))

    def _arrive(self, epoch: int, members: list[int], *, timeout_s: float | None = None) -> None:
        """Wait until every member of the new generation is here before building its groups: a
        member that dies now releases the wait (a new epoch), where gloo's group construction would
        wait out its whole timeout."""
        store = self.coordinator.store
        store.set(keys.arrive(epoch, self.rank), "1")
        for r in members:
            self.coordinator.wait_key(keys.arrive(epoch, r), timeout_s=timeout_s)

    # --- recovery ----------------------------------------------------------------------------------
    def recover(self, exc: BaseException) -> None:
        """Handle a failure signal: wait for the agent's epoch, then apply it (and any newer one,
        including one published while this one was being applied)."""
        record = exc.record if isinstance(exc, Reconfigure) else None
        if record is None:
            record = self.coordinator.wait_pending(self.grace_s)
            if record is None:
                raise exc  # an error without a membership change is a real error
            if record.kind in SWITCH_KINDS:
                logger.info("rank %d: a peer applying %s epoch %d released this rank from its iteration (%s)",
                            self.rank, record.kind, record.epoch, type(exc).__name__)
        while True:
            try:
                self.apply(record)
                return
            except Reconfigure as newer:
                record = newer.record
            except Exception as failed:  # noqa: BLE001 - a peer died while this plan was applied
                if not is_failure(failed):
                    raise
                newer = self.coordinator.wait_pending(self.grace_s)
                if newer is None or newer.epoch == record.epoch:
                    raise  # no newer membership change explains it: a real error
                logger.warning("rank %d: epoch %d interrupted (%s); applying epoch %d", self.rank, record.epoch, failed,
                               newer.epoch)
                record = newer

    def plan(self, record: EpochRecord) -> RecoveryPlan:
        """Post this worker's step count, read the survivors', and plan (pure)."""
        workers = self.view.workers(record)
        self._steps = self.coordinator.gather_steps(record.epoch, self.tier.host.counters()[0],
                                                    self.view.ranks(voters(workers)))
        return plan_recovery(workers, self.topology, self.view.worker_steps(self._steps),
                             covered=self.provider.covers, tied=self.provider.tied,
                             # a slow epoch changes no membership: never a reason to re-form the grid
                             regrid=self.regrid is not None and record.kind != "slow",
                             prefer_regrid=self.prefer_regrid, unfed=self.unfed)

    def apply(self, record: EpochRecord) -> None:
        started = time.perf_counter()
        self.coordinator.begin(record)
        if record.kind in SWITCH_KINDS:
            self._switch(record)
        self.executor.reset()
        if self.growing is not None and record.epoch == self.growing.epoch:  # a joiner growing the grid back
            self.grow(record, None)  # marks the epoch applied and logs it; the engine is a new one after it
            return
        grows = record.grows
        if grows and self.grow is None:
            raise ResilienceError(f"rank {self.rank}: ranks {list(record.joining)} re-join a grid the survivors "
                                  f"re-formed without them, and this engine cannot grow back (resilience.regrid off)")
        if not grows and any(not self.topology.has_rank(r) for r in record.joining):
            raise ResilienceError(f"rank {self.rank}: ranks {list(record.joining)} re-join a grid re-formed without "
                                  f"them, but epoch {record.epoch} does not grow it back (an agent older than this "
                                  f"worker?)")
        if self.topology.rank(self.me) in self.view.workers(record).failed:
            self._retire(record)
            return
        plan = self.plan(record)
        _log_plan(plan, self.rank, record.failed)
        self.fault_hook("in_recovery", plan.resume_step)
        if self._steps[self.rank] > plan.resume_step:  # it took the resume step already (plan.rollbacks)
            self.tier.rollback(plan.resume_step)
            self.executor.forget_pending()  # the speculative step, if any, is undone with it
        if self.executor.validator is not None and plan.action == "continue":
            # the replayed iterations' gradient norms are published again (before the arrival barrier)
            self.executor.validator.forget_from(plan.resume_step, self.me.stage)
        if plan.action == "regrid":
            self.regrid(record, plan)  # marks the epoch applied and logs it; the engine is a new one after it
            return
        if grows and plan.action == "continue":
            self.grow(record, plan)  # the survivors, at the resume step: the first grid with the joiners
            return
        if plan.action != "continue":
            self._beyond_tolerance(record, plan)
        failed = frozenset(self.topology.coord(r)[0] for r in plan.failed)
        generation = self.generation(record.epoch, failed, speeds=self._speeds(record))
        self.executor.install(generation.groups)
        self.adopt(generation)
        if record.kind == "slow":
            self._log_switch(record, generation, plan.resume_step)
        for donor, joiner in plan.handovers:
            if donor == self.rank:
                self.fault_hook("in_rejoin", plan.resume_step)
                send_state(generation.groups.world, joiner, self.tier.state(), timeout_s=self.timeout_s)
        if self.on_membership is not None:
            self.on_membership(record, plan, self.current, generation, joining=False)
        self.current = generation.topology
        self.coordinator.mark_applied(record)
        self.log.append({
            "epoch": record.epoch,
            "kind": record.kind,
            "failed": list(record.failed),
            "resume_step": plan.resume_step,
            "plan": plan.to_dict(),
            "schedule_source": generation.source,
            "lookup_s": generation.lookup_s,
            "apply_s": time.perf_counter() - started,
            # new epoch published by the agent -> ready for the first new step (same host clock)
            "recovery_s": time.time() - record.detected_at if record.detected_at else None,
            **({"speeds": [[r, v] for r, v in record.speeds], "figures": generation.figures}
               if record.kind == "slow" else {}),
        })

    def _speeds(self, record: EpochRecord) -> dict[Worker, float]:
        """A ``slow`` epoch's slow workers (grid ranks of this grid only: a re-formed grid's view
        leaves out the ranks lost before it) and their speeds."""
        return {self.topology.coord(r)[0]: v for r, v in record.speeds
                if self.topology.has_rank(r) and r not in record.failed}

    def _log_switch(self, record: EpochRecord, generation: Generation, resume_step: int) -> None:
        """One line per switch of a ``slow`` epoch, on the first alive rank: the plan adopted and its
        predicted iteration time (the cost model's unit), or the return to the failed set's schedule."""
        alive = self.view.ranks(self.topology.rank(w) for w in generation.topology.alive_workers())
        if not alive or self.rank != min(alive):
            return
        figures = generation.figures or {}
        if generation.speeds:
            slow = ", ".join(f"worker p{w.pipeline}s{w.stage} (rank {self.topology.rank(w)}) at {v:.2f}x"
                             for w, v in generation.speeds)
            loads = figures.get("loads") or []
            logger.warning(
                "slow-worker switch (epoch %d, from step %d): %s; adopted the weighted plan (micro-batches per "
                "worker %s), predicted iteration %.4g against %.4g un-adapted (fault-free %.4g, bound %.4g; "
                "cost-model units); planned in %.3f s", record.epoch, resume_step, slow, loads,
                figures.get("iteration_time", float("nan")), figures.get("unadapted_time", float("nan")),
                figures.get("fault_free_iteration_time", float("nan")), figures.get("bound", float("nan")),
                generation.lookup_s)
        elif record.speeds:  # slow workers beside failed ones: the failure plan as is
            logger.warning("slow-worker switch (epoch %d, from step %d): ranks %s slow beside failed workers %s; "
                           "kept the failure plan (%s)", record.epoch, resume_step, [r for r, _ in record.speeds],
                           sorted(str(w) for w in generation.topology.failed), generation.source)
        else:
            what = "the fault-free schedule" if not generation.topology.failed else f"the {generation.source} schedule"
            logger.warning("slow-worker switch (epoch %d, from step %d): no worker slow any more; back to %s",
                           record.epoch, resume_step, what)

    def _switch(self, record: EpochRecord) -> None:
        """This rank applies a re-join (or a slow epoch's switch of schedule: same members, nothing
        moved) at its iteration boundary; its peers may not have seen the
        epoch at theirs and be inside an iteration that waits on this rank. Release them: the switch
        key makes their store waits give up (``Coordinator.interrupting``), and closing this rank's
        pairs of the old groups (which the new generation replaces) fails their receives and
        collectives with it. They apply the re-join in turn; whatever step one of them took in
        that iteration is rolled back by the plan, as after a failure."""
        self.coordinator.announce_switch(record)
        if self.executor.groups is not None:
            self.executor.groups.poison()

    def _retire(self, record: EpochRecord) -> None:
        """This rank lives but its replica lost a rank: it leaves the membership and idles (the
        replica's work is re-routed like any failed replica's); it never votes or rolls back."""
        self.executor.install(None)
        self.retired = True
        self.coordinator.mark_applied(record)
        self.log.append({"epoch": record.epoch, "kind": "retired", "failed": list(record.failed)})
        logger.warning("rank %d: replica %s lost a rank (failed ranks %s); this rank leaves the membership and idles",
                       self.rank, self.me, list(record.failed))

    # --- re-join -----------------------------------------------------------------------------------
    def join(self) -> None:
        """A re-joining worker: wait for the agent's re-join epoch, join its groups, take a peer's state.

        Until a donor has sent the state, the waits give up with :class:`TrainingOver` when the
        agent says training ended: the survivors ran their last step without this worker (the
        coordinator of a relaunched worker starts ``joining``)."""
        deadline = time.monotonic() + max(self.timeout_s, 60.0)
        while True:
            record = self.coordinator.pending()
            if record is not None and self.rank in record.joining:
                break
            if record is not None:
                self.coordinator.mark_applied(record)  # an epoch before ours: nothing to do yet
            self.coordinator.check_training_over()
            if time.monotonic() > deadline:
                raise ResilienceError(f"rank {self.rank}: no re-join epoch from the agent within {self.timeout_s:.0f} s")
            time.sleep(0.01)
        if record.grows:
            # the grid this worker left was re-formed without it: it grows the first grid back with the
            # survivors at their next iteration boundary (the epoch stays pending until then)
            if self.grow is None:
                raise ResilienceError(f"rank {self.rank}: epoch {record.epoch} grows a re-formed grid back, and this "
                                      f"engine cannot (resilience.regrid off)")
            self.growing = record
            logger.info("rank %d: re-join epoch %d grows the re-formed grid back to the first one", self.rank,
                        record.epoch)
            return
        self.coordinator.begin(record)
        plan = plan_recovery(record, self.topology, {r: 0 for r in voters(record)}, covered=self.provider.covers,
                             tied=self.provider.tied)
        donor = next(d for d, j in plan.handovers if j == self.rank)
        failed = frozenset(self.topology.coord(r)[0] for r in plan.failed)
        generation = self.generation(record.epoch, failed, joining=True)
        self.executor.install(generation.groups)
        self.adopt(generation)
        state = recv_state(generation.groups.world, donor, timeout_s=self.timeout_s)
        self.coordinator.admitted()  # the survivors train on with this worker
        apply(state, self.tier.host, stage=self.me.stage)
        if self.on_membership is not None:
            self.on_membership(record, plan, None, generation, joining=True)
        self.current = generation.topology
        self.coordinator.mark_applied(record)
        self.log.append({"epoch": record.epoch, "kind": "joined", "resume_step": state.steps, "donor": donor,
                         "schedule_source": generation.source, "lookup_s": generation.lookup_s,
                         "recovery_s": time.time() - record.detected_at if record.detected_at else None})

    # --- beyond tolerance --------------------------------------------------------------------------
    def _beyond_tolerance(self, record: EpochRecord, plan: RecoveryPlan) -> None:
        lost = list(plan.lost_stages)
        step = plan.resume_step
        if plan.action == "restart" and self.tier.memory is not None:
            ready = self.tier.ready_for_restart(step)
            self.coordinator.mark_applied(record)
            self.log.append({"epoch": record.epoch, "kind": "restart", "resume_step": step, "plan": plan.to_dict(),
                             **ready})
            raise BeyondTolerance(
                f"{_beyond(plan)} (failed ranks {list(record.failed)}); the agent restarts all "
                f"workers from the in-memory snapshots (this worker's step {step} is committed: "
                f"{ready['committed']}, replicated: {ready['replicated']})",
                checkpoint_dir=None, step=step, lost_stages=lost, restart=True,
            )
        base = self.persistent_dir or os.path.join(os.getcwd(), "checkpoints")
        ckpt_dir = os.path.join(base, f"global_step{step}")
        interrupted = record.kind == "interrupt" and not lost  # SIGTERM / SIGINT: every stage saves
        failed = self.view.workers(record).failed
        target = self.topology.without(frozenset(self.topology.coord(r)[0] for r in failed))
        writers = {s: min(target.stage_peers(s)) for s in range(target.pp) if s not in lost}
        store = self.coordinator.store
        if writers.get(self.me.stage) == self.me:
            self.export(ckpt_dir, step)
            store.set(keys.saved(record.epoch, self.rank), "1")
        elif self.me.stage not in lost:
            self.export(ckpt_dir, step, writer=False)  # ZeRO-1: every replica's optimizer shard
        if self.me == min(target.alive_workers()) and self.view.leader:
            for r in self.view.ranks(self.topology.rank(w) for w in writers.values()):  # every shard of each
                self.coordinator.wait_key(keys.saved(record.epoch, r))
            manifest = {
                "step": step,
                "stages_saved": sorted(writers),
                "stages_lost": lost,
                "reason": plan.reason or _beyond(plan),
                "dp": self.topology.dp,
                "pp": self.topology.pp,
                "format": self.export_format,
            }
            Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
            write_durably(Path(ckpt_dir) / "manifest.json", json.dumps(manifest, indent=1))
            if self.exported is not None:
                self.exported(ckpt_dir, step)
            store.set(keys.saved_manifest(record.epoch), ckpt_dir)
        else:
            self.coordinator.wait_key(keys.saved_manifest(record.epoch))
        self.coordinator.mark_applied(record)
        self.log.append({"epoch": record.epoch, "kind": "stop", "resume_step": step, "plan": plan.to_dict(),
                         "checkpoint_dir": ckpt_dir})
        if interrupted:
            message = (f"{record.reason or 'interrupted'}: stopped gracefully after step {step}, every stage saved "
                       f"to {ckpt_dir}")
            logger.warning("rank %d: %s", self.rank, message)
            raise JobInterrupted(message, checkpoint_dir=ckpt_dir, step=step, lost_stages=[])
        raise BeyondTolerance(
            f"{_beyond(plan)} (failed ranks {list(record.failed)}): re-routing cannot cover this; "
            f"stopped cleanly after step {step}, surviving stages saved to {ckpt_dir}"
            + (" (the lost stages must come from an earlier checkpoint)" if lost else " (every stage)"),
            checkpoint_dir=ckpt_dir, step=step, lost_stages=lost,
        )


def _beyond(plan: RecoveryPlan) -> str:
    """What put a plan beyond tolerance, for its messages."""
    if plan.lost_stages:
        return f"stage(s) {list(plan.lost_stages)} lost every replica"
    return plan.reason or "beyond tolerance"


def release_on_epoch(record: EpochRecord, groups: Any, tier: CheckpointTier | None) -> None:
    """An engine's watcher-thread reaction to a newly latched epoch: poison the current groups so
    whatever the main thread waits on returns (a re-join changes nothing for the running iteration:
    it is applied at the next boundary; so is a slow epoch's switch of schedule), and stop replicating
    to the failed peers."""
    if groups is not None and record.kind not in SWITCH_KINDS:
        groups.poison()
    if tier is not None:
        tier.drop(record.failed)


def _log_plan(plan: RecoveryPlan, rank: int, failed_ranks: tuple[int, ...]) -> None:
    """One JSON line per plan, on the worker's stderr and the ``ds_resilience.recovery`` logger.
    ``failed_ranks``: the epoch's failed global ranks; where they differ from the plan's (a worker
    is a group of ranks under tensor parallelism, named by its grid rank) the line lists them too."""
    if tuple(failed_ranks) == tuple(plan.failed):
        line = plan.to_json()
    else:
        line = json.dumps({**plan.to_dict(), "failed_ranks": list(failed_ranks)}, sort_keys=True)
    logger.info("rank %d recovery plan %s", rank, line)
