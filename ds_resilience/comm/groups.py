"""Process groups addressed by global ranks: one generation's groups, pair groups, and the world.

Each group is a standalone process group over a ``PrefixStore`` named by a session id, the
generation and its members (gloo for CPU tensors; NCCL when the engine's device is a GPU, with the
abort-based recovery torchft and NVIDIA's resiliency extension use: non-blocking communicator
init, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` so a failed operation aborts its communicator without
tearing the process down, :meth:`Group.poison` aborts the generation's communicators, and every
wait polls its work with a deadline instead of trusting the watchdog), so a later generation never meets an earlier one's keys or pairs
(``dist.new_group`` names groups by their ranks alone, which collides when a member set recurs,
e.g. the same worker failing twice). Groups keep the original global ranks at their interface:
:class:`Group` translates to group-local ranks. Only the members construct a group; a dead rank is
never waited for. Every wait on a :class:`Group` is bounded by its timeout.

Point-to-point matching (``matching``): ``"tags"`` (gloo: a receive takes the message sent under
its tag) or ``"fifo"`` (NCCL's rule: tags are ignored and a pair's messages match in the order
they are posted; on gloo every message then travels under one tag, which is how the CPU tests run
the engine under NCCL's matching). The default comes from ``DSR_P2P_MATCHING`` (``tags`` if unset);
the schedules the runtime runs are valid under both (validator rule 7, early receive posts).

Collectives of plain values (:meth:`Group.all_gather_json`, :meth:`Group.broadcast_json`) carry
JSON, never pickles: nothing received from another process can run code here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import store_keys
from ..errors import ResilienceError
from ..topology import Topology, Worker

__all__ = ["MATCHINGS", "CommError", "Group", "default_matching", "GenerationGroups", "build_groups", "new_group", "poison", "world_group"]

_POISON_TAG = (1 << 30) + 7
_MAX_JSON_BYTES = 64 << 20
MATCHINGS = ("tags", "fifo")
_FIFO_TAG = 0
_POLL_S = 0.0005


def default_matching() -> str:
    """``DSR_P2P_MATCHING`` (``tags`` when unset); anything else is an error naming the choices."""
    value = os.environ.get("DSR_P2P_MATCHING", "tags")
    if value not in MATCHINGS:
        raise ValueError(f"DSR_P2P_MATCHING={value!r}; allowed: {', '.join(MATCHINGS)}")
    return value


class CommError(ResilienceError):
    """A communication failed: it timed out, the peer went away, or what arrived is malformed."""


class Group:
    """A gloo process group addressed by global ranks.

    Args:
        pg: the backend process group.
        ranks: its members' global ranks, in group-rank order.
        timeout_s: how long each operation waits.
        me: this process's global rank.
        name: what the group is for (in error messages).
        matching: ``"tags"`` or ``"fifo"`` (module docstring); default :func:`default_matching`
            (``"fifo"`` on NCCL, which ignores tags).
        backend: ``"gloo"`` or ``"nccl"`` (how waits and :meth:`poison` work).
    """

    def __init__(self, pg: dist.ProcessGroup, ranks: Sequence[int], timeout_s: float, me: int, name: str = "",
                 matching: str | None = None, backend: str = "gloo") -> None:
        self.backend = backend
        # where its operations run: the CPU for gloo, the communicator's GPU for NCCL (tensors on
        # another device are staged there and back, so CPU-side callers work unchanged)
        self.device = torch.device(getattr(pg, "dsr_device", "cpu")) if backend == "nccl" else torch.device("cpu")
        self.matching = ("fifo" if backend == "nccl" else default_matching()) if matching is None else matching
        if self.matching not in MATCHINGS:
            raise ValueError(f"matching {self.matching!r}; allowed: {', '.join(MATCHINGS)}")
        self.pg = pg
        self.meta_store: dist.Store | None = None  # the group's own keys (set by new_group): p2p headers
        self.poisoned = False
        self.me = me
        self.ranks = tuple(ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.name = name or f"group{list(self.ranks)}"

    def __len__(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={list(self.ranks)})"

    def wait(self, work, what: str, timeout_s: float | None = None) -> None:
        """Wait for ``work`` with the group's timeout (or ``timeout_s``); :class:`CommError` names ``what``.

        On NCCL a work's ``wait`` only orders the current stream after it; here the host polls
        ``is_completed`` until the deadline (a hung peer is then a :class:`CommError`, and an
        aborted communicator completes the work with its error)."""
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            if self.backend == "nccl":
                deadline = time.monotonic() + timeout.total_seconds()
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise CommError(f"{self.name}: {what}: not completed within {timeout.total_seconds():.0f}s")
                    time.sleep(_POLL_S)
            work.wait(timeout)
        except RuntimeError as exc:  # gloo: timeout, or the peer closed the connection; NCCL: aborted
            raise CommError(f"{self.name}: {what}: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over the members."""
        staged = tensor if tensor.device == self.device else tensor.to(self.device)
        self.wait(self.pg.allreduce([staged]), "all-reduce")
        if staged is not tensor:
            tensor.copy_(staged)

    def _post(self, op: str, tensor: torch.Tensor, peer: int, tag: int):
        """Post a send or receive; gloo raises at once on a pair a dead peer closed: a CommError."""
        try:
            return getattr(self.pg, op)([tensor], self.index[peer], tag if self.matching == "tags" else _FIFO_TAG)
        except RuntimeError as exc:
            raise CommError(f"{self.name}: posting a {op} with rank {peer}: {exc}") from exc

    def all_reduce_flat(self, tensors: Sequence[torch.Tensor]) -> None:
        """In-place sum of each of ``tensors`` over the members, through one flat buffer (one
        collective instead of one per tensor)."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t))
            offset += n

    def isend(self, tensor: torch.Tensor, dst: int, tag: int):
        staged = tensor if tensor.device == self.device else tensor.to(self.device)
        work = self._post("send", staged, dst, tag)
        return work if staged is tensor else _Staged(work, staged, None)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int):
        if tensor.device == self.device:
            return self._post("recv", tensor, src, tag)
        buf = torch.empty_like(tensor, device=self.device)
        work = self._post("recv", buf, src, tag)
        return _Staged(work, buf, tensor)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))

    def poison(self) -> None:
        """Release every operation blocked on this group now; the group is unusable afterwards.

        Gloo: a receive with a 1 ms timeout makes gloo close the pair; a main thread blocked in a
        receive or a collective on the group is released in milliseconds instead of waiting out
        the process-group timeout. NCCL: the communicators are aborted (a posted receive would
        otherwise match the next real send), which completes their pending work with an error.
        """
        self.poisoned = True
        poison_pg(self.pg, self.backend, [i for i, r in enumerate(self.ranks) if r != self.me])

    # --- plain values as JSON ---------------------------------------------------------------------
    def all_gather_json(self, value: Any) -> list[Any]:
        """Every member's ``value`` (JSON-able), in group-rank order."""
        data = json.dumps(value, sort_keys=True).encode()
        sizes = torch.zeros(len(self.ranks), dtype=torch.int64)
        sizes[self.index[self.me]] = len(data)
        self.all_reduce(sizes)
        if int(sizes.max()) > _MAX_JSON_BYTES:
            raise CommError(f"{self.name}: a member gathers {int(sizes.max())} bytes of JSON (limit {_MAX_JSON_BYTES})")
        width = int(sizes.max())
        rows = torch.zeros(len(self.ranks), width, dtype=torch.uint8)
        if data:
            rows[self.index[self.me], : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.all_reduce(rows)  # every other row is zero: the sum is the gather
        out = []
        for i, n in enumerate(sizes.tolist()):
            out.append(_loads(bytes(rows[i, :n].numpy()), f"{self.name}: value from rank {self.ranks[i]}"))
        return out

    def broadcast_json(self, value: Any, src: int) -> Any:
        """``src``'s ``value`` (JSON-able) on every member."""
        return self.all_gather_json(value if self.me == src else None)[self.index[src]]


class _Staged:
    """A work whose tensor was staged on the group's device: keeps it alive, and for a receive
    copies it into the caller's tensor once done."""

    def __init__(self, work, staged: torch.Tensor, target: torch.Tensor | None) -> None:
        self.work, self.staged, self.target = work, staged, target

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout=None) -> bool:
        done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if self.target is not None:
            self.target.copy_(self.staged)
            self.target = None
        return done


