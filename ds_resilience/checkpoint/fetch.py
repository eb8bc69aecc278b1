"""Fetch dead ranks' snapshots from whichever machine holds them (ZeRO-1's lost optimizer shards).

:func:`fetch_versions` is a collective over the survivors' group: every rank reports which of the
wanted versions its machine's host memory holds, and each wanted version goes to the rank that
needs it, read from its own machine when it holds it, else sent by the first holder over the state
transport (checked against its checksum on receipt).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..comm.groups import Group
from ..errors import ResilienceError
from .inmemory import InMemoryCheckpointer

__all__ = ["fetch_versions"]


def fetch_versions(memory: InMemoryCheckpointer | None, owners: Sequence[int], step: int, group: Group, *,
                   receiver_of: Callable[[int], int]) -> dict[int, Any] | None:
    """Version ``step`` of each of ``owners`` (dead ranks), delivered to ``receiver_of(owner)``.

    Collective over ``group`` (every survivor, in the same order). Returns ``{owner: tree}`` for
    the versions this rank received, or ``None`` on every rank when some owner's version is held
    by no survivor's machine.

    Raises:
        ResilienceError: a holder's copy failed its checks on receipt.
    """
    me = group.me
    held = [o for o in owners if memory is not None and memory.holds(o, step)]
    gathered = group.all_gather_json(held)
    holders = {o: [group.ranks[i] for i, h in enumerate(gathered) if o in h] for o in owners}
    if any(not hs for hs in holders.values()):
        return None
    out: dict[int, Any] = {}
    for owner in owners:  # every rank walks the same list: the transfers pair up in order
        to = receiver_of(owner)
        holder = to if to in holders[owner] else holders[owner][0]
        if me == to and holder == to:
            out[owner] = memory.load_peer(owner, step)
        elif me == holder:
            memory.send_peer(owner, to, step, group)
        elif me == to:
            tree = memory.receive_peer(owner, holder, step, group)
            if tree is None:
                raise ResilienceError(f"rank {me}: rank {owner}'s snapshot of step {step} from rank {holder} failed "
                                      f"its checks")
            out[owner] = tree
    return out
