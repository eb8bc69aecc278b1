"""Which ranks send their snapshots to which: Gemini's placement over the machines still alive.

Ranks ``r`` live on machine ``r // ranks_per_machine``. The machines with at least one rank not
``gone`` are sorted by ``machine_key`` (of their first rank; consecutive ones form a placement
group, ``planning/placement.py``) and placed with ``min(replicas, alive machines)`` copies. Rank
``r``'s replicas go to one alive rank on each other machine that holds its machine's snapshots: the
rank with its local index when that one is alive, else the alive rank at that index modulo the
machine's alive ranks. A replica never lands on the owner's own machine (its own copy is there
already) and never on a gone rank.

When a replica target fails, :func:`replica_targets` over the grown ``gone`` set is the new
placement (``inmemory.py`` switches the replicator to it at the next iteration boundary), so a
second failure finds every survivor's newest snapshot on another machine again. Pure: no torch, no
processes; every rank computes the same map from the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import ConfigError
from ..planning.placement import place

__all__ = ["RankTargets", "replica_targets"]


@dataclass(frozen=True, kw_only=True)
class RankTargets:
    """One rank's part of a placement: the ranks it sends its snapshots to and receives from."""

    send_to: tuple[int, ...]
    recv_from: tuple[int, ...]


def replica_targets(world: int, ranks_per_machine: int, replicas: int, *, gone: Iterable[int] = (),
                    machine_key: Callable[[int], Any] | None = None) -> dict[int, RankTargets]:
    """The placement of every rank not in ``gone`` (see the module docstring).

    Args:
        world: ranks ``0..world-1``.
        ranks_per_machine: ranks that share a machine (and its host memory).
        replicas: copies of each snapshot, the owner's own included.
        gone: ranks that neither send nor receive replicas any more (failed, lost before a re-grid).
        machine_key: sort key of a machine, given its first rank (default: the machine index).

    Raises:
        ConfigError: ``ranks_per_machine`` does not divide ``world``, or ``replicas`` < 1.
    """
    if ranks_per_machine < 1 or world % ranks_per_machine:
        raise ConfigError("resilience.checkpoint.ranks_per_machine",
                          f"{ranks_per_machine} ranks per machine do not divide the world size {world}; "
                          f"allowed: a divisor of {world}")
    if replicas < 1:
        raise ConfigError("resilience.checkpoint.replicas", f"must be at least 1, got {replicas}")
    dead = set(gone)
    rpm = ranks_per_machine
    alive_on = {m: [r for r in range(m * rpm, (m + 1) * rpm) if r not in dead] for m in range(world // rpm)}
    machines = sorted((m for m, rs in alive_on.items() if rs),
                      key=lambda m: (m if machine_key is None else machine_key(m * rpm), m))
    send: dict[int, list[int]] = {r: [] for rs in alive_on.values() for r in rs}
    if machines:
        placement = place(len(machines), min(replicas, len(machines)))
        for pos, m in enumerate(machines):
            # the machines paired with ``m`` (as the engine has always read the placement: for a
            # ring, the mirror image of ``Placement.holders``, equally likely to survive)
            holders = [machines[h] for h in placement.stored_on(pos) if machines[h] != m]
            for r in alive_on[m]:
                local = r % rpm
                for h in holders:
                    there = alive_on[h]
                    target = h * rpm + local if h * rpm + local in there else there[local % len(there)]
                    send[r].append(target)
    recv: dict[int, list[int]] = {r: [] for r in send}
    for r, targets in send.items():
        for t in targets:
            recv[t].append(r)
    return {r: RankTargets(send_to=tuple(sorted(send[r])), recv_from=tuple(sorted(recv[r]))) for r in send}