def _loads(data: bytes, what: str) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CommError(f"{what} is not JSON: {exc}") from None


def poison_pg(pg: Any, backend: str, peers: Sequence[int]) -> None:
    """Release every operation blocked on the process group ``pg`` (see :meth:`Group.poison`):
    NCCL aborts it; gloo closes its pair to each of ``peers`` (group ranks) with a receive that
    times out after 1 ms. Used for our groups and for a front end's own (megatron-core's)."""
    if backend == "nccl":
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - aborting an already broken communicator
            pass
        return
    buf = torch.zeros(1)
    for peer in peers:
        try:
            pg.recv([buf], peer, _POISON_TAG).wait(timedelta(milliseconds=1))
        except Exception:  # noqa: BLE001 - the timeout is the point
            pass


def poison(group: Group) -> None:
    """Close every pair of ``group`` (see :meth:`Group.poison`)."""
    group.poison()


def new_group(ranks: Sequence[int], *, name: str, timeout_s: float, store: dist.Store | None = None,
              me: int | None = None, device: torch.device | str | None = None, interface: str | None = None) -> Group:
    """Create the group ``ranks`` (call on every member); ``name`` must be unique per creation.

    ``store`` defaults to the default process group's store; under the agent it is the agent's.
    ``device``: the tensors' device; a CUDA device makes it an NCCL group on that device (fresh
    communicators per generation, since every generation's names differ), anything else gloo.
    ``interface``: the network interface a gloo group uses (e.g. replication on a second NIC);
    ``None``: gloo's default (``GLOO_SOCKET_IFNAME``, else the hostname's address).

    Raises:
        CommError: ``interface`` does not exist on this machine, or NCCL is missing for a GPU.
    """
    me = dist.get_rank() if me is None else me
    ranks = sorted(ranks)
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of group {name} {ranks}")
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    prefix = store_keys.group(name, ranks)
    store = dist.PrefixStore(prefix, base)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        pg = _nccl_group(store, ranks.index(me), len(ranks), timeout_s, device, name)
        group = Group(pg, ranks, timeout_s, me, name, backend="nccl")
        group.meta_store = dist.PrefixStore("meta", store)
        return group
    if interface is not None:
        opts = dist.ProcessGroupGloo._Options()
        try:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
        except RuntimeError as exc:
            raise CommError(f"group {name}: network interface {interface!r} cannot be used: {exc}") from exc
        opts._timeout = timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), opts)
    else:
        pg = dist.ProcessGroupGloo(store, ranks.index(me), len(ranks), timedelta(seconds=timeout_s))
    group = Group(pg, ranks, timeout_s, me, name)
    group.meta_store = dist.PrefixStore("meta", store)
    return group


NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""Set (unless the user set them) before the first NCCL group: a failed operation aborts its
communicator and leaves the process alive (the default tears the survivors down with a dead peer)."""


def _nccl_group(store: dist.Store, rank: int, size: int, timeout_s: float, device: torch.device, name: str):
    """A standalone NCCL backend for one group: non-blocking init (bounded by our own waits, and
    abortable while it connects), its communicator created now on ``device`` rather than at the
    first operation."""
    if not dist.is_nccl_available():
        raise CommError(f"group {name}: the engine's device is {device} but this torch has no NCCL backend")
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts.config.blocking = 0
    pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    pg.eager_connect_single_device(device)
    pg.dsr_device = str(device)  # read by Group: where its operations run
    return pg


def world_group(timeout_s: float) -> Group:
    """The default process group (every rank of the job) as a :class:`Group` with a timeout."""
    pg = dist.distributed_c10d._get_default_group()
    return Group(pg, range(dist.get_world_size()), timeout_s, dist.get_rank(), "world")


@dataclass(frozen=True)
class GenerationGroups:
    """The groups one surviving worker uses in one generation.

    Attributes:
        generation: membership epoch these groups belong to.
        world: all surviving workers (messages, global norm, loss aggregation, agreement).
        stage: this worker's stage's surviving replicas (gradient reduce).
        tied: tied group index -> the surviving workers of every stage of that tied group (the
            tied-weight gradient reduce), for the groups that hold this worker's stage.
    """

    generation: int
    world: Group
    stage: Group
    tied: dict[int, Group] = field(default_factory=dict)

    def poison(self) -> None:
        """Release whatever is blocked on this generation's groups (see :meth:`Group.poison`)."""
        self.world.poison()
        self.stage.poison()
        for group in self.tied.values():
            group.poison()


def build_groups(topology: Topology, me: Worker, *, session: str, generation: int = 0, timeout_s: float = 60.0,
                 store: dist.Store | None = None, tied: Sequence[Sequence[int]] = (),
                 device: torch.device | str | None = None) -> GenerationGroups:
    """Create the surviving world group, ``me``'s stage group and the tied groups of ``me``'s stage
    (``tied``: the schedule's tied groups, tuples of stages) for ``generation``; on ``device``
    (NCCL for a GPU, see :func:`new_group`)."""
    world_ranks = [topology.rank(w) for w in topology.alive_workers()]
    stage_ranks = [topology.rank(w) for w in topology.stage_peers(me.stage)]
    name = f"{session}/g{generation}"
    rank = topology.rank(me)
    world = new_group(world_ranks, name=f"{name}/world", timeout_s=timeout_s, store=store, me=rank, device=device)
    stage = new_group(stage_ranks, name=f"{name}/stage{me.stage}", timeout_s=timeout_s, store=store, me=rank,
                      device=device)
    tied_groups = {}
    for g, stages in enumerate(tied):  # in group order on every member: no crossed rendezvous
        if me.stage in stages:
            ranks = [topology.rank(w) for s in stages for w in topology.stage_peers(s)]
            tied_groups[g] = new_group(ranks, name=f"{name}/tied{g}", timeout_s=timeout_s, store=store, me=rank,
                                       device=device)
    return GenerationGroups(generation=generation, world=world, stage=stage, tied=tied_groups)
