"""The PTD-P grid of a Megatron job: ranks, tensor-parallel replicas and the groups a failure changes.

Megatron-LM (PTD-P) places a stage's tensor-parallel group inside one node, pipelines across nodes
and data parallelism over both. megatron-core numbers ranks by an ``order`` string whose first
axis varies fastest (``"tp-cp-ep-dp-pp"`` by default: rank = ``(stage * dp + pipeline) * tp +
tp_rank``, which is also DeepSpeed's ``(pipe, data, model)`` order, so :class:`~ds_resilience.topology.Topology`
is the same grid). ``--use-tp-pp-dp-mapping`` gives ``"tp-cp-ep-pp-dp"``; both are accepted.

A *replica* of a stage is one tensor-parallel group: its ranks hold shards of the same layers and
run the same schedule in lockstep, so one dead rank takes the whole replica out. The planner,
the plan table and the simulator therefore count replicas (``dp`` pipelines x ``pp`` stages), and
:meth:`PTDPGrid.failed_workers` maps dead ranks onto them. :meth:`PTDPGrid.changed_groups` says
which of megatron-core's groups a failure changes; only those are rebuilt in the next generation.

Pure Python: no torch, no megatron (tests check the groups against megatron-core's own generator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..errors import ConfigError
from ..topology import Topology, Worker

__all__ = ["DEFAULT_ORDER", "PTDPGrid"]

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
"""megatron-core's default rank order (``initialize_model_parallel(order=...)``)."""
_AXES = ("tp", "dp", "pp")
_FLAG = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size", "dp": "data_parallel_size"}


@dataclass(frozen=True)
class PTDPGrid:
    """``tp`` x ``pp`` x ``dp`` ranks in megatron-core's ``order`` (context and expert axes of size 1)."""

    tp: int
    pp: int
    dp: int
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name in _AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(_FLAG[name], f"must be an integer >= 1, got {value!r}")
        tokens = self.order.lower().split("-")
        axes = [t for t in tokens if t in _AXES]
        if sorted(axes) != sorted(_AXES) or any(t not in _AXES + ("cp", "ep") for t in tokens) \
                or len(set(tokens)) != len(tokens):
            raise ConfigError("order", f"{self.order!r} is not a megatron-core rank order: each of tp, dp, pp "
                                       f"once (cp and ep allowed at size 1), e.g. {DEFAULT_ORDER!r}")
        object.__setattr__(self, "order", self.order.lower())

    # --- ranks --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def _strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for token in self.order.split("-"):
            if token in _AXES:
                strides[token] = step
                step *= getattr(self, token)
        return strides

    def rank(self, worker: Worker, tp_rank: int = 0) -> int:
        """Global rank of tensor-parallel rank ``tp_rank`` of ``worker`` (pipeline = dp index)."""
        self.topology().check(worker)
        if not 0 <= tp_rank < self.tp:
            raise ConfigError("tp_rank", f"{tp_rank} out of range, allowed 0..{self.tp - 1}")
        s = self._strides()
        return tp_rank * s["tp"] + worker.pipeline * s["dp"] + worker.stage * s["pp"]

    def coord(self, rank: int) -> tuple[Worker, int]:
        """Inverse of :meth:`rank`: the replica (worker) and tensor-parallel rank of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ConfigError("rank", f"{rank} out of range, allowed 0..{self.world_size - 1}")
        s = self._strides()
        at = {axis: (rank // s[axis]) % getattr(self, axis) for axis in _AXES}
        return Worker(pipeline=at["dp"], stage=at["pp"]), at["tp"]

    def replica(self, worker: Worker) -> tuple[int, ...]:
        """The ranks of ``worker``'s tensor-parallel group (its replica of the stage), by tp rank."""
        return tuple(self.rank(worker, t) for t in range(self.tp))

    def topology(self, dead_ranks: Iterable[int] = ()) -> Topology:
        """The planner's grid (``dp`` x ``pp`` replicas of ``tp`` ranks) with the replicas of
        ``dead_ranks`` failed."""
        return Topology(dp=self.dp, pp=self.pp, tp=self.tp, failed=self.failed_workers(dead_ranks))

    def failed_workers(self, dead_ranks: Iterable[int]) -> frozenset[Worker]:
        """The replicas ``dead_ranks`` take out: one dead rank fails its whole tensor-parallel group."""
        return frozenset(self.coord(r)[0] for r in dead_ranks)

    # --- megatron-core's groups -------------------------------------------------------------------
    def tp_groups(self) -> list[tuple[int, ...]]:
        """Tensor-parallel groups: one per replica."""
        return [self.replica(Worker(pipeline=p, stage=s)) for s in range(self.pp) for p in range(self.dp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Data-parallel groups (a stage's gradient reduce): per stage and tp rank, over pipelines."""
        return [tuple(self.rank(Worker(pipeline=p, stage=s), t) for p in range(self.dp))
                for s in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Pipeline groups: per pipeline and tp rank, over stages (tp rank t talks to tp rank t)."""
        return [tuple(self.rank(Worker(pipeline=p, stage=s), t) for s in range(self.pp))
                for p in range(self.dp) for t in range(self.tp)]

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """Tied-embedding groups (first and last stage of each pipeline, per tp rank)."""
        if self.pp == 1:
            return [(self.rank(Worker(pipeline=p, stage=0), t),) for p in range(self.dp) for t in range(self.tp)]
        return [(self.rank(Worker(pipeline=p, stage=0), t), self.rank(Worker(pipeline=p, stage=self.pp - 1), t))
                for p in range(self.dp) for t in range(self.tp)]

    def changed_groups(self, failed: Iterable[Worker]) -> dict[str, list[tuple[int, ...]]]:
        """The groups of the healthy grid that hold a rank of a failed replica, by kind (``tp``,
        ``dp``, ``pp``, ``embedding``): exactly what the next generation must rebuild (or drop);
        every other group keeps its members."""
        gone = {r for w in failed for r in self.replica(w)}
        kinds = {"tp": self.tp_groups(), "dp": self.dp_groups(), "pp": self.pp_groups(),
                 "embedding": self.embedding_groups()}
        return {kind: [g for g in groups if gone.intersection(g)] for kind, groups in kinds.items()}

    # --- placement ----------------------------------------------------------------------------------
    def check_nodes(self, ranks_per_node: int) -> None:
        """PTD-P's placement: every tensor-parallel group inside one node (its all-reduces on every
        layer need the node's fast links).

        Raises:
            ConfigError: a tensor-parallel group spans nodes, naming the sizes that would fit.
        """
        if ranks_per_node < 1:
            raise ConfigError("ranks_per_node", f"must be >= 1, got {ranks_per_node}")
        for group in self.tp_groups():
            nodes = {r // ranks_per_node for r in group}
            if len(nodes) > 1:
                raise ConfigError("--tensor-model-parallel-size",
                                  f"{self.tp} with {ranks_per_node} ranks per node puts tensor-parallel group "
                                  f"{list(group)} on nodes {sorted(nodes)}; PTD-P keeps a tensor-parallel group "
                                  f"inside a node: use a tensor-parallel size that divides {ranks_per_node} "
                                  f"(and an order with tp first, e.g. {DEFAULT_ORDER!r})")
