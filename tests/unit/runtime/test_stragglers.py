"""Straggler detection from the executor's own timings (runtime/stragglers.py) and the fail-slow
fault that makes one (runtime/faults.py, config.FaultInjection kind ``slow``)."""

from __future__ import annotations

import random

import pytest

from ds_resilience.config import FaultInjection
from ds_resilience.errors import ConfigError
from ds_resilience.runtime.faults import FaultInjector
from ds_resilience.runtime.stragglers import StragglerDetector, StragglerWatch, pace_of

STAGE = {0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1}  # PP=2 x DP=3


def _run(detector: StragglerDetector, pace, iterations: int, seed: int = 0):
    """Feed ``pace(rank, iteration)`` plus noise that only adds time (a shared machine), return
    the decisions by iteration."""
    rng = random.Random(seed)
    out = []
    for it in range(iterations):
        for rank, stage in STAGE.items():
            detector.observe(rank, stage, it, pace(rank, it) * (1 + rng.uniform(0, 0.25) if rng.random() < 0.6 else 1))
        out += detector.decide(it)
    return out


def test_a_worker_at_half_speed_is_found_with_its_speed_and_its_recovery():
    base = {0: 0.010, 1: 0.010, 2: 0.010, 3: 0.020, 4: 0.020, 5: 0.020}  # stage 1 does twice the work

    def pace(rank, it):
        return base[rank] * (2.0 if rank == 1 and 5 <= it < 20 else 1.0)

    decisions = _run(StragglerDetector(window=5, margin=0.3), pace, 40)
    assert [(d.rank, d.slow) for d in decisions] == [(1, True), (1, False)], decisions
    slow, back = decisions
    assert 5 <= slow.iteration <= 9 and slow.stage == 0 and slow.speed == pytest.approx(0.5, abs=0.06)
    assert 20 <= back.iteration <= 25 and back.speed > 1 / 1.15
    assert "rank 1 (stage 0) is slow at iteration" in slow.line() and "0.5" in slow.line()


def test_noise_and_a_slower_stage_are_not_stragglers():
    base = {0: 0.010, 1: 0.011, 2: 0.010, 3: 0.030, 4: 0.031, 5: 0.030}  # stages are compared with themselves
    assert _run(StragglerDetector(window=5, margin=0.3), lambda r, it: base[r], 60, seed=3) == []


def test_a_short_spike_is_not_a_straggler_and_a_failed_rank_is_forgotten():
    detector = StragglerDetector(window=5, margin=0.3)
    spike = _run(detector, lambda r, it: 0.01 * (3.0 if r == 2 and it == 7 else 1.0), 30)
    assert spike == []  # the fastest of the window: one slow iteration is noise
    detector = StragglerDetector(window=3, margin=0.3)
    _run(detector, lambda r, it: 0.01 * (2.0 if r == 2 else 1.0), 10)
    assert 2 in detector.slow
    detector.forget(2)
    assert 2 not in detector.slow and detector.decide(11) == []


def test_pace_is_compute_per_microbatch():
    assert pace_of({"F": [0.1, 0.1], "B": [0.2, 0.2], "W": [0.1, 0.1], "RD": [5.0]}, 2) == pytest.approx(0.4)
    assert pace_of({"BW": [0.3]}, 1) == pytest.approx(0.3)
    assert pace_of({}, 0) is None
    with pytest.raises(ValueError, match="window"):
        StragglerDetector(window=1)


class _Store:
    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]


def test_the_watch_publishes_every_pace_and_only_the_first_alive_rank_decides():
    store = _Store()
    members = {0: 0, 1: 0, 2: 1, 3: 1}
    watches = {r: StragglerWatch(store, "s", r, lambda: members, window=3, margin=0.3) for r in members}
    for it in range(8):
        for r, w in watches.items():
            slow = 2.0 if r == 1 and it >= 2 else 1.0
            w.after_iteration(it, {"F": [0.01 * slow], "B": [0.02 * slow]}, 1)
    assert [(d.rank, d.slow) for d in watches[0].decisions] == [(1, True)]
    assert all(not watches[r].decisions for r in (1, 2, 3))
    assert store.data["dsr/s/pace/1"].decode().startswith("7 ")
    del members[0]  # rank 0 failed: rank 1 reports now
    watches[1].after_iteration(8, {"F": [0.02]}, 1)
    assert watches[1].detector._stage.keys() <= {1, 2, 3}


def test_a_slow_fault_slows_its_rank_for_its_steps_only():
    fault = FaultInjection(rank=1, step=3, point="before_forward", kind="slow", speed=0.5, steps=4)
    injector = FaultInjector([fault], 1, env={})
    assert injector.speed(3) == 1.0
    injector.maybe_fire("before_forward", 3)  # it fires and returns
    assert [injector.speed(s) for s in range(2, 9)] == [1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    other = FaultInjector([fault], 0, env={})
    other.maybe_fire("before_forward", 3)
    assert other.speed(4) == 1.0


def test_a_slow_fault_needs_its_speed_and_steps():
    with pytest.raises(ConfigError, match="speed"):
        FaultInjection(rank=1, step=3, point="before_forward", kind="slow", steps=4)
    with pytest.raises(ConfigError, match="steps"):
        FaultInjection(rank=1, step=3, point="before_forward", kind="slow", speed=0.5)
    with pytest.raises(ConfigError, match="speed"):
        FaultInjection(rank=1, step=3, point="before_forward", kind="sigkill", speed=0.5)
    with pytest.raises(ConfigError):
        FaultInjection(rank=1, step=3, point="before_forward", kind="slow", speed=1.5, steps=2)
