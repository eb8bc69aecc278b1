"""Which step to restore and where each rank's snapshot comes from (pure: no torch, no processes).

Every rank reports the verified versions its machine holds (its own and its peers' replicas);
the persistent tier reports what it holds on disk. The restore step is the newest one that *every*
rank's snapshot has somewhere, preferring host memory; each rank then takes it from the cheapest
source: its own machine's memory (a software failure), else the lowest-ranked peer holding it (a
lost machine), else disk (every holder lost). Memory wins a tie with disk at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .store import CheckpointError

__all__ = ["LOCAL", "PEER", "PERSISTENT", "RestorePlan", "plan_restore"]

LOCAL, PEER, PERSISTENT = "local", "peer", "persistent"


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores, and per rank ``(source, holder rank or None)``."""

    step: int
    sources: dict[int, tuple[str, int | None]]

    def count(self, source: str) -> int:
        return sum(1 for s, _ in self.sources.values() if s == source)

    def transfers(self) -> list[tuple[int, int]]:
        """``(holder, owner)`` pairs of peer transfers, in the order every rank executes them."""
        return sorted(((h, o) for o, (s, h) in self.sources.items() if s == PEER), key=lambda t: (t[1], t[0]))


def plan_restore(world: int, memory: Mapping[int, Mapping[int, Sequence[int]]],
                 persistent: Mapping[int, Sequence[int]] | None = None,
                 machine_of: Mapping[int, int] | None = None) -> RestorePlan:
    """Choose the restore step and sources.

    Args:
        world: ranks ``0..world-1``, each the owner of one snapshot series.
        memory: ``memory[h][o]``: the steps of owner ``o`` that rank ``h``'s machine holds.
        persistent: ``persistent[o]``: the steps of owner ``o`` on disk.
        machine_of: rank -> machine; ranks on one machine share its memory (default: one rank each).

    Raises:
        CheckpointError: some rank's snapshot exists nowhere (naming the ranks).
    """
    persistent = persistent or {}
    machine_of = machine_of or {r: r for r in range(world)}
    in_memory: dict[int, set[int]] = {o: set() for o in range(world)}
    for holdings in memory.values():
        for o, steps in holdings.items():
            if o in in_memory:
                in_memory[o].update(steps)
    on_disk = {o: set(persistent.get(o, ())) for o in range(world)}
    candidates = set.intersection(*(in_memory[o] | on_disk[o] for o in range(world))) if world else set()
    if not candidates:
        missing = [o for o in range(world) if not in_memory[o] and not on_disk[o]]
        detail = (f"ranks {missing} have no snapshot in any host memory or on disk" if missing
                  else "no step is held for every rank at once")
        raise CheckpointError(f"cannot restore: {detail}; memory holds "
                              + ", ".join(f"rank {o}: {sorted(in_memory[o])}" for o in range(world))
                              + "; disk holds " + ", ".join(f"rank {o}: {sorted(on_disk[o])}" for o in range(world)))
    step = max(candidates)
    sources: dict[int, tuple[str, int | None]] = {}
    for o in range(world):
        holders = sorted(h for h, held in memory.items() if step in held.get(o, ()))
        local = [h for h in holders if machine_of.get(h) == machine_of[o]]
        if local:
            sources[o] = (LOCAL, o)
        elif holders:
            sources[o] = (PEER, holders[0])
        else:
            sources[o] = (PERSISTENT, None)
    return RestorePlan(step, sources)
