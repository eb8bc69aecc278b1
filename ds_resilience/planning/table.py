"""The plan table: a plan for every normalized failure set, precomputed, cached, looked up in O(1).

:func:`enumerate_keys` lists one canonical failure set per class (see :mod:`.normalize`):
every set of at most ``max_failures`` failed workers, and, if asked, every set that still leaves
each stage a replica. :func:`build_table` plans them in parallel processes and stores the table
as JSON in a cache directory keyed by topology, costs, micro-batches and planner options.
:meth:`PlanTable.lookup` normalizes the actual failure set, fetches the canonical plan and maps it
back by relabelling pipelines; a re-join is the lookup of the smaller set. Sets that lose every
replica of a stage are recorded as uncoverable, so a lookup answers "beyond tolerance" at once.

The table keeps each plan's figures and its schedule as text, one line per worker, and relabels
only what is asked for: :meth:`PlanView.actions_for` parses one worker's line (what a worker needs
at a failure), :meth:`PlanView.schedule` the whole schedule. Pure Python.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..costs import CostModel
from ..errors import PlanningError, ScheduleError
from ..ir import Action, Schedule, TiedGroups, check_tied, parse_action
from ..logs import progress_bar
from ..topology import Topology, Worker
from .normalize import FailureKey, normalize, relabel_schedule
from .plan import Plan
from .planner import plan

__all__ = ["TableSpec", "PlanView", "PlanTable", "enumerate_keys", "build_table", "FORMAT_VERSION"]

FORMAT_VERSION = 3
"""2: the default memory cap became fault-free 1F1B's peak (was 2 x pp states); plans carry peak_memory.
3: every schedule receives a pair's messages in their send order (NCCL's FIFO matching)."""
_MAX_KEYS = 200_000


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSpec:
    """Everything a plan table depends on; its hash names the cache entry.

    ``tied``: the model's tied groups (see :class:`~ds_resilience.ir.Schedule`), part of the hash;
    every stored plan carries them (its schedule text's header), so a lookup's relabelled schedule does.
    """

    dp: int
    pp: int
    microbatches: int
    cost: CostModel
    variant: str = "recycle"
    solver: str = "heuristic"
    time_limit_s: float = 10.0
    memory_cap: float | str | None = None
    max_failures: int = 1
    all_coverable: bool = False
    tied: TiedGroups = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "tied", check_tied(self.tied, self.pp))
        except ScheduleError as exc:
            raise PlanningError(f"plan table: bad tied groups: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "dp": self.dp,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "cost": self.cost.to_dict(),
            "variant": self.variant,
            "solver": self.solver,
            "time_limit_s": self.time_limit_s,
            "memory_cap": self.memory_cap,
            "max_failures": self.max_failures,
            "all_coverable": self.all_coverable,
            "tied": [list(group) for group in self.tied],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TableSpec":
        """Read :meth:`to_dict`'s output back.

        Raises:
            PlanningError: another format version, or a malformed spec.
        """
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise PlanningError(f"plan table spec of format {data.get('format') if isinstance(data, dict) else None!r}; "
                                f"this version reads format {FORMAT_VERSION}")
        try:
            return cls(dp=int(data["dp"]), pp=int(data["pp"]), microbatches=int(data["microbatches"]),
                       cost=CostModel.from_dict(data["cost"], source="plan table spec"), variant=data["variant"],
                       solver=data["solver"], time_limit_s=float(data["time_limit_s"]), memory_cap=data["memory_cap"],
                       max_failures=int(data["max_failures"]), all_coverable=bool(data["all_coverable"]),
                       tied=tuple(tuple(group) for group in data["tied"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanningError(f"malformed plan table spec: {exc}") from exc

    def digest(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _key_workers(key: FailureKey) -> frozenset[Worker]:
    _, _, per_pipeline = key
    return frozenset(Worker(pipeline=c, stage=s) for c, stages in enumerate(per_pipeline) for s in stages)


def enumerate_keys(dp: int, pp: int, *, max_failures: int, all_coverable: bool = False) -> list[FailureKey]:
    """Canonical keys of every failure set with at most ``max_failures`` failures (and, with
    ``all_coverable``, of every set that leaves each stage at least one replica), the empty set first.

    Raises:
        PlanningError: more than 200,000 classes (choose a smaller tolerance).
    """
    budget = dp * pp if all_coverable else max_failures
    subsets: list[tuple[int, ...]] = []

    def stage_sets(start: int, size: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if len(prefix) == size:
            yield prefix
            return
        for s in range(start, pp):
            yield from stage_sets(s + 1, size, prefix + (s,))

    for size in range(1, min(pp, budget) + 1):
        subsets.extend(stage_sets(0, size, ()))
    subsets.sort(key=lambda t: (-len(t), t))  # the canonical order of pipelines
    keys: list[FailureKey] = []

    def grow(first: int, left: int, chosen: list[tuple[int, ...]], lost: list[int]) -> None:
        keys.append((dp, pp, tuple(chosen)))
        if len(keys) > _MAX_KEYS:
            raise PlanningError(f"more than {_MAX_KEYS} failure classes; lower max_failures or drop all_coverable")
        if len(chosen) == dp:
            return
        size = sum(len(t) for t in chosen)
        for i in range(first, len(subsets)):
            t = subsets[i]
            if len(t) > left:
                continue
            now_lost = [n + (1 if s in t else 0) for s, n in enumerate(lost)]
            if size + len(t) > max_failures and max(now_lost) >= dp:
                continue  # beyond the tolerance and uncoverable: neither it nor its supersets
            grow(i, left - len(t), chosen + [t], now_lost)

    grow(0, budget, [], [0] * pp)
    return keys


def _plan_one(args: tuple[TableSpec, FailureKey]) -> tuple[FailureKey, dict[str, Any] | None, str | None]:
    spec, key = args
    failed = _key_workers(key)
    topology = Topology(dp=spec.dp, pp=spec.pp).without(failed)
    if topology.uncovered_stages():
        return key, None, f"stages {list(topology.uncovered_stages())} lost every replica"
    p = plan(
        spec.dp,
        spec.pp,
        spec.microbatches,
        failed,
        cost=spec.cost,
        variant=spec.variant,
        solver=spec.solver,
        time_limit_s=spec.time_limit_s,
        memory_cap=spec.memory_cap,
        tied=spec.tied,
    )
    data = p.to_dict(with_schedule=False)
    data["schedule_text"] = p.schedule.to_text()
    return key, data, None


@lru_cache(maxsize=1 << 16)
def _parse_cached(token: str) -> Action:
    return parse_action(token)


@dataclass(frozen=True, slots=True)
class PlanView:
    """A stored plan seen through a pipeline relabelling (the actual failure set's labels)."""

    data: dict[str, Any]
    to_canonical: tuple[int, ...]
    from_canonical: tuple[int, ...]
    dp: int

    @property
    def iteration_time(self) -> float:
        return float(self.data["iteration_time"])

    @property
    def figures(self) -> dict[str, Any]:
        """The plan's figures (iteration time, degradation, bound, solver, memory per canonical worker)."""
        return {k: v for k, v in self.data.items() if k not in ("schedule_text", "_lines")}

    def actions_for(self, worker_index: int) -> tuple[Action, ...]:
        """One worker's actions (by its actual index), relabelled; cheap enough for a failure path."""
        stage, p = divmod(worker_index, self.dp)
        canonical_index = stage * self.dp + self.to_canonical[p]
        lines = self.data.get("_lines")
        if lines is None:  # split once per stored plan, then every lookup is O(one line)
            lines = self.data["_lines"] = self.data["schedule_text"].splitlines()
        body = lines[canonical_index + 1].partition(": ")[2]
        if body.strip() in ("", "(failed)"):
            return ()
        perm = self.from_canonical
        out = []
        for token in body.split():
            a = _parse_cached(token)
            peer = None if a.peer is None else (a.peer // self.dp) * self.dp + perm[a.peer % self.dp]
            out.append(
                Action(
                    kind=a.kind,
                    stage=a.stage,
                    microbatch=a.microbatch,
                    pipeline=None if a.pipeline is None else perm[a.pipeline],
                    peer=peer,
                )
            )
        return tuple(out)

    def schedule(self) -> Schedule:
        """The whole schedule in the actual labels."""
        return relabel_schedule(Schedule.from_text(self.data["schedule_text"]), self.from_canonical)

    def plan(self) -> Plan:
        """The full :class:`Plan`, relabelled (failed workers and schedule in actual labels)."""
        data = dict(self.figures)
        data["schedule"] = self.schedule().to_dict()
        data["failed"] = [
            f"{self.from_canonical[int(w.split(':')[0])]}:{w.split(':')[1]}" for w in self.data["failed"]
        ]
        return Plan.from_dict(data)


class PlanTable:
    """Precomputed plans keyed by canonical failure key."""

    def __init__(self, spec: TableSpec, plans: dict[FailureKey, dict[str, Any]], uncoverable: dict[FailureKey, str]):
        self.spec = spec
        self._plans = plans
        self._uncoverable = uncoverable

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def keys(self) -> list[FailureKey]:
        return list(self._plans)

    def lookup(self, failed: Iterable[Worker]) -> PlanView:
        """The plan for ``failed`` (actual labels). A re-join is the lookup of the smaller set.

        Raises:
            PlanningError: the set lost every replica of a stage, or lies beyond the table's tolerance.
        """
        norm = normalize(self.spec.dp, self.spec.pp, failed)
        data = self._plans.get(norm.key)
        if data is None:
            why = self._uncoverable.get(norm.key)
            if why is not None:
                raise PlanningError(f"re-routing cannot cover failure set {sorted(map(str, failed))}: {why}")
            raise PlanningError(
                f"failure set {sorted(map(str, failed))} is beyond the plan table's tolerance "
                f"(max_failures={self.spec.max_failures}); plan it on demand with planning.plan()"
            )
        return PlanView(data, norm.to_canonical, norm.from_canonical, self.spec.dp)

    # --- persistence ---------------------------------------------------------------------------
    def schedules_digest(self) -> str:
        """A hash of what a worker runs from this table: each class's key and schedule text, and
        the uncoverable classes (not the solver's timings). Two tables with equal digests give every
        failure set the same schedule; CP-SAT under a time limit can give two builds of one spec
        different ones (see ``runtime/plan_agreement.py``)."""
        h = hashlib.sha256()
        for key in sorted(self._plans):
            h.update(repr(key[2]).encode())
            h.update(self._plans[key]["schedule_text"].encode())
        for key in sorted(self._uncoverable):
            h.update(b"uncoverable" + repr(key[2]).encode())
        return h.hexdigest()[:32]

    def to_bytes(self) -> bytes:
        """The table as :meth:`save` writes it (gzip JSON)."""
        payload = {
            "spec": self.spec.to_dict(),
            "plans": [[list(map(list, k[2])), {x: y for x, y in v.items() if x != "_lines"}] for k, v in self._plans.items()],
            "uncoverable": [[list(map(list, k[2])), v] for k, v in self._uncoverable.items()],
        }
        return gzip.compress(json.dumps(payload).encode("utf-8"), compresslevel=1)

    def save(self, path: Path) -> None:
        """Write the table atomically (gzip JSON)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_bytes(self.to_bytes())
        os.replace(tmp, path)

    @classmethod
    def from_bytes(cls, data: bytes, spec: TableSpec | None = None, *, source: str = "plan table") -> "PlanTable":
        """Read :meth:`to_bytes`' output for ``spec`` (``None``: the spec it was built for).

        Raises:
            PlanningError: the bytes are unreadable or were built for another spec.
        """
        try:
            payload = json.loads(gzip.decompress(data).decode("utf-8"))
        except (OSError, ValueError, EOFError) as exc:
            raise PlanningError(f"{source} is unreadable: {exc}") from exc
        if spec is None:
            spec = TableSpec.from_dict(payload.get("spec"))
        if payload.get("spec") != json.loads(json.dumps(spec.to_dict())):
            raise PlanningError(f"{source} was built for another topology, cost model or options")

        def key(raw: list) -> FailureKey:
            return (spec.dp, spec.pp, tuple(tuple(t) for t in raw))

        return cls(
            spec,
            {key(k): v for k, v in payload["plans"]},
            {key(k): v for k, v in payload["uncoverable"]},
        )

    @classmethod
    def load(cls, path: Path, spec: TableSpec) -> "PlanTable":
        """Read a table written by :meth:`save` for ``spec``.

        Raises:
            PlanningError: the file is unreadable or was built for another spec.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise PlanningError(f"plan table {str(path)!r} is unreadable: {exc}") from exc
        return cls.from_bytes(data, spec, source=f"plan table {str(path)!r}")


def build_table(
    spec: TableSpec,
    *,
    cache_dir: str | Path | None = None,
    workers: int = 0,
    progress: bool | None = None,
    lock_timeout_s: float = 3600.0,
) -> tuple[PlanTable, dict[str, Any]]:
    """Plan every class of failure sets in ``spec`` (or load it from ``cache_dir``).

    Args:
        spec: topology, costs, variant, solver and tolerance.
        cache_dir: where tables are kept (``<cache_dir>/<digest>.json.gz``); ``None``: no cache.
        workers: parallel processes; 0 = the machine's CPU count, 1 = in this process.
        progress: ``False``: no progress bar; ``None`` or ``True``: a bar on stderr while the plans
            are computed, on rank 0 where stderr is a terminal or ``DSR_PROGRESS=1``
            (:func:`ds_resilience.logs.progress_enabled`).
        lock_timeout_s: how long to wait for another process building the same table (the
            processes of one machine share the cache; a builder that dies releases the lock).

    Returns:
        The table and a summary: ``plans``, ``uncoverable``, ``seconds``, ``cached``, ``path``.
    """
    started = time.perf_counter()
    path = Path(cache_dir) / f"plans-{spec.digest()}.json.gz" if cache_dir is not None else None
    if path is None:
        return _build(spec, None, workers, progress, started)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the processes of one machine build a table once: the first holds the lock, the others load it
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        _lock(lock, path, lock_timeout_s)
        try:
            if path.exists():
                table = PlanTable.load(path, spec)
                return table, {
                    "plans": len(table),
                    "uncoverable": len(table._uncoverable),
                    "seconds": time.perf_counter() - started,
                    "cached": True,
                    "path": str(path),
                }
            return _build(spec, path, workers, progress, started)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock(fh, path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise PlanningError(f"waited {timeout_s:.0f} s for another process building plan table {path}") from None
            time.sleep(0.05)


def _build(spec: TableSpec, path: Path | None, workers: int, progress: bool | None,
           started: float) -> tuple[PlanTable, dict[str, Any]]:
    keys = enumerate_keys(spec.dp, spec.pp, max_failures=spec.max_failures, all_coverable=spec.all_coverable)
    jobs = [(spec, k) for k in keys]
    n = workers or os.cpu_count() or 1
    if multiprocessing.current_process().daemon:
        n = 1  # a daemonic process (a worker of a pool or a test harness) may not have children
    plans: dict[FailureKey, dict[str, Any]] = {}
    uncoverable: dict[FailureKey, str] = {}
    with progress_bar(len(jobs), f"plan table {spec.dp} x {spec.pp}", enabled=progress, unit="set") as bar:

        def collect(result: tuple[FailureKey, dict[str, Any] | None, str | None]) -> None:
            key, data, why = result
            if data is None:
                uncoverable[key] = why or "uncoverable"
            else:
                plans[key] = data
            bar.update()

        if n == 1 or len(jobs) < 4:
            for job in jobs:
                collect(_plan_one(job))
        else:
            with ProcessPoolExecutor(max_workers=n) as pool:
                for result in pool.map(_plan_one, jobs, chunksize=max(1, len(jobs) // (8 * n))):
                    collect(result)
    table = PlanTable(spec, plans, uncoverable)
    if path is not None:
        table.save(path)
    return table, {
        "plans": len(plans),
        "uncoverable": len(uncoverable),
        "seconds": time.perf_counter() - started,
        "cached": False,
        "path": str(path) if path else None,
    }
