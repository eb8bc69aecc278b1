"""Fault injection for tests and demos: a worker kills or freezes itself at a named point.

``resilience.fault_injection`` lists ``{rank, step, point, kind}`` entries; the environment
variable ``DSR_FAULTS`` (a JSON list of the same objects) replaces that list, so a test or demo can
inject faults without writing a config. The engine calls :meth:`FaultInjector.maybe_fire` at each
point of each iteration; a matching entry fires once:

``exit``     ``os._exit(17)`` (a crash with an exit status, no cleanup)
``sigkill``  SIGKILL to itself (death by signal)
``hang``     SIGSTOP to itself: every thread stops, heartbeats included; the agent detects the
             silence and kills the process (if someone sends SIGCONT instead, training resumes)
``stall``    the main thread stops in place (as in a kernel that never returns or a wait on a
             device), its other threads run on: the heartbeat thread beats until hang detection
             by progress (``detector.stall_timeout_s``, ``runtime/progress.py``) stops it
``lose_machine``  the machine is lost: its host memory (the in-memory snapshots of every rank on
             it, ``lose_memory`` callback) is wiped, then SIGKILL as above
``delay``    a straggler: the main thread sleeps the fault's ``seconds``, then goes on (kept below
             ``detector.stall_timeout_s``, it slows its peers without failing anyone)

Faults fire only in the first incarnation of a rank of the first attempt (``DSR_INCARNATION`` and
``DSR_RESTART`` unset or 0), so a worker the agent relaunched does not kill itself again at the
same step.
"""

from __future__ import annotations

import os
import signal
import time
import sys
from typing import Callable, Mapping, Sequence

from ..config import FAULT_KINDS, FAULT_POINTS, FaultInjection
from ..errors import ResilienceError
from ..launch import FAULTS_VAR, LaunchEnv, faults_from_env
from ..logs import get_logger

log = get_logger(__name__)

__all__ = ["FaultInjector", "FaultPointError", "faults_from_env", "EXIT_CODE", "ENV_VAR"]

EXIT_CODE = 17
ENV_VAR = FAULTS_VAR


class FaultPointError(ResilienceError, ValueError):
    """:meth:`FaultInjector.maybe_fire` was called with a point that is not in ``FAULT_POINTS``."""


class FaultInjector:
    """Fires the faults of one rank at their (step, point), each at most once.

    Args:
        faults: all configured faults (every rank's); ``DSR_FAULTS`` replaces them when set.
        rank: this process's global rank.
        launch: the agent's contract (its ``faults`` replace ``faults``; it arms the injector only
            in the first incarnation of the first attempt).
        env: for a process not launched by the agent (tests): an environment to read
            ``DSR_FAULTS``, ``DSR_INCARNATION`` and ``DSR_RESTART`` from (default: none).
        on_fire: called with the fault just before it fires (e.g. to flush logs or record the time).
        kill: how a signal is sent to this process (``os.kill``; replaceable in tests).
        lose_memory: wipes this machine's host memory for ``lose_machine`` (default: nothing to wipe).
    """

    def __init__(self, faults: Sequence[FaultInjection], rank: int, *, launch: LaunchEnv | None = None,
                 env: Mapping[str, str] | None = None, on_fire: Callable[[FaultInjection], None] | None = None,
                 kill: Callable[[int, int], None] = os.kill,
                 lose_memory: Callable[[], None] | None = None) -> None:
        if launch is not None:
            override, self.incarnation, self.restart = launch.faults, launch.incarnation, launch.restart
        else:
            env = {} if env is None else env
            override = faults_from_env(env)
            self.incarnation = int(env.get("DSR_INCARNATION", "0") or 0)
            self.restart = int(env.get("DSR_RESTART", "0") or 0)
        chosen = tuple(faults) if override is None else override
        self.rank = rank
        self.armed = self.incarnation == 0 and self.restart == 0
        self.lose_memory = lose_memory
        self._pending = {(f.step, f.point): f for f in chosen if f.rank == rank}
        self._on_fire = on_fire
        self._kill = kill
        self.fired: list[FaultInjection] = []
        self._slow: tuple[int, int, float] | None = None  # (first slow step, first at full speed again, speed)

    @property
    def pending(self) -> tuple[FaultInjection, ...]:
        """This rank's faults that have not fired yet."""
        return tuple(self._pending.values())

    def maybe_fire(self, point: str, step: int) -> None:
        """Fire this rank's fault for (``step``, ``point``) if there is one that has not fired.

        ``exit`` and ``sigkill`` never return; ``hang`` returns only if the process is continued;
        ``delay`` returns after its seconds.

        Raises:
            FaultPointError: ``point`` is not one of ``FAULT_POINTS``.
        """
        if point not in FAULT_POINTS:
            raise FaultPointError(f"unknown fault point {point!r}; allowed: {', '.join(FAULT_POINTS)}")
        if not self.armed or not self._pending:
            return
        fault = self._pending.pop((step, point), None)
        if fault is None:
            return
        self.fired.append(fault)
        log.warning("injecting %s at step %s %s on rank %s", fault.kind, step, point, self.rank)
        if self._on_fire is not None:
            self._on_fire(fault)
        sys.stdout.flush()
        if fault.kind == "slow":
            self._slow = (step, step + (fault.steps or 1), fault.speed or 1.0)
            return
        self._fire(fault.kind, fault.seconds)

    def speed(self, step: int) -> float:
        """The fraction of its own speed at which this worker's forward and backward passes run in
        iteration ``step`` (a ``slow`` fault that fired and has not run out; else 1)."""
        if self._slow is None or not self._slow[0] <= step < self._slow[1]:
            return 1.0
        return self._slow[2]

    def _fire(self, kind: str, seconds: float | None = None) -> None:
        if kind == "delay":
            time.sleep(seconds or 0.0)
        elif kind == "exit":
            os._exit(EXIT_CODE)
        elif kind == "sigkill":
            self._kill(os.getpid(), signal.SIGKILL)  # delivered before kill() returns
        elif kind == "hang":
            self._kill(os.getpid(), signal.SIGSTOP)
        elif kind == "stall":
            while True:  # only this thread: the heartbeat thread and the watcher run on
                time.sleep(0.05)
        elif kind == "lose_machine":
            if self.lose_memory is not None:
                self.lose_memory()
            self._kill(os.getpid(), signal.SIGKILL)
        else:  # pragma: no cover - FaultInjection validates kinds
            raise FaultPointError(f"unknown fault kind {kind!r}; allowed: {', '.join(FAULT_KINDS)}")
