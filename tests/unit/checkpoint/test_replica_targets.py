"""Replica placement over the machines left after failures (``checkpoint/targets.py``), and the idle
gate that must keep letting replicas through once the iterations change (pure, single process)."""

from __future__ import annotations

import itertools
import threading

import pytest

from ds_resilience.checkpoint.replication import IdleGate
from ds_resilience.checkpoint.targets import replica_targets
from ds_resilience.errors import ConfigError


def _send(world, rpm, replicas, gone=(), key=None):
    return {r: list(t.send_to) for r, t in replica_targets(world, rpm, replicas, gone=gone, machine_key=key).items()}


def _pipeline_major(rank):  # PP=2 x DP=2, rank = stage * 2 + pipeline: (pipeline, stage)
    return (rank % 2, rank // 2)


def test_without_failures_the_placement_is_gemini_group_and_mixed_placement():
    assert _send(4, 1, 2) == {0: [1], 1: [0], 2: [3], 3: [2]}  # groups {0,1} {2,3}
    assert _send(5, 1, 2) == {0: [1], 1: [0], 2: [4], 3: [2], 4: [3]}  # ring inside the last group
    assert _send(4, 1, 2, key=_pipeline_major) == {0: [2], 1: [3], 2: [0], 3: [1]}  # groups {0,2} {1,3}
    assert _send(4, 2, 2) == {0: [2], 1: [3], 2: [0], 3: [1]}  # the same local index on the other machine


def test_a_dead_replica_target_is_replaced_by_an_alive_machine():
    """The issue's case: rank 2's replicas went to rank 3; rank 3 dies; they go elsewhere now."""
    before = _send(4, 1, 2)
    assert before[2] == [3]
    after = _send(4, 1, 2, gone={3})
    assert 3 not in after
    assert after[2] and 3 not in after[2] and 2 not in after[2]
    assert all(len(t) == 1 for t in after.values())  # two copies each, over the three machines left
    # the engine's pipeline-major grouping (the README's main job): rank 1's target was rank 3
    demo = _send(4, 1, 2, gone={3}, key=_pipeline_major)
    assert demo[1] and demo[1] != [3] and demo[1] != [1]
    assert sorted(t for ts in demo.values() for t in ts) == [0, 1, 2]  # every survivor holds one


def test_a_dead_rank_on_a_machine_still_alive_is_replaced_by_its_machine_mate():
    """Two ranks per machine: rank 3 (machine 1, local 1) dies; rank 1's replicas (machine 0,
    local 1) go to machine 1's other rank, never to machine 0."""
    after = replica_targets(4, 2, 2, gone={3})
    assert after[1].send_to == (2,)
    assert sorted(after[2].recv_from) == [0, 1]
    assert after[0].send_to == (2,)


def test_one_machine_left_keeps_its_snapshots_to_itself():
    assert _send(4, 1, 2, gone={1, 2, 3}) == {0: []}
    assert _send(4, 2, 2, gone={2, 3}) == {0: [], 1: []}  # never a copy on the owner's own machine


@pytest.mark.parametrize("world,rpm,replicas", [(4, 1, 2), (6, 1, 2), (6, 1, 3), (5, 1, 2), (8, 2, 2), (12, 3, 2),
                                                (9, 1, 3)])
def test_every_failure_set_gives_a_consistent_placement_over_the_survivors(world, rpm, replicas):
    for k in range(world):
        for gone in itertools.combinations(range(world), k):
            placed = replica_targets(world, rpm, replicas, gone=gone)
            alive = [r for r in range(world) if r not in gone]
            assert sorted(placed) == alive
            machines = {r // rpm for r in alive}
            copies = min(replicas, len(machines)) - 1
            for r, t in placed.items():
                assert len(t.send_to) == copies, (gone, r, t)
                assert all(d not in gone and d // rpm != r // rpm for d in t.send_to), (gone, r, t)
                assert len({d // rpm for d in t.send_to}) == copies  # distinct machines
                for d in t.send_to:
                    assert r in placed[d].recv_from
            assert sum(len(t.recv_from) for t in placed.values()) == sum(len(t.send_to) for t in placed.values())


def test_placements_are_the_same_on_every_rank_for_the_same_failures():
    # the survivors compute it independently: it must not depend on the order failures were reported
    assert replica_targets(8, 1, 2, gone=[5, 1, 3]) == replica_targets(8, 1, 2, gone={1, 3, 5})


def test_bad_machine_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="ranks_per_machine"):
        replica_targets(6, 4, 2)
    with pytest.raises(ConfigError, match="replicas"):
        replica_targets(4, 1, 0)


def test_idle_gate_forgets_spans_older_than_the_previous_iteration():
    """A chunk time measured under load (2 s here) must not wait for a span as long as one opened
    iterations ago (5 s): half the longest span of the last two iterations is enough."""
    gate = IdleGate(enabled=True)
    gate.open(5.0)
    gate.close()
    gate.mark_iteration()
    assert gate.longest == 5.0  # the previous iteration's spans still count
    gate.mark_iteration()
    assert gate.longest == 0.0
    got = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(2.0)))
    t.start()
    gate.open(1.0)  # shorter than a chunk, but the longest of this iteration: the chunk goes in it
    t.join(10.0)
    assert got == [True]
    gate.close()
    assert gate.acquire(0.0, timeout_s=0.05) is False  # closed: a bounded wait gives up
    gate.stop()
    assert gate.acquire(0.0) is False
