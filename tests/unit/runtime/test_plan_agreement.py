"""Every worker answers a failure from rank 0's plan table (runtime/plan_agreement.py): the table's
bytes and digest, the other ranks' adoption through a store (without planning), and a re-joining
worker's."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError, ResilienceError
from ds_resilience.planning.planner import plan
from ds_resilience.planning.provider import ScheduleProvider
from ds_resilience.planning.table import PlanTable, TableSpec
from ds_resilience.runtime.plan_agreement import (PublisherLost, adopt_published, announce, await_published,
                                                  check_joined, latest, newest, publish)
from ds_resilience.topology import Topology, Worker

TOPOLOGY = Topology(dp=2, pp=3)
PROFILED = CostModel(name="profiled", t_f=(1.0, 1.1, 1.2), t_b=(1.3, 1.2, 1.5), t_w=(0.9, 0.8, 1.0),
                     t_fused=(2.0, 1.9, 2.3))


def _provider(cost: CostModel = CostModel.unit(), variant: str = "recycle", max_failures: int = 1,
              cache_dir=None) -> ScheduleProvider:
    return ScheduleProvider.build(TOPOLOGY, 4, cost, schedule="1f1b", variant=variant, solver="heuristic",
                                  time_limit_s=1.0, memory_cap=None, max_failures=max_failures, all_coverable=False,
                                  cache_dir=cache_dir, workers=1)


def _diverged(provider: ScheduleProvider) -> Worker:
    """Make one class of ``provider``'s table hold another valid schedule (what a second CP-SAT
    build under a time limit can give): the decoupled plan instead of the recycle one."""
    failed = Worker(pipeline=0, stage=1)
    other = plan(2, 3, 4, [failed], variant="decoupled", solver="heuristic")
    view = provider.table.lookup([failed])
    assert view.data["schedule_text"] != other.schedule.to_text()
    view.data["schedule_text"] = other.schedule.to_text()
    view.data.pop("_lines", None)
    return failed


def test_a_table_round_trips_through_bytes_with_or_without_its_spec():
    table = _provider().table
    again = PlanTable.from_bytes(table.to_bytes(), table.spec)
    assert again.schedules_digest() == table.schedules_digest() and len(again) == len(table)
    alone = PlanTable.from_bytes(table.to_bytes())  # the spec it was built for, read from the bytes
    assert alone.spec == table.spec and TableSpec.from_dict(table.spec.to_dict()) == table.spec
    failed = [Worker(pipeline=1, stage=2)]
    assert alone.lookup(failed).schedule().to_text() == table.lookup(failed).schedule().to_text()
    with pytest.raises(PlanningError, match="another topology, cost model or options"):
        PlanTable.from_bytes(table.to_bytes(), _provider(cost=PROFILED).table.spec)
    with pytest.raises(PlanningError, match="unreadable"):
        PlanTable.from_bytes(b"not gzip")
    with pytest.raises(PlanningError, match="format"):
        TableSpec.from_dict({**table.spec.to_dict(), "format": 1})


def test_the_digest_covers_the_schedules_not_the_solver_timings():
    a, b = _provider().table, _provider().table
    assert a.schedules_digest() == b.schedules_digest()
    for data in b._plans.values():  # two builds of one spec differ in how long they took
        data["solver"] = {**data["solver"], "seconds": data["solver"]["seconds"] + 1.0}
    assert a.schedules_digest() == b.schedules_digest()
    provider = _provider()
    _diverged(provider)
    assert provider.table.schedules_digest() != a.schedules_digest()


def _maker(made: list):
    def make(cost, variant, solver):  # what the engine's _adopting_provider does: no table of its own
        made.append((cost, variant, solver))
        return ScheduleProvider(TOPOLOGY, 4, cost, schedule="1f1b", variant=variant, solver=solver,
                                time_limit_s=1.0, memory_cap=None)
    return make


def test_a_waiting_rank_takes_rank_0s_table_without_planning_and_then_answers_like_it(tmp_path):
    """Rank 0's table holds another valid schedule for one class than a second build would (as
    CP-SAT under a time limit can give): the other ranks answer that class as rank 0 does, because
    they plan nothing and take rank 0's cost model, variant, solver and table."""
    store = dist.HashStore()
    zero = _provider(cost=PROFILED, variant="auto")
    failed = _diverged(zero)
    assert _provider(cost=PROFILED, variant="auto").schedule_for([failed]).schedule.to_text() != \
        zero.schedule_for([failed]).schedule.to_text()  # a build of its own would answer otherwise
    publish(store, zero, scope="attempt0", build=1)
    made = []
    other = await_published(store, _maker(made), scope="attempt0", build=1, timeout_s=5.0)
    assert made == [(PROFILED, "auto", "heuristic")]
    assert other.table.schedules_digest() == zero.table.schedules_digest()
    for workers in ([failed], [Worker(pipeline=1, stage=0)]):
        assert other.schedule_for(workers).schedule.to_text() == zero.schedule_for(workers).schedule.to_text()
    publish(store, _provider(max_failures=0), scope="attempt0", build=2)  # rank 0 planned no table
    plain = await_published(store, _maker(made), scope="attempt0", build=2, timeout_s=5.0)
    assert plain.table is None and made[-1] == (CostModel.unit(), "recycle", "heuristic")
    cached = _provider(cache_dir=tmp_path / "node0")  # rank 0 publishes its cached file's bytes
    publish(store, cached, scope="attempt0", build=3)
    taken = await_published(store, _maker(made), scope="attempt0", build=3, timeout_s=5.0)
    assert taken.table.schedules_digest() == cached.table.schedules_digest()


