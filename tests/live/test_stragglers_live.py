"""A fail-slow worker under ``ds-resilience run``'s agent: found from the executor's own action
timings (runtime/stragglers.py), with its measured speed; the job switches to the weighted plan for
that speed at an iteration boundary (a ``slow`` epoch: no process killed, no state moved), and back
to the fault-free schedule when the worker is found recovered; the parameters are the fault-free
run's. In the alone tier (conftest.ALONE): the paces of a 2-core machine shared with another job are
noise that only adds time, which the detector's fastest-of-window absorbs, but a job's own worker
starved for seconds would look slow. Iteration times are measured and printed, never asserted."""

from __future__ import annotations

import re
import statistics

import pytest

from test_live import HEARTBEAT_TIMEOUT_S, assert_equal_to_reference, logs, run_job

STEPS = 40
FAULT_STEP, FAULT_STEPS = 4, 20  # rank 1 at half speed in iterations 4..23
# a window of 8 iterations (about 3 s here): a noisy neighbour must starve a worker for that long to
# look slow, as the fastest pace of the window counts. Margin 0.6 (slow above 1.6x, recovered below
# 1.3x): four ranks on two cores leave one rank 1.2-1.3x behind its peer for long stretches (CI run 2
# of this session saw a recovered rank stay above 1.2x for 16 iterations); the fault is 2x. A hold
# of 8 iterations between switches (default 20): the return to the fault-free schedule fits in the run
DETECTOR = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "pg_timeout_s": 60.0,
            "straggler_window": 8, "straggler_margin": 0.6, "straggler_hold": 8, "straggler_replan": True}
# the engine profiles its first 2 iterations and plans with what it measured (the suite's default is
# unit costs, DSR_SELF_PROFILE=0): the plan's predicted times are then seconds of this machine
RESILIENCE = {"detector": DETECTOR, "profile_steps": 2}


def step_seconds(dump: dict) -> dict[int, float]:
    """{step: wall seconds of the call that completed it} from a rank's ``step_ends``."""
    ends = dump["step_ends"]
    return {step: t - ends[i - 1][1] for i, (step, t) in enumerate(ends) if i > 0}


