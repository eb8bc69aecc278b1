"""The DeepSpeed engine's plan table and the agreement on it (``runtime/plan_agreement.py``).

:func:`schedule_provider` builds the plan table and planner of one cost model from a
:class:`PlanSettings`. Under the agent only the grid's first rank plans, and publishes its table,
cost model, variant and solver; every other rank waits for them and adopts them without planning
(:func:`agreed_plans`); a re-joining worker adopts the newest published build
(:func:`joined_plans`). :class:`BackgroundReplan` is the re-plan after the self-profile (off the
training thread, adopted by every rank at one step), and
:func:`healthy_schedule` re-lists a fault-free run's schedule with the profiled costs;
:func:`first_generation` is the schedule and groups a worker starts with.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ..comm.groups import build_groups, world_group
from ..config import ResilienceConfig
from ..ir import Schedule
from ..logs import STDOUT, get_logger
from ..planning.provider import ScheduleChoice, ScheduleProvider
from ..planning.stage_mix import fused_in, split_margin
from ..runtime.membership import failed_after, latest_epoch
from ..runtime.plan_agreement import PublisherLost, adopt_published, announce, await_published, newest, publish
from ..runtime.recovery import Generation
from ..topology import Topology, Worker

__all__ = ["BackgroundReplan", "EnginePlans", "PlanAgreement", "PlanSettings", "REPLAN_LAG", "REPLAN_SOLVER",
           "ReplannedProvider", "adopting_provider", "agreed_plans", "first_generation", "healthy_schedule",
           "joined_plans", "plans_timeout_s", "publisher_failed", "schedule_provider"]

log = get_logger(__name__)

REPLAN_SOLVER = "heuristic"
"""The solver of the re-plan after the self-profile (:class:`BackgroundReplan`). It runs off the
training thread, but every rank adopts its table :data:`REPLAN_LAG` steps after the profile and
waits there for it if need be, and its thread takes the interpreter from the training thread: with
CP-SAT (``planner.time_limit_s`` per failure set, 10 s by default) a 4-rank job stopped for 12-24 s
when it planned on the training thread. The heuristic takes milliseconds per failure set; the
start's table, planned before training, keeps the configured solver."""

REPLAN_LAG = 1
"""The iterations that train on with the table before while the re-plan runs: every rank adopts
the re-plan's table at the start of the iteration this many after the profile's end
(:class:`BackgroundReplan`; the heuristic's table of a 2 x 2 grid takes 0.03 s). One: a failure
one iteration after the profile is already answered from the profiled table."""


@dataclass(frozen=True)
class PlanSettings:
    """What a plan table is built from."""

    config: ResilienceConfig
    topology: Topology
    microbatches: int
    tied: Any  # the tied groups' stages (``ds_stage.tied_layout``)
    clipping: bool  # gradient clipping on
    fp16: bool
    config_dir: Path | None = None  # a relative ``resilience.cost_model`` is resolved against it


@dataclass(frozen=True)
class PlanAgreement:
    """What the agreement on a plan table needs of this worker (under the agent)."""

    settings: PlanSettings
    store: Any  # the coordinator's store
    rank: int
    scope: str  # ``attempt<restart>[-grid<n>]``: one agreement per launch attempt and grid
    fire: Callable[[str, int], Any]  # the fault injector's ``maybe_fire``
    step: Callable[[], int]  # the optimizer steps taken
    from_step: int | None = None  # the step the survivors adopt the table at (``publish``; None: at once)


