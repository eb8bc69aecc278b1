"""Replication of snapshots to peers over gloo, chunk by chunk, in the schedule's idle spans.

Each rank streams its newest committed version to its holders (the ranks with its local index on
the machines that store its machine's snapshots, see ``planning/placement.py``) and stores what its
sources stream to it. Every pair of ranks that exchange replicas gets its own two-member gloo group
(created in one global order, so construction cannot deadlock), used by two threads: this rank's
sender to the peer and receiver from it. A version goes out as one message of the state transport
(``comm/transport.py``): a JSON header with the step, size, checksum and the JSON layout, then the
payload in ``chunk_mb`` frames, straight from (and into) the shm files; a ``bye`` message says
goodbye. The receiver writes the chunks into an uncommitted shm file and commits it only once its
layout parses and its checksum matches (``SnapshotStore.receive``): a sender that dies mid-version
leaves the previous version in place, and a corrupted or malformed transfer is rejected.

Interleaving: before each chunk the sender asks the :class:`IdleGate` for a span long enough for one
chunk (its measured send time); the engine opens the gate while it runs an action the timeline marks
as link-idle (``ir/windows.py``), for the measured length of that action times ``idle_fraction``. When
the spans are too short for a version, it simply takes more iterations: the sender always sends the
newest committed version when it starts one, so intermediate versions are skipped, never queued.
A chunk slower than every span of the last two iterations still goes in their longest one (the
gate's ``longest`` forgets older iterations, see :meth:`IdleGate.mark_iteration`), so a chunk time
measured while the machine was loaded cannot starve replication once the iterations got shorter.

Re-placement: a replicator serves one placement. When a peer fails, the checkpointer builds a new
one for the placement over the machines left (new pair groups, under a new name) and
:meth:`Replicator.abort` ends the old one at once: its pairs are closed, a version in flight is
abandoned (the receiver keeps its previous one) and the new replicator sends the newest version.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..comm.groups import Group, new_group
from ..comm.transport import TransportError, recv_header, recv_payload, send_message
from .store import CheckpointError, SnapshotStore

__all__ = ["IdleGate", "ReplicationStats", "Replicator"]

logger = logging.getLogger("ds_resilience.checkpoint")

_TAG = 11  # one stream per direction of a pair group
IDLE_WAIT_S = 7 * 24 * 3600.0
"""How long a receiver waits for its source's next version: until the source says goodbye, or the
pair is poisoned (at close, or when the source fails), so in effect the stream's lifetime. Frames
within a version wait for the group's timeout."""


class IdleGate:
    """Lets replication chunks through only while the training link is idle.

    ``open(seconds)`` starts an idle span that ends after ``seconds`` (``None``: unknown length) or
    at ``close()``; :meth:`acquire` blocks until a span has at least the time one chunk needs, or
    half the longest span of this and the previous iteration (:meth:`mark_iteration`). A disabled
    gate (``interleave: false``) is always open.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._cond = threading.Condition()
        self._deadline: float | None = None  # monotonic end of the open span; None: closed
        self._stopped = False
        # the longest span opened in this iteration and the previous one: a chunk slower than every
        # span still goes in it (an all-time longest kept a chunk time measured under load above
        # every later span: replication starved)
        self._longest_now = 0.0
        self._longest_before = 0.0

    @property
    def longest(self) -> float:
        return max(self._longest_now, self._longest_before)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def mark_iteration(self) -> None:
        """An iteration boundary: spans older than the previous iteration stop counting."""
        with self._cond:
            self._longest_before, self._longest_now = self._longest_now, 0.0

    def open(self, seconds: float | None) -> None:
        with self._cond:
            self._deadline = float("inf") if seconds is None else time.monotonic() + seconds
            if seconds is not None:
                self._longest_now = max(self._longest_now, seconds)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._deadline = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def acquire(self, need_s: float, timeout_s: float | None = None) -> bool:
        """Wait for an open span with ``need_s`` seconds left; ``False`` once stopped, or after
        ``timeout_s`` (``None``: no limit)."""
        if not self.enabled:
            return not self._stopped
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._stopped:
                longest = self.longest
                need = min(need_s, 0.5 * longest) if longest > 0 else need_s
                now = time.monotonic()
                if self._deadline is not None and self._deadline - now >= need:
                    return True
                if end is not None and now >= end:
                    return False
                wait = 0.005 if self._deadline is not None else 0.1
                self._cond.wait(wait if end is None else max(0.0, min(wait, end - now)))
            return False


@dataclass
class ReplicationStats:
    """Counters of one rank's replication (read by logs, tests and benchmarks)."""

    versions_sent: int = 0
    versions_skipped: int = 0
    versions_received: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    send_seconds: float = 0.0  # wall time from a version's header to its last chunk (all holders)
    busy_seconds: float = 0.0  # time spent sending chunks (gate waits left out): what the sends cost a core
    errors: list[str] = field(default_factory=list)

    @property
    def throughput_bytes_per_s(self) -> float:
        return self.bytes_sent / self.send_seconds if self.send_seconds > 0 else 0.0


