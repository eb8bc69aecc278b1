"""StepValidator: the global norm / overflow agreed through a store, speculation and its counts."""

import math

import pytest

from ds_resilience.runtime.validation import StepValidator, clip_coefficient


def _validator(clip=1.0, fp16=False, stages=2):
    store: dict[str, str] = {}
    v = StepValidator(clip=clip, check_overflow=fp16, num_stages=stages, key=lambda i, s: f"{i}/{s}",
                      publish=store.__setitem__, wait=lambda k: store[k].encode(), delete=lambda k: store.pop(k, None))
    return v, store


def test_the_decision_is_the_global_norm_over_every_stage():
    v, store = _validator(clip=1.0)
    v.publish(0, 0, 0.64, False)
    v.publish(0, 1, 0.36, False)
    d = v.decide(0)
    assert d.norm == pytest.approx(1.0) and not d.overflow
    assert d.coef == pytest.approx(clip_coefficient(1.0, 1.0)) and d.coef < 1.0  # 1 / (1 + 1e-6)
    v.publish(1, 0, 0.25, False)
    v.publish(1, 1, 0.0, False)
    assert v.decide(1).speculation_holds


def test_speculation_stops_after_a_clipped_step_and_resumes_after_an_unclipped_one():
    v, _ = _validator(clip=1.0)
    assert v.should_speculate(0.1, False)  # nothing known yet
    assert not v.should_speculate(1.5, False)  # this stage's share alone exceeds the limit
    for i, sq in enumerate((4.0, 0.01)):
        v.publish(i, 0, sq, False)
        v.publish(i, 1, 0.0, False)
        v.decide(i)
        assert v.should_speculate(0.0, False) == (sq < 1.0)


def test_fp16_overflow_anywhere_skips_everywhere_and_a_nan_norm_is_an_overflow():
    v, _ = _validator(clip=0.0, fp16=True)
    assert v.active and not v.should_speculate(0.0, True)
    v.publish(0, 0, 0.5, False)
    v.publish(0, 1, math.nan, False)
    d = v.decide(0)
    assert d.overflow and not d.speculation_holds
    v2, _ = _validator(clip=0.0, fp16=False)
    assert not v2.active


def test_counts_per_100_steps_and_old_keys_are_deleted():
    v, store = _validator()
    for i in range(10):
        v.publish(i, 0, 0.0, False)
        v.record(i, "rolled back" if i in (3, 7) else "waited" if i == 5 else "speculated")
    assert v.rollbacks_per_100() == pytest.approx(20.0)
    assert v.waits_per_100() == pytest.approx(10.0)
    assert (v.speculated, v.rollbacks, v.waited) == (7, 2, 1)
    assert sorted(store) == ["7/0", "8/0", "9/0"]  # three iterations kept: every stage validated the rest


def test_every_replica_of_a_stage_chooses_alike_a_fresh_one_reads_the_last_decision_from_the_store():
    """A worker that re-joined (no decision of its own yet) and one that has trained all along must
    choose alike at the next step: ZeRO-1 gathers shards once per step taken, so a replica that
    speculates (and later redoes the step) beside one that waits would cross the stage's
    collectives. The fresh one reads the previous iteration's decision from the store."""
    old, store = _validator(clip=1.0)
    old.publish(4, 0, 4.0, False)
    old.publish(4, 1, 0.0, False)
    old.decide(4)  # clipped: the next step waits
    fresh = StepValidator(clip=1.0, check_overflow=False, num_stages=2, key=lambda i, s: f"{i}/{s}",
                          publish=store.__setitem__, wait=lambda k: store[k].encode(), delete=lambda k: store.pop(k, None),
                          peek=lambda k: store[k].encode() if k in store else None)
    assert fresh.should_speculate(0.0, False, 5) == old.should_speculate(0.0, False, 5) is False
    # a restart: a fresh store has no history, every worker alike speculates
    empty = StepValidator(clip=1.0, check_overflow=False, num_stages=2, key=lambda i, s: f"{i}/{s}",
                          publish=lambda k, v: None, wait=lambda k: b"", peek=lambda k: None)
    assert empty.should_speculate(0.0, False, 5)


def test_a_recovery_forgets_the_values_of_the_iterations_it_replays():
    v, store = _validator()
    for i in (3, 4, 5):
        v.publish(i, 0, 0.5, False)
        v.publish(i, 1, 0.5, False)
    v.forget_from(4, stage=0)
    assert sorted(store) == ["3/0", "3/1", "4/1", "5/1"]
