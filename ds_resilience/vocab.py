"""The project's vocabulary: the names of schedules, planner variants and solvers, fault points
and fault kinds, defined once.

Layer L0, pure Python with no imports: the config schema (:mod:`ds_resilience.config`), the
generators and the planner (:mod:`ds_resilience.planning`), the command line and the fault
injector all take their choices from here.
"""

from __future__ import annotations

__all__ = ["SCHEDULES", "VARIANTS", "VARIANT_CHOICES", "SOLVERS", "FAULT_POINTS", "ITERATION_POINTS", "FAULT_KINDS"]

SCHEDULES = ("1f1b", "decoupled")
"""Fault-free schedules :func:`ds_resilience.planning.generate` builds."""

VARIANTS = ("adaptive", "decoupled", "recycle")
"""Planner variants: re-routing only; + decoupled backward; + staggered optimizer."""

VARIANT_CHOICES = VARIANTS + ("auto",)
"""What a user may ask for: a variant, or ``auto``: per failure set, the variant the cost model (a
profile) predicts fastest within the memory cap."""

SOLVERS = ("heuristic", "cpsat")
"""Planner solvers: list scheduling only, or CP-SAT warm-started from it."""

ITERATION_POINTS = ("before_forward", "mid_backward", "in_reduce", "in_optimizer")
"""The fault points every iteration passes, in order."""

FAULT_POINTS = ITERATION_POINTS + ("in_recovery", "in_snapshot", "in_rejoin", "in_replan")
"""Where an injected fault fires: four points of an iteration; while a survivor applies a recovery
plan (step: the resume step); right after a snapshot was handed to the background copy, while it
drains into host memory (step: the snapshot's); on a donor, right before it hands its state to a
re-joining worker (step: the resume step); while the plans are rebuilt after the profile, on the
publisher once it has announced the build, on every other rank before it waits for it (step: the
last step of the profile)."""

FAULT_KINDS = ("exit", "sigkill", "hang", "stall", "lose_machine", "delay", "slow")
"""How an injected fault fails the worker (``delay``: a straggler, it goes on after ``seconds``;
``slow``: a fail-slow worker, its forward and backward passes run at ``speed`` for ``steps``
iterations)."""
