"""Hang detection by progress (runtime/progress.py): what the heartbeat thread reads."""

from __future__ import annotations

import pytest

from ds_resilience.runtime.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_only_an_action_that_runs_too_long_inside_an_iteration_is_a_stall():
    clock = Clock()
    p = Progress(2.0, clock=clock)
    clock.now += 50  # between iterations (the user's own code): not timed
    assert p.stalled_for() == 0.0 and not p.stalled()
    with p.active():
        clock.now += 1.5
        p.advance()  # an action finished, the next began
        clock.now += 1.9
        assert not p.stalled()
        with p.waiting():  # a receive waits for a slow peer: the peer's progress is what counts
            clock.now += 30
            assert p.stalled_for() == 0.0 and not p.stalled()
        clock.now += 2.1  # after the wait, the next action runs 2.1 s without advancing
        assert p.stalled_for() == pytest.approx(2.1) and p.stalled()
        p.advance()
        assert not p.stalled()
    clock.now += 10
    assert not p.stalled()


def test_stall_timeout_none_never_stalls_and_bad_values_are_named():
    clock = Clock()
    p = Progress(None, clock=clock)
    with p.active():
        clock.now += 1e6
        assert not p.stalled()
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0 or None, got 0"):
        Progress(0)
