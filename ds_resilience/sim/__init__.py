"""The failure-trace simulator of whole training jobs (layer L2, pure Python): traces, model
profiles, per-system policies. It takes iteration times from the planner (layer L1); the timeline
replay of one schedule is :func:`ds_resilience.ir.simulate`."""

from .traces import (
    SimulationError,
    Trace,
    TraceError,
    TraceEvent,
    add_slow_events,
    load_trace,
    parse_duration,
    periodic_trace,
    poisson_trace,
    redraw_victims,
    slow_stretch,
)
from .regrid_cost import RegridCost, RegridCostError
from .models import ModelProfile, ModelProfileError, PlanCache, list_models, load_model
from .jobsim import Action, Policy, Result
from .systems import SYSTEMS, make_policy, simulate_system

__all__ = [
    "SimulationError",
    "TraceError",
    "TraceEvent",
    "Trace",
    "load_trace",
    "parse_duration",
    "periodic_trace",
    "poisson_trace",
    "redraw_victims",
    "add_slow_events",
    "slow_stretch",
    "RegridCost",
    "RegridCostError",
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
