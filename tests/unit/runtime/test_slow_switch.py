"""Issue 45 part 2, the live switch for slow workers: the generation a ``slow`` epoch builds
(runtime/recovery.py, planning/provider.py) and the reporting rank's request (runtime/stragglers.py).
The agent's side and the epoch's checks: test_membership.py; live: tests/live/test_stragglers_live.py."""

from __future__ import annotations

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.epochs import EpochRecord, SlowRequest
from ds_resilience.ir import ActionKind
from ds_resilience.errors import PlanningError
from ds_resilience.planning.provider import SLOW_LEVELS, ScheduleProvider, slow_level
from ds_resilience.runtime.recovery import LiveRecovery
from ds_resilience.runtime.stragglers import StragglerWatch
from ds_resilience.topology import Topology, Worker

SLOW = Worker(pipeline=1, stage=0)


def _recovery(dp=2, pp=2, m=8) -> LiveRecovery:
    """A LiveRecovery's planning side (no coordinator, groups or executor)."""
    rec = LiveRecovery.__new__(LiveRecovery)
    rec.topology = Topology(dp=dp, pp=pp)
    rec.provider = ScheduleProvider(rec.topology, m, CostModel.unit(), schedule="1f1b", variant="recycle",
                                    solver="heuristic", time_limit_s=5.0, memory_cap=None)
    return rec


def _loads(schedule):
    return [sum(1 for a in actions if a.kind is ActionKind.F) for actions in schedule.workers]


def test_a_slow_generation_runs_the_weighted_plan_every_rank_builds_alike():
    rec = _recovery()
    gen = rec.generation(5, frozenset(), build=False, speeds={SLOW: 0.5})
    again = _recovery().generation(5, frozenset(), build=False, speeds={SLOW: 0.5})
    assert gen.schedule == again.schedule  # deterministic: no agreement needed
    assert gen.source == "slow-plan" and gen.speeds == ((SLOW, 0.5),) and gen.groups is None
    assert gen.topology.failed == frozenset()  # same members
    index = rec.topology.worker_index(SLOW)
    peer = rec.topology.worker_index(Worker(pipeline=0, stage=0))
    loads = _loads(gen.schedule)
    assert loads[index] < 8 < loads[peer] and loads[index] + loads[peer] == 16 == sum(loads[2:])
    f = gen.figures
    assert f["loads"] == loads and f["speeds"] == {str(SLOW): 0.5}
    assert f["bound"] <= f["iteration_time"] < f["unadapted_time"] and f["fault_free_iteration_time"] < f["unadapted_time"]
    assert rec.generation(7, frozenset(), build=False, speeds={SLOW: 0.5}).schedule is gen.schedule  # planned once
    healthy = rec.generation(6, frozenset(), build=False, speeds={})
    assert healthy.source == "fault-free" and healthy.speeds == () and _loads(healthy.schedule) == [8, 8, 8, 8]


def test_speeds_snap_to_the_slow_tables_levels():
    assert [slow_level(v) for v in (0.46, 0.5, 0.54, 0.71, 0.8, 0.6, 0.333)] == [0.5, 0.5, 0.5, 0.75, 0.75, 0.6, 0.33]


def test_the_slow_table_plans_one_slow_worker_per_stage_ahead_and_answers_as_on_demand():
    """Warmed (planned ahead, as the live stage does in a thread) or not, a provider answers a slow
    worker with the same schedule: ranks need not agree on whether their table is ready. A worker of
    pipeline 1 gets pipeline 0's plan relabelled: the same loads, mirrored."""
    warm, cold = _recovery(dp=3, pp=2, m=6).provider, _recovery(dp=3, pp=2, m=6).provider
    assert warm.warm_slow_table() == 2 * len(SLOW_LEVELS) and warm.warm_slow_table() == 0  # once per provider
    for worker in (Worker(pipeline=0, stage=0), Worker(pipeline=2, stage=1), Worker(pipeline=1, stage=0)):
        for speed in (0.47, 0.74):
            a, b = warm.schedule_for_slow({worker: speed}), cold.schedule_for_slow({worker: speed})
            assert a.source == "slow-table" and b.source == "slow-plan"
            assert a.schedule == b.schedule and a.figures == b.figures
            loads, me = a.figures["loads"], warm.topology.worker_index(worker)
            assert loads == _loads(a.schedule) and loads[me] == min(loads) < 6
            assert a.figures["speeds"] == {str(worker): slow_level(speed)}
    first = warm.schedule_for_slow({Worker(pipeline=0, stage=1): 0.5}).figures["loads"]
    other = warm.schedule_for_slow({Worker(pipeline=2, stage=1): 0.5}).figures["loads"]
    assert other == [first[2], first[1], first[0], first[5], first[4], first[3]]  # pipelines 0 and 2 swapped
    with pytest.raises(PlanningError, match="outside the 3x2 grid"):
        warm.schedule_for_slow({Worker(pipeline=3, stage=0): 0.5})


