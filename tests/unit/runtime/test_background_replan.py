"""The re-plan after the self-profile runs off the training thread (issue 45): ``_replan`` returns
at once, every rank adopts the new table at the same step (the profile's last + ``REPLAN_LAG``),
and the table in force is a function of the step, so that a recovery that rolls back across that
step plans from the same table on every survivor (``ds_plans.BackgroundReplan``)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import ResilienceError
from ds_resilience.integrations import ds_plans
from ds_resilience.integrations.ds_plans import REPLAN_LAG, BackgroundReplan
from ds_resilience.planning.generators import generate
from ds_resilience.planning.provider import ScheduleProvider
from ds_resilience.runtime.plan_agreement import PublisherLost
from ds_resilience.runtime.recovery import Generation
from ds_resilience.topology import Topology

TOPOLOGY = Topology(dp=2, pp=2)
MICROBATCHES = 4


def _provider(schedule: str) -> ScheduleProvider:
    return ScheduleProvider.build(TOPOLOGY, MICROBATCHES, CostModel.unit(), schedule=schedule, variant="recycle",
                                  solver="heuristic", time_limit_s=1.0, memory_cap=None, max_failures=0,
                                  all_coverable=False, cache_dir=None, workers=1)


def _fault_free(schedule: str) -> Generation:
    return Generation(epoch=0, topology=TOPOLOGY, schedule=generate(schedule, 2, 2, MICROBATCHES, CostModel.unit()),
                      source="fault-free", lookup_s=0.0, figures=None, groups=None)


class Steps:
    """The engine's optimizer steps, moved by the test."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def _replan(plans, steps: Steps, before: ScheduleProvider, reported: list | None = None) -> BackgroundReplan:
    return BackgroundReplan(plans, CostModel.unit(), rank=0, due=steps.value + REPLAN_LAG, before=before, steps=steps,
                            reporter=lambda: reported is not None)


def test_the_re_plan_returns_at_once_and_every_rank_adopts_its_table_at_the_agreed_step_not_before(caplog):
    """The planning blocks until the test lets it go: ``start`` returns meanwhile, the steps before
    the agreed one run with the table before (no wait), and the agreed step's boundary waits for
    the table (and says how long), adopts it and switches the fault-free schedule."""
    before, after = _provider("decoupled"), _provider("1f1b")
    release, entered = threading.Event(), threading.Event()

    def plans():
        entered.set()
        assert release.wait(10)
        return after

    profile_end = 5
    steps = Steps(profile_end)
    started = time.perf_counter()
    replan = _replan(plans, steps, before, reported=[]).start()
    assert time.perf_counter() - started < 0.5 and entered.wait(5) and not replan.done  # planning goes on
    assert replan.due == profile_end + REPLAN_LAG
    generation = _fault_free("decoupled")
    for step in range(profile_end, replan.due):  # the iterations in between: the table they had
        steps.value = step
        assert replan.at_boundary(step, generation) is generation
        assert replan.provider.current is before and replan.provider.schedule_name == "decoupled"
    assert not replan.done

    steps.value = replan.due
    threading.Timer(0.3, release.set).start()
    caplog.set_level(logging.INFO, logger="ds_resilience")
    waited = time.perf_counter()
    switched = replan.at_boundary(replan.due, generation)
    assert time.perf_counter() - waited >= 0.2  # the boundary waited for the table
    assert replan.done and replan.provider.current is after and replan.provider.schedule_name == "1f1b"
    assert switched is not generation and switched.schedule == after.schedule_for(frozenset()).schedule
    assert switched.epoch == generation.epoch and switched.source == "fault-free"
    text = caplog.text
    assert f"step {replan.due} waited" in text and "for the re-plan" in text
    assert f"plans rebuilt with the profiled costs (unit) in" in text and f"adopted at step {replan.due}" in text
    assert replan.at_boundary(replan.due + 1, switched) is switched  # once switched, nothing more


def test_a_recovery_that_rolls_back_below_the_agreed_step_plans_from_the_table_before_on_every_rank():
    """One rank passed the agreed step (adopted), its peer had not when a failure came: both plan
    the recovery at the resume step (the fewest steps any survivor took, after the rollback), so
    both take the table before; a fault-free generation rebuilt then is switched again at the
    agreed step."""
    before, after = _provider("decoupled"), _provider("1f1b")
    steps = Steps(3)
    replan = _replan(lambda: after, steps, before).start()
    ahead = replan.at_boundary(replan.due, _fault_free("decoupled"))
    assert ahead.schedule == after.schedule_for(frozenset()).schedule
    steps.value = replan.due - 1  # the rollback
    assert replan.provider.current is before  # what the recovery's schedule_for reads
    assert replan.provider.schedule_for(frozenset()).schedule == before.schedule_for(frozenset()).schedule
    rebuilt = _fault_free("decoupled")  # e.g. a re-join back to fault-free, from the table before
    assert replan.at_boundary(replan.due - 1, rebuilt) is rebuilt
    steps.value = replan.due
    assert replan.at_boundary(replan.due, rebuilt).schedule == after.schedule_for(frozenset()).schedule


def test_a_lost_publisher_abandons_the_re_plan_on_every_rank_and_a_thread_error_is_raised_at_the_agreed_step(caplog):
    before = _provider("decoupled")

    def lost():
        raise PublisherLost("rank 0 failed (epoch 1: crash) before it published its plan table (build 1)")

    caplog.set_level(logging.INFO, logger="ds_resilience")
    steps = Steps(3)
    replan = _replan(lost, steps, before, reported=[]).start()
    generation = _fault_free("decoupled")
    steps.value = replan.due
    assert replan.at_boundary(replan.due, generation) is generation and replan.provider.current is before
    assert "re-plan abandoned" in caplog.text and "plans rebuilt" not in caplog.text

    def broken():
        raise ResilienceError("rank 0 did not publish its plan table (build 1) within 1800 s")

    steps = Steps(3)
    replan = _replan(broken, steps, before).start()
    for _ in range(100):
        if replan.done:
            break
        time.sleep(0.01)
    assert replan.at_boundary(replan.due - 1, generation) is generation  # not before the agreed step
    steps.value = replan.due
    with pytest.raises(ResilienceError, match="did not publish"):
        replan.at_boundary(replan.due, generation)
    with pytest.raises(ResilienceError, match="did not publish"):
        replan.provider.schedule_for(frozenset())  # nor later: this rank cannot tell which table the others run


def test_the_thread_fires_in_replan_at_the_profile_s_step_and_plans_on_its_own_store_connection():
    """The fault point ``in_replan`` fires in the thread at the step the profile ended, not at
    whatever step training reached meanwhile; the thread's store is a clone of the engine's."""
    from ds_resilience.config import ResilienceConfig

    fired = []

    class Store:
        clones = 0

        def clone(self):
            Store.clones += 1
            return self

        def __getattr__(self, name):  # announce / publish / latest_epoch: not needed here
            raise AssertionError(name)

    settings = ds_plans.PlanSettings(config=ResilienceConfig(), topology=TOPOLOGY, microbatches=MICROBATCHES,
                                     tied=(), clipping=False, fp16=False)
    plans = ds_plans.EnginePlans(settings, rank=1, scope="attempt0", coordinator=type("C", (), {"store": Store()})(),
                                 fire=lambda point, step: fired.append((point, step)), step=lambda: 99)
    agreement = plans.agreement(step=5, own_store=True)
    assert Store.clones == 1 and agreement.step() == 5
    agreement.fire("in_replan", agreement.step())
    assert fired == [("in_replan", 5)]
    assert plans.agreement().step() == 99 and Store.clones == 1
