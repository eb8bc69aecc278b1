"""Failure normalization: one canonical key per class of failure sets that differ by pipeline labels.

Definition. A failure set F on a ``dp`` x ``pp`` grid is described, per pipeline p, by the set of
its failed stages ``S_p = {s : (p, s) in F}``. Relabelling pipelines by a permutation ``pi``
(``(p, s) -> (pi(p), s)``) permutes the ``S_p`` and changes nothing else: every pipeline holds the
same layers, all replicas of a stage are interchangeable, and the cost model does not depend on the
pipeline index. So the multiset ``{S_p}`` is invariant, and it determines F up to relabelling.

The canonical representative lists the pipelines with failures first, ordered by
``(-len(S_p), sorted(S_p))``, relabelled 0, 1, ...; healthy pipelines follow in their original
order. The key is ``(dp, pp, tuple of sorted(S_p) for the failed pipelines in that order)``.

Two failure sets have the same key exactly when one is a relabelling of the other; a plan made for
the canonical set is mapped to any member of its class by :func:`relabel_schedule`, which renames
pipelines in every action and moves each worker's action list to its renamed index. Stages are
never permuted (positions in a pipeline are not interchangeable). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..ir import Action, Schedule
from ..topology import Worker

__all__ = ["FailureKey", "Normalized", "normalize", "relabel_schedule"]

FailureKey = tuple[int, int, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Normalized:
    """A failure set's canonical form.

    Attributes:
        key: the canonical key (hashable; equal for relabellings of one another).
        canonical: the canonical failure set.
        to_canonical: ``to_canonical[p]`` is the canonical label of original pipeline ``p``.
    """

    key: FailureKey
    canonical: frozenset[Worker]
    to_canonical: tuple[int, ...]

    @property
    def from_canonical(self) -> tuple[int, ...]:
        """Inverse permutation: ``from_canonical[c]`` is the original label of canonical pipeline ``c``."""
        inverse = [0] * len(self.to_canonical)
        for original, canonical in enumerate(self.to_canonical):
            inverse[canonical] = original
        return tuple(inverse)


def normalize(dp: int, pp: int, failed: Iterable[Worker]) -> Normalized:
    """Canonicalize ``failed`` on a ``dp`` x ``pp`` grid (see the module docstring)."""
    per_pipeline: list[list[int]] = [[] for _ in range(dp)]
    for w in failed:
        per_pipeline[w.pipeline].append(w.stage)
    stages = [tuple(sorted(set(s))) for s in per_pipeline]
    with_failures = sorted((p for p in range(dp) if stages[p]), key=lambda p: (-len(stages[p]), stages[p], p))
    healthy = [p for p in range(dp) if not stages[p]]
    order = with_failures + healthy  # canonical label c -> original pipeline order[c]
    to_canonical = [0] * dp
    for c, p in enumerate(order):
        to_canonical[p] = c
    canonical = frozenset(
        Worker(pipeline=to_canonical[p], stage=s) for p in with_failures for s in stages[p]
    )
    key: FailureKey = (dp, pp, tuple(stages[p] for p in with_failures))
    return Normalized(key=key, canonical=canonical, to_canonical=tuple(to_canonical))


def _relabel_action(a: Action, perm: tuple[int, ...], dp: int) -> Action:
    pipeline = None if a.pipeline is None else perm[a.pipeline]
    peer = None
    if a.peer is not None:
        stage, p = divmod(a.peer, dp)
        peer = stage * dp + perm[p]
    return Action(kind=a.kind, stage=a.stage, microbatch=a.microbatch, pipeline=pipeline, peer=peer)


def relabel_schedule(schedule: Schedule, perm: tuple[int, ...]) -> Schedule:
    """Rename pipelines: label ``p`` becomes ``perm[p]`` in actions, peers and worker indices.

    Tied groups are sets of stages, which relabelling never moves: they are kept as they are.
    """
    dp = schedule.dp
    workers: list[tuple[Action, ...]] = [()] * len(schedule.workers)
    failed = set()
    for index, actions in enumerate(schedule.workers):
        stage, p = divmod(index, dp)
        target = stage * dp + perm[p]
        workers[target] = tuple(_relabel_action(a, perm, dp) for a in actions)
        if index in schedule.failed:
            failed.add(target)
    return Schedule(
        dp=dp,
        pp=schedule.pp,
        microbatches=schedule.microbatches,
        workers=tuple(workers),
        failed=frozenset(failed),
        optimizer=schedule.optimizer,
        iterations=schedule.iterations,
        name=schedule.name,
        tied=schedule.tied,
    )
