"""The snapshot interval, one schedule for the whole job.

Each rank measures its own capture stall and may need a longer interval than the configured one
(``resilience.checkpoint.stall_budget``). If each rank stretched its own interval, ranks would
capture different steps, and a rollback, a restore from memory or a re-grid, which all need one
step held for every rank, could find none (a rank that captures every 2nd step holds 6 and 4
while its peers hold 7 and 6: only 6, and after one lagging copy nothing). So the interval is a
job-wide schedule, kept in the agent's store under one key: the needs each rank posted and a list
of changes ``(first step, interval)``.

* A rank whose need changes posts it and, when the largest need differs from the interval in
  force, appends a change that takes effect ``LEAD`` steps after its own step (one atomic
  compare-and-set: two ranks changing it at once both land, in order).
* A failed rank's need leaves the schedule when the survivors learn of the failure
  (:meth:`SnapshotInterval.forget`), with a change ``LEAD`` steps ahead where that lowers the
  largest need.
* Every rank reads the schedule once per step, before it decides whether that step is captured.
  Ranks are at most about one iteration apart, so ``LEAD`` steps leave every rank time to read a
  change before the first step it governs, and the steps a replay after a rollback evaluates again
  get the same answer.

Without a store (one process, tests), the schedule is this rank's own and a change takes effect at
the next step.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .. import store_keys

__all__ = ["LEAD", "SnapshotInterval"]

LEAD = 4
"""Steps between the step a change is made at and the first step it governs."""

logger = logging.getLogger("ds_resilience.checkpoint")


class SnapshotInterval:
    """Which steps are captured, the same answer on every rank (module docstring).

    Args:
        base: the configured interval (``resilience.checkpoint.interval``); every need is a
            multiple of it.
        store: the agent's store (``None``: this rank's own schedule).
        key: the schedule's key in ``store``, the same on every rank of one attempt.
        rank: this rank (its need is posted under it).
    """

    def __init__(self, base: int, *, store: Any = None, key: str = store_keys.snapshot_interval(), rank: int = 0) -> None:
        if base < 1:
            raise ValueError(f"the snapshot interval must be >= 1, got {base}")
        self.base, self.store, self.key, self.rank = base, store, key, rank
        self.changes: list[tuple[int, int]] = []  # (first step, interval), first steps increasing
        self.need = base  # posted only once it departs from the base: most jobs never write the key
        self._read_for = -1  # the newest step the store was read for

    def at(self, step: int) -> int:
        """The interval in force at ``step``."""
        self._refresh(step)
        interval = self.base
        for first, value in self.changes:
            if first > step:
                break
            interval = value
        return interval

    def due(self, step: int) -> bool:
        """Whether step ``step`` is captured (step 0, the initial state, always is)."""
        return step % self.at(step) == 0

    def request(self, need: int, step: int) -> None:
        """This rank needs an interval of ``need`` (measured after step ``step``)."""
        if need < 1 or need % self.base:
            raise ValueError(f"a snapshot interval need must be a positive multiple of {self.base}, got {need}")
        if need == self.need:
            return
        self.need = need
        if self.store is None:
            if need != self.at(step + 1):
                self.changes = [c for c in self.changes if c[0] <= step] + [(step + 1, need)]
            return
        state = self._update(lambda s: self._with_need(s, need, step))
        self.changes = [tuple(c) for c in state["changes"]]

    def forget(self, ranks) -> None:
        """Ranks that failed: their needs leave the schedule, so a dead rank's slow captures no
        longer stretch the survivors' interval. A change that follows takes effect ``LEAD`` steps
        after the newest step this rank read. Every survivor may call it; after the first, the
        others find nothing to drop."""
        gone = {str(r) for r in ranks} - {str(self.rank)}
        if self.store is None or not gone or not self.store.check([self.key]):
            return
        step = max(self._read_for, 0)

        def drop(state: dict) -> dict:
            needs = state.get("needs", {})
            if not gone & needs.keys():
                return state
            return self._with_need({**state, "needs": {r: n for r, n in needs.items() if r not in gone}}, None, step)

        state = self._update(drop)
        self.changes = [tuple(c) for c in state.get("changes", [])]

    def _with_need(self, state: dict, need: int | None, step: int) -> dict:
        """``state`` with this rank's need set to ``need`` (``None``: needs unchanged) and a change
        appended if the largest need differs from the interval in force."""
        needs = dict(state.get("needs", {}))
        if need is not None:
            needs[str(self.rank)] = need
        changes = [list(c) for c in state.get("changes", [])]
        wanted = max(needs.values(), default=self.base)
        first = max(step + LEAD, changes[-1][0] + 1 if changes else 0)
        current = changes[-1][1] if changes else self.base
        if wanted != current:
            changes.append([first, wanted])
            logger.info("rank %d: snapshot interval %d -> %d from step %d (largest need of %d ranks%s)",
                        self.rank, current, wanted, first, len(needs), "" if need is not None else ", failed ranks' dropped")
        return {"needs": needs, "changes": changes}

    def _update(self, change) -> dict:
        """Read-modify-write the schedule atomically (compare-and-set, retried on a race)."""
        while True:
            old = self.store.get(self.key) if self.store.check([self.key]) else b""
            state = json.loads(old) if old else {}
            new = json.dumps(change(state), sort_keys=True).encode()
            if self.store.compare_set(self.key, old, new) == new:
                return json.loads(new)

    def _refresh(self, step: int) -> None:
        if self.store is None or step <= self._read_for:
            return
        self._read_for = step
        if self.store.check([self.key]):
            self.changes = [tuple(c) for c in json.loads(self.store.get(self.key)).get("changes", [])]
