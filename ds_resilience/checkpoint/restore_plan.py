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
    """The step every rank restores, and per rank ``(source, holder rank or None, snapshot owner)``:
    the owner is the rank itself, or a data-parallel peer of its stage whose state is identical."""

    step: int
    sources: dict[int, tuple[str, int | None, int]]

    def transfers(self) -> list[tuple[int, int, int]]:
        """``(holder, rank, snapshot owner)`` of the peer transfers, in the order every rank runs them."""
        return sorted(((h, r, o) for r, (s, h, o) in self.sources.items() if s == PEER), key=lambda t: (t[1], t[0]))


def plan_restore(world: int, memory: Mapping[int, Mapping[int, Sequence[int]]],
                 persistent: Mapping[int, Sequence[int]] | None = None,
                 machine_of: Mapping[int, int] | None = None,
                 stage_of: Mapping[int, int] | None = None) -> RestorePlan:
    """Choose the restore step and sources.

    Args:
        world: ranks ``0..world-1``, each the owner of one snapshot series.
        memory: ``memory[h][o]``: the steps of owner ``o`` that rank ``h``'s machine holds.
        persistent: ``persistent[o]``: the steps of owner ``o`` on disk.
        machine_of: rank -> machine; ranks on one machine share its memory (default: one rank each).
        stage_of: rank -> pipeline stage, when the data-parallel replicas of a stage hold identical
            states (no sharded optimizer): then any replica's snapshot restores every replica, so a
            stage is covered while any of its snapshots survives. ``None``: every rank is unique.

    Raises:
        CheckpointError: some rank's snapshot exists nowhere (naming the ranks).
    """
    persistent = persistent or {}
    machine_of = machine_of or {r: r for r in range(world)}
    stage_of = stage_of or {r: r for r in range(world)}
    in_memory: dict[int, set[int]] = {o: set() for o in range(world)}
    for holdings in memory.values():
        for o, steps in holdings.items():
            if o in in_memory:
                in_memory[o].update(steps)
    on_disk = {o: set(persistent.get(o, ())) for o in range(world)}
    peers = {r: [q for q in range(world) if stage_of[q] == stage_of[r]] for r in range(world)}
    covered = {r: set().union(*(in_memory[q] | on_disk[q] for q in peers[r])) for r in range(world)}
    candidates = set.intersection(*covered.values()) if world else set()
    if not candidates:
        missing = [r for r in range(world) if not covered[r]]
        detail = (f"ranks {missing} have no snapshot in any host memory or on disk" if missing
                  else "no step is held for every rank at once")
        raise CheckpointError(f"cannot restore: {detail}; memory holds "
                              + ", ".join(f"rank {o}: {sorted(in_memory[o])}" for o in range(world))
                              + "; disk holds " + ", ".join(f"rank {o}: {sorted(on_disk[o])}" for o in range(world)))
    step = max(candidates)
    sources: dict[int, tuple[str, int | None, int]] = {}
    for r in range(world):
        owners = [r] + [q for q in peers[r] if q != r]  # its own snapshot first
        choice = None
        for o in owners:  # host memory of its own machine
            local = [h for h, held in memory.items() if machine_of.get(h) == machine_of[r] and step in held.get(o, ())]
            if local:
                choice = (LOCAL, min(local), o)
                break
        for o in owners if choice is None else ():  # a peer's memory
            holders = sorted(h for h, held in memory.items() if step in held.get(o, ()))
            if holders:
                choice = (PEER, holders[0], o)
                break
        for o in owners if choice is None else ():  # disk
            if step in on_disk[o]:
                choice = (PERSISTENT, None, o)
                break
        sources[r] = choice
    return RestorePlan(step, sources)
