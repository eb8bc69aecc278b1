"""What the planner answers: a :class:`Plan` (a validated schedule for one failure set, with its
figures) and the :class:`SolverReport` of how it was found.

Its own module so that the planner (:mod:`.planner`) and the CP-SAT solver (:mod:`.cpsat`) both
import it without importing each other. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..ir import Schedule
from ..topology import Worker, format_worker, parse_worker

__all__ = ["SolverReport", "Plan"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverReport:
    """How the plan was found. ``gap`` is the relative optimality gap (0 = proven optimal)."""

    name: str
    status: str
    gap: float | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "gap": self.gap, "seconds": self.seconds}


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A validated schedule for one failure set, with its figures.

    Times are in the cost model's unit. ``schedule`` covers one iteration; for ``recycle`` it is
    meant to be repeated with the staggered optimizer. ``memory_cap`` and ``peak_memory`` (per
    worker) are in ``memory_unit``: ``"bytes"`` with a profiled cost model, else ``"states"``
    (micro-batch states, each activation or pending W counting 1).
    """

    dp: int
    pp: int
    microbatches: int
    failed: tuple[Worker, ...]
    variant: str
    schedule: Schedule
    iteration_time: float
    fault_free_iteration_time: float
    best_fault_free_iteration_time: float
    lower_bound: float
    memory_cap: float
    peak_activations: tuple[int, ...]
    peak_pending_w: tuple[int, ...]
    peak_state: tuple[int, ...]
    solver: SolverReport
    cost_name: str = "unit"
    memory_unit: str = "states"
    peak_memory: tuple[float, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def degradation(self) -> float:
        """Iteration time over fault-free 1F1B's (what DeepSpeed runs today), minus 1."""
        return self.iteration_time / self.fault_free_iteration_time - 1.0

    @property
    def degradation_vs_best(self) -> float:
        """Iteration time over the best fault-free schedule's (decoupled, same optimizer), minus 1."""
        return self.iteration_time / self.best_fault_free_iteration_time - 1.0

    @property
    def gap_to_bound(self) -> float:
        """Iteration time over the lower bound, minus 1 (0 = provably optimal)."""
        return self.iteration_time / self.lower_bound - 1.0 if self.lower_bound > 0 else 0.0

    def to_dict(self, *, with_schedule: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dp": self.dp,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "failed": [format_worker(w) for w in self.failed],
            "variant": self.variant,
            "cost_model": self.cost_name,
            "fault_free_iteration_time": self.fault_free_iteration_time,
            "best_fault_free_iteration_time": self.best_fault_free_iteration_time,
            "iteration_time": self.iteration_time,
            "degradation": self.degradation,
            "degradation_vs_best": self.degradation_vs_best,
            "lower_bound": self.lower_bound,
            "gap_to_bound": self.gap_to_bound,
            "memory_cap": self.memory_cap,
            "memory_unit": self.memory_unit,
            "peak_memory": list(self.peak_memory),
            "peak_activations": list(self.peak_activations),
            "peak_pending_w": list(self.peak_pending_w),
            "peak_state": list(self.peak_state),
            "solver": self.solver.to_dict(),
        }
        out.update(self.extra)
        if with_schedule:
            out["schedule"] = self.schedule.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        known = {
            "dp", "pp", "microbatches", "failed", "variant", "cost_model", "fault_free_iteration_time",
            "best_fault_free_iteration_time", "iteration_time", "degradation", "degradation_vs_best",
            "lower_bound", "gap_to_bound", "memory_cap", "memory_unit", "peak_memory", "peak_activations", "peak_pending_w", "peak_state", "solver",
            "schedule",
        }
        return cls(
            dp=data["dp"],
            pp=data["pp"],
            microbatches=data["microbatches"],
            failed=tuple(parse_worker(w) for w in data["failed"]),
            variant=data["variant"],
            schedule=Schedule.from_dict(data["schedule"]),
            iteration_time=data["iteration_time"],
            fault_free_iteration_time=data["fault_free_iteration_time"],
            best_fault_free_iteration_time=data["best_fault_free_iteration_time"],
            lower_bound=data["lower_bound"],
            memory_cap=data["memory_cap"],
            peak_activations=tuple(data["peak_activations"]),
            peak_pending_w=tuple(data["peak_pending_w"]),
            peak_state=tuple(data["peak_state"]),
            solver=SolverReport(**data["solver"]),
            cost_name=data.get("cost_model", "unit"),
            memory_unit=data.get("memory_unit", "states"),
            peak_memory=tuple(data.get("peak_memory", data["peak_state"])),
            extra={k: v for k, v in data.items() if k not in known},
        )