@dataclass
class EnginePlans:
    """A worker's plan tables: the table of a build (0 at start, 1 after the self-profile), agreed
    with the grid's first rank under the agent (``coordinator`` set) or built here otherwise, and a
    re-joining worker's copy of the newest published one."""

    settings: PlanSettings
    rank: int
    scope: str  # ``attempt<restart>[-grid<n>]`` under the agent
    coordinator: Any | None  # the live stage's coordinator (its store carries the agreement)
    fire: Callable[[str, int], Any]  # the fault injector's ``maybe_fire``
    step: Callable[[], int]  # the optimizer steps taken
    joined_record: dict | None = None  # what :meth:`joined` read

    def agreement(self, *, step: int | None = None, own_store: bool = False,
                  from_step: int | None = None) -> PlanAgreement:
        """``step``: the step its faults fire at (default: the steps taken when they fire);
        ``own_store``: a connection of its own to the store (for a thread other than training's);
        ``from_step``: the step the table is adopted at (published with it)."""
        store = self.coordinator.store
        return PlanAgreement(settings=self.settings, store=store.clone() if own_store else store, rank=self.rank,
                             scope=self.scope, fire=self.fire, step=self.step if step is None else lambda: step,
                             from_step=from_step)

    def build(self, build: int, cost=None, solver: str | None = None, *, step: int | None = None,
              own_store: bool = False, from_step: int | None = None) -> ScheduleProvider:
        """The plan table and planner of ``build`` (:func:`agreed_plans` under the agent; ``step``,
        ``own_store`` and ``from_step``: :meth:`agreement`'s, for a build in a thread of its own).

        Raises:
            PublisherLost: the publisher failed before it published (no rank took this build).
        """
        if self.coordinator is None:
            return schedule_provider(self.settings, self.settings.config_dir, cost=cost, solver=solver)
        agreement = self.agreement(step=step, own_store=own_store, from_step=from_step)
        return agreed_plans(agreement, build, cost=cost, solver=solver)

    def joined(self) -> ScheduleProvider | None:
        """A re-joining worker's plans: rank 0's newest published (``None``: nothing published)."""
        self.joined_record, provider = joined_plans(self.agreement())
        return provider


def schedule_provider(settings: PlanSettings, base_dir: Path | None, cost=None, solver: str | None = None,
                      variant: str | None = None, table: bool = True) -> ScheduleProvider:
    """The plan table and planner for ``cost`` (default: the configured model); ``variant``
    overrides the one the cost model implies; ``table=False``: none built (one is adopted)."""
    cfg = settings.config
    planner = cfg.planner
    cost = cost if cost is not None else cfg.cost(base_dir)
    # before the step check is priced in: unit costs stay unit costs
    variant = variant if variant is not None else cfg.variant_for(cost)
    if settings.clipping or settings.fp16:
        # plans are rated with the step check they will run: the barrier, or speculation with
        # its publish / validate traffic (and the fractions of waits and rollbacks the cost
        # model names; measured ones come back in the engine's report)
        cost = replace(cost, step_check="barrier" if cfg.clipping == "barrier" else "speculative")
    return ScheduleProvider.build(
        settings.topology, settings.microbatches, cost, schedule=cfg.schedule, variant=variant,
        solver=solver or planner.solver, time_limit_s=planner.time_limit_s, memory_cap=planner.memory_cap,
        max_failures=cfg.max_failures if table else 0, all_coverable=planner.all_coverable and table,
        cache_dir=planner.cache_dir,
        workers=planner.workers, tied=settings.tied,
    )


def adopting_provider(settings: PlanSettings, cost, variant: str, solver: str) -> ScheduleProvider:
    """A provider with the publisher's cost model, variant and solver and no table (it adopts one)."""
    return schedule_provider(settings, settings.config_dir, cost=cost, variant=variant, solver=solver, table=False)


def plans_timeout_s(config: ResilienceConfig) -> float:
    return max(config.detector.store_timeout_s, 1800.0)


def publisher_failed(store: Any, publisher: int, since: int | None = None) -> str | None:
    """Why the wait for ``publisher``'s plans ends, if it failed (see ``failed_after``): the build
    it was making was abandoned, even if it re-joined since."""
    record = failed_after(store, publisher, since)
    return None if record is None else f"epoch {record.epoch}: {record.reason}"


def agreed_plans(agreement: PlanAgreement, build: int, cost=None, solver: str | None = None) -> ScheduleProvider:
    """The plan table and planner of ``build`` (0 at start, 1 after the profile), agreed under the
    agent: only the grid's first rank (rank 0, unless a re-grid left it out) plans, and publishes
    its table, cost model, variant and solver; every other rank waits for them and adopts them.

    Raises:
        PublisherLost: the publisher failed before it published (no rank took this build).
    """
    settings, store, scope = agreement.settings, agreement.store, agreement.scope
    topology = settings.topology
    publisher = min(topology.rank(w) for w in topology.alive_workers())
    if agreement.rank == publisher:
        announce(store, scope=scope, build=build, publisher=publisher, epoch=latest_epoch(store))
        if build:
            agreement.fire("in_replan", agreement.step())
        provider = schedule_provider(settings, settings.config_dir, cost=cost, solver=solver)
        publish(store, provider, scope=scope, build=build, from_step=agreement.from_step)
        return provider
    # from the newest epoch on: a publisher that fails and re-joins while this rank waits
    # still ends the wait (the build it was making is gone)
    since = latest_epoch(store) - 1
    if build:
        agreement.fire("in_replan", agreement.step())
    return await_published(store, lambda *a: adopting_provider(settings, *a), scope=scope, build=build,
                           interrupted=lambda: publisher_failed(store, publisher, since),
                           timeout_s=plans_timeout_s(settings.config), publisher=publisher)


