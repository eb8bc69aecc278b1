"""One stage's failure-handling machinery, assembled once for every front end.

A front end (the DeepSpeed engine, the Megatron schedule) describes its stage in a
:class:`StageDescription` and gets a :class:`LiveStage` that holds, wired to each other:

* the :class:`~ds_resilience.runtime.progress.Progress` of the main thread (hang detection: a
  main thread stuck in an action stops the heartbeat);
* the agent's :class:`~ds_resilience.runtime.coordinator.Coordinator` (heartbeats, latched epochs);
* the :class:`~ds_resilience.runtime.faults.FaultInjector` of the tests and drills;
* the :class:`~ds_resilience.checkpoint.tier.CheckpointTier` with its in-memory snapshots;
* once the front end built its executor (:meth:`LiveStage.attach`), the
  :class:`~ds_resilience.runtime.recovery.LiveRecovery` and the current :class:`Generation`.

It runs an iteration (:meth:`LiveStage.iteration`: the executor's and the tier's begin and end,
the progress timer around the actions) and the recover-and-retry loop around any call
(:meth:`LiveStage.resilient`). What is left to a front end is what only it knows: how to build
its executor, how to run the actions, what a recovery means for its own state (an adopted
schedule, re-sharded optimizer states) and how to export its checkpoint.

The ways a stage starts are one :class:`StartMode`, chosen in one place (:meth:`StartMode.of`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..checkpoint.inmemory import InMemoryCheckpointer
from ..checkpoint.tier import CheckpointTier
from ..config import ResilienceConfig
from ..epochs import EpochRecord
from ..errors import ConfigError
from ..ir import Action
from ..ir.pairs import early_posts
from ..launch import LaunchEnv, job_checkpoint_dir
from ..topology import Topology, Worker
from .coordinator import Coordinator
from .executor import Executor
from .faults import FaultInjector
from .progress import Progress
from .stragglers import StragglerWatch, replans
from . import stop_signals
from .recovery import Generation, LiveRecovery, RecoveryHooks, is_failure, release_on_epoch

__all__ = ["LiveStage", "RecoveryHooks", "StageDescription", "StartMode"]


log = logging.getLogger(__name__)

class StartMode(enum.Enum):
    """How a stage starts."""

    FRESH = "fresh"  #: no agent, every worker trains
    SIMULATED = "simulated"  #: no agent, ``resilience.simulate_failed`` leaves workers idle
    LIVE = "live"  #: under the agent, the first launch
    REJOIN = "rejoin"  #: relaunched by the agent to re-join the survivors (takes a peer's state)
    RESTART = "restart"  #: every worker restarted by the agent (restores the in-memory snapshots)
    REGRID = "regrid"  #: a survivor's new position in a grid the survivors re-formed (same process)

    @classmethod
    def of(cls, launch: LaunchEnv | None, *, simulated: bool = False, regrid: bool = False) -> StartMode:
        """The mode of a stage launched with ``launch`` (``None``: not under the agent)."""
        if regrid:
            return cls.REGRID
        if launch is None:
            return cls.SIMULATED if simulated else cls.FRESH
        if simulated:
            raise ConfigError("resilience.simulate_failed", "simulated failures and the live agent do not mix")
        if launch.rejoin:
            return cls.REJOIN
        return cls.RESTART if launch.restart else cls.LIVE

    @property
    def live(self) -> bool:
        """Under the agent (failures handled while training)."""
        return self not in (StartMode.FRESH, StartMode.SIMULATED)

    @property
    def fresh(self) -> bool:
        """A first start of the job's first grid (it may profile itself)."""
        return self in (StartMode.FRESH, StartMode.LIVE)


