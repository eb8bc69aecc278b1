"""polling.Backoff: each wait sleeps ``start``, then ``factor`` times longer, never above ``cap``."""

from __future__ import annotations

import pytest

from ds_resilience import polling
from ds_resilience.polling import Backoff


def test_the_delays_grow_by_the_factor_up_to_the_cap(monkeypatch):
    slept = []
    monkeypatch.setattr(polling.time, "sleep", slept.append)
    backoff = Backoff(0.001, cap=0.004, factor=2.0)
    for _ in range(5):
        backoff.sleep()
    assert slept == [0.001, 0.002, 0.004, 0.004, 0.004]


@pytest.mark.parametrize("args", [(0.0, 0.005, 1.5), (0.01, 0.005, 1.5), (0.001, 0.005, 0.5)])
def test_bad_settings_are_refused(args):
    with pytest.raises(ValueError, match="need 0 < start"):
        Backoff(*args)
