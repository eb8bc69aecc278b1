"""ds_resilience against every baseline (Bamboo, Varuna, Oobleck, checkpoint-restart, ReCycle) on
every shipped failure trace and every model profile: its throughput is the best. A file of its own
(about 110 s of one core) so that the suite's workers share it and test_jobsim.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_resilience.sim import SYSTEMS, load_model, load_trace, simulate_system
from ds_resilience.sim.models import MODEL_NAMES, PlanCache

TRACES = Path(__file__).resolve().parents[3] / "configs" / "traces"


@pytest.fixture(scope="module")
def store():
    """One plan store for the whole module: profiles with equal layer counts share plans."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("trace_name", sorted(p.name for p in TRACES.iterdir()))
def test_ds_resilience_beats_every_baseline(trace_name, model_name, store):
    model = load_model(model_name)
    cache = PlanCache(model, store=store)
    trace = load_trace(TRACES / trace_name)
    got = {s: simulate_system(trace, model, s, cache=cache).throughput for s in SYSTEMS}
    best = max(v for k, v in got.items() if k != "ds_resilience")
    assert got["ds_resilience"] > best, got
