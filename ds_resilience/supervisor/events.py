"""The agent's record: what it saw and did (:class:`AgentEvent`), and the table it prints at exit.

The table (:func:`event_table`) is the agent's last message on stderr: its exit code and why, then
one line per event with its time since the agent started, rank, epoch and latency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["AgentEvent", "event_table"]


@dataclass(frozen=True, kw_only=True)
class AgentEvent:
    """Something the agent saw or did. ``latency_s``: for a crash, from the exit being observable to
    the epoch's publication; for a hang, the silence since the last heartbeat change; for a
    register, from the relaunch to the registration (the re-join epoch is published then); for a
    rejoin, from the relaunch to the survivors admitting the worker (it trains with them from then
    on). A relaunched worker that registered but was never admitted (training ended first) has a
    register and an exit, no rejoin."""

    time: float  # time.time()
    kind: str  # start | crash | hang | node | nodelost | nodeback | stop | relaunch | register | rejoin | slow | grow | grow_declined | exit | killed | giveup | cancel
    rank: int | None = None
    epoch: int | None = None
    latency_s: float | None = None
    detail: str = ""


def event_table(events: Iterable[AgentEvent], t0: float, exit_code: int | None, message: str) -> str:
    """The agent's summary: ``[ds_resilience agent] exit code N: message``, the column header, and
    one line per event (``t0``: the agent's start, ``time.time()``)."""
    lines = [f"[ds_resilience agent] exit code {exit_code}: {message}",
             "   time  event     rank  epoch  latency  detail"]
    for e in events:
        lat = f"{e.latency_s:7.3f}s" if e.latency_s is not None else "       -"
        lines.append(f"{e.time - t0:6.2f}s  {e.kind:<8}  {'-' if e.rank is None else e.rank:>4}  "
                     f"{'-' if e.epoch is None else e.epoch:>5}  {lat}  {e.detail}")
    return "\n".join(lines)
