"""Every worker answers a failure from the same plan table: rank 0's.

At a failure each survivor takes the new schedule from its own plan table, without talking, so
the tables must agree action for action. Two builds of one spec need not: CP-SAT under a time
limit (the default solver) stops where the clock says, so a node that is slower or busier keeps a
different schedule (two builds of a 4 x 4 table, one with a core kept busy, gave 2 of its 5
classes different schedules: docs/benchmarks/planner.md, "Scale"). And a worker the agent relaunched (a
re-join) starts from the configuration's cost model, while the survivors may have re-planned with
the job's own profile.

So only rank 0 plans (at start, and after the profile): it publishes in the job's store its table
(gzip JSON), its cost model, variant and solver, and a digest of the schedules. Every other rank
waits for that record and adopts the table without planning (:func:`await_published`): no second
answer to disagree with, and rank 0's solver has the node's cores to itself (ranks of one node
share them; with four builds of a 4 x 4 table at once on this machine's two cores, CP-SAT improved
on the heuristic in none of its 5 classes within the time limit, alone in 2: docs/benchmarks/planner.md). A
re-joining worker reads the newest record the same way; when rank 0 announced a build it has not
published yet (a worker failed while rank 0 built the table after the profile, and its relaunch
came up before the table did), it waits for that build: the survivors answer its re-join with it.

After a live re-grid the new grid's first rank publishes under its own scope. Keys:
``dsr/plans/<scope>/<build>/record`` and ``.../table``, ``dsr/plans/<scope>/latest``,
``dsr/plans/<scope>/building`` (the build under way and its publisher).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from .. import store_keys as keys
from ..costs import CostModel
from ..errors import ResilienceError
from ..logs import get_logger
from ..planning.provider import ScheduleProvider
from ..planning.table import PlanTable

__all__ = ["PublisherLost", "announce", "publish", "await_published", "latest", "newest", "adopt_published",
           "check_joined"]

log = get_logger(__name__)

PREFIX = keys.PLANS


class PublisherLost(ResilienceError):
    """The publisher failed before it published: no rank can have adopted this build."""


def _key(scope: str, build: int, what: str) -> str:
    return keys.plans(scope, build, what)


def _building_key(scope: str) -> str:  # "<build> <publisher> <epoch>" of the build under way
    return keys.plans_building(scope)


def _latest_key(scope: str) -> str:  # the newest published build
    return keys.plans_latest(scope)


def _published(store: Any, scope: str, record: dict[str, Any], publisher: int) -> PlanTable:
    """The table ``record`` announces, checked against the record's digest."""
    table = PlanTable.from_bytes(store.get(_key(scope, record["build"], "table")),
                                 source=f"rank {publisher}'s plan table")
    if table.schedules_digest() != record["digest"]:
        raise ResilienceError(f"rank {publisher}'s published plan table (build {record['build']}) does not match "
                              f"its digest")
    return table


def announce(store: Any, *, scope: str, build: int, publisher: int, epoch: int) -> None:
    """The publisher, before it builds ``build`` (the agent's newest epoch is ``epoch``): a worker
    that re-joins meanwhile waits for it."""
    store.set(_building_key(scope), f"{build} {publisher} {epoch}")


def publish(store: Any, provider: ScheduleProvider, *, scope: str, build: int,
            from_step: int | None = None) -> dict[str, Any]:
    """Rank 0: make ``provider``'s table, cost model, variant and solver the job's for ``build``;
    ``from_step``: the optimizer step from which the survivors answer failures from it (the re-plan
    after the profile is adopted a step after it ends; ``None``: at once)."""
    table = provider.table
    record = {"build": build, "cost": provider.cost.to_dict(), "variant": provider.variant, "solver": provider.solver,
              "digest": table.schedules_digest() if table is not None else None}
    if from_step is not None:
        record["from_step"] = from_step
    if table is not None:  # the cached file holds these bytes already (PlanTable.save writes to_bytes())
        path = (provider.table_summary or {}).get("path")
        data = Path(path).read_bytes() if path and Path(path).is_file() else table.to_bytes()
        store.set(_key(scope, build, "table"), data)  # before the record that announces it
    store.set(_key(scope, build, "record"), json.dumps(record))
    store.set(_latest_key(scope), str(build))
    return record


def _record(store: Any, scope: str, build: int, timeout_s: float, interrupted: Callable[[], str | None],
            publisher: int) -> dict:
    key = _key(scope, build, "record")
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        why = interrupted()
        # the publisher publishes before it can fail, so once its failure is known one more look decides
        if why is not None and not store.check([key]):
            raise PublisherLost(f"rank {publisher} failed ({why}) before it published its plan table (build {build})")
        if time.monotonic() > deadline:
            raise ResilienceError(
                f"rank {publisher} did not publish its plan table (build {build}) within {timeout_s:.0f} s; every "
                f"worker must answer a failure from the same table, so this rank cannot go on")
        time.sleep(0.05)
    return json.loads(store.get(key))


