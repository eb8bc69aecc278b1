"""Re-routing: which surviving data-parallel peer runs each micro-batch of a failed worker.

Only the failed stage's work moves: micro-batch m of pipeline p at stage s runs on a survivor
(p', s), which receives the activation from (p, s-1) and sends its output to (p, s+1) (gradients
take the mirror path). Re-routed micro-batches are dealt out so that every survivor of the stage
ends with the same load (to within one) and the extra work is spread over the iteration rather
than bunched at its end. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import PlanningError
from ..topology import Topology, Worker

__all__ = ["check_coverable", "reroute_assignment", "weighted_assignment"]

Key = tuple[int, int, int]


def check_coverable(topology: Topology) -> None:
    """Raise :class:`PlanningError` if some stage lost every replica."""
    lost = topology.uncovered_stages()
    if lost:
        names = ", ".join(str(s) for s in lost)
        raise PlanningError(
            f"stage {names} lost every replica (failed: {sorted(str(w) for w in topology.failed)}); "
            "re-routing needs a surviving data-parallel peer of each stage and cannot cover this failure set "
            "(fall back to pipeline templates or restart from a checkpoint)"
        )


def reroute_assignment(topology: Topology, microbatches: int, *, ties: str = "first") -> dict[Key, int]:
    """Map every (pipeline, stage, micro-batch) to the worker index that runs it.

    Healthy workers keep their own micro-batches. For each stage, the failed workers' micro-batches
    (taken in micro-batch order, interleaving failed pipelines) go to the survivor with the least
    load so far, ties to the lowest pipeline (``ties="first"``) or the highest (``"last"``); this
    balances the counts exactly and alternates between survivors. The planner tries both: which
    survivor takes the first re-routed micro-batch changes how the stages around it line up.

    Raises:
        PlanningError: a stage has no survivor.
    """
    check_coverable(topology)
    dp = topology.dp
    assignment: dict[Key, int] = {}
    for s in range(topology.pp):
        survivors = [w.pipeline for w in topology.stage_peers(s)]
        failed = [p for p in range(dp) if Worker(pipeline=p, stage=s) in topology.failed]
        load = {p: microbatches for p in survivors}
        for p in survivors:
            for m in range(microbatches):
                assignment[(p, s, m)] = s * dp + p
        for m in range(microbatches):
            for p in failed:
                target = min(survivors, key=lambda q: (load[q], q if ties == "first" else -q))
                load[target] += 1
                assignment[(p, s, m)] = s * dp + target
    return assignment


def weighted_assignment(topology: Topology, microbatches: int, speeds: Mapping[Worker, float]) -> dict[Key, int]:
    """Like :func:`reroute_assignment`, with slow workers as partial failures: every stage's
    ``dp x microbatches`` micro-batches are dealt to its live workers in proportion to their speeds
    (``speeds``: a worker's fraction of full speed, 1 when not named; largest remainders round).
    A worker keeps its own micro-batches up to its share (a slow one keeps evenly spaced ones, so
    what it hands over is spread over the iteration); the rest, and a failed worker's, go in
    micro-batch order to the peer with the most room left (ties to the lowest pipeline). The same
    micro-batches as ever, each run once: only where they run changes.

    Raises:
        PlanningError: a stage has no survivor, or a speed is not in (0, 1].
    """
    check_coverable(topology)
    for worker, v in speeds.items():
        topology.check(worker)
        if not 0 < v <= 1:
            raise PlanningError(f"speed of worker {worker}: {v!r}; allowed: (0, 1]")
    dp = topology.dp
    assignment: dict[Key, int] = {}
    for s in range(topology.pp):
        alive = [w.pipeline for w in topology.stage_peers(s)]
        v = {p: float(speeds.get(Worker(pipeline=p, stage=s), 1.0)) for p in alive}
        total = dp * microbatches
        ideal = {p: total * v[p] / sum(v.values()) for p in alive}
        share = {p: int(ideal[p]) for p in alive}
        for p in sorted(alive, key=lambda q: (-(ideal[q] - share[q]), q))[:total - sum(share.values())]:
            share[p] += 1
        handed: list[tuple[int, int]] = []  # (micro-batch, pipeline) run elsewhere
        load = {}
        for p in range(dp):
            if p not in v:
                handed += [(m, p) for m in range(microbatches)]
                continue
            keep = min(share[p], microbatches)
            kept = {m for m in range(microbatches) if (m + 1) * keep // microbatches > m * keep // microbatches}
            for m in range(microbatches):
                if m in kept:
                    assignment[(p, s, m)] = s * dp + p
                else:
                    handed.append((m, p))
            load[p] = keep
        for m, p in sorted(handed):
            target = max(alive, key=lambda q: (share[q] - load[q], -q))
            load[target] += 1
            assignment[(p, s, m)] = s * dp + target
    return assignment
