"""The plan table: one plan per normalized class, cached, looked up for any actual failure set."""

import itertools

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError
from ds_resilience.ir import validate
from ds_resilience.planning.normalize import normalize
from ds_resilience.planning.table import PlanTable, TableSpec, build_table, enumerate_keys
from ds_resilience.topology import Worker

W = Worker


def brute_force_classes(dp, pp, k):
    cells = [W(pipeline=p, stage=s) for p in range(dp) for s in range(pp)]
    return {normalize(dp, pp, c).key for r in range(k + 1) for c in itertools.combinations(cells, r)}


@pytest.mark.parametrize("dp,pp,k", [(2, 2, 2), (3, 2, 2), (3, 3, 2), (2, 4, 3), (4, 2, 3)])
def test_enumeration_equals_brute_force(dp, pp, k):
    keys = enumerate_keys(dp, pp, max_failures=k)
    assert len(keys) == len(set(keys))
    assert set(keys) == brute_force_classes(dp, pp, k)


def test_all_coverable_adds_every_coverable_set():
    dp, pp = 2, 3
    cells = [W(pipeline=p, stage=s) for p in range(dp) for s in range(pp)]
    expected = set()
    for r in range(len(cells) + 1):
        for c in itertools.combinations(cells, r):
            lost = [sum(1 for w in c if w.stage == s) for s in range(pp)]
            if r <= 1 or max(lost) < dp:
                expected.add(normalize(dp, pp, c).key)
    assert set(enumerate_keys(dp, pp, max_failures=1, all_coverable=True)) == expected


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    spec = TableSpec(dp=3, pp=3, microbatches=3, cost=CostModel.unit(), max_failures=2)
    t, summary = build_table(spec, cache_dir=tmp_path_factory.mktemp("plans"), workers=2)
    assert not summary["cached"] and summary["plans"] == len(t)
    return t, spec, summary


def test_every_actual_failure_set_gets_a_valid_relabelled_plan(table):
    t, spec, _ = table
    cells = [W(pipeline=p, stage=s) for p in range(spec.dp) for s in range(spec.pp)]
    for r in range(spec.max_failures + 1):
        for failed in itertools.combinations(cells, r):
            view = t.lookup(failed)
            schedule = view.schedule()
            validate(schedule)
            assert schedule.failed == {w.stage * spec.dp + w.pipeline for w in failed}
            assert set(view.plan().failed) == set(failed)
            for w in range(len(schedule.workers)):
                assert view.actions_for(w) == schedule.workers[w]
            # relabelling keeps the timing: the same iteration time as the canonical plan
            assert view.plan().iteration_time == view.iteration_time


def test_rejoin_is_the_smaller_lookup(table):
    t, _, _ = table
    degraded = t.lookup([W(pipeline=2, stage=1)])
    healthy = t.lookup([])
    assert healthy.schedule().failed == frozenset()
    assert degraded.iteration_time >= healthy.iteration_time


def test_beyond_tolerance_and_uncoverable(table):
    t, _, _ = table
    with pytest.raises(PlanningError, match="beyond the plan table's tolerance"):
        t.lookup([W(pipeline=0, stage=0), W(pipeline=1, stage=1), W(pipeline=2, stage=2)])
    spec = TableSpec(dp=2, pp=2, microbatches=2, cost=CostModel.unit(), max_failures=2)
    small, summary = build_table(spec, workers=1)
    assert summary["uncoverable"] > 0
    with pytest.raises(PlanningError, match="cannot cover"):
        small.lookup([W(pipeline=0, stage=1), W(pipeline=1, stage=1)])


def test_cache_hit_and_spec_mismatch(table, tmp_path):
    t, spec, summary = table
    again, summary2 = build_table(spec, cache_dir=summary["path"].rsplit("/", 1)[0])
    assert summary2["cached"] and len(again) == len(t)
    assert again.lookup([W(pipeline=1, stage=2)]).figures == t.lookup([W(pipeline=1, stage=2)]).figures
    other = TableSpec(dp=3, pp=3, microbatches=4, cost=CostModel.unit(), max_failures=2)
    from pathlib import Path

    with pytest.raises(PlanningError, match="another topology"):
        PlanTable.load(Path(summary["path"]), other)
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(PlanningError, match="unreadable"):
        PlanTable.load(broken, spec)
