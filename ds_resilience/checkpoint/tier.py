"""The checkpoint tier of one worker: the states a rollback, a restart or a peer may need.

:class:`CheckpointTier` is the one owner of a stage's saved states inside a running engine. It is
the executor's hooks (``runtime.executor.ExecutorHooks``):

* ``before_step``: the snapshot copy of the previous step reads the live tensors, so it must be done
  first; and the pre-step state must be kept when the step may be undone: a speculative step (its
  validation may roll it back), and every step when live failures are handled (a peer failing
  before every stage stepped rolls the stage back). The in-memory snapshot of the current step is
  that state; without one, a deep copy is kept instead. An exact step without live handling keeps
  nothing (the copy of parameters and both Adam moments cost 0.20 s a step on 40M parameters);
* ``after_step``: every ``interval`` steps the new state is captured into host memory (in the
  background; ``inmemory.py``), replicated and, every ``persistent_interval`` steps, persisted;
* ``action_window``: replication chunks go out while the engine runs an action the timeline marks
  link-idle (``ir/windows.py``), for the measured length of that action (from the previous
  iteration) times ``idle_fraction``.

:meth:`rollback` puts the stage back to the start of a step it already took (a peer failed before
every stage stepped); :meth:`restore` loads the newest step held for every rank after the agent
restarted all workers; :meth:`ready_for_restart` makes sure this worker's newest state is
committed (and replicated) before it exits for such a restart. All of them move one type,
:class:`~.state.StageState`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, ContextManager

from ..config import CheckpointConfig
from ..costs import CostModel
from ..errors import ResilienceError
from ..ir import Schedule
from ..ir.windows import replication_windows
from .inmemory import InMemoryCheckpointer
from .state import StageHost, StageState, apply, capture

__all__ = ["CheckpointTier"]

logger = logging.getLogger("ds_resilience.checkpoint")


class CheckpointTier:
    """A worker's saved states (see the module docstring).

    Args:
        host: the engine's stage (parameters, optimizer, scheduler, counters).
        stage, rank: this worker's stage and global rank.
        keep_pre_step: keep the pre-step state of every step (live failure handling is on); a
            speculative step's is kept either way.
        memory: the in-memory snapshot tier, or ``None`` (off, or not under the agent).
        fault_hook: ``fault_hook("in_snapshot", step)`` while a snapshot drains (tests).
    """

    def __init__(self, host: StageHost, *, stage: int, rank: int, keep_pre_step: bool,
                 memory: InMemoryCheckpointer | None = None,
                 fault_hook: Callable[[str, int], None] | None = None) -> None:
        self.host = host
        self.stage, self.rank = stage, rank
        self.keep_pre_step = keep_pre_step
        self.memory = memory
        self.fault_hook = fault_hook
        self._pre_step: StageState | None = None
        self._spare: StageState | None = None  # an earlier pre-step copy whose buffers the next one fills
        self._windows: dict[int, Any] = {}
        self._windows_of: Schedule | None = None
        self._measured: dict[int, float] = {}

    @property
    def cfg(self) -> CheckpointConfig | None:
        return self.memory.cfg if self.memory is not None else None

    def state(self) -> StageState:
        """The stage's state now (live tensors)."""
        return capture(self.host, stage=self.stage, rank=self.rank)

    # --- the executor's hooks ------------------------------------------------------------------------
    def before_step(self, speculative: bool = False) -> None:
        mem = self.memory
        if mem is not None:
            mem.wait_copied()  # the previous capture still reads the live tensors
        # the last copy's buffers are filled again (no allocation, no page faults): nothing reads it
        # after this step begins (a rollback applies copies of it)
        spare, self._pre_step = self._pre_step or self._spare, None
        self._spare = spare
        needed = speculative or self.keep_pre_step
        if needed and (mem is None or mem.last_captured != self.host.counters()[0]):
            # a GPU stage's copy in host memory
            self._pre_step = self.state().clone(host=True, reuse=spare)
            self._spare = None

    def after_step(self) -> None:
        self.capture_due()

    def undo_step(self) -> None:
        """Undo the stage's last optimizer step (a speculative step that validation rejected)."""
        self.rollback(self.host.counters()[0] - 1)

    def action_window(self, index: int) -> ContextManager[None]:
        mem = self.memory
        if mem is None or not mem.replicating or index not in self._windows:
            return contextlib.nullcontext()
        return self._window(index)

    @contextlib.contextmanager
    def _window(self, index: int):
        mem = self.memory
        expected = self._measured.get(index)
        mem.gate.open(None if expected is None else expected * mem.cfg.idle_fraction)
        started = time.perf_counter()
        try:
            yield
        finally:
            mem.gate.close()
            self._measured[index] = time.perf_counter() - started

    # --- iterations ------------------------------------------------------------------------------------
    def capture_due(self) -> None:
        """Capture the current state if its step is due (step 0, the initial state, always is)."""
        mem = self.memory
        steps = self.host.counters()[0]
        if mem is not None and mem.due(steps):
            mem.capture(steps, self.state().to_tree())
            if self.fault_hook is not None:
                self.fault_hook("in_snapshot", steps)  # the copy into host memory is in flight

    def begin_iteration(self, schedule: Schedule, worker_index: int, cost: CostModel) -> None:
        """An iteration boundary: switch to the replica placement over the machines left when
        peers failed (``inmemory.py``, in the background); compute the replication windows when
        the schedule changed."""
        mem = self.memory
        if mem is None:
            return
        mem.at_boundary()
        mem.gate.mark_iteration()
        if mem.replicating and mem.cfg.interleave and self._windows_of is not schedule:
            self._windows = {w.index: w for w in replication_windows(schedule, worker_index, cost)}
            self._windows_of = schedule
            self._measured.clear()

    def end_iteration(self, seconds: float) -> None:
        if self.memory is not None:
            self.memory.note_iteration(seconds, self.host.counters()[0])

    # --- recovery ----------------------------------------------------------------------------------
    def rollback(self, steps: int) -> None:
        """Put the stage back to the state before its step ``steps + 1`` (it took that step already).

        Raises:
            ResilienceError: no saved state of step ``steps`` is held.
        """
        current = self.host.counters()[0]
        if current == steps:
            return
        held = self._pre_step.steps if self._pre_step is not None else None
        if current == steps + 1 and self._pre_step is None and self._load_snapshot(steps):
            return
        if self._pre_step is None or held != steps or current != steps + 1:
            raise ResilienceError(f"rank {self.rank}: cannot roll back from step {current} to {steps} "
                                  f"(the pre-step copy holds step {held})")
        apply(self._pre_step, self.host, stage=self.stage)

    def _load_snapshot(self, steps: int) -> bool:
        mem = self.memory
        if mem is None or mem.last_captured is None or mem.last_captured < steps or not mem.wait_committed(steps):
            return False
        apply(StageState.from_tree(mem.load_local(steps)), self.host, stage=self.stage)
        return True

    def drop(self, ranks) -> None:
        """Peers that failed: stop replicating to them (frees a thread blocked on them; at the next
        iteration boundary the replicas are re-placed over the machines left), and take their
        snapshot-interval needs out of the job's schedule (``checkpoint/interval.py``)."""
        if self.memory is None:
            return
        self.memory.drop(ranks)
        try:
            self.memory.schedule.forget(ranks)
        except Exception as exc:  # noqa: BLE001 - the store unreachable: the schedule keeps their needs
            logger.warning("rank %d: could not drop failed ranks %s from the snapshot interval schedule: %s",
                           self.rank, list(ranks), exc)

    def ready_for_restart(self, step: int) -> dict[str, Any]:
        """Before exiting for a restart: the snapshot of ``step`` is committed (and replicated, if
        the holders are alive and it takes less than a few seconds)."""
        mem = self.memory
        if mem is None:
            return {"committed": False, "replicated": False}
        if mem.last_captured != step:  # the interval skipped it: the state is exactly step ``step`` now
            mem.capture(step, self.state().to_tree())
        committed = mem.wait_committed(step)
        mem.gate.open(None)  # no training traffic any more: replicate freely
        replicated = mem.wait_replicated(step, 5.0)
        return {"committed": committed, "replicated": replicated}

    def restore(self, stage_of: dict[int, int] | None, *, newer_than: int | None = None) -> dict[str, Any] | None:
        """After a restart: load the newest step held for every rank (collective over all ranks).

        ``stage_of`` (rank -> stage) lets a rank restore from a data-parallel peer's snapshot of
        the same stage, whose state is identical. Returns the recovery-log entry; ``None`` when
        the newest step is not newer than ``newer_than`` (nothing loaded).
        """
        started = time.time()
        found = self.memory.restore(stage_of=stage_of, newer_than=newer_than)
        if found is None:
            return None
        tree, plan, timings = found
        apply(StageState.from_tree(tree), self.host, stage=self.stage)
        self.memory.mark_held(self.host.counters()[0])
        source, holder, from_rank = plan.sources[self.rank]
        return {"kind": "restored", "resume_step": plan.step, "source": source, "holder": holder,
                "from_rank": from_rank, "sources": {str(r): s for r, (s, _, _) in plan.sources.items()},
                "recovery_s": time.time() - started, **timings}

    @property
    def lose_memory(self) -> Callable[[], None] | None:
        """Wipes this machine's host memory (the ``lose_machine`` fault)."""
        return self.memory.lose_memory if self.memory is not None else None

    def close(self) -> None:
        """Stop the tier's threads (the snapshots stay in host memory for the agent)."""
        if self.memory is not None:
            self.memory.close()
