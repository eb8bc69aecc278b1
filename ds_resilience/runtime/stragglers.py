"""Stragglers: a worker whose forward and backward passes stay slower than its stage peers'.

At scale the worker that slows a job is more common than the one that dies (fail-slow: a throttled
GPU, a noisy neighbour, a degraded link). Every worker already times every action of its schedule
(``IterationStats.durations``); after each iteration it publishes its *pace*, the seconds of
forward and backward compute per micro-batch it ran, in one store ``set`` that overwrites the last
(``dsr/{session}/pace/{rank}``: no extra synchronisation, no key left per iteration). The reporting
rank (the first alive) reads the alive workers' paces in one ``multi_get`` and feeds
:class:`StragglerDetector`, which holds each worker's *fastest* pace over the last ``window``
iterations against the fastest of its stage peers': noise on a shared machine only ever adds time,
so the fastest is what a worker can do, and a slow worker is slow in every iteration of the window.
A worker above ``1 + margin`` times its peers' pace is reported slow, with its measured speed (the
peers' pace over its own); below ``1 + margin / 2`` it is reported recovered. One log line and one
monitor event per decision. Stages are compared with themselves only: their work differs.

Under the agent each decision also asks for a switch of schedule (:func:`request_switch`): the
reporting rank posts every worker slow now with its speed (an ``epochs.SlowRequest``), the agent
publishes a ``slow`` epoch, and every rank applies it at its next iteration boundary
(``runtime/recovery.py``): the weighted plan for those speeds, or, once none is slow, the schedule
of the failed set.

The detector is pure Python (no torch); :class:`StragglerWatch` is its store plumbing.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .. import store_keys as keys
from ..epochs import SlowRequest

__all__ = ["Straggler", "StragglerDetector", "StragglerWatch", "pace_of", "replans", "request_switch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    """One decision: ``rank`` (of ``stage``) became slow (``slow=True``) or recovered, at
    ``iteration``, running at ``speed`` of its stage peers' fastest (their pace over its own)."""

    rank: int
    stage: int
    iteration: int
    slow: bool
    speed: float
    pace_s: float
    peers_pace_s: float

    def line(self) -> str:
        what = "is slow" if self.slow else "recovered"
        return (f"rank {self.rank} (stage {self.stage}) {what} at iteration {self.iteration}: its forward and "
                f"backward passes run at {self.speed:.2f}x its stage peers' ({1e3 * self.pace_s:.1f} ms a "
                f"micro-batch against {1e3 * self.peers_pace_s:.1f} ms, fastest of the last iterations)")


class StragglerDetector:
    """Decides who is slow from the paces it is fed (see the module docstring).

    Args:
        window: iterations of pace held per worker (its fastest counts), >= 2.
        margin: slow above ``1 + margin`` times the stage peers' fastest; recovered below
            ``1 + margin / 2``.
    """

    def __init__(self, window: int = 5, margin: float = 0.3) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not margin > 0:
            raise ValueError(f"margin must be > 0, got {margin}")
        self.window, self.margin = window, margin
        self._paces: dict[int, deque[tuple[int, float]]] = {}
        self._stage: dict[int, int] = {}
        self.slow: dict[int, float] = {}  # rank -> speed, while reported slow

    def observe(self, rank: int, stage: int, iteration: int, pace_s: float) -> None:
        """``rank``'s pace at ``iteration`` (a repeated iteration is ignored)."""
        history = self._paces.setdefault(rank, deque(maxlen=self.window))
        self._stage[rank] = stage
        if history and history[-1][0] >= iteration:
            return
        history.append((iteration, pace_s))

    def retain(self, ranks: Iterable[int]) -> None:
        """Only ``ranks`` are alive now: the others are forgotten (see :meth:`forget`)."""
        keep = set(ranks)
        for rank in [r for r in self._stage if r not in keep]:
            self.forget(rank)

    def forget(self, rank: int) -> None:
        """``rank`` left (failed): its paces go; a slow mark is dropped without a decision."""
        self._paces.pop(rank, None)
        self._stage.pop(rank, None)
        self.slow.pop(rank, None)

    def _fastest(self, rank: int) -> float | None:
        history = self._paces.get(rank)
        if not history or len(history) < self.window:
            return None  # a full window first: one iteration is noise
        return min(p for _, p in history)

    def decide(self, iteration: int) -> list[Straggler]:
        """The decisions the paces so far make (each state change once)."""
        out = []
        for rank in sorted(self._paces):
            mine = self._fastest(rank)
            stage = self._stage[rank]
            peers = [f for r in self._paces if r != rank and self._stage[r] == stage
                     and (f := self._fastest(r)) is not None]
            if mine is None or not peers or mine <= 0:
                continue
            ref = min(peers)
            ratio = mine / ref if ref > 0 else 1.0
            if rank not in self.slow and ratio > 1 + self.margin:
                self.slow[rank] = 1 / ratio
                out.append(Straggler(rank=rank, stage=stage, iteration=iteration, slow=True, speed=1 / ratio,
                                     pace_s=mine, peers_pace_s=ref))
            elif rank in self.slow and ratio < 1 + self.margin / 2:
                del self.slow[rank]
                out.append(Straggler(rank=rank, stage=stage, iteration=iteration, slow=False, speed=1 / ratio,
                                     pace_s=mine, peers_pace_s=ref))
        return out


