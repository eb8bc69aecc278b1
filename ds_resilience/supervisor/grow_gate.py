"""The agent's gate before a grow-back epoch (issue 46, part 2).

After a live re-grid the agent relaunches the ranks it left out; their ``rejoin`` epoch with
``grows`` (``integrations/ds_grow.py``) is published only when :func:`grow_verdict` says ``grow``:

1. every rank the re-grid left out registered again (a rank whose relaunches gave up: ``decline``,
   the first grid cannot be re-formed);
2. every survivor finished applying every epoch so far (``dsr/applied/{rank}``): a grow published
   while one is still re-gridding would interrupt it, and the joiners would meet a grid that is
   not there yet (fresh-clone CI run 6);
3. growing pays: ``planning/grow_back.decide_grow`` on the figures the re-formed grid's lowest rank
   posts after each iteration (``dsr/grow_figures``: ``ds_grow.post_figures``). Not paying, or
   figures that cannot be read: ``decline``.

The agent acts on the verdict (``supervisor/agent.py``): ``wait`` asks again at its next tick.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, NamedTuple

from .. import store_keys as keys
from ..errors import PlanningError
from ..planning.grow_back import decide_grow
from ..runtime import membership as mb

__all__ = ["GrowVerdict", "grow_verdict"]


class GrowVerdict(NamedTuple):
    action: str  # "wait" | "decline" | "grow"
    detail: str  # why (decline), the figures (grow); "" while waiting


def grow_verdict(store: Any, *, left_out: Iterable[int], back: Iterable[int], coming: Callable[[int], bool],
                 survivors: Iterable[int], newest_epoch: int) -> GrowVerdict:
    """The gate (module docstring). ``left_out``: the ranks the re-grid left out (failed);
    ``back``: the relaunched ranks registered now; ``coming(rank)``: whether a rank not back yet is
    still relaunching; ``survivors``: the running ranks of the re-formed grid; ``newest_epoch``: the
    newest epoch published."""
    out = set(left_out) - set(back)
    if out:
        if not any(coming(r) for r in out):
            return GrowVerdict("decline", f"ranks {sorted(out)} are not coming back (their relaunches gave up)")
        return GrowVerdict("wait", "")
    if any(mb.applied(store, r) < newest_epoch for r in survivors):
        return GrowVerdict("wait", "")
    if not store.check([keys.GROW_FIGURES]):
        return GrowVerdict("wait", "")
    try:
        figures = json.loads(store.get(keys.GROW_FIGURES))
        decision = decide_grow(float(figures["small_s"]), float(figures["full_s"]), float(figures["pause_s"]),
                               figures.get("iterations_left"))
    except (ValueError, KeyError, TypeError, PlanningError) as exc:
        return GrowVerdict("decline", f"the re-formed grid's figures are unreadable ({exc})")
    left = "unknown" if decision.iterations_left is None else decision.iterations_left
    detail = (f"small grid {decision.small_s:.3g} s/iteration, first grid {decision.full_s:.3g} s predicted, pause "
              f"{decision.pause_s:.3g} s, iterations left {left} (step {figures.get('step')})")
    if not decision.pays:
        return GrowVerdict("decline", f"growing back does not pay: {detail}")
    return GrowVerdict("grow", f"growing back pays: {detail}")