def test_waiting_for_rank_0_stops_at_its_failure_or_the_deadline():
    """Rank 0 publishes before it can fail: once its failure is known, a missing record means no
    rank adopted that build (they all keep what they had); a record already there is adopted."""
    store = dist.HashStore()
    with pytest.raises(PublisherLost, match="rank 0 failed .*epoch 3.* before it published"):
        await_published(store, _maker([]), scope="attempt0", build=0, timeout_s=60.0,
                        interrupted=lambda: "epoch 3: crash")
    zero = _provider()
    publish(store, zero, scope="attempt0", build=0)
    taken = await_published(store, _maker([]), scope="attempt0", build=0, timeout_s=60.0,
                            interrupted=lambda: "epoch 3: crash")
    assert taken.table.schedules_digest() == zero.table.schedules_digest()
    store = dist.HashStore()
    with pytest.raises(ResilienceError, match="within 0 s"):
        await_published(store, _maker([]), scope="attempt0", build=0, timeout_s=0.1)
    publish(store, zero, scope="attempt0", build=0)
    store.set("dsr/plans/attempt0/0/table", _provider(cost=PROFILED).table.to_bytes())  # not what the record says
    with pytest.raises(ResilienceError, match="does not match its digest"):
        await_published(store, _maker([]), scope="attempt0", build=0, timeout_s=5.0)


def test_a_rejoining_worker_takes_the_survivors_newest_cost_model_variant_and_table():
    """The survivors re-planned with their profile (build 1, auto); a relaunched worker's config
    says unit costs. It must plan what they plan, or the first failure after it joins gives them
    different schedules."""
    store = dist.HashStore()
    assert latest(store, "attempt0") is None
    publish(store, _provider(), scope="attempt0", build=0)
    replanned = _provider(cost=PROFILED, variant="auto")
    publish(store, replanned, scope="attempt0", build=1)
    record = latest(store, "attempt0")
    assert record["build"] == 1 and record["variant"] == "auto"
    made = []
    joined = adopt_published(store, record, _maker(made), scope="attempt0")
    assert made == [(PROFILED, "auto", "heuristic")] and joined.cost == PROFILED and joined.variant == "auto"
    assert joined.table.schedules_digest() == replanned.table.schedules_digest()
    for failed in ([Worker(pipeline=0, stage=2)], [Worker(pipeline=0, stage=0), Worker(pipeline=1, stage=1)]):
        assert joined.schedule_for(failed).schedule.to_text() == replanned.schedule_for(failed).schedule.to_text()

    def wrong(cost, variant, solver):  # a provider that would plan with something else cannot adopt the table
        return ScheduleProvider(TOPOLOGY, 4, CostModel.unit(), schedule="1f1b", variant=variant, solver="heuristic",
                                time_limit_s=1.0, memory_cap=None)

    with pytest.raises(PlanningError, match="another cost model"):
        adopt_published(store, record, wrong, scope="attempt0")


