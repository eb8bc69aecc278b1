"""A worker's side of live membership: heartbeats, the epoch watcher, agreement on where to resume.

The agent (``supervisor/agent.py``, never inside a worker) owns membership: it detects crashes and
hangs and publishes numbered epoch records in its store. In each worker:

* a heartbeat thread bumps ``dsr/hb/{rank}`` (a hung process stops bumping it), at the agent's
  interval (``LaunchEnv.heartbeat_interval_s``: the agent judges silence by its own settings);
* a watcher thread waits for the next epoch record; when one arrives it is *latched* and the
  current generation's process groups are *poisoned* (each pair gets a receive with a 1 ms timeout,
  which makes gloo close it), so a main thread blocked in a receive or a collective is released in
  milliseconds instead of waiting out the process-group timeout;
* in-band communication errors only prompt a look at the epoch: membership changes only through
  the agent's records;
* at recovery every survivor posts its step count and reads everyone's (:meth:`gather_steps`);
  the recovery plan (``planning/recovery.py``) takes the resume step from them, so no stage steps
  twice and none skips.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable

from .. import store_keys as keys
from ..comm.groups import poison
from ..epochs import SWITCH_KINDS
from ..errors import ResilienceError
from ..launch import LaunchEnv
from ..polling import Backoff
from . import membership

__all__ = ["Reconfigure", "TrainingOver", "Coordinator", "poison"]


class Reconfigure(ResilienceError):
    """A newer membership epoch is latched: stop the iteration and reconfigure."""

    def __init__(self, record) -> None:
        super().__init__(f"membership epoch {record.epoch} ({record.kind}): failed ranks {list(record.failed)}")
        self.record = record


class TrainingOver(ResilienceError):
    """A re-joining worker learns that training ended before the survivors admitted it (the
    agent's ``TRAINING_OVER_KEY``): there is no step left for it; it exits 0."""


class Coordinator:
    """Heartbeats, the epoch watcher and the store protocol of one worker (under the agent).

    Args:
        launch: the agent's contract (store address, incarnation, heartbeat interval, its pid).
        info: what the worker registers: ``pipeline``, ``stage``, ``dp``, ``pp``, ``settings``.
        heartbeat_interval_s: the interval when the agent set none (the config's).
        store_timeout_s: how long a store wait may take before it is an error.
        on_epoch: called from the watcher thread right after a new epoch is latched (the engine
            poisons its groups there).
        progress: the main thread's progress: heartbeats stop while it is stalled (hang detection).
    """

    def __init__(self, *, launch: LaunchEnv, info: dict, heartbeat_interval_s: float, store_timeout_s: float,
                 on_epoch: Callable[[object], None], progress=None) -> None:
        store = membership.agent_store_from_env(store_timeout_s, launch)
        if store is None:
            raise ResilienceError("live failure handling needs the agent: start with `ds-resilience run`")
        self.store = store
        self.rank = rank = launch.rank
        self.store_timeout_s = store_timeout_s
        self.on_epoch = on_epoch
        self.applied = membership.latest_epoch(store)
        self.applying = 0  # the epoch being applied: only a newer one interrupts it
        self._latched = None
        self._disruptive = 0  # the newest latched epoch that is not a switch (a re-join, a slow epoch)
        self._lock = threading.Lock()
        self._switch_seen = 0  # the newest re-join a peer is known to apply (announce_switch)
        self._switch_checked = 0.0
        self.joining = bool(launch.rejoin)  # a relaunched worker not admitted yet: its waits end when training does
        self.incarnation = launch.incarnation
        self._over_checked = 0.0
        interval = launch.heartbeat_interval_s or heartbeat_interval_s
        self.heartbeat_interval_s = interval
        membership.register_worker(store, membership.WorkerInfo(
            rank=rank, pipeline=info["pipeline"], stage=info["stage"], pid=os.getpid(),
            incarnation=launch.incarnation, dp=info.get("dp", 0), pp=info.get("pp", 0), heartbeat_interval_s=interval,
            settings=info.get("settings"),
        ))
        self._heartbeat = membership.Heartbeat(store, rank, interval, agent_pid=launch.agent_pid, progress=progress)
        self._watcher = membership.EpochWatcher(store, self._latch, after=self.applied)
        self._heartbeat.start()
        self._watcher.start()

    def _latch(self, record) -> None:
        """Watcher thread: remember the newest epoch, then let the engine release blocked work."""
        with self._lock:
            self._latched = record
            if getattr(record, "kind", None) not in SWITCH_KINDS:
                self._disruptive = max(self._disruptive, record.epoch)
        self.on_epoch(record)

    def request_stop(self, reason: str) -> None:
        """Ask the agent for a graceful stop of the whole job (see :meth:`Heartbeat.request_stop`)."""
        self._heartbeat.request_stop(reason)

    def close(self) -> None:
        """Stop heartbeats (telling the agent this is an exit, not a hang) and the watcher."""
        self._heartbeat.stop()
        self._watcher.stop()

    # --- main-thread API --------------------------------------------------------------------------
    def pending(self):
        """The newest latched epoch record not applied yet, or ``None``."""
        with self._lock:
            record = self._latched
        if record is not None and record.epoch > max(self.applied, self.applying):
            return record
        return None

    def interrupting(self):
        """The pending epoch when it must interrupt the work in flight, else ``None``.

        A failure or a stop interrupts (the engine poisons the groups, store waits give up). A
        re-join (or a ``slow`` epoch: a switch of schedule, ``epochs.SWITCH_KINDS``) interrupts only
        once a peer has started applying it (:meth:`announce_switch`): nothing in flight involves
        the joining worker, so each rank applies it at its next iteration boundary, but ranks reach their boundaries at different times, and one that is
        still inside the iteration may be waiting on a peer that has switched already."""
        record = self.pending()
        if record is None:
            return None
        if self._disruptive > max(self.applied, self.applying) or self._switched(record):
            return record
        return None

    def announce_switch(self, record) -> None:
        """This rank starts applying the re-join ``record``: store waits of its peers' iterations
        give up for it from now on."""
        self.store.set(_switch_key(record.epoch), "1")

    def _switched(self, record) -> bool:
        """Whether a peer has started applying the re-join ``record`` (one store read per 20 ms)."""
        if getattr(record, "kind", None) not in SWITCH_KINDS:
            return False
        if self._switch_seen == record.epoch:
            return True
        now = time.monotonic()
        if now - self._switch_checked < 0.02:
            return False
        self._switch_checked = now
        if self.store.check([_switch_key(record.epoch)]):
            self._switch_seen = record.epoch
            return True
        return False

    def admitted(self) -> None:
        """This relaunched worker was admitted by the survivors: its waits no longer end with
        training, and the agent records the re-join (not just the registration)."""
        self.joining = False
        membership.mark_admitted(self.store, self.rank, self.incarnation)

    def check_training_over(self) -> None:
        """While this worker is re-joining (:attr:`joining`), raise :class:`TrainingOver` once the
        agent says a member finished training (one store read per 20 ms)."""
        if not self.joining:
            return
        now = time.monotonic()
        if now - self._over_checked < 0.02:
            return
        self._over_checked = now
        why = membership.training_over(self.store)
        if why is not None:
            raise TrainingOver(f"rank {self.rank}: training ended ({why}) before the survivors admitted this "
                               f"relaunched worker: no step is left for it to join")

    def begin(self, record) -> None:
        """``record`` is being applied: waits inside it are interrupted only by a newer epoch."""
        self.applying = record.epoch

    def check(self, *, rejoin: bool = True) -> None:
        """Raise :class:`Reconfigure` if a newer epoch is latched. ``rejoin=False``: a boundary that
        is not the start of a training iteration (a save, an evaluation, the end of training), where
        a re-join (or a slow epoch's switch) is left for the next iteration's start. The joiner's first call is a training
        iteration: survivors that took it in before a save would wait for it in the save's
        collectives while it waits for them in the iteration (CI run I); and after the last step a
        peer that passed its end before the epoch came has exited and would never post its
        agreement (stop 48's CI; the agent then tells the joiner that training is over)."""
        record = self.pending()
        if record is not None and (rejoin or getattr(record, "kind", None) not in SWITCH_KINDS):
            raise Reconfigure(record)

    def mark_applied(self, record) -> None:
        self.applied = record.epoch
        self.applying = 0
        membership.mark_applied(self.store, self.rank, record.epoch)  # the agent waits on it before a grow

    def wait_pending(self, grace_s: float):
        """Wait up to ``grace_s`` for a new epoch (after an in-band error); ``None`` if none came."""
        deadline, backoff = time.monotonic() + grace_s, Backoff(0.001)
        while time.monotonic() < deadline:
            record = self.pending()
            if record is not None:
                return record
            backoff.sleep()
        return None

    def wait_key(self, key: str, *, store=None, timeout_s: float | None = None) -> bytes:
        """Wait for ``key`` in the store, polling; give up at once if a newer epoch that interrupts
        work in flight is latched (:meth:`interrupting`). ``timeout_s``: default the store timeout."""
        store = store or self.store
        timeout_s = self.store_timeout_s if timeout_s is None else timeout_s
        deadline, backoff = time.monotonic() + timeout_s, Backoff()
        while True:
            if store.check([key]):
                return store.get(key)
            record = self.interrupting()
            if record is not None:
                raise Reconfigure(record)
            self.check_training_over()
            if time.monotonic() > deadline:
                raise ResilienceError(f"timed out after {timeout_s:.0f}s waiting for store key {key}")
            backoff.sleep()

    def gather_steps(self, epoch: int, value: int, ranks: Iterable[int]) -> dict[int, int]:
        """Every survivor posts its step count ``value``; returns ``{rank: steps}`` for ``ranks``
        (raises :class:`Reconfigure` if another epoch arrives meanwhile).

        A rank posts once per epoch: a rank that applies an epoch again (interrupted by a newer
        one) keeps its first value, which every survivor has planned with, even if it has rolled
        back since."""
        key = keys.agree(epoch, self.rank)
        if not self.store.check([key]):
            self.store.set(key, str(value))
        return {r: int(self.wait_key(keys.agree(epoch, r))) for r in ranks}


def _switch_key(epoch: int) -> str:
    return keys.switch(epoch)
