"""The protocol between the agent and its workers, through the agent's TCPStore.

The agent (:mod:`ds_resilience.supervisor.agent`) hosts the store and is the one authority on
membership; workers never decide it locally. All keys live under ``dsr/`` (spelled in :mod:`ds_resilience.store_keys`):

``dsr/hb/{rank}``
    A counter the worker bumps with ``store.add(key, 1)`` every heartbeat interval. The agent
    watches it *change* on its own monotonic clock, so no clock synchronisation is needed.
    ``dsr/hb/{rank}/stopped`` is set when the heartbeat is stopped on purpose (the worker exits;
    interpreter exit can outlast a heartbeat timeout), so the agent does not take it for a hang.
``dsr/worker/{rank}``
    The worker's registration (:class:`WorkerInfo` as JSON): pipeline, stage, pid, incarnation.
``dsr/epoch/{g}`` and ``dsr/epoch/latest``
    Membership epochs (:class:`EpochRecord` as JSON). The record is written first and the pointer
    second, so whoever reads ``latest == g`` can read record ``g``. Records are never rewritten.
``dsr/status/{rank}``
    A free-form worker status string (``"running"``, ``"saved"``, ...), for logs and tests.

Waiting is done by polling ``store.check`` (never a blocking ``get``, which would wait for the
store timeout on a missing key, and never a timed-out ``store.wait``, which makes c10d log two
warnings per timeout). Every call here is bounded. Pure Python plus the torch.distributed store.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..epochs import EPOCH_KINDS, EpochRecord, MembershipError, WorkerInfo
from .. import store_keys as keys
from ..job_secret import SECRET_VAR, BadSignature, seal, unseal
from ..launch import LaunchEnv, launch_env

__all__ = [
    "MembershipError", "EpochRecord", "WorkerInfo", "EPOCH_KINDS", "EXIT_ORPHANED",
    "hb_key", "hb_stopped_key", "worker_key", "epoch_key", "status_key", "LATEST_KEY",
    "publish_epoch", "read_epoch", "latest_epoch", "wait_epoch",
    "register_worker", "read_worker", "admitted_key", "mark_admitted", "admitted", "set_status", "read_status", "read_heartbeat",
    "AgentEnv", "agent_env", "agent_store_from_env", "attempt_view", "connect_store", "EpochWatcher", "Heartbeat",
]

log = logging.getLogger(__name__)

EXIT_ORPHANED = 75  # a worker's exit code when its agent died
LATEST_KEY = keys.LATEST_EPOCH
_POLL_S = 0.01


def hb_key(rank: int) -> str:
    """Heartbeat counter of global rank ``rank``."""
    return keys.hb(rank)


def hb_stopped_key(rank: int) -> str:
    """Set when ``rank`` stopped its heartbeat on purpose (it is exiting): silence is no hang."""
    return keys.hb_stopped(rank)


def worker_key(rank: int) -> str:
    """Registration of global rank ``rank``."""
    return keys.worker(rank)


def epoch_key(epoch: int) -> str:
    """Record of membership epoch ``epoch``."""
    return keys.epoch(epoch)


def status_key(rank: int) -> str:
    """Status string of global rank ``rank``."""
    return keys.status(rank)


def _get(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key``, or None when absent (never blocks on a missing key)."""
    return store.get(key) if store.check([key]) else None


# --- sealed records -----------------------------------------------------------------------------
# The store has no authentication: the records that decide who is alive (epochs, their pointer,
# registrations) are sealed with the job's secret (job_secret.py), which a worker takes from its own
# agent's environment (DSR_JOB_SECRET, never from a launch request) and the agent passes itself. A
# record that does not verify reads as absent, and is logged once per key. Without a secret (no
# agent, or an agent-less test) records are plain. Heartbeat counters (``add``) cannot be sealed: a
# rogue client can hide a hang from the heartbeat check (not from the progress check), never fail a
# healthy rank.
_refused: set[str] = set()  # keys whose forged value was logged (once each, in this process)


def _secret(given: str | None) -> str | None:
    return given if given is not None else (os.environ.get(SECRET_VAR) or None)


def _set_record(store: dist.Store, key: str, value: str, secret: str | None) -> None:
    secret = _secret(secret)
    store.set(key, value if secret is None else seal(secret, key, value))