def joined_plans(agreement: PlanAgreement) -> tuple[dict | None, ScheduleProvider | None]:
    """A re-joining worker plans with what the survivors plan with: rank 0's newest published
    cost model, variant and table. Returns the record read and the provider (``None``: nothing
    published, plan as configured)."""
    store, settings = agreement.store, agreement.settings
    record = newest(store, agreement.scope, timeout_s=plans_timeout_s(settings.config),
                    interrupted=functools.partial(publisher_failed, store))
    if record is None:
        return None, None
    provider = adopt_published(store, record, lambda *a: adopting_provider(settings, *a), scope=agreement.scope)
    log.info("rank %d: re-joining with rank 0's plans (build %s, %s costs, variant %s)", agreement.rank,
             record["build"], provider.cost.name, provider.variant)
    return record, provider


class BackgroundReplan:
    """The re-plan after the self-profile (``resilience.profile_steps``), off the training thread.

    :meth:`start` runs ``plans()`` (under the agent: rank 0 plans and publishes, every other rank
    waits for its table, ``agreed_plans``) in a daemon thread and returns at once; training goes on
    with the table it has. Every rank adopts the new table at optimizer step ``due`` (the profile's
    last step + :data:`REPLAN_LAG`: the profile ends at the same step on every rank), so that they
    switch together: :attr:`provider` stands for the table in force at the current step, the one
    before until ``due``, the new one from then on (:meth:`table_at`), and at each training
    iteration's start :meth:`at_boundary` switches a fault-free run to the profiled fault-free
    schedule (:func:`healthy_schedule`). Reaching ``due`` before the thread is done, a rank waits
    for it there and logs how long.

    Failures: the table in force is a function of the step, so a recovery, which plans on every
    survivor at the same resume step (the fewest steps any survivor took, after the rollback), takes
    its schedule from the same table on all of them, even when one rank had passed ``due`` and
    another had not when the failure came. A publisher that failed before it published
    (``PublisherLost``) leaves every rank on the table before (``re-plan abandoned``). Any other
    exception in the thread is raised again on the training thread when the table is needed at
    ``due`` or later. The table is published with ``due`` (``from_step``): a worker that re-joins
    with it but is handed an earlier step's state stops (``plan_agreement.check_joined``) rather
    than answer a failure from another table than the survivors'. A restart or a re-grid builds
    new engines, whose plans do not read this.
    """

    def __init__(self, plans: Callable[[], ScheduleProvider], cost, *, rank: int, due: int, before: ScheduleProvider,
                 steps: Callable[[], int], reporter: Callable[[], bool]) -> None:
        self.cost, self.rank, self.due, self.before = cost, rank, due, before
        self._plans, self._steps, self._reporter = plans, steps, reporter
        self._thread = threading.Thread(target=self._run, name="dsr-replan", daemon=True)
        self._new: ScheduleProvider | None = None
        self._error: BaseException | None = None
        self._started = 0.0
        self._seconds = 0.0  # the thread's time
        self._joined = False
        self._reported = False
        self._checked: Generation | None = None  # the generation at_boundary saw last
        self.provider = ReplannedProvider(self)

    def start(self) -> "BackgroundReplan":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._new = self._plans()
        except PublisherLost as exc:  # nobody took the new table: every survivor keeps the agreed one
            log.info("rank %d: re-plan abandoned: %s", self.rank, exc)
        except BaseException as exc:  # noqa: BLE001 - raised again on the training thread (table_at)
            self._error = exc
        finally:
            self._seconds = time.perf_counter() - self._started

    @property
    def done(self) -> bool:
        """The thread has finished (a table, an abandonment or an error)."""
        return not self._thread.is_alive() and self._started > 0

    def table_at(self, step: int) -> ScheduleProvider:
        """The plans in force at optimizer step ``step``: the table before the re-plan until ``due``,
        the re-plan's from then on (joined here if the thread is not done; the table before if it
        was abandoned).

        Raises:
            BaseException: what the thread raised (other than ``PublisherLost``), at ``due`` or later.
        """
        if step < self.due:
            return self.before
        if not self._joined:
            if self._thread.is_alive():
                waited = time.perf_counter()
                self._thread.join()
                log.info("rank %d: step %d waited %.2fs for the re-plan (started %.2fs before)", self.rank, step,
                         time.perf_counter() - waited, waited - self._started)
            self._joined = True
        if self._error is not None:
            raise self._error
        return self._new if self._new is not None else self.before

    def at_boundary(self, step: int, generation: Generation) -> Generation:
        """A training iteration starts at optimizer step ``step``: from ``due`` on, the re-plan's
        table is in force (:meth:`table_at`) and a fault-free run runs its fault-free schedule
        (:func:`healthy_schedule`; again after a recovery that rolled back below ``due`` and
        re-joined everyone with the table before). Returns the generation to run."""
        if step < self.due or generation is self._checked:
            return generation
        provider = self.table_at(step)
        said = ""
        if provider is not self.before:
            generation, said = healthy_schedule(generation, provider)
        self._checked = generation
        if not self._reported:
            self._reported = True
            if provider is not self.before and self._reporter():
                log.info("plans rebuilt with the profiled costs (%s) in %.2fs, adopted at step %d%s", self.cost.name,
                         self._seconds, step, said, extra=STDOUT)
        return generation