def pace_of(durations: Mapping[str, Iterable[float]], forwards: int) -> float | None:
    """Seconds of forward and backward compute per micro-batch (``None``: no forward ran)."""
    if forwards <= 0:
        return None
    return sum(sum(durations.get(code, ())) for code in ("F", "B", "W", "BW")) / forwards


def replans(setting: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether a worker found slow switches the job's schedule: ``detector.straggler_replan``, or
    when null, yes unless ``DSR_STRAGGLER_REPLAN=0`` is in the environment (the test suite's)."""
    if setting is not None:
        return bool(setting)
    environ = os.environ if environ is None else environ
    return environ.get("DSR_STRAGGLER_REPLAN", "1") != "0"


def request_switch(store: Any, speeds: Mapping[int, float], reason: str = "") -> SlowRequest:
    """Ask the agent for a ``slow`` epoch with ``speeds`` (every worker slow now, by grid rank; empty:
    none any more), rounded to hundredths: the request is numbered with an ``add`` on the store (a
    new reporting rank's requests come after its predecessor's) and posted in one ``set``."""
    rounded = {r: min(0.99, max(0.01, round(float(v), 2))) for r, v in speeds.items()}
    request = SlowRequest(seq=int(store.add(keys.SLOW_REQUEST_SEQ, 1)), speeds=tuple(rounded.items()), reason=reason)
    store.set(keys.SLOW_REQUEST, request.to_json())
    return request


class StragglerWatch:
    """The store side: every worker publishes its pace; the reporting rank decides.

    Args:
        store: the agent's store; ``session``: the live stage's session (the keys' prefix).
        rank: this worker's global rank.
        members: ``() -> {rank: stage}`` of the alive workers now (the current generation).
        window, margin: :class:`StragglerDetector`'s.
        on_decision: called with each decision on the reporting rank (after it is logged).
        switch: after the iteration's decisions, ask the agent to switch the schedule to the workers
            slow now (:func:`request_switch`, once per iteration that decided something).
        hold: iterations after a switch request before the next one (``detector.straggler_hold``):
            a worker that a busy machine makes slow and fast by turns would otherwise switch the
            job's schedule back and forth, each switch an epoch that replays the iteration in flight.
            Decisions are still logged at once; the switch follows the newest state when the hold
            ends, and none if the state came back to what was last requested.
    """

    def __init__(self, store: Any, session: str, rank: int, members: Callable[[], Mapping[int, int]], *,
                 window: int, margin: float, on_decision: Callable[[Straggler], None] | None = None,
                 switch: bool = False, hold: int = 0) -> None:
        if hold < 0:
            raise ValueError(f"hold must be >= 0 iterations, got {hold!r}")
        self.store, self.session, self.rank, self.members = store, session, rank, members
        self.switch, self.hold = switch, hold
        self.requests: list[SlowRequest] = []
        self._requested: frozenset[int] = frozenset()  # the slow ranks of the last request
        self._requested_at: int | None = None  # the iteration of the last request
        self._pending: list[Straggler] = []  # decisions since the last request (its reason)
        self.detector = StragglerDetector(window, margin)
        self.on_decision = on_decision
        self.decisions: list[Straggler] = []

    def after_iteration(self, iteration: int, durations: Mapping[str, Iterable[float]], forwards: int) -> None:
        """Publish this worker's pace; on the reporting rank, read everyone's and decide."""
        pace = pace_of(durations, forwards)
        if pace is not None:
            self.store.set(keys.pace(self.session, self.rank), f"{iteration} {pace!r}")
        members = dict(self.members())
        if not members or self.rank != min(members):
            return
        self.detector.retain(members)
        ranks = sorted(members)
        wanted = [keys.pace(self.session, r) for r in ranks]
        if self.store.check(wanted):  # one round trip in the usual case: everyone published
            present = ranks
        else:
            present = [r for r, k in zip(ranks, wanted) if self.store.check([k])]
        if not present:
            return
        values = self.store.multi_get([keys.pace(self.session, r) for r in present])
        for rank, raw in zip(present, values):
            it, _, value = raw.decode().partition(" ")
            self.detector.observe(rank, members[rank], int(it), float(value))
        decided = self.detector.decide(iteration)
        for decision in decided:
            self.decisions.append(decision)
            log.warning("%s", decision.line())
            if self.on_decision is not None:
                self.on_decision(decision)
        if decided:
            self._pending.extend(decided)
        if self.switch:
            self._maybe_request(iteration)

    def _maybe_request(self, iteration: int) -> None:
        """Ask for the switch to the slow set now, unless it is what was last asked for or the hold
        since the last request has not passed."""
        slow = frozenset(self.detector.slow)
        if slow == self._requested:
            self._pending.clear()  # back where the last request left it: nothing to switch
            return
        if self._requested_at is not None and iteration - self._requested_at < self.hold:
            return
        reason = "; ".join(f"rank {d.rank} {'slow' if d.slow else 'recovered'} at iteration {d.iteration}"
                           for d in self._pending)
        self.requests.append(request_switch(self.store, self.detector.slow, reason))
        self._requested, self._requested_at = slow, iteration
        self._pending.clear()
