"""A worker's side of live membership: heartbeats, the epoch watcher, agreement on where to resume.

The agent (``runtime/agent.py``, never inside a worker) owns membership: it detects crashes and
hangs and publishes numbered epoch records in its store. In each worker:

* a heartbeat thread bumps ``dsr/hb/{rank}`` (a hung process stops bumping it);
* a watcher thread waits for the next epoch record; when one arrives it is *latched* and the
  current generation's process groups are *poisoned* (each pair gets a receive with a 1 ms timeout,
  which makes gloo close it), so a main thread blocked in a receive or a collective is released in
  milliseconds instead of waiting out the process-group timeout;
* in-band communication errors only prompt a look at the epoch: membership changes only through
  the agent's records;
* at recovery the survivors agree, through the store, on the iteration to resume from (the oldest
  one some survivor has not stepped yet), so no stage steps twice and none skips.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

from ..errors import ResilienceError
from . import membership

__all__ = ["Reconfigure", "Coordinator", "poison"]


class Reconfigure(ResilienceError):
    """A newer membership epoch is latched: stop the iteration and reconfigure."""

    def __init__(self, record) -> None:
        super().__init__(f"membership epoch {record.epoch} ({record.kind}): failed ranks {list(record.failed)}")
        self.record = record


class Coordinator:
    """Heartbeats, the epoch watcher and the store protocol of one worker (under the agent).

    Args:
        rank: this worker's global rank.
        info: what the worker registers (pipeline, stage, ...).
        heartbeat_interval_s: how often to bump the heartbeat.
        store_timeout_s: how long a store wait may take before it is an error.
        on_epoch: called from the watcher thread right after a new epoch is latched (the engine
            poisons its groups there).
    """

    def __init__(self, *, rank: int, info: dict, heartbeat_interval_s: float, store_timeout_s: float,
                 on_epoch: Callable[[object], None]) -> None:
        store = membership.agent_store_from_env(store_timeout_s)
        if store is None:
            raise ResilienceError("live failure handling needs the agent: start with `ds-resilience run`")
        self.store = store
        self.rank = rank
        self.store_timeout_s = store_timeout_s
        self.on_epoch = on_epoch
        self.applied = membership.latest_epoch(store)
        self._latched = None
        self._lock = threading.Lock()
        membership.register_worker(store, membership.WorkerInfo(
            rank=rank, pipeline=info["pipeline"], stage=info["stage"], pid=os.getpid(),
            incarnation=int(os.environ.get("DSR_INCARNATION", "0")),
        ))
        agent_pid = os.environ.get("DSR_AGENT_PID")
        self._heartbeat = membership.Heartbeat(store, rank, heartbeat_interval_s,
                                               agent_pid=int(agent_pid) if agent_pid else None)
        self._watcher = membership.EpochWatcher(store, self._latch, after=self.applied)
        self._heartbeat.start()
        self._watcher.start()

    def _latch(self, record) -> None:
        """Watcher thread: remember the newest epoch, then let the engine release blocked work."""
        with self._lock:
            self._latched = record
        self.on_epoch(record)

    def close(self) -> None:
        """Stop heartbeats (telling the agent this is an exit, not a hang) and the watcher."""
        self._heartbeat.stop()
        self._watcher.stop()

    # --- main-thread API --------------------------------------------------------------------------
    def pending(self):
        """The newest latched epoch record not applied yet, or ``None``."""
        with self._lock:
            record = self._latched
        if record is not None and record.epoch > self.applied:
            return record
        return None

    def check(self) -> None:
        """Raise :class:`Reconfigure` if a newer epoch is latched."""
        record = self.pending()
        if record is not None:
            raise Reconfigure(record)

    def mark_applied(self, record) -> None:
        self.applied = record.epoch

    def wait_pending(self, grace_s: float):
        """Wait up to ``grace_s`` for a new epoch (after an in-band error); ``None`` if none came."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            record = self.pending()
            if record is not None:
                return record
            time.sleep(0.002)
        return None

    def wait_key(self, key: str, *, store=None) -> bytes:
        """Wait for ``key`` in the store, polling, and give up at once if a newer epoch is latched."""
        store = store or self.store
        deadline = time.monotonic() + self.store_timeout_s
        while True:
            if store.check([key]):
                return store.get(key)
            self.check()
            if time.monotonic() > deadline:
                raise ResilienceError(f"timed out after {self.store_timeout_s:.0f}s waiting for store key {key}")
            time.sleep(0.001)

    def agree_min(self, epoch: int, value: int, ranks: Iterable[int]) -> int:
        """Every survivor posts ``value``; returns the minimum over ``ranks`` (raises
        :class:`Reconfigure` if another epoch arrives meanwhile)."""
        self.store.set(f"dsr/agree/{epoch}/{self.rank}", str(value))
        return min(int(self.wait_key(f"dsr/agree/{epoch}/{r}")) for r in ranks)


def poison(group) -> None:
    """Close every pair of a gloo group so blocked operations on it fail now (see the module doc)."""
    import torch

    buf = torch.zeros(1)
    for peer in range(len(group.ranks)):
        if group.ranks[peer] == group.me:
            continue
        try:
            group.pg.recv([buf], peer, _POISON_TAG).wait(timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - the timeout is the point
            pass


_POISON_TAG = (1 << 30) + 7