@dataclass(frozen=True)
class StageDescription:
    """What a front end tells :class:`LiveStage` about its stage.

    Attributes:
        topology: the full grid; ``me`` this worker's position; ``rank`` its global rank.
        mode: how it starts; ``launch`` the agent's contract (``None`` without the agent).
        config: the ``"resilience"`` section (detector, checkpoint, fault injection, ``fast_w``).
        host: the stage's state as the checkpoint tier sees it (``checkpoint.state.StageHost``).
        session: names the stage's process groups and its snapshots.
        alive: whether this worker trains (a simulated-failed one idles).
        keep_pre_step: keep each step's pre-step state (a rollback's source).
        machine_key: ``machine_key(rank)`` groups ranks into machines for snapshot placement.
        snapshot_name: the snapshots' name (default ``{session}/attempt{restart}``).
        exclude: ranks that hold no position any more (lost before a re-grid).
        info: what the worker registers with the agent (pipeline, stage, grid).
    """

    topology: Topology
    me: Worker
    rank: int
    mode: StartMode
    launch: LaunchEnv | None
    config: ResilienceConfig
    host: Any
    session: str
    alive: bool = True
    keep_pre_step: bool = True
    machine_key: Callable[[int], Any] | None = None
    snapshot_name: str | None = None
    exclude: Sequence[int] = ()
    info: dict[str, Any] = field(default_factory=dict)


def agent_settings(config: ResilienceConfig) -> dict[str, Any]:
    """What the agent needs of the config, registered by every worker: the agent reads it there,
    however the script was given its config (a file, a dict in code, a launcher flag)."""
    ckpt = config.checkpoint
    return {"max_restarts": ckpt.max_restarts if ckpt.enabled else 0, "regrid": bool(config.regrid),
            "grow_back": bool(config.grow_back), "host_dir": str(ckpt.host_dir) if ckpt.host_dir else None,
            "snapshots": bool(ckpt.enabled)}


