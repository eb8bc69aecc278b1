"""A fail-slow worker under ``ds-resilience run``'s agent: found from the executor's own action
timings (runtime/stragglers.py), with its measured speed, and found recovered when it is fast again.
In the alone tier (conftest.ALONE): the paces of a 2-core machine shared with another job are noise
that only adds time, which the detector's fastest-of-window absorbs, but a job's own worker starved
for seconds would look slow."""

from __future__ import annotations

import re

import pytest

from test_live import HEARTBEAT_TIMEOUT_S, logs, run_job

STEPS = 34
# a window of 8 iterations (about 3 s here): a noisy neighbour must starve a worker for that long to
# look slow, as the fastest pace of the window counts. Margin 0.6 (slow above 1.6x, recovered below
# 1.3x): four ranks on two cores leave one rank 1.2-1.3x behind its peer for long stretches (CI run 2
# of this session saw a recovered rank stay above 1.2x for 16 iterations); the fault is 2.5x
DETECTOR = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "pg_timeout_s": 60.0,
            "straggler_window": 8, "straggler_margin": 0.6}


@pytest.mark.timeout(300)
def test_a_slow_worker_is_reported_slow_then_recovered(tmp_path):
    fault = {"rank": 1, "step": 4, "point": "before_forward", "kind": "slow", "speed": 0.4, "steps": 14}
    code, events, dumps = run_job(tmp_path, faults=[fault], steps=STEPS, resilience={"detector": DETECTOR})
    assert code == 0, logs(tmp_path, "job")
    assert [e.kind for e in events if e.kind in ("crash", "hang", "stop")] == []  # slow is not dead
    assert sorted(dumps) == [0, 1, 2, 3] and all(d["steps"] == STEPS for d in dumps.values())
    reporter = (tmp_path / "job-logs" / "rank0.0.log").read_text()
    found = re.findall(r"rank (\d+) \(stage (\d+)\) (is slow|recovered) at iteration (\d+): its forward and backward "
                       r"passes run at ([\d.]+)x", reporter)
    assert [(r, s, what) for r, s, what, _, _ in found] == [("1", "0", "is slow"), ("1", "0", "recovered")], reporter
    (_, _, _, slow_at, speed), (_, _, _, back_at, _) = found
    # measured: 0.38-0.57x for the fault's 0.4x (noise only adds time to the peers' pace too); at most
    # 1 / 1.6 by the margin
    assert 0.25 <= float(speed) < 0.625, found
    assert 4 <= int(slow_at) < 18 <= int(back_at), found  # slow while the fault lasts, recovered after
    for r in (1, 2, 3):  # only the first alive rank decides
        assert "is slow at iteration" not in (tmp_path / "job-logs" / f"rank{r}.0.log").read_text()
