"""The in-memory checkpoint tier of one worker: capture every iteration, replicate, persist, restore.

:class:`InMemoryCheckpointer` ties the pieces together for one rank:

* **capture** (:meth:`capture`, called right after the optimizer step): the state (``state.py``:
  live tensors, nothing cloned) is handed to a background thread that copies it into an uncommitted
  version in this machine's host-memory store (``/dev/shm/ds_resilience/<job>/machine<M>``, created
  and removed by the node agent, so a worker crash loses nothing). The copy overlaps the next
  iteration's forward and backward passes, which do not change the tensors; the next optimizer step
  first waits for it (:meth:`wait_copied`). That wait, plus the hand-over, is the stall.
* **commit** (the same thread): checksum, atomic commit, then the replicator is offered the version
  and, every ``persistent_interval`` steps, it is copied to the persistent tier
  (``<persistent_dir>/snapshots/<job>``, same format, ``keep_last`` versions).
* **budget**: when a capture costs more than ``stall_budget`` of the iteration time, captures are
  spread over more iterations (the effective interval grows) instead of stalling training. A
  capture costs the training thread's wait (the hand-over and :meth:`wait_copied`); when the
  workers have no spare core (no more cores than ranks on the machine: the background copy and
  the replicas' sends then run on the training threads' cores), it costs the background copy and
  this rank's replica sends of the version too (:meth:`capture_cost`).
* **restore** (:meth:`restore`, collective at start-up of a restart): every rank reports what its
  machine holds, ``restore_plan.plan_restore`` picks the newest step held for every rank, peers
  send the snapshots whose owners lost them, and each rank loads its own.

Placement: ranks ``r`` live on machine ``r // ranks_per_machine``; Gemini's group placement of the
machines (``planning/placement.py``) decides which machines hold each machine's snapshots, and
rank ``r``'s replicas go to the ranks with its local index on those machines (``targets.py``).
When ranks fail (:meth:`InMemoryCheckpointer.drop`), the placement is recomputed over the machines
left at the next iteration boundary (:meth:`InMemoryCheckpointer.at_boundary`) and a background
thread switches the replicator to it: a replica target that died is replaced, so a second failure
loses at most the iteration in flight.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
import queue
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import store_keys
from ..comm.groups import Group, world_group
from ..comm.transport import recv_header, recv_payload, send_message
from ..config import CheckpointConfig
from ..errors import ConfigError
from ..launch import DEFAULT_HOST_DIR, snapshot_root
from .interval import SnapshotInterval
from .replication import IdleGate, Replicator
from .restore_plan import LOCAL, PEER, PERSISTENT, RestorePlan, plan_restore
from .staging import StagingPipeline
from .store import CheckpointError, SnapshotStore
from .targets import RankTargets, replica_targets

__all__ = ["DEFAULT_HOST_DIR", "InMemoryCheckpointer", "host_root", "owner_name"]

logger = logging.getLogger("ds_resilience.checkpoint")

_XFER_TAG = 1 << 26


def _usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def owner_name(rank: int) -> str:
    return f"rank{rank}"


host_root = snapshot_root


class InMemoryCheckpointer:
    """One rank's in-memory checkpoint tier (see the module docstring).

    Args:
        cfg: the ``resilience.checkpoint`` section.
        rank, world: this rank and the world size.
        job_id: names the host-memory directory (the agent's ``DSR_JOB_ID``).
        local_world_size: ranks per machine when ``cfg.ranks_per_machine`` is null.
        name: unique name for this attempt's replication groups.
        replicate: build the replicator (a re-joining worker cannot: its peers' groups are gone).
        group_store, timeout_s: rendezvous store and per-message timeout of the replication groups.
        exclude: ranks gone for good (lost before a re-grid): the placement is over the others.
        machine_key: sorts the machines, by their first rank, into the order in which group
            placement groups them (consecutive ones form a group; default: machine index). Under
            independent failures every grouping is equally good; the engine sorts pipeline-major,
            so the replicas of a stage's workers land on machines of other stages and losing a
            whole stage loses no snapshot.

    Raises:
        ConfigError: a placement that cannot exist (more replicas than machines, ranks that do not
            fill whole machines).
    """

    def __init__(self, cfg: CheckpointConfig, *, rank: int, world: int, job_id: str, local_world_size: int,
                 name: str, replicate: bool = True, group_store=None, timeout_s: float = 60.0,
                 machine_key: Callable[[int], Any] | None = None, exclude: Sequence[int] = (),
                 spare_core: bool | None = None) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        # whether the background copy and sends have a core of their own (default: more cores than
        # ranks on this machine); without one they are charged to the stall budget
        self.spare_core = spare_core if spare_core is not None else _usable_cores() > local_world_size
        self._busy_noted, self._sent_noted = 0.0, 0  # the replicator's busy seconds and versions sent, last look
        self._sends: deque[float] = deque(maxlen=5)  # send seconds per captured version, recent
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        rpm = cfg.ranks_per_machine or local_world_size
        if world % rpm:
            raise ConfigError("resilience.checkpoint.ranks_per_machine",
                              f"{rpm} ranks per machine do not divide the world size {world}; allowed: a divisor of {world}")
        machines = world // rpm
        if cfg.replicas > machines and cfg.ranks_per_machine is None:
            logger.warning("rank %d: all %d ranks are on one machine: snapshots stay in its memory only (they "
                           "survive worker crashes, not the machine's loss); set resilience.checkpoint."
                           "ranks_per_machine to place replicas", rank, world)
            cfg = replace(cfg, replicas=machines)
            self.cfg = cfg
        if cfg.replicas > machines:
            raise ConfigError(
                "resilience.checkpoint.replicas",
                f"{cfg.replicas} copies need {cfg.replicas} machines, this job has {machines} ({world} ranks, "
                f"{rpm} per machine); allowed: 1..{machines}, or fewer ranks_per_machine")
        self.rpm, self.machines = rpm, machines
        self.machine = rank // rpm
        self.machine_key = machine_key
        self.name = name
        self.group_store = group_store
        self._replicate = replicate
        self._gone = frozenset(int(r) for r in exclude)  # the ranks the current placement leaves out
        self._failed: set[int] = set(self._gone)  # every rank reported failed (grows; applied at a boundary)
        self.placement_map = self._targets(self._gone)
        mine = self.placement_map.get(rank, RankTargets(send_to=(), recv_from=()))
        self.send_to, self.recv_from = list(mine.send_to), list(mine.recv_from)
        self.root = host_root(cfg.host_dir, job_id)
        pipeline = StagingPipeline(cfg.gpu_buffer_mb, cfg.num_sub_buffers)
        self.store = SnapshotStore(self.root / f"machine{self.machine}", keep=2, pipeline=pipeline)
        self.owner = owner_name(rank)
        # the job's own directory: snapshots of an earlier job in the same persistent_dir never mix in
        # durable: on disk a manifest never names bytes a machine crash could lose (fsync first)
        # keep_common: pruning keeps the newest step every rank holds there (a restore needs one)
        self.disk = (SnapshotStore(Path(cfg.persistent_dir) / "snapshots" / job_id, keep=cfg.keep_last, recycle=False,
                                   durable=True, keep_common=True) if cfg.persistent_dir else None)
        self.gate = IdleGate(enabled=cfg.interleave)
        self.replicator: Replicator | None = None
        if replicate and self.send_to + self.recv_from:
            self.replicator = self._replicator(mine, name)
        self.placements = 0  # re-placements switched to (after failures)
        self._switch_to: frozenset[int] | None = None  # the placement the switch thread is asked for
        self._switch_busy = False
        self._switcher: threading.Thread | None = None
        # one schedule for every rank of the attempt: grows when captures exceed the budget
        self.schedule = SnapshotInterval(cfg.interval, store=group_store, key=store_keys.snapshot_interval(name), rank=rank)
        self._noted_step = 0
        # the newest captures: step, stall_s (the training thread's wait), copy_s (the background copy)
        self.captures: deque[dict[str, float]] = deque(maxlen=64)
        self.committed: int | None = None
        self.copied: int | None = None
        self.last_captured: int | None = None
        self.persisted: int | None = None
        self.errors: list[str] = []
        self._closing = False
        self._commits: queue.Queue = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name="dsr-ckpt-commit", daemon=True)
        self._committer.start()

    # --- placement ---------------------------------------------------------------------------------
    def _targets(self, gone: frozenset[int]) -> dict[int, RankTargets]:
        return replica_targets(self.world, self.rpm, self.cfg.replicas, gone=gone, machine_key=self.machine_key)

    def _replicator(self, mine: RankTargets, name: str, old: Replicator | None = None) -> Replicator:
        # a connection of its own: its groups' rendezvous (a blocking wait for the peer, up to the
        # timeout) and its threads' store traffic never hold the training thread's client, whose
        # lock serializes every operation (a re-placement whose peer was still in the iteration
        # then blocked this rank's message headers: a deadlock seen with 3 machines)
        store = self.group_store.clone() if hasattr(self.group_store, "clone") else self.group_store
        return Replicator(self.store, rank=self.rank, owner_of=owner_name, send_to=mine.send_to,
                          recv_from=mine.recv_from, name=name,
                          chunk_bytes=max(64, int(self.cfg.chunk_mb * (1 << 20)) // 64 * 64),
                          timeout_s=self.timeout_s, gate=self.gate, group_store=store,
                          interface=self.cfg.interface, stats=old.stats if old is not None else None,
                          chunk_seconds=old.chunk_seconds if old is not None else 0.0)

    def drop(self, ranks: Sequence[int]) -> None:
        """Ranks that failed (any thread): stop replicating to them now (frees a thread blocked on
        them); the placement over the machines left is applied at the next :meth:`at_boundary`."""
        replicator = self.replicator
        if replicator is not None:
            replicator.drop(ranks)
        with self._cond:
            self._failed.update(int(r) for r in ranks)

    def at_boundary(self) -> None:
        """An iteration boundary (the training thread; never blocks): when ranks failed since the
        current placement was made and the placement over the machines left differs, a background
        thread replaces the replicator by one for the new placement (every survivor does the same
        at its own boundary: the new pair groups rendezvous by name)."""
        with self._cond:
            if not self._replicate or self._failed <= self._gone or self.rank in self._failed:
                return
            gone = frozenset(self._failed)
        new = self._targets(gone)
        alive = set(new)
        if {r: t for r, t in self.placement_map.items() if r in alive} == new:
            with self._cond:
                self._gone = gone  # the failed ranks were nobody's target (nor source)
            return
        logger.info("rank %d: ranks %s failed: replicas re-placed over the %d machines left: sends to %s "
                    "(was %s), receives from %s", self.rank, sorted(gone - self._gone),
                    len({r // self.rpm for r in alive}), list(new[self.rank].send_to), self.send_to,
                    list(new[self.rank].recv_from))
        with self._cond:
            self._gone, self.placement_map = gone, new
            self.send_to, self.recv_from = list(new[self.rank].send_to), list(new[self.rank].recv_from)
            self._switch_to = gone
            self._switch_busy = True
            if self._switcher is None:
                self._switcher = threading.Thread(target=self._switch_loop, name="dsr-repl-place", daemon=True)
                self._switcher.start()
            self._cond.notify_all()

    def _switch_loop(self) -> None:
        while True:
            with self._cond:
                while self._switch_to is None:
                    self._cond.wait()
                gone, self._switch_to = self._switch_to, None
                closing = self._closing
            old = self.replicator
            if old is not None:
                old.abort()
            self.replicator = None
            if closing:
                with self._cond:
                    self._switch_busy = False
                    self._cond.notify_all()
                return
            mine = self._targets(gone).get(self.rank, RankTargets(send_to=(), recv_from=()))
            name = f"{self.name}/placed-{'-'.join(map(str, sorted(gone)))}"
            new = None
            if mine.send_to or mine.recv_from:
                try:
                    new = self._replicator(mine, name, old)
                except Exception as exc:  # noqa: BLE001 - a peer gone meanwhile: the next failure re-places
                    self.errors.append(f"{self.owner}: re-placement without ranks {sorted(gone)}: {exc}")
                    logger.warning("rank %d: replicator for the placement without ranks %s not built: %s",
                                   self.rank, sorted(gone), exc)
            with self._cond:
                self.replicator = new
                self.placements += 1
                if self._switch_to is None:
                    self._switch_busy = False
                self._cond.notify_all()
                committed = self.committed
            if new is not None and committed is not None:
                new.offer(committed)  # the newest version goes to the new holders at once

    @property
    def replicating(self) -> bool:
        """Whether this rank replicates (or is switching to a new placement's replicator)."""
        return self.replicator is not None or self._switch_busy

    def wait_placed(self, timeout_s: float) -> bool:
        """Block until no re-placement is in progress (its replicator built), or the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._switch_busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def wait_replicated(self, step: int, timeout_s: float) -> bool:
        """Block until version ``step`` (or newer) reached every live holder of the current
        placement (after a re-placement in progress), or the timeout."""
        deadline = time.monotonic() + timeout_s
        if not self.wait_placed(timeout_s):
            return False
        replicator = self.replicator
        if replicator is None:
            return not (self._replicate and (self.send_to or self.recv_from))
        return replicator.wait_replicated(step, max(0.0, deadline - time.monotonic()))

    # --- capture -------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether step ``step`` is captured (step 0, the initial state, always is); the same on
        every rank of the job (``checkpoint/interval.py``)."""
        return self.schedule.due(step)

    @property
    def interval(self) -> int:
        """The interval in force for the step after the last one noted (:meth:`note_iteration`)."""
        return self.schedule.at(self._noted_step + 1)

    def capture(self, step: int, state: Any) -> float:
        """Start copying ``state`` (of step ``step``, live tensors) into host memory; returns the
        time this call took. The tensors must not change before :meth:`wait_copied` returns.

        Capturing a step again (after a rollback replays it) first waits for the earlier commits.
        """
        started = time.perf_counter()
        if self.last_captured is not None and step <= self.last_captured:
            self.wait_committed(self.last_captured)
        self.last_captured = step
        self._commits.put((step, state))
        stall = time.perf_counter() - started
        self.captures.append({"step": step, "stall_s": stall, "copy_s": 0.0})
        return stall

    def wait_copied(self, timeout_s: float = 300.0) -> float:
        """Block until the last capture's copy is done (call before the optimizer changes the
        tensors); returns the wait, which is added to that capture's stall."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.last_captured is not None and (self.copied is None or self.copied < self.last_captured):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointError(f"rank {self.rank}: snapshot copy of step {self.last_captured} "
                                          f"took over {timeout_s:.0f} s")
                self._cond.wait(left)
        waited = time.perf_counter() - started
        if self.captures:
            self.captures[-1]["stall_s"] += waited
        return waited

    def note_iteration(self, seconds: float, step: int | None = None) -> None:
        """Ask for the interval that keeps this rank's capture stall within ``stall_budget`` of an
        iteration of ``seconds`` (after step ``step``, default the last captured); the job's
        schedule takes the largest need of all ranks."""
        if step is None:
            step = self.last_captured or 0
        self._noted_step = step
        if not self.captures or seconds <= 0:
            return
        stall = self.capture_cost()
        needed = max(1, math.ceil(stall / (self.cfg.stall_budget * seconds * self.cfg.interval))) * self.cfg.interval
        if needed != self.schedule.need:
            logger.info("rank %d: snapshot %s %.1f ms vs iteration %.1f ms (budget %.0f%%): needs interval %d",
                        self.rank, "stall" if self.spare_core else "stall, copy and sends (no spare core)",
                        stall * 1e3, seconds * 1e3, self.cfg.stall_budget * 100, needed)
            self.schedule.request(needed, step)

    def capture_cost(self) -> float:
        """What one capture costs training, the median of the recent ones: the training thread's
        stall; without a spare core (:attr:`spare_core`) at least the background copy (it ran on
        a training core; the stall's wait for it is part of it) plus this rank's sends of the
        version to its replica holders."""
        recent = list(self.captures)[-5:]
        if not recent:
            return 0.0
        if self.spare_core:
            costs = [c["stall_s"] for c in recent]
        else:
            replicator = self.replicator
            if replicator is not None:
                busy, sent = replicator.stats.busy_seconds, replicator.stats.versions_sent
                if busy < self._busy_noted or sent < self._sent_noted:  # another replicator's stats
                    self._busy_noted, self._sent_noted = 0.0, 0
                if sent > self._sent_noted:  # per version sent since the last look
                    self._sends.append((busy - self._busy_noted) / (sent - self._sent_noted))
                    self._busy_noted, self._sent_noted = busy, sent
            send = sorted(self._sends)[len(self._sends) // 2] if self._sends else 0.0
            costs = [max(c["stall_s"], c["copy_s"]) + send for c in recent]
        return sorted(costs)[len(costs) // 2]

    def _commit_loop(self) -> None:
        while True:
            item = self._commits.get()
            if item is None:
                return
            step, state = item
            pending = None
            try:
                t0 = time.perf_counter()
                params = state.get("params", []) if isinstance(state, dict) else []
                on_gpu = any(torch.is_tensor(p) and p.is_cuda for p in params)  # the kernel checksums in the copy
                pending = self.store.begin_save(self.owner, step, state, checksum=on_gpu)
                del state, item
                copy_s = time.perf_counter() - t0
                with self._cond:
                    self.copied = step
                    self._cond.notify_all()
                # a copy of the newest three: the training thread appends to the deque meanwhile
                # (iterating it live raised "deque mutated during iteration")
                for c in reversed(list(self.captures)[-3:]):
                    if c["step"] == step:
                        c["copy_s"] = copy_s
                        break
                self.store.finish_save(pending)
                with self._cond:
                    self.committed = pending.step
                    self._cond.notify_all()
                if self.replicator is not None:
                    self.replicator.offer(pending.step)
                if self.disk is not None and pending.step % self.cfg.persistent_interval == 0:
                    self._persist(pending.step)
            except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop training
                self.errors.append(f"{self.owner}@{step}: {exc}")
                logger.warning("snapshot %s@%d failed: %s", self.owner, step, exc)
                with self._cond:
                    self.copied = step if self.copied is None else max(self.copied, step)  # never block training
                    self._cond.notify_all()

    def _persist(self, step: int) -> None:
        info, layout, payload = self.store.open_version(self.owner, step)
        try:
            self.disk.receive(self.owner, step, info.nbytes, layout, info.checksum, lambda buf: buf.copy_(payload))
        finally:
            del payload
            self.store.release(self.owner, step)
        self.persisted = step

    def wait_committed(self, step: int, timeout_s: float = 30.0) -> bool:
        """Block until version ``step`` (or a newer one) is committed locally."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.committed is None or self.committed < step:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def mark_held(self, step: int) -> None:
        """Version ``step`` is in this rank's store already (restored): count it as captured."""
        with self._cond:
            self.last_captured = self.copied = self.committed = step
            self._cond.notify_all()

    def load_local(self, step: int) -> Any:
        """This rank's own version ``step`` from host memory (verified)."""
        return self.store.load(self.owner, step)

    def lose_memory(self) -> None:
        """Wipe this machine's host memory (the ``lose_machine`` fault)."""
        self.store.wipe()

    def close(self) -> None:
        self.gate.open(None)  # training is over: the last version may use the link freely
        self._commits.put(None)
        self._committer.join(30.0)
        with self._cond:
            self._closing = True  # a re-placement not started yet is not built any more
            self._cond.notify_all()
        self.wait_placed(self.timeout_s)  # one being built is closed with the others
        if self.replicator is not None:
            self.replicator.close()

    # --- restore -------------------------------------------------------------------------------------
    def restore(self, group: Group | None = None, stage_of: dict[int, int] | None = None, *,
                newer_than: int | None = None) -> tuple[Any, RestorePlan, dict[str, float]] | None:
        """Collective over every rank (all alive, e.g. right after a restart): agree on the newest
        step held for every rank, fetch what this rank lost from a peer or disk, and load it.

        ``group`` is every rank of the job (default: the default process group, with this tier's
        timeout). ``stage_of`` (rank -> stage) lets a rank restore from a data-parallel peer's
        snapshot of the same stage (identical state); see :func:`plan_restore`. What the ranks hold
        is exchanged as JSON and snapshots over the state transport. Returns ``(state, plan,
        timings)``; raises :class:`CheckpointError` when some rank's snapshot is nowhere.
        ``newer_than``: a step the ranks already hold (a named job's stop checkpoint, loaded): the
        snapshots are only loaded if their step is newer, else ``None`` is returned (on every rank:
        the plan is the same everywhere) and nothing is moved.
        """
        t0 = time.perf_counter()
        group = group if group is not None else world_group(self.timeout_s)
        mine = {int(o.removeprefix("rank")): steps for o, steps in self.store.holdings(verify=False).items()
                if o.startswith("rank")}
        disk = {self.rank: self.disk.holdings(verify=False).get(self.owner, [])} if self.disk is not None else {}
        gathered = group.all_gather_json({"memory": {str(o): s for o, s in mine.items()},
                                          "disk": {str(r): s for r, s in disk.items()}})
        memory = {h: {int(o): [int(x) for x in steps] for o, steps in g["memory"].items()} for h, g in enumerate(gathered)}
        persistent: dict[int, list[int]] = {}
        for g in gathered:
            persistent.update({int(r): [int(x) for x in steps] for r, steps in g["disk"].items()})
        machine_of = {r: r // self.rpm for r in range(self.world)}
        transfer_s = 0.0
        while True:  # plan on the manifests; the copies actually read are verified, a bad one is dropped
            plan = plan_restore(self.world, memory, persistent, machine_of, stage_of)
            if newer_than is not None and plan.step <= newer_than:
                return None
            bad = []
            t_x = time.perf_counter()
            for holder, rank, owner in plan.transfers():  # the receiver checks the bytes
                if self.rank == holder:
                    self._send_snapshot(owner, rank, plan.step, group)
                elif self.rank == rank and not self._recv_snapshot(holder, plan.step, group):
                    bad.append((machine_of[holder], owner, plan.step))
            transfer_s += time.perf_counter() - t_x
            source, _, owner = plan.sources[self.rank]
            if source == LOCAL and not self.store.verify(owner_name(owner), plan.step):
                bad.append((self.machine, owner, plan.step))
            reports = group.all_gather_json([list(b) for b in bad])
            found = {tuple(b) for rep in reports for b in rep}
            if not found:
                break
            for machine, owner, step in found:  # the copy is bad for every rank of that machine
                for h in memory:
                    if machine_of[h] == machine and step in memory[h].get(owner, ()):
                        memory[h][owner] = [x for x in memory[h][owner] if x != step]
        t2 = time.perf_counter()
        t1 = t2 - transfer_s
        source, _, owner = plan.sources[self.rank]
        if source == PEER:
            state = self.store.load(self.owner, plan.step, cached=True)  # received (and verified) under its name
        else:
            tier = self.disk if source == PERSISTENT else self.store
            state = tier.load(owner_name(owner), plan.step, cached=True)  # verified in the plan round
            if owner != self.rank or source == PERSISTENT:  # into host memory under its own name
                self.store.save(self.owner, plan.step, state)
        t3 = time.perf_counter()
        return state, plan, {"plan_s": t1 - t0, "transfer_s": t2 - t1, "load_s": t3 - t2, "total_s": t3 - t0}

    def holds(self, owner: int, step: int) -> bool:
        """Whether this machine's host memory holds ``owner``'s committed version ``step``."""
        return step in self.held_steps(owner)

    def held_steps(self, owner: int) -> list[int]:
        """The committed versions of ``owner`` this machine's host memory holds, newest first."""
        return self.store.holdings(verify=False).get(owner_name(owner), [])

    def load_peer(self, owner: int, step: int) -> Any:
        """``owner``'s version ``step`` from this machine's host memory (a replica, verified)."""
        return self.store.load(owner_name(owner), step)

    def send_peer(self, owner: int, to: int, step: int, group: Group) -> None:
        """Send ``owner``'s version ``step`` (held here) to rank ``to`` (see :meth:`receive_peer`)."""
        self._send_snapshot(owner, to, step, group)

    def receive_peer(self, owner: int, holder: int, step: int, group: Group) -> Any | None:
        """Receive ``owner``'s version ``step`` from ``holder`` into this machine's host memory and
        load it; ``None`` when the holder's copy was missing or failed its checksum."""
        if not self._receive(owner_name(owner), holder, step, group):
            return None
        return self.store.load(owner_name(owner), step)

    def forget_captures(self) -> None:
        """The live state changed shape (a ZeRO-1 re-shard): the held versions no longer match it,
        so a rollback keeps a pre-step copy instead of loading one of them."""
        with self._cond:
            self.last_captured = None

    def _send_snapshot(self, owner: int, to: int, step: int, group: Group) -> None:
        try:
            info, layout, payload = self.store.open_version(owner_name(owner), step, verify=False)
        except CheckpointError:  # gone or broken: tell the receiver, which reports it
            send_message(group, to, tag=_XFER_TAG, kind="missing", fields={"step": step})
            return
        try:
            send_message(group, to, tag=_XFER_TAG, fields={"step": step, "layout": layout.decode("utf-8")},
                         payload=payload if info.nbytes else None, checksum=info.checksum)
        finally:
            del payload
            self.store.release(owner_name(owner), step)

    def _recv_snapshot(self, holder: int, step: int, group: Group) -> bool:
        """Receive this rank's snapshot from ``holder``; ``False`` if it was missing or corrupt."""
        return self._receive(self.owner, holder, step, group)

    def _receive(self, owner: str, holder: int, step: int, group: Group) -> bool:
        """Receive ``owner``'s version ``step`` from ``holder`` into this machine's store."""
        message = recv_header(group, holder, tag=_XFER_TAG)
        if message.kind == "missing":
            return False
        layout = message.fields.get("layout")
        if message.fields.get("step") != step or not isinstance(layout, str):
            raise CheckpointError(f"rank {self.rank}: snapshot message from rank {holder} is not step {step}'s snapshot")

        def fill(buf: torch.Tensor) -> None:
            recv_payload(group, message, buf, tag=_XFER_TAG, verify=False)  # the store verifies

        try:
            self.store.receive(owner, step, message.nbytes, layout.encode("utf-8"), message.checksum or 0, fill)
        except CheckpointError as exc:  # every byte was received first: the protocol stays in step
            logger.warning("rank %d: snapshot %s from rank %d rejected: %s", self.rank, owner, holder, exc)
            return False
        return True