def _get_record(store: dist.Store, key: str, secret: str | None) -> str | None:
    """The record under ``key`` if it verifies; None when absent or forged (logged once)."""
    raw = _get(store, key)
    secret = _secret(secret)
    if raw is None or secret is None:
        return None if raw is None else raw.decode()
    try:
        return unseal(secret, key, raw)
    except BadSignature as exc:
        if key not in _refused:
            _refused.add(key)
            log.warning("ignored a membership record not signed with the job's secret (%s): someone else writes "
                        "to the agent's store", exc)
        return None


def publish_epoch(store: dist.Store, record: EpochRecord, *, secret: str | None = None) -> None:
    """Write ``record`` then point ``dsr/epoch/latest`` at it, both sealed with the job's secret
    (``secret``, else ``$DSR_JOB_SECRET``; plain without one).

    Raises:
        MembershipError: the record is not exactly the successor of the latest epoch.
    """
    latest = latest_epoch(store, secret=secret)
    if record.epoch != latest + 1:
        raise MembershipError(f"epoch {record.epoch} published after epoch {latest}; expected {latest + 1}")
    _set_record(store, epoch_key(record.epoch), record.to_json(), secret)
    _set_record(store, LATEST_KEY, str(record.epoch), secret)


def read_epoch(store: dist.Store, epoch: int, *, secret: str | None = None) -> EpochRecord | None:
    """Record ``epoch``, or None if not (yet) published (or not signed by the agent)."""
    raw = _get_record(store, epoch_key(epoch), secret)
    return None if raw is None else EpochRecord.from_json(raw)


def latest_epoch(store: dist.Store, *, secret: str | None = None) -> int:
    """The latest published epoch; 0 if none. A pointer not signed by the agent gives way to the
    newest epoch record that is (the records are written before the pointer)."""
    raw = _get_record(store, LATEST_KEY, secret)
    if raw is not None:
        return int(raw)
    if not store.check([LATEST_KEY]):
        return 0
    newest = 0
    while store.check([epoch_key(newest + 1)]) and read_epoch(store, newest + 1, secret=secret) is not None:
        newest += 1
    return newest


def failed_after(store: dist.Store, rank: int, since: int | None = None, *,
                 secret: str | None = None) -> EpochRecord | None:
    """The epoch record that names ``rank`` failed, if any: the newest epoch only, or with ``since``
    any epoch after that one (newest first; the rank may have re-joined since)."""
    newest_epoch = latest_epoch(store, secret=secret)
    for epoch in range(newest_epoch, newest_epoch - 1 if since is None else since, -1):
        record = read_epoch(store, epoch, secret=secret)
        if record is not None and rank in record.failed:
            return record
    return None


