"""runtime/live_stage.py: what the watcher thread releases when an epoch is latched."""

from __future__ import annotations

from types import SimpleNamespace

from ds_resilience.epochs import EpochRecord
from ds_resilience.runtime.live_stage import LiveStage


class _Groups:
    def __init__(self):
        self.poisoned = 0

    def poison(self):
        self.poisoned += 1


def _stage(epoch: int):
    stage = LiveStage.__new__(LiveStage)
    groups = _Groups()
    stage.generation = SimpleNamespace(epoch=epoch, groups=groups)
    stage.tier = SimpleNamespace(dropped=[], drop=lambda failed: stage.tier.dropped.append(tuple(failed)))
    seen = []
    stage.releases = [seen.append]
    return stage, groups, seen


def test_a_watcher_that_comes_late_does_not_poison_the_generation_built_for_its_epoch():
    """CI: a starved watcher thread called the release after the main thread had applied the
    epoch; it poisoned the new generation's groups (and megatron-core's renewed tensor-parallel
    group), and the peers failed later with no epoch to explain it. The tier still drops the
    failed ranks, and the front end's own releases still hear of the record."""
    crash = EpochRecord(epoch=3, failed=(1,), alive=(0, 2), kind="crash")
    stage, groups, seen = _stage(epoch=3)  # the main thread already runs epoch 3's generation
    stage._on_epoch(crash)
    assert groups.poisoned == 0 and stage.tier.dropped == [(1,)] and seen == [crash]
    stage, groups, seen = _stage(epoch=2)  # still in the generation before it: released
    stage._on_epoch(crash)
    assert groups.poisoned == 1 and seen == [crash]
    rejoin = EpochRecord(epoch=3, failed=(), alive=(0, 1, 2), joining=(1,), kind="rejoin")
    stage, groups, _ = _stage(epoch=2)  # a re-join releases nothing in flight
    stage._on_epoch(rejoin)
    assert groups.poisoned == 0