class Replicator:
    """Sends this rank's snapshots to ``send_to`` and stores the snapshots of ``recv_from``.

    Args:
        store: this machine's snapshot store (local versions are read from it, replicas land in it).
        rank: this rank; ``owner_of(r)`` names rank ``r``'s snapshots in the store.
        send_to, recv_from: the holders of this rank's snapshots, and the ranks whose it holds.
        name: unique name of this set of pair groups (session and attempt).
        chunk_bytes: payload bytes per message.
        timeout_s: how long one message may take before the pair counts as broken.
        gate: the idle gate (default: always open).
        group_store: the store the pair groups rendezvous in (default: the default group's).
        interface: the network interface the pair groups use (``checkpoint.interface``).
        stats, chunk_seconds: carried over from the replicator of the previous placement.
    """

    def __init__(self, store: SnapshotStore, *, rank: int, owner_of: Callable[[int], str], send_to: Sequence[int],
                 recv_from: Sequence[int], name: str, chunk_bytes: int, timeout_s: float = 60.0,
                 gate: IdleGate | None = None, group_store=None, interface: str | None = None,
                 stats: ReplicationStats | None = None, chunk_seconds: float = 0.0) -> None:
        if chunk_bytes < 64:
            raise CheckpointError(f"replication chunk must be at least 64 bytes, got {chunk_bytes}")
        self.store, self.rank, self.owner_of = store, rank, owner_of
        self.send_to, self.recv_from = tuple(send_to), tuple(recv_from)
        self.chunk_bytes = chunk_bytes
        self.gate = gate or IdleGate(enabled=False)
        self.stats = stats if stats is not None else ReplicationStats()
        self.chunk_seconds = chunk_seconds  # measured time of one chunk (moving average), what a span must hold
        self._cond = threading.Condition()
        self._offered: int | None = None
        self._sent: int | None = None
        self._current: int | None = None  # the step being sent
        self._closing = False
        self._aborted = False
        self._dead: set[int] = set()
        self._groups: dict[int, Group] = {}
        for peer in sorted(set(self.send_to) | set(self.recv_from)):  # global order: (min, max) pairs
            self._groups[peer] = new_group([rank, peer], name=f"{name}/repl", timeout_s=timeout_s,
                                           store=group_store, me=rank, interface=interface)
        self._threads = [threading.Thread(target=self._send_loop, name="dsr-repl-send", daemon=True)]
        self._threads += [threading.Thread(target=self._recv_loop, args=(src,), name=f"dsr-repl-recv{src}", daemon=True)
                          for src in self.recv_from]
        for t in self._threads:
            t.start()

    # --- the training side -------------------------------------------------------------------------
    def offer(self, step: int) -> None:
        """Version ``step`` is committed locally: replicate it (or a newer one) when the sender is free."""
        with self._cond:
            if self._offered is not None and self._offered not in (self._sent, self._current):
                self.stats.versions_skipped += 1  # superseded before it started: spread, not queued
            self._offered = step
            self._cond.notify_all()

    def wait_replicated(self, step: int, timeout_s: float) -> bool:
        """Block until a version >= ``step`` reached every live holder, or the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._sent is None or self._sent < step:
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return False
                self._cond.wait(left)
            return True

    def drop(self, ranks: Sequence[int]) -> None:
        """Peers that failed: stop sending to them and free any thread blocked on them."""
        for r in ranks:
            if r in self._groups and r not in self._dead:
                self._dead.add(r)
                self._groups[r].poison()

    def abort(self) -> None:
        """Replaced by another placement's replicator: stop now, without waiting (the version in
        flight is abandoned; its receivers keep their previous version) and without touching the
        shared gate. Closing the pairs frees the peers' threads on them too."""
        with self._cond:
            self._aborted = self._closing = True
            self._cond.notify_all()
        for peer, group in self._groups.items():
            if peer not in self._dead:
                self._dead.add(peer)
                group.poison()

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the version in flight (up to ``timeout_s``), say goodbye, and stop the threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._threads[0].join(timeout_s)
        self.gate.stop()
        deadline = time.monotonic() + timeout_s
        for t in self._threads[1:]:
            t.join(max(0.0, deadline - time.monotonic()))
        for peer, group in self._groups.items():
            if peer not in self._dead:
                group.poison()  # frees a receiver whose sender never said goodbye
        for t in self._threads:
            t.join(1.0)

    # --- sending -------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        owner = self.owner_of(self.rank)
        while True:
            with self._cond:
                while not self._closing and (self._offered is None or self._offered == self._sent):
                    self._cond.wait()
                if self._aborted or self._offered is None or self._offered == self._sent:
                    break  # closing with nothing new
                step = self._current = self._offered
            try:
                self._send_version(owner, step)
            except Exception as exc:  # noqa: BLE001 - a replication error must never stop training
                if not self._aborted:
                    self.stats.errors.append(f"send {owner}@{step}: {exc}")
                    logger.warning("replication of %s@%d failed: %s", owner, step, exc)
            with self._cond:
                self._current = None
                self._sent = step if self._sent is None else max(self._sent, step)
                self._cond.notify_all()
        for dst in self.send_to:
            if dst not in self._dead:
                try:
                    send_message(self._groups[dst], dst, tag=_TAG, kind="bye")
                except Exception:  # noqa: BLE001 - the peer is gone already
                    pass

    def _send_version(self, owner: str, step: int) -> None:
        try:
            info, layout, payload = self.store.open_version(owner, step)
        except CheckpointError:
            return  # pruned meanwhile: a newer one is offered already
        try:
            self._stream(owner, step, info, layout, payload)
        finally:
            del payload
            self.store.release(owner, step)

    def _stream(self, owner: str, step: int, info, layout: bytes, payload: torch.Tensor) -> None:
        started = time.perf_counter()
        fields = {"owner": owner, "step": step, "layout": layout.decode("utf-8")}

        def gate() -> bool:
            while not self._aborted:
                if self.gate.acquire(self.chunk_seconds, timeout_s=0.25):
                    return not self._aborted
                if self.gate.stopped:
                    return False
            return False

        def measured(nbytes: int, seconds: float) -> None:
            self.chunk_seconds = seconds if not self.chunk_seconds else 0.8 * self.chunk_seconds + 0.2 * seconds
            self.stats.bytes_sent += nbytes
            self.stats.busy_seconds += seconds

        for dst in self.send_to:
            if dst in self._dead:
                continue
            try:
                done = send_message(self._groups[dst], dst, tag=_TAG, fields=fields,
                                    payload=payload if info.nbytes else None, checksum=info.checksum,
                                    chunk_bytes=self.chunk_bytes, before_chunk=gate, on_chunk=measured)
                if not done:
                    return
            except Exception:
                self._dead.add(dst)  # the pair is broken for good; recovery finds older replicas
                raise
        if self._aborted:
            return
        self.stats.send_seconds += time.perf_counter() - started
        self.stats.versions_sent += 1

    # --- receiving -----------------------------------------------------------------------------------
    def _recv_loop(self, src: int) -> None:
        group = self._groups[src]
        owner = self.owner_of(src)
        while src not in self._dead:
            try:
                message = recv_header(group, src, tag=_TAG, timeout_s=IDLE_WAIT_S)
            except TransportError as exc:  # malformed: the stream cannot be trusted any more
                self.stats.rejected += 1
                self.stats.errors.append(f"recv {owner}: {exc}")
                logger.warning("replication stream from rank %d refused: %s", src, exc)
                return
            except Exception:  # noqa: BLE001 - peer gone or poisoned at close
                return
            if message.kind == "bye":
                return
            step = message.fields.get("step")
            layout = message.fields.get("layout")
            if message.fields.get("owner") != owner or not isinstance(step, int) or not isinstance(layout, str):
                self.stats.rejected += 1
                self.stats.errors.append(f"recv {owner}: bad replica header {sorted(message.fields)}")
                logger.warning("replication stream from rank %d: bad header, refused", src)
                return
            try:
                def fill(buf: torch.Tensor) -> None:
                    recv_payload(group, message, buf, tag=_TAG, verify=False)  # the store verifies

                self.store.receive(owner, step, message.nbytes, layout.encode("utf-8"), message.checksum or 0, fill)
                self.stats.versions_received += 1
            except CheckpointError as exc:
                if self._aborted:
                    return
                self.stats.rejected += 1
                self.stats.errors.append(f"recv {owner}@{step}: {exc}")
                logger.warning("rejected replica %s@%d: %s", owner, step, exc)
            except Exception as exc:  # noqa: BLE001 - peer died mid-version: the previous one stays
                if not self._aborted:
                    self.stats.errors.append(f"recv {owner}@{step}: {exc}")
                return
