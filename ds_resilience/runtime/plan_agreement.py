"""Every worker answers a failure from the same plan table: rank 0's.

At a failure each survivor takes the new schedule from its own plan table, without talking, so
the tables must agree action for action. Two builds of one spec need not: CP-SAT under a time
limit (the default solver) stops where the clock says, so a node that is slower or busier keeps a
different schedule (two builds of a 4 x 4 table, one with a core kept busy, gave 2 of its 5
classes different schedules: BENCHMARKS.md, "Scale"). Ranks of one machine share the table through ``planner.cache_dir``; ranks
of different machines do not. And a worker the agent relaunched (a re-join) starts from the
configuration's cost model, while the survivors may have re-planned with the job's own profile.

So after every table build (at start, and after the profile) rank 0 publishes in the job's store
its table (gzip JSON), its cost model and variant, and a digest of the schedules; every other rank
compares its own digest and, where it differs, adopts rank 0's table. A re-joining worker reads
the newest record and takes its cost model, variant and table without planning.

After a live re-grid the new grid's first rank publishes under its own scope. Keys:
``dsr/plans/<scope>/<build>/record`` and ``.../table``, ``dsr/plans/<scope>/latest``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from ..costs import CostModel
from ..errors import ResilienceError
from ..planning.provider import ScheduleProvider
from ..planning.table import PlanTable

__all__ = ["PublisherLost", "publish", "agree", "latest", "adopt_published"]

PREFIX = "dsr/plans"


class PublisherLost(ResilienceError):
    """The publisher failed before it published: no rank can have adopted this build."""


def _key(scope: str, build: int, what: str) -> str:
    return f"{PREFIX}/{scope}/{build}/{what}"


def _published(store: Any, scope: str, record: dict[str, Any], spec, publisher: int) -> PlanTable:
    """The table ``record`` announces, read for ``spec`` (``None``: the one it was built for) and
    checked against the record's digest."""
    table = PlanTable.from_bytes(store.get(_key(scope, record["build"], "table")), spec,
                                 source=f"rank {publisher}'s plan table")
    if table.schedules_digest() != record["digest"]:
        raise ResilienceError(f"rank {publisher}'s published plan table (build {record['build']}) does not match "
                              f"its digest")
    return table


def publish(store: Any, provider: ScheduleProvider, *, scope: str, build: int) -> dict[str, Any]:
    """Rank 0: make ``provider``'s table, cost model and variant the job's for ``build``."""
    table = provider.table
    record = {"build": build, "cost": provider.cost.to_dict(), "variant": provider.variant,
              "digest": table.schedules_digest() if table is not None else None}
    if table is not None:  # the cached file holds these bytes already (PlanTable.save writes to_bytes())
        path = (provider.table_summary or {}).get("path")
        data = Path(path).read_bytes() if path and Path(path).is_file() else table.to_bytes()
        store.set(_key(scope, build, "table"), data)  # before the record that announces it
    store.set(_key(scope, build, "record"), json.dumps(record))
    store.set(f"{PREFIX}/{scope}/latest", str(build))
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


def agree(store: Any, provider: ScheduleProvider, *, scope: str, build: int, timeout_s: float,
          interrupted: Callable[[], str | None] = lambda: None, publisher: int = 0) -> str | None:
    """Any rank but the publisher (rank 0; after a re-grid the new grid's first rank), after
    building its own table: adopt the publisher's where the schedules differ. ``interrupted()``
    names the publisher's failure once the agent published it, else ``None``.

    Returns what was done (``None``: the tables already agreed).

    Raises:
        PublisherLost: the publisher failed before publishing (every rank keeps what it had).
        ResilienceError: the publisher did not publish in time, or the tables cannot be reconciled
            (one rank has a table, the other none; other specs).
    """
    record = _record(store, scope, build, timeout_s, interrupted, publisher)
    table = provider.table
    mine = table.schedules_digest() if table is not None else None
    if record["digest"] == mine:
        return None
    if table is None or record["digest"] is None:
        raise ResilienceError(f"rank {publisher} {'has' if record['digest'] else 'has no'} plan table and this rank "
                              f"{'has' if table is not None else 'has none'}: resilience.max_failures and "
                              f"planner.all_coverable must be the same on every rank")
    provider.adopt(_published(store, scope, record, table.spec, publisher))
    return (f"its plan table differed from rank {publisher}'s (digest {mine[:12]} against {record['digest'][:12]}: "
            f"CP-SAT under a time limit, or planner.cache_dir not shared between machines); adopted rank {publisher}'s")


def latest(store: Any, scope: str) -> dict[str, Any] | None:
    """The newest record rank 0 published under ``scope`` (``None``: none yet)."""
    key = f"{PREFIX}/{scope}/latest"
    if not store.check([key]):
        return None
    build = int(store.get(key))
    return json.loads(store.get(_key(scope, build, "record")))


def adopt_published(store: Any, record: dict[str, Any], make_provider, *, scope: str) -> ScheduleProvider:
    """A re-joining worker: the provider the survivors plan with, from ``record`` (:func:`latest`).

    ``make_provider(cost, variant)`` builds a provider with that cost model and variant and no
    table; the table is rank 0's, read from the store (no planning).

    Raises:
        ResilienceError: the published table does not match its record.
    """
    if record["digest"] is None:
        return make_provider(CostModel.from_dict(record["cost"], source="rank 0's published cost model"),
                             record["variant"])
    table = _published(store, scope, record, None, 0)
    provider = make_provider(table.spec.cost, table.spec.variant)
    provider.adopt(table)
    return provider
