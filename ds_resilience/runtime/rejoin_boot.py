"""A relaunched or restarted worker's start: its default process group is a local stand-in, or
meets under its attempt's prefix.

A worker the agent relaunches to re-join the survivors (``DSR_REJOIN=1``) cannot enter the
original world's rendezvous: the survivors will never meet it there. Before the user's script runs,
its default group is made a local no-op stand-in (:mod:`ds_resilience.comm.standin`) of the launch's rank and world size, so the
script's own ``deepspeed.init_distributed()`` (which keeps an initialized default group) or
``ds_resilience.init_distributed()`` goes on at once; DeepSpeed builds its engine locally, and all
real communication goes through ds_resilience's groups on the agent's store. The agent runs a
fresh-interpreter re-join as ``python -u -m ds_resilience.runtime.rejoin_boot script args``; a
forked one calls :func:`stand_in_if_rejoining` before the script. A worker of a restart
(``DSR_RESTART`` >= 1) starts the same way, for :func:`~.attempt_scope.scope_rendezvous`.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Mapping

from .attempt_scope import restart_of, scope_rendezvous
from .build_locks import guard_build_locks

__all__ = ["needs_boot", "stand_in_default_group", "stand_in_if_rejoining"]


def needs_boot(env: Mapping[str, str]) -> bool:
    """Whether a worker launched with ``env`` must start through this module (a re-join, or a
    restart's worker) rather than as ``python -u script``."""
    return env.get("DSR_REJOIN") == "1" or restart_of(env) > 0


def stand_in_default_group(rank: int, world_size: int) -> bool:
    """Initialize the default group as a local stand-in of ``rank`` in ``world_size`` (returns
    whether it did; a default group already there is kept)."""
    from ..comm.standin import init_stand_in

    return init_stand_in(rank, world_size)


def stand_in_if_rejoining(env: Mapping[str, str] | None = None) -> bool:
    """:func:`stand_in_default_group` for the launch ``env`` describes, under ``DSR_REJOIN=1`` only."""
    env = os.environ if env is None else env
    if env.get("DSR_REJOIN") != "1":
        return False
    return stand_in_default_group(int(env["RANK"]), int(env["WORLD_SIZE"]))


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m ds_resilience.runtime.rejoin_boot SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    stand_in_if_rejoining()
    scope_rendezvous()
    guard_build_locks()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