def wait_epoch(store: dist.Store, epoch: int, timeout_s: float, poll_s: float = _POLL_S, *,
               secret: str | None = None) -> EpochRecord | None:
    """Wait up to ``timeout_s`` for record ``epoch``; None on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_epoch(store, epoch, secret=secret)
        if record is not None:
            return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


REGRID_FAILED_KEY = keys.REGRID_FAILED
"""Set by a survivor that cannot re-form the grid (why, as text): the agent then stops the job with
a restart from the in-memory snapshots, the tier below the re-grid."""

REGRIDDED_KEY = keys.REGRIDDED
"""Set by the survivors as they start to re-form the grid (the epoch and the ranks of the old grid,
as text): the agent then relaunches no worker any more (a relaunched worker would join the first
grid, which is gone)."""

TRAINING_OVER_KEY = keys.TRAINING_OVER
"""Set by the agent when a member finished training (who, as text): a relaunched worker that has
registered but was not admitted yet gives up its re-join and exits 0 (the survivors ran their last
step without it and will not come back to its epoch)."""


def training_over(store: dist.Store) -> str | None:
    """Why training is over (the agent's text), or None while it goes on; never blocks."""
    raw = _get(store, TRAINING_OVER_KEY)
    return None if raw is None else raw.decode(errors="replace")


def admitted_key(rank: int) -> str:
    """Set by a relaunched worker once the survivors admitted it (its incarnation, as text)."""
    return keys.admitted(rank)


def mark_admitted(store: dist.Store, rank: int, incarnation: int) -> None:
    """A relaunched worker says the survivors admitted it: it trains with them from now on (the
    agent's event table tells a re-join from a registration that came too late)."""
    store.set(admitted_key(rank), str(incarnation))


def admitted(store: dist.Store, rank: int) -> int | None:
    """The incarnation of ``rank`` last admitted by the survivors, or None; never blocks."""
    raw = _get(store, admitted_key(rank))
    return None if raw is None else int(raw)


def mark_applied(store: dist.Store, rank: int, epoch: int) -> None:
    """``rank`` finished applying ``epoch`` (every epoch it applies, so the newest)."""
    store.set(keys.applied(rank), str(epoch))


def applied(store: dist.Store, rank: int) -> int:
    """The newest epoch ``rank`` finished applying (0: none since it started); never blocks."""
    raw = _get(store, keys.applied(rank))
    return 0 if raw is None else int(raw)


def register_worker(store: dist.Store, info: WorkerInfo, *, secret: str | None = None) -> None:
    """Publish ``info`` under ``dsr/worker/{rank}`` (the agent uses it to judge tolerance), sealed
    with the job's secret (``secret``, else ``$DSR_JOB_SECRET``)."""
    _set_record(store, worker_key(info.rank), info.to_json(), secret)


def read_worker(store: dist.Store, rank: int, *, secret: str | None = None) -> WorkerInfo | None:
    """Registration of ``rank``, or None if it has not registered (or it is not signed)."""
    raw = _get_record(store, worker_key(rank), secret)
    return None if raw is None else WorkerInfo.from_json(raw)


def set_status(store: dist.Store, rank: int, status: str) -> None:
    """Set the status string of ``rank``."""
    store.set(status_key(rank), status)


def read_status(store: dist.Store, rank: int) -> str | None:
    """Status string of ``rank``, or None."""
    raw = _get(store, status_key(rank))
    return None if raw is None else raw.decode()


def read_heartbeat(store: dist.Store, rank: int) -> int:
    """Current heartbeat counter of ``rank`` (0 before its first beat); never blocks."""
    return int(store.add(hb_key(rank), 0))


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A raw client of the agent's store; raises :class:`MembershipError` if unreachable."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:  # DistNetworkError is a RuntimeError
        raise MembershipError(f"cannot reach the agent's store at {host}:{port} within {timeout_s} s: {exc}") from exc


AgentEnv = LaunchEnv
"""The agent-to-worker contract (:class:`ds_resilience.launch.LaunchEnv`)."""
agent_env = launch_env
"""Read the contract from the environment (:func:`ds_resilience.launch.launch_env`)."""


def agent_store_from_env(timeout_s: float = 30.0, launch: LaunchEnv | None = None) -> dist.Store | None:
    """A client of the agent's store when launched by the agent, else None.

    ``launch`` is the parsed contract (default: read from the environment); raises
    :class:`MembershipError` if the store cannot be reached within ``timeout_s``.
    """
    settings = launch if launch is not None else launch_env()
    if settings is None:
        return None
    return attempt_view(connect_store(settings.host, settings.port, timeout_s), settings.restart)


def attempt_view(store: dist.Store, attempt: int) -> dist.Store:
    """The store as attempt ``attempt`` sees it: itself for the first attempt (0), else every key
    under ``store_keys.attempt_prefix(attempt)`` (a restart keeps the agent's store; the keys of
    the attempts before it stay where they were and are never read again)."""
    return store if attempt == 0 else dist.PrefixStore(keys.attempt_prefix(attempt), store)


def _clone(store: dist.Store) -> dist.Store:
    """An independent connection to the same store (a blocking call then blocks nobody else)."""
    return store.clone()


def _stop_at_exit(ref: "weakref.ref[_Loop]") -> None:
    loop = ref()
    if loop is not None:
        loop.stop(timeout_s=2.0)


class _Loop(threading.Thread):
    """A daemon thread with a stop event, its own store client, and rate-limited error logging.

    It is stopped and joined at interpreter exit: a daemon thread still inside a c10d store call
    when the interpreter finalizes aborts the process ("terminate called without an active
    exception", SIGABRT) instead of letting it exit with its own status.
    """

    def __init__(self, store: dist.Store, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._stop_event = threading.Event()
        self._store = _clone(store)
        self._last_log = -1e9
        self.errors = 0
        atexit.register(_stop_at_exit, weakref.ref(self))

    def _log_error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._last_log > 10.0:
            self._last_log = now
            log.warning("%s: %s failed (%d errors so far): %s", self.name, what, self.errors, exc)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to finish and join it (bounded)."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)


class EpochWatcher(_Loop):
    """Calls ``on_epoch(record)`` for epochs ``after+1, after+2, ...``, in order, from a daemon thread.

    Args:
        store: any client of the agent's store; the watcher clones its own connection.
        on_epoch: called once per new record, in order; its exceptions are logged, not raised.
        after: the last epoch already known (default: the latest at construction).
        poll_s: how often the next record's key is checked (the detection latency it adds).
    """

    def __init__(self, store: dist.Store, on_epoch: Callable[[EpochRecord], None], *,
                 after: int | None = None, poll_s: float = _POLL_S) -> None:
        super().__init__(store, "dsr-epoch-watcher")
        self._on_epoch = on_epoch
        self._poll_s = poll_s
        self.last_epoch = latest_epoch(self._store) if after is None else after

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                record = read_epoch(self._store, self.last_epoch + 1)
            except Exception as exc:  # noqa: BLE001 - never raise into the process
                self._log_error("reading the next epoch", exc)
                self._stop_event.wait(1.0)
                continue
            if record is None:
                self._stop_event.wait(self._poll_s)
                continue
            self.last_epoch = record.epoch
            try:
                self._on_epoch(record)
            except Exception:  # noqa: BLE001
                log.exception("%s: on_epoch(%d) raised", self.name, record.epoch)


class Heartbeat(_Loop):
    """Bumps ``dsr/hb/{rank}`` every ``interval_s`` from a daemon thread (first beat at once).

    A SIGSTOP'd process stops beating too; the agent turns that silence into a hang. With
    ``progress`` (:class:`~ds_resilience.runtime.progress.Progress`) it also stops while the main
    thread is stalled (a live thread is not a live worker).

    Args:
        store: any client of the agent's store; the heartbeat clones its own connection.
        rank: this worker's global rank.
        interval_s: seconds between beats.
        agent_pid: when given (the agent exports ``DSR_AGENT_PID``), the process exits with
            :data:`EXIT_ORPHANED` as soon as its parent is no longer that process: an agent
            killed with SIGKILL cannot clean up, so its workers do not outlive it.
    """

    def __init__(self, store: dist.Store, rank: int, interval_s: float, *, agent_pid: int | None = None,
                 progress=None) -> None:
        if interval_s <= 0:
            raise MembershipError(f"heartbeat interval must be > 0, got {interval_s!r}")
        super().__init__(store, f"dsr-heartbeat-{rank}")
        self._key = hb_key(rank)
        self._interval_s = interval_s
        self._agent_pid = agent_pid
        self._rank = rank
        self._progress = progress  # runtime.progress.Progress: no beat while the main thread is stalled
        self.stalled = False
        self.beats = 0
        self._stop_request: str | None = None  # posted to the agent by this thread (request_stop)
        self._stop_posted = False

    def request_stop(self, reason: str) -> None:
        """Ask the agent to stop the job gracefully (this worker received SIGTERM or SIGINT); safe
        from a signal handler: the thread posts it with its own store connection at its next beat."""
        self._stop_request = reason

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating, then tell the agent the silence to come is an exit, not a hang."""
        was_running = self.is_alive() and not self._stop_event.is_set()
        super().stop(timeout_s)
        if was_running:
            try:  # the thread's client once it is joined; if a store call stalled it past the join's
                # bound, a connection of its own (one client is never used by two threads at once)
                client = self._store if not self.is_alive() else _clone(self._store)
                client.set(hb_stopped_key(self._rank), "1")
                # a TCPStore set is sent without an answer: a round trip on the same connection
                # returns once the store has it, before this worker exits (the agent, on another
                # connection, reads the mark when it sees the exit)
                client.check([hb_stopped_key(self._rank)])
            except Exception as exc:  # noqa: BLE001 - the agent may be gone already
                self._log_error("marking the heartbeat stopped", exc)

    def run(self) -> None:
        while not self._stop_event.is_set():
            if self._agent_pid is not None and os.getppid() != self._agent_pid:
                log.error("%s: the agent (pid %d) is gone; exiting", self.name, self._agent_pid)
                os._exit(EXIT_ORPHANED)
            if self._progress is not None and self._progress.stalled():
                if not self.stalled:
                    self.stalled = True
                    log.error("%s: the main thread has not advanced for %.1fs in %s (stall_timeout_s %.1fs): no "
                              "more heartbeats, the agent will take this worker for hung", self.name,
                              self._progress.stalled_for(), self._progress.where or "?", self._progress.stall_timeout_s)
                self._stop_event.wait(self._interval_s)
                continue
            self.stalled = False
            try:
                self._store.add(self._key, 1)
                self.beats += 1
                if self._stop_request is not None and not self._stop_posted:
                    self._store.set(keys.STOP_REQUEST, self._stop_request)
                    self._stop_posted = True
            except Exception as exc:  # noqa: BLE001 - never raise into the process
                self._log_error("heartbeat", exc)
            self._stop_event.wait(self._interval_s)
