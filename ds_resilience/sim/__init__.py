"""Simulation (layer L2, pure Python): timeline replay of schedules under a cost model."""

from .timeline import Timeline, complement, merge_spans, simulate

__all__ = ["Timeline", "simulate", "merge_spans", "complement"]
