"""Simulation (layer L2, pure Python): timeline replay of schedules under a cost model, and the
failure-trace simulator of whole training jobs (traces, model profiles, per-system policies)."""

from .timeline import Timeline, complement, iteration_ends, memory_peaks, merge_spans, simulate, steady_period
from .traces import (
    SimulationError,
    Trace,
    TraceError,
    TraceEvent,
    load_trace,
    parse_duration,
    periodic_trace,
    poisson_trace,
    redraw_victims,
)
from .models import ModelProfile, ModelProfileError, PlanCache, list_models, load_model
from .jobsim import Action, Policy, Result
from .systems import SYSTEMS, make_policy, simulate_system

__all__ = [
    "Timeline",
    "simulate",
    "merge_spans",
    "complement",
    "iteration_ends",
    "steady_period",
    "memory_peaks",
    "SimulationError",
    "TraceError",
    "TraceEvent",
    "Trace",
    "load_trace",
    "parse_duration",
    "periodic_trace",
    "poisson_trace",
    "redraw_victims",
    "ModelProfile",
    "ModelProfileError",
    "PlanCache",
    "list_models",
    "load_model",
    "Action",
    "Policy",
    "Result",
    "SYSTEMS",
    "make_policy",
    "simulate_system",
]
