"""Simulation (layer L2, pure Python): timeline replay of schedules under a cost model."""

from .timeline import Timeline, complement, iteration_ends, memory_peaks, merge_spans, simulate, steady_period

__all__ = ["Timeline", "simulate", "merge_spans", "complement", "iteration_ends", "steady_period", "memory_peaks"]
