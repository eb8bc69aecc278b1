"""The project's vocabulary: the names of schedules, planner variants and solvers, fault points
and fault kinds, defined once.

Layer L0, pure Python with no imports: the config schema (:mod:`ds_resilience.config`), the
generators and the planner (:mod:`ds_resilience.planning`), the command line and the fault
injector all take their choices from here.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "VARIANTS", "SOLVERS", "FAULT_POINTS", "FAULT_KINDS"]

SCHEDULES = ("1f1b", "decoupled")
"""Fault-free schedules :func:`ds_resilience.planning.generate` builds."""

VARIANTS = ("adaptive", "decoupled", "recycle")
"""Planner variants: re-routing only; + decoupled backward; + staggered optimizer."""

SOLVERS = ("heuristic", "cpsat")
"""Planner solvers: list scheduling only, or CP-SAT warm-started from it."""

FAULT_POINTS = ("before_forward", "mid_backward", "in_reduce", "in_optimizer")
"""Where in an iteration an injected fault fires."""

FAULT_KINDS = ("exit", "sigkill", "hang", "lose_machine")
"""How an injected fault fails the worker."""