def test_a_slow_worker_beside_a_failed_one_runs_the_failure_plan():
    rec = _recovery()
    dead = Worker(pipeline=0, stage=1)
    gen = rec.generation(5, frozenset({dead}), build=False, speeds={SLOW: 0.5})
    plain = rec.generation(5, frozenset({dead}), build=False)
    assert gen.speeds == () and gen.source == plain.source != "slow-plan" and gen.schedule == plain.schedule


def test_a_slow_epochs_speeds_are_the_grids_workers():
    rec = _recovery()
    record = EpochRecord(epoch=3, failed=(2,), alive=(0, 1, 3), kind="slow", speeds=((1, 0.5), (3, 0.7)))
    assert rec._speeds(record) == {Worker(pipeline=1, stage=0): 0.5, Worker(pipeline=1, stage=1): 0.7}


class _Store:
    def __init__(self):
        self.data, self.counters = {}, {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.counters[key] = self.counters.get(key, 0) + n
        return self.counters[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        return [self.data[k] for k in keys]


def test_each_decision_asks_the_agent_for_the_workers_slow_now():
    """Slow, then recovered: two requests, numbered, with every worker slow at that moment (none at
    the end); without ``switch`` the watch only reports."""
    for switch in (True, False):
        store = _Store()
        members = {0: 0, 1: 0, 2: 1, 3: 1}
        watches = {r: StragglerWatch(store, "s", r, lambda: members, window=3, margin=0.3, switch=switch)
                   for r in members}
        for it in range(16):
            for r, w in watches.items():
                slow = 2.0 if r == 1 and 2 <= it < 8 else 1.0
                w.after_iteration(it, {"F": [0.01 * slow], "B": [0.02 * slow]}, 1)
        assert [(d.rank, d.slow) for d in watches[0].decisions] == [(1, True), (1, False)]
        if not switch:
            assert watches[0].requests == [] and "dsr/slow_request" not in store.data
            continue
        assert [(q.seq, q.speeds) for q in watches[0].requests] == [(1, ((1, 0.5),)), (2, ())]
        assert SlowRequest.from_json(store.data["dsr/slow_request"]) == watches[0].requests[-1]
        assert "rank 1 recovered" in watches[0].requests[-1].reason


def _flapping(hold: int, iterations: int = 40):
    """Rank 1 slow and fast by turns (4 iterations each way), as a busy machine makes a worker: the
    reporting rank's watch after ``iterations``."""
    store = _Store()
    members = {0: 0, 1: 0, 2: 1, 3: 1}
    watches = {r: StragglerWatch(store, "s", r, lambda: members, window=2, margin=0.3, switch=True, hold=hold)
               for r in members}
    for it in range(iterations):
        for r, w in watches.items():
            slow = 2.0 if r == 1 and (it // 4) % 2 else 1.0
            w.after_iteration(it, {"F": [0.01 * slow], "B": [0.02 * slow]}, 1)
    return watches[0]


def test_a_worker_slow_and_fast_by_turns_switches_the_schedule_at_most_once_per_hold():
    """Every flip is decided and logged; without a hold each one is a switch (an epoch), with
    ``straggler_hold`` the requests are that many iterations apart and follow the newest state."""
    free = _flapping(hold=0)
    assert len(free.decisions) >= 8 and len(free.requests) == len(free.decisions)
    held = _flapping(hold=20)
    assert len(held.decisions) == len(free.decisions)
    assert 1 <= len(held.requests) <= 2, [(q.seq, q.speeds) for q in held.requests]
    assert held.requests[0].speeds == ((1, 0.5),)
    with pytest.raises(ValueError, match="hold must be >= 0"):
        StragglerWatch(_Store(), "s", 0, dict, window=2, margin=0.3, hold=-1)


def test_the_switch_is_on_by_default_unless_the_environment_or_the_config_says_no():
    from ds_resilience.config import DetectorConfig
    from ds_resilience.runtime.stragglers import replans

    assert DetectorConfig().straggler_replan is None and replans(None, {}) is True
    assert replans(None, {"DSR_STRAGGLER_REPLAN": "0"}) is False
    assert replans(True, {"DSR_STRAGGLER_REPLAN": "0"}) is True and replans(False, {}) is False