def await_published(store: Any, make_provider, *, scope: str, build: int, timeout_s: float,
                    interrupted: Callable[[], str | None] = lambda: None, publisher: int = 0) -> ScheduleProvider:
    """Any rank but the publisher (rank 0; after a re-grid the new grid's first rank): wait for its
    record of ``build`` and take its plans (:func:`adopt_published`), without planning.
    ``interrupted()`` names the publisher's failure once the agent published it, else ``None``.

    Raises:
        PublisherLost: the publisher failed before publishing (no rank can have adopted this build).
        ResilienceError: the publisher did not publish in time, or its table does not match its record.
    """
    record = _record(store, scope, build, timeout_s, interrupted, publisher)
    return adopt_published(store, record, make_provider, scope=scope, publisher=publisher)


def latest(store: Any, scope: str) -> dict[str, Any] | None:
    """The newest record rank 0 published under ``scope`` (``None``: none yet)."""
    key = _latest_key(scope)
    if not store.check([key]):
        return None
    build = int(store.get(key))
    return json.loads(store.get(_key(scope, build, "record")))


def newest(store: Any, scope: str, *, timeout_s: float,
           interrupted: Callable[[int, int], str | None] = lambda publisher, epoch: None) -> dict[str, Any] | None:
    """A re-joining worker: the record of the build the survivors will answer its re-join with.
    That is the build the publisher announced (:func:`announce`), waited for up to ``timeout_s``
    when it is not published yet, unless the publisher failed after announcing it
    (``interrupted(publisher, epoch)`` names a failure of it in an epoch after ``epoch``, even one
    it has re-joined from since; then every survivor kept the build before, and so does this
    worker). ``None``: nothing published.

    Raises:
        ResilienceError: the announced build did not come within ``timeout_s``.
    """
    key = _building_key(scope)
    if store.check([key]):
        build, publisher, epoch = (int(x) for x in store.get(key).decode().split())
        if not store.check([_key(scope, build, "record")]):
            log.info("waiting for rank %s's plan table (build %s, announced in epoch %s): the survivors will "
                     "answer this re-join with it", publisher, build, epoch)
        try:
            return _record(store, scope, build, timeout_s, lambda: interrupted(publisher, epoch), publisher)
        except PublisherLost:
            pass
    return latest(store, scope)


def check_joined(store: Any, scope: str, adopted: dict[str, Any] | None, *, rank: int, step: int | None = None) -> None:
    """A re-joined worker, once its donor has handed it state (at optimizer step ``step``): the
    survivors answer failures from the newest published build, once past the step it is adopted
    at (``from_step``: the re-plan after the profile is published from a thread and adopted by
    every survivor at one step); ``adopted`` (the record the worker took, ``None``: none) must be
    it, and the worker must have joined at or after that step.

    Raises:
        ResilienceError: it is not, or the worker joined while the survivors still answered from
            the build before (it would answer the next failure from another table); the worker
            stops, and its next relaunch reads the survivors' build.
    """
    current = latest(store, scope)
    mine = None if adopted is None else (adopted["build"], adopted["digest"])
    theirs = None if current is None else (current["build"], current["digest"])
    from_step = None if current is None else current.get("from_step")
    if mine == theirs and from_step is not None and step is not None and step < from_step:
        raise ResilienceError(
            f"rank {rank} re-joined at step {step} with plan table {_name(mine)}, which the survivors answer "
            f"failures from only from step {from_step}; it stops rather than answer a failure before then from "
            f"another table (a relaunch reads theirs)")
    if mine != theirs:
        raise ResilienceError(
            f"rank {rank} re-joined with plan table {_name(mine)}, but the survivors answer failures from "
            f"{_name(theirs)}; it stops rather than answer the next failure from another table (a relaunch "
            f"reads theirs)")


def _name(build: tuple | None) -> str:
    return "none (the configured plans)" if build is None else f"build {build[0]} (digest {str(build[1])[:12]})"


def adopt_published(store: Any, record: dict[str, Any], make_provider, *, scope: str,
                    publisher: int = 0) -> ScheduleProvider:
    """The provider the publisher plans with, from its ``record`` (:func:`newest` for a re-joining
    worker, :func:`await_published` for the others).

    ``make_provider(cost, variant, solver)`` builds a provider with that cost model, variant and
    on-demand solver and no table; the table is the publisher's, read from the store (no planning).

    Raises:
        ResilienceError: the published table does not match its record.
    """
    if record["digest"] is None:
        return make_provider(CostModel.from_dict(record["cost"], source=f"rank {publisher}'s published cost model"),
                             record["variant"], record["solver"])
    table = _published(store, scope, record, publisher)
    provider = make_provider(table.spec.cost, table.spec.variant, record["solver"])
    provider.adopt(table)
    return provider