class LiveStage:
    """A stage's progress, coordinator, fault injector, checkpoint tier, recovery and generation.

    Args:
        desc: the stage.
        coordinator, progress: a re-formed grid keeps the ones of the stage it replaces.
    """

    def __init__(self, desc: StageDescription, *, coordinator: Coordinator | None = None,
                 progress: Progress | None = None) -> None:
        self.desc = desc
        self.mode = desc.mode
        # what else an epoch releases (the watcher thread calls each with the record): a front end's
        # own groups (megatron-core's tensor-parallel group)
        self.releases: list[Callable[[EpochRecord], None]] = []
        self._restore_signals: Callable[[], None] = lambda: None
        cfg = desc.config
        det = cfg.detector
        live = desc.mode.live
        self.progress = progress if progress is not None else Progress(det.stall_timeout_s) if live else None
        if coordinator is None and live:
            settings = {**agent_settings(cfg), **desc.info.get("settings", {})}  # the front end's own flags too
            coordinator = Coordinator(launch=desc.launch, info={**desc.info, "settings": settings},
                                      heartbeat_interval_s=det.heartbeat_interval_s,
                                      store_timeout_s=det.store_timeout_s, on_epoch=self._on_epoch,
                                      progress=self.progress)
            # SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C) ask the agent for a graceful stop
            self._restore_signals = stop_signals.install(coordinator.request_stop, desc.rank)
        elif coordinator is not None:
            coordinator.on_epoch = self._on_epoch  # a re-formed grid's: its epochs release this stage's groups
        self.coordinator = coordinator
        self.faults = FaultInjector(cfg.fault_injection, desc.rank, launch=desc.launch)
        memory = self._memory() if live and desc.alive else None
        self.tier = CheckpointTier(desc.host, stage=desc.me.stage, rank=desc.rank, keep_pre_step=desc.keep_pre_step,
                                   memory=memory, fault_hook=self.faults.maybe_fire)
        self.faults.lose_memory = self.tier.lose_memory
        self.executor: Executor | None = None
        self.recovery: LiveRecovery | None = None
        self.hooks: RecoveryHooks | None = None
        self.generation: Generation | None = None
        self.stragglers: StragglerWatch | None = None  # under the agent: who runs slower than its stage peers
        self._slow_warmed: Any = None  # the provider whose slow table is planned (``_warm_slow_table``)
        self._straggler_error = False
        self.closed = False
        self._derived: tuple[Any, tuple[Action, ...], dict[int, tuple[int, ...]]] | None = None

    # --- construction ----------------------------------------------------------------------------
    def _memory(self) -> InMemoryCheckpointer | None:
        desc = self.desc
        cfg = desc.config.checkpoint
        if not cfg.enabled:
            return None
        launch = desc.launch
        world = launch.world_size
        return InMemoryCheckpointer(
            cfg, rank=desc.rank, world=world, job_id=launch.job_id or f"job-{desc.session}",
            local_world_size=launch.local_world_size or world,
            name=desc.snapshot_name or f"{desc.session}/attempt{launch.restart}",
            replicate=desc.mode is not StartMode.REJOIN, group_store=self.coordinator.store,
            timeout_s=desc.config.detector.pg_timeout_s, machine_key=desc.machine_key, exclude=desc.exclude)

    def attach(self, executor: Executor, provider: Any, hooks: RecoveryHooks) -> None:
        """The front end's executor: it reports its progress here, and under the agent the
        recovery is built around it with ``provider``'s schedules."""
        self.executor = executor
        executor.progress = self.progress
        executor.fast_w = self.desc.config.fast_w
        executor.speed = lambda: self.faults.speed(executor.iteration)  # an injected fail-slow worker
        self.hooks = hooks
        if not self.mode.live:
            return
        desc, det = self.desc, self.desc.config.detector
        self.stragglers = StragglerWatch(self.coordinator.store, desc.session, desc.rank, self._members,
                                         window=det.straggler_window, margin=det.straggler_margin,
                                         switch=replans(det.straggler_replan), hold=det.straggler_hold)
        self.recovery = LiveRecovery(
            topology=desc.topology, me=desc.me, coordinator=self.coordinator, executor=executor, tier=self.tier,
            provider=provider, session=desc.session, timeout_s=det.pg_timeout_s,
            grace_s=det.heartbeat_timeout_s + 5.0, adopt=self.adopt,
            persistent_dir=job_checkpoint_dir(desc.config.checkpoint.persistent_dir, desc.launch.job_id), hooks=hooks,
            fault_hook=self.faults.maybe_fire)

    def start(self, restore: Callable[[], dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
        """The snapshots' start, by mode: a first start captures the initial state (step 0); a
        restart restores with ``restore()`` (the front end's: which ranks' snapshots serve which
        stage) and returns its log entry; a re-joining worker takes a peer's state."""
        mode = self.mode
        if mode is StartMode.REJOIN:
            if self.desc.alive:
                self.recovery.join()
            return None
        if self.tier.memory is None:
            return None
        if mode is StartMode.RESTART and restore is not None:
            return restore()
        self.tier.capture_due()
        return None

    # --- the generation ------------------------------------------------------------------------------
    def begin(self, generation: Generation) -> None:
        """The first generation: its groups go to the executor."""
        self.generation = generation
        if generation.groups is not None:
            self.executor.install(generation.groups)

    def adopt(self, generation: Generation) -> None:
        """A recovery's new generation (its groups are installed already); the front end hears of it."""
        self.generation = generation
        if self.hooks is not None and self.hooks.adopted is not None:
            self.hooks.adopted(generation)

    @property
    def index(self) -> int:
        return self.desc.topology.worker_index(self.desc.me)

    def _derive(self) -> tuple[tuple[Action, ...], dict[int, tuple[int, ...]]]:
        generation = self.generation  # its schedule and, for the posts, whether it has groups
        if self._derived is None or self._derived[0] is not generation:
            schedule = generation.schedule
            posts = early_posts(schedule)[self.index] if generation.groups is not None else {}
            self._derived = (generation, schedule.workers[self.index], posts)
        return self._derived[1], self._derived[2]

    @property
    def actions(self) -> tuple[Action, ...]:
        """This worker's actions in the current schedule."""
        return self._derive()[0]

    @property
    def posts(self) -> dict[int, tuple[int, ...]]:
        """This worker's early receive posts for the current schedule (NCCL's pair order)."""
        return self._derive()[1]

    # --- running ---------------------------------------------------------------------------------------
    def iteration(self, step: int, run: Callable[[], None], cost: Any, *,
                  before: Callable[[], None] | None = None, after: Callable[[], Any] | None = None) -> tuple[Any, float]:
        """One iteration of the current schedule at optimizer step ``step``: ``before()`` (the
        front end's preparation), then the actions, which ``run()`` executes the front end's
        way, timed by the progress watch, then ``after()`` (what the front end does with the
        iteration's results). Returns ``after()``'s value and the iteration's seconds."""
        ex = self.executor
        started = time.perf_counter()
        if before is not None:
            before()
        ex.begin_iteration(step, self.actions, self.posts)
        self.tier.begin_iteration(self.generation.schedule, self.index, cost)
        if self.progress is None:
            run()
        else:
            with self.progress.active():
                run()
        ex.end_iteration()
        self._watch_stragglers(step)
        result = after() if after is not None else None
        elapsed = time.perf_counter() - started
        self.tier.end_iteration(elapsed)
        return result, elapsed

    def _members(self) -> dict[int, int]:
        """{global rank: stage} of the alive workers of the current generation."""
        generation = self.generation
        if generation is None:
            return {}
        topology = generation.topology
        return {topology.rank(w): w.stage for w in topology.alive_workers()}

    def _watch_stragglers(self, step: int) -> None:
        """Publish this worker's pace, and on the reporting rank decide who is slow
        (runtime/stragglers.py); a store error here is told once and never stops training."""
        if self.stragglers is None:
            return
        if self.stragglers.switch and self.recovery is not None:
            self._warm_slow_table()
        stats = self.executor.stats
        try:
            self.stragglers.after_iteration(step, stats.durations, stats.forwards)
        except (RuntimeError, ValueError) as exc:
            if not self._straggler_error:
                self._straggler_error = True
                log.warning("rank %s: straggler detection skipped (%s)", self.desc.rank, exc)

    def _warm_slow_table(self) -> None:
        """The slow table of the provider in force (``ScheduleProvider.warm_slow_table``), planned in
        a daemon thread once per provider (a re-plan brings a new one): a switch then looks its plan
        up. A failure there is logged; the switch plans on demand as without it."""
        provider = self.recovery.provider
        provider = getattr(provider, "current", provider)  # ds_plans.ReplannedProvider: the table in force
        if provider is self._slow_warmed or not hasattr(provider, "warm_slow_table"):
            return
        self._slow_warmed = provider

        def warm() -> None:
            try:
                provider.warm_slow_table()
            except Exception as exc:  # noqa: BLE001 - a thread's error is logged, the switch plans on demand
                log.warning("rank %s: the slow table was not planned ahead (%s); a switch plans on demand",
                            self.desc.rank, exc)

        threading.Thread(target=warm, name="dsr-slow-table", daemon=True).start()

    def resilient(self, run: Callable[[], Any], *, rejoin: bool = True) -> Any:
        """``run()``; on a failure signal under the agent, recover (roll back, new groups and
        schedule) and run it again. ``rejoin=False``: ``run`` is not a training iteration (a save,
        an evaluation, the end of training): a pending re-join is left for the next iteration
        (:meth:`Coordinator.check`)."""
        while True:
            try:
                if self.coordinator is not None:
                    self.coordinator.check(rejoin=rejoin)
                return run()
            except Exception as exc:  # noqa: BLE001 - filtered by is_failure
                if self.recovery is None or not is_failure(exc):
                    raise
                self.recovery.recover(exc)

    def _on_epoch(self, record: EpochRecord) -> None:
        """Watcher thread: a new epoch was latched; release whatever the main thread is blocked on
        (a re-join changes nothing for the running iteration: it is applied at the next boundary).

        The record is visible to the main thread before this runs: a starved watcher may get here
        after the main thread applied the epoch, and must not poison the generation built for it
        (its peers would see their fresh pairs closed, with no newer epoch to explain it)."""
        generation = self.generation
        stale = generation is not None and generation.epoch < record.epoch
        release_on_epoch(record, generation.groups if stale else None, getattr(self, "tier", None))
        for release in self.releases:
            release(record)

    @property
    def retired(self) -> bool:
        """This rank's replica lost a rank while it lives on (tensor parallelism): it idles."""
        return self.recovery is not None and self.recovery.retired

    def close(self, *, heartbeats: bool = True) -> None:
        """The end of training: the last snapshot committed and replicated, the tier's threads
        stopped, and with ``heartbeats`` the coordinator's (an exit, not a hang). Calling it
        twice is harmless."""
        if not self.closed:
            self.closed = True
            self.tier.close()
        if heartbeats and self.coordinator is not None:
            self.coordinator.close()
            self._restore_signals()