def test_a_worker_relaunched_while_rank_0_builds_waits_for_that_build():
    """A worker fails while rank 0 builds the table after the profile (the others wait for it) and
    its relaunch comes up first: build 0 is the newest published, but the survivors will answer
    its re-join with build 1, so it waits for build 1. If rank 0 fails after announcing a build,
    everyone keeps the one before, even after rank 0 itself has re-joined."""
    store = dist.HashStore()
    assert newest(store, "attempt0", timeout_s=1.0) is None
    publish(store, _provider(), scope="attempt0", build=0)
    assert newest(store, "attempt0", timeout_s=1.0)["build"] == 0
    announce(store, scope="attempt0", build=1, publisher=0, epoch=1)
    replanned = _provider(cost=PROFILED, variant="auto")
    later = threading.Timer(0.5, publish, args=(store, replanned), kwargs={"scope": "attempt0", "build": 1})
    later.start()
    record = newest(store, "attempt0", timeout_s=30.0)
    later.join()
    assert record["build"] == 1 and record["variant"] == "auto" and latest(store, "attempt0")["build"] == 1
    announce(store, scope="attempt0", build=2, publisher=0, epoch=3)  # rank 0 dies building it
    asked = []
    record = newest(store, "attempt0", timeout_s=30.0,
                    interrupted=lambda rank, epoch: asked.append((rank, epoch)) or "epoch 4: crash")
    assert record["build"] == 1 and asked and set(asked) == {(0, 3)}
    with pytest.raises(ResilienceError, match="did not publish its plan table \\(build 2\\)"):
        newest(store, "attempt0", timeout_s=0.2)


def test_a_rejoined_worker_stops_when_its_table_is_not_the_survivors():
    """Once its donor handed it state the survivors are past any re-plan: the newest published
    build is theirs. A re-joiner that took another build (it read the store before rank 0 announced
    the re-plan) stops with both builds named; one that took theirs goes on."""
    store = dist.HashStore()
    check_joined(store, "attempt0", None, rank=1)  # nothing published on either side
    publish(store, _provider(), scope="attempt0", build=0)
    first = latest(store, "attempt0")
    check_joined(store, "attempt0", first, rank=1)
    with pytest.raises(ResilienceError, match="rank 1 re-joined with plan table none .* from build 0"):
        check_joined(store, "attempt0", None, rank=1)
    publish(store, _provider(cost=PROFILED, variant="auto"), scope="attempt0", build=1)
    with pytest.raises(ResilienceError, match="rank 1 re-joined with plan table build 0 .*survivors answer failures "
                                              "from build 1"):
        check_joined(store, "attempt0", first, rank=1)
    check_joined(store, "attempt0", latest(store, "attempt0"), rank=1)
    forged = {**latest(store, "attempt0"), "digest": "0" * 64}  # the same build number, another table
    with pytest.raises(ResilienceError, match="digest 000000000000"):
        check_joined(store, "attempt0", forged, rank=1)


def test_a_worker_that_rejoins_before_the_survivors_adopt_the_re_plan_stops():
    """The re-plan after the profile is published from a thread and adopted by every survivor at
    one step (``from_step``, ``ds_plans.BackgroundReplan``): a re-joiner that took it but was
    handed the state of an earlier step joined survivors that still answer from the build before,
    so it stops; at or after that step it goes on."""
    store = dist.HashStore()
    publish(store, _provider(), scope="attempt0", build=0)
    publish(store, _provider(cost=PROFILED, variant="auto"), scope="attempt0", build=1, from_step=6)
    record = latest(store, "attempt0")
    assert record["from_step"] == 6
    with pytest.raises(ResilienceError, match="rank 1 re-joined at step 5 with plan table build 1 .* only from step 6"):
        check_joined(store, "attempt0", record, rank=1, step=5)
    check_joined(store, "attempt0", record, rank=1, step=6)
    check_joined(store, "attempt0", record, rank=1, step=40)


def test_a_failure_of_the_publisher_ends_a_wait_even_one_it_rejoined_from():
    """``failed_after`` (the engine's test for ending a wait on the publisher): the newest epoch for
    a rank waiting at a build; for a re-joiner, any epoch after the announcement (rank 0 failed in
    epoch 4 and re-joined in epoch 5)."""
    from ds_resilience.runtime import membership as mb

    store = dist.HashStore()

    def failed(rank, since=None):
        record = mb.failed_after(store, rank, since)
        return None if record is None else f"epoch {record.epoch}: {record.reason}"

    records = [(1, "start", (), (0, 1, 2, 3)), (2, "crash", (2,), (0, 1, 3)), (3, "rejoin", (), (0, 1, 2, 3)),
               (4, "crash", (0,), (1, 2, 3)), (5, "rejoin", (), (0, 1, 2, 3))]
    for epoch, kind, down, alive in records:
        mb.publish_epoch(store, mb.EpochRecord(epoch=epoch, failed=down, alive=alive, reason=f"{kind} {epoch}",
                                               detected_at=0.0, kind=kind))
        if epoch == 4:
            assert failed(0) == "epoch 4: crash 4"
    assert failed(0) is None  # the newest epoch: rank 0 is back
    assert failed(0, 3) == "epoch 4: crash 4"  # announced in epoch 3, failed after it
    assert failed(0, 4) is None and failed(2, 1) == "epoch 2: crash 2" and failed(1, 0) is None