def switch_phases(dump: dict, fault_start: int, fault_end: int, rank: int = 1) -> dict:
    """The measured iteration times around the slow epochs of slowed ``rank`` in ``dump``'s recovery
    log (the first that names it, and the first after it that does not): medians of the
    healthy iterations before the fault (``healthy``), of the fault's before the switch
    (``unadapted``) and after it (``adapted``); the plan's predicted figures; and ``fraction``, how
    far the measured time went from the un-adapted one toward the plan's prediction (the predicted
    ratio applied to the measured un-adapted time). Iterations next to a switch are left out (the
    switch's own cost is in them). ``None`` for a phase without iterations."""
    slow = [e for e in dump["recovery"] if e.get("kind") == "slow"]
    names = lambda e: rank in [r for r, _ in e.get("speeds") or ()]  # noqa: E731
    adopted = next((e for e in slow if names(e)), None)
    if adopted is None:
        return {"switched_at": None}
    at = adopted["resume_step"]
    back = next((e["resume_step"] for e in slow if not names(e) and e["resume_step"] > at), None)
    secs = step_seconds(dump)

    def median(lo: int, hi: int) -> float | None:
        values = [secs[s] for s in range(lo, hi) if s in secs]
        return statistics.median(values) if values else None

    figures = adopted["figures"]
    out = {"switched_at": at, "back_at": back, "healthy": median(3, fault_start),
           "unadapted": median(fault_start + 2, at), "adapted": median(at + 3, fault_end),
           "predicted": figures["iteration_time"], "predicted_unadapted": figures["unadapted_time"],
           "predicted_healthy": figures["fault_free_iteration_time"], "bound": figures["bound"],
           "loads": figures["loads"], "after": median(back + 3, max(secs) + 1) if back is not None else None}
    if out["unadapted"] and out["adapted"]:
        ratio = figures["iteration_time"] / figures["unadapted_time"]
        gain = out["unadapted"] * (1 - ratio)
        out["fraction"] = (out["unadapted"] - out["adapted"]) / gain if gain > 0 else None
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run of the same steps (the switch off: noise found slow plans nothing)."""
    tmp = tmp_path_factory.mktemp("ref")
    fault_free = {**RESILIENCE, "detector": {**DETECTOR, "straggler_replan": False}}
    code, _, dumps = run_job(tmp, name="ref", steps=STEPS, resilience=fault_free)
    assert code == 0, logs(tmp, "ref")
    return dumps


@pytest.mark.timeout(420)
def test_a_slow_worker_switches_the_job_to_the_weighted_plan_and_back(tmp_path, reference):
    fault = {"rank": 1, "step": FAULT_STEP, "point": "before_forward", "kind": "slow", "speed": 0.5,
             "steps": FAULT_STEPS}
    code, events, dumps = run_job(tmp_path, faults=[fault], steps=STEPS, resilience=RESILIENCE)
    assert code == 0, logs(tmp_path, "job")
    assert [e.kind for e in events if e.kind in ("crash", "hang", "stop")] == []  # slow is not dead
    reporter = (tmp_path / "job-logs" / "rank0.0.log").read_text()
    found = re.findall(r"rank (\d+) \(stage (\d+)\) (is slow|recovered) at iteration (\d+): its forward and backward "
                       r"passes run at ([\d.]+)x", reporter)
    mine = [f for f in found if f[0] == "1"]
    assert [(r, s, what) for r, s, what, _, _ in mine[:2]] == [("1", "0", "is slow"), ("1", "0", "recovered")], reporter
    (_, _, _, slow_at, speed), (_, _, _, back_at, _) = mine[:2]
    assert 0.25 <= float(speed) < 0.625, found  # at most 1 / 1.6 by the margin
    end = FAULT_STEP + FAULT_STEPS
    assert FAULT_STEP <= int(slow_at) < end <= int(back_at), found  # slow while the fault lasts, recovered after
    for r in (1, 2, 3):  # only the first alive rank decides
        assert "is slow at iteration" not in (tmp_path / "job-logs" / f"rank{r}.0.log").read_text()
    # one line per switch on the first alive rank: the weighted plan for rank 1, and after its
    # recovery a schedule without it (the fault-free one unless the machine's noise made another slow)
    switches = [text for _, text in re.findall(r"slow-worker switch \(epoch \d+, from step (\d+)\): (.*)", reporter)]
    with_it = [text for text in switches if "(rank 1)" in text]
    assert with_it and "worker p1s0 (rank 1) at" in with_it[0] and "adopted the weighted plan" in with_it[0], switches
    first = switches.index(with_it[0])
    assert any("(rank 1)" not in text for text in switches[first + 1:]), switches  # its recovery's switch
    noise = [f for f in found if f not in mine[:2]]
    if noise:  # a peer starved for a whole window by the shared machine: planned as slow too (not asserted)
        print(f"\nother ranks found slow by the noise of the machine: {noise}")
    else:
        assert [e.kind for e in events if e.kind not in ("start", "exit")] == ["slow", "slow"], events
        assert len(switches) == 2 and "back to the fault-free schedule" in switches[1], switches
    # every rank applied the switches: the slow worker runs fewer micro-batches, then its own again
    for rank, d in dumps.items():
        slow = [e for e in d["recovery"] if e.get("kind") == "slow"]
        adopted = next(e for e in slow if 1 in [r for r, _ in e["speeds"]])
        assert adopted["schedule_source"] in ("slow-table", "slow-plan"), adopted  # planned ahead, or on demand
        loads = adopted["figures"]["loads"]
        assert loads[1] < loads[0] and loads[0] + loads[1] == loads[2] + loads[3], loads
        later = slow[slow.index(adopted) + 1:]
        assert any(1 not in [r for r, _ in e["speeds"]] for e in later), slow
        if not noise:
            assert len(slow) == 2 and slow[-1]["schedule_source"] == "fault-free" and slow[-1]["speeds"] == [], slow
    # the math of the fault-free run: the same micro-batches, wherever they ran (another summation order)
    assert_equal_to_reference(dumps, reference, steps=STEPS, atol=1e-5)
    # measured, never asserted (a shared machine): how far the switch went toward the plan's prediction
    phases = switch_phases(dumps[0], FAULT_STEP, end)
    print(f"\nslow worker at 0.5x, measured iteration seconds: {phases}")


@pytest.mark.timeout(420)
def test_a_slow_worker_that_then_dies_is_an_ordinary_failure(tmp_path, reference):
    """Rank 1 at half speed, switched to the weighted plan, then killed: a crash epoch whose plan is
    the failure plan (the speeds go with it: a failure plan does not weigh them); the survivors end
    with the fault-free run's parameters."""
    slow = {"rank": 1, "step": FAULT_STEP, "point": "before_forward", "kind": "slow", "speed": 0.5,
            "steps": FAULT_STEPS}
    kill = {"rank": 1, "step": 22, "point": "mid_backward", "kind": "sigkill"}
    code, events, dumps = run_job(tmp_path, faults=[slow, kill], steps=STEPS, resilience=RESILIENCE)
    assert code == 0, logs(tmp_path, "job")
    kinds = [e.kind for e in events if e.kind not in ("start", "exit")]
    assert kinds.count("crash") == 1 and "slow" in kinds and kinds.index("slow") < kinds.index("crash"), events
    for rank, d in dumps.items():
        crash = next(e for e in d["recovery"] if e.get("kind") == "crash")
        assert crash["failed"] == [1] and crash["schedule_source"] in ("table", "planner"), crash
        assert any(e.get("kind") == "slow" and e["resume_step"] < crash["resume_step"] for e in d["recovery"]), d
    assert_equal_to_reference(dumps, reference, dead=(1,), steps=STEPS, atol=1e-5)
