"""Data x pipeline (x tensor) topology: workers, coordinates and global ranks.

The rank order is DeepSpeed's :class:`~deepspeed.runtime.pipe.topology.ProcessTopology` with axes
``("pipe", "data", "model")``: the pipe axis varies slowest, so the worker of pipeline ``p`` (the
data-parallel index) at stage ``s`` has global rank ``(s * dp + p) * tp + t``. With ``tp == 1`` (the
default, and the only value the schedules use today) that is ``s * dp + p``.

A *worker* here is one (pipeline, stage) position; with tensor parallelism a worker is a group of
``tp`` ranks that act as one. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .errors import TopologyError

__all__ = ["Worker", "Topology", "parse_worker", "format_worker"]


@dataclass(frozen=True, slots=True, kw_only=True, order=True)
class Worker:
    """A (pipeline, stage) position. ``pipeline`` is the data-parallel index."""

    pipeline: int
    stage: int

    def __str__(self) -> str:
        return format_worker(self)


def format_worker(worker: Worker) -> str:
    """``Worker(pipeline=1, stage=2)`` -> ``"1:2"`` (the form used in configs and on the CLI)."""
    return f"{worker.pipeline}:{worker.stage}"


def parse_worker(text: str) -> Worker:
    """Parse ``"p:s"`` into a :class:`Worker`.

    Raises:
        TopologyError: the text is not two non-negative integers separated by ``:``.
    """
    parts = str(text).strip().split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise TopologyError(f"worker {text!r} is not of the form 'pipeline:stage' (e.g. '1:2')")
    return Worker(pipeline=int(parts[0]), stage=int(parts[1]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A ``dp`` x ``pp`` (x ``tp``) grid of workers, some of which may have failed.

    Args:
        dp: number of pipelines (data-parallel degree), >= 1.
        pp: number of pipeline stages, >= 1.
        tp: tensor-parallel degree, >= 1 (ranks per worker).
        failed: workers that are gone; ``without`` returns a copy with more of them.
        ranks: the global rank of each worker, by worker index (``tp == 1`` only); default
            DeepSpeed's order. A grid the survivors re-formed keeps their ranks (the agent's
            names for them), which are then neither dense nor in DeepSpeed's order.
    """

    dp: int
    pp: int
    tp: int = 1
    failed: frozenset[Worker] = field(default_factory=frozenset)
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"{name} must be an integer >= 1, got {value!r}")
        object.__setattr__(self, "failed", frozenset(self.failed))
        for worker in self.failed:
            self.check(worker)
        if self.ranks is not None:
            ranks = tuple(self.ranks)
            object.__setattr__(self, "ranks", ranks)
            if self.tp != 1:
                raise TopologyError(f"an explicit rank table needs tp == 1, got tp={self.tp}")
            if len(ranks) != self.num_workers or len(set(ranks)) != len(ranks) or any(
                    not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
                raise TopologyError(f"ranks must be {self.num_workers} distinct integers >= 0 (one per worker), "
                                    f"got {list(ranks)}")

    # --- sizes -----------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Number of (pipeline, stage) positions, failed ones included."""
        return self.dp * self.pp

    @property
    def world_size(self) -> int:
        """Number of global ranks (workers x tp)."""
        return self.dp * self.pp * self.tp

    # --- coordinates -----------------------------------------------------------------------
    def check(self, worker: Worker) -> Worker:
        """Return ``worker`` if it lies in the grid.

        Raises:
            TopologyError: naming the out-of-range pipeline or stage and the allowed range.
        """
        if not 0 <= worker.pipeline < self.dp:
            raise TopologyError(
                f"worker {worker}: pipeline {worker.pipeline} out of range, allowed 0..{self.dp - 1}"
            )
        if not 0 <= worker.stage < self.pp:
            raise TopologyError(
                f"worker {worker}: stage {worker.stage} out of range, allowed 0..{self.pp - 1}"
            )
        return worker

    def rank(self, worker: Worker, tp_rank: int = 0) -> int:
        """Global rank of ``worker`` (and its tensor-parallel rank), DeepSpeed's order."""
        self.check(worker)
        if not 0 <= tp_rank < self.tp:
            raise TopologyError(f"tp rank {tp_rank} out of range, allowed 0..{self.tp - 1}")
        if self.ranks is not None:
            return self.ranks[worker.stage * self.dp + worker.pipeline]
        return (worker.stage * self.dp + worker.pipeline) * self.tp + tp_rank

    def worker_index(self, worker: Worker) -> int:
        """Index of ``worker`` in schedules: its global rank with ``tp == 1`` (``s * dp + p``)."""
        self.check(worker)
        return worker.stage * self.dp + worker.pipeline

    def worker(self, index: int) -> Worker:
        """Inverse of :meth:`worker_index`."""
        if not 0 <= index < self.num_workers:
            raise TopologyError(f"worker index {index} out of range, allowed 0..{self.num_workers - 1}")
        stage, pipeline = divmod(index, self.dp)
        return Worker(pipeline=pipeline, stage=stage)

    def coord(self, rank: int) -> tuple[Worker, int]:
        """Inverse of :meth:`rank`: the worker and tensor-parallel rank of a global rank."""
        if self.ranks is not None:
            if rank not in self.ranks:
                raise TopologyError(f"rank {rank} is not in this grid, whose ranks are {sorted(self.ranks)}")
            return self.worker(self.ranks.index(rank)), 0
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} out of range, allowed 0..{self.world_size - 1}")
        index, tp_rank = divmod(rank, self.tp)
        return self.worker(index), tp_rank

    # --- failures --------------------------------------------------------------------------
    def without(self, failed: Iterable[Worker]) -> "Topology":
        """A copy with ``failed`` added to the failed set (a re-join is a smaller set)."""
        extra = frozenset(self.check(w) for w in failed)
        return Topology(dp=self.dp, pp=self.pp, tp=self.tp, failed=self.failed | extra, ranks=self.ranks)

    def healthy(self) -> "Topology":
        """The same grid with no failures."""
        return Topology(dp=self.dp, pp=self.pp, tp=self.tp, ranks=self.ranks)

    def has_rank(self, rank: int) -> bool:
        """Whether global rank ``rank`` is one of this grid's (failed or not)."""
        if self.ranks is not None:
            return rank in self.ranks
        return 0 <= rank < self.world_size

    def is_alive(self, worker: Worker) -> bool:
        return self.check(worker) not in self.failed

    def workers(self) -> Iterator[Worker]:
        """All workers in index order, failed ones included."""
        for index in range(self.num_workers):
            yield self.worker(index)

    def alive_workers(self) -> tuple[Worker, ...]:
        return tuple(w for w in self.workers() if w not in self.failed)

    def stage_peers(self, stage: int) -> tuple[Worker, ...]:
        """Surviving workers of ``stage`` (its data-parallel group), by pipeline."""
        return tuple(
            Worker(pipeline=p, stage=stage)
            for p in range(self.dp)
            if Worker(pipeline=p, stage=stage) not in self.failed
        )

    def uncovered_stages(self) -> tuple[int, ...]:
        """Stages that lost every replica (re-routing cannot cover them)."""
        return tuple(s for s in range(self.pp) if not self.stage_peers(s))