class ReplannedProvider:
    """The plans in force at the engine's current optimizer step, while and after a
    :class:`BackgroundReplan` runs (``BackgroundReplan.table_at``): a stand-in for a
    :class:`ScheduleProvider`, whose attributes it reads from that table."""

    def __init__(self, replan: BackgroundReplan) -> None:
        self._replan = replan

    @property
    def current(self) -> ScheduleProvider:
        return self._replan.table_at(self._replan._steps())

    def __getattr__(self, name: str) -> Any:
        if name == "_replan" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.current, name)


def healthy_schedule(generation: Generation, provider: ScheduleProvider) -> tuple[Generation, str]:
    """A fault-free run switches to the fault-free schedule of the profiled costs (every rank
    at this same iteration boundary, from the same agreed model): ``schedule: decoupled`` runs
    fused on the stages where the profile finds the split dearer and the replay slower
    (``planning/generators.decoupled``). Returns the generation to run and what changed, for the
    log ("" if nothing)."""
    if generation.source != "fault-free" or generation.topology.failed:
        return generation, ""
    choice = provider.schedule_for(frozenset())
    if choice.schedule == generation.schedule:
        return generation, ""
    fused = fused_in(choice.schedule)
    cost = provider.cost
    margin = ("the profile's noise" if cost.split_noise is not None else "fixed")
    how = (f"fused backward on stage(s) {', '.join(map(str, fused))}; a split must be predicted "
           f"{100 * split_margin(cost):.1f}% faster to run ({margin} margin)" if fused else "every stage split")
    return (replace(generation, schedule=choice.schedule, lookup_s=choice.seconds),
            f"; the healthy {choice.schedule.name} schedule re-listed with them ({how})")


def first_generation(provider: ScheduleProvider, topology: Topology, me: Worker, failed: frozenset[Worker], *,
                     live: bool, rejoin: bool, alive: bool, session: str, store: Any, tied: Any,
                     device: str | None, solver: str, timeout_s: float) -> tuple[Generation, str]:
    """The schedule and groups to start with, and the session that names the groups.

    Under the agent every worker starts fault-free (a re-joining one learns the real membership
    when it joins; ``store``: the coordinator's). Otherwise rank 0 plans the simulated failure set
    ``failed`` (with ``solver``) and broadcasts the schedule as JSON, with a session id that names
    the groups.
    """
    if live:
        choice = provider.schedule_for(frozenset())
        groups = None
        if not rejoin:
            groups = build_groups(topology, me, session=session, timeout_s=timeout_s, store=store, tied=tied,
                                  device=device)
    else:
        payload = None
        if dist.get_rank() == 0:
            c = provider.schedule_for(failed, solver=solver)
            payload = {"schedule": c.schedule.to_text(), "source": c.source, "seconds": c.seconds,
                       "figures": c.figures, "session": uuid.uuid4().hex[:12]}
        payload = world_group(timeout_s).broadcast_json(payload, src=0)
        session = payload["session"]
        choice = ScheduleChoice(Schedule.from_text(payload["schedule"]), payload["source"], payload["seconds"],
                                payload["figures"])
        groups = (build_groups(topology.without(failed), me, session=session, timeout_s=timeout_s, tied=tied,
                               device=device) if alive else None)
    return (Generation(epoch=0, topology=topology.without(failed), schedule=choice.schedule, source=choice.source,
                       lookup_s=choice.seconds, figures=choice.figures, groups=groups), session)
