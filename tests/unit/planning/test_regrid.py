"""Re-grid planning (planning/regrid.py): the survivors' positions on a template grid minimize the
bytes they receive (the Hungarian method against brute force), every lacking layer names a
surviving holder or the snapshots, and the sends spread over the holders."""

from __future__ import annotations

import itertools
import random

import pytest

from ds_resilience.errors import PlanningError
from ds_resilience.planning.layers import LayerProfile
from ds_resilience.planning.regrid import Position, assign, plan_regrid, positions
from ds_resilience.planning.templates import instantiate, plan_templates


def test_the_hungarian_assignment_is_the_cheapest_brute_force():
    rng = random.Random(2)
    for _ in range(300):
        rows, cols = rng.randint(1, 5), rng.randint(1, 6)
        if rows > cols:
            rows, cols = cols, rows
        cost = [[rng.choice([0, 1, 2, 3, 5, 8, 13]) * 1.0 for _ in range(cols)] for _ in range(rows)]
        got = assign(cost)
        assert len(set(got)) == rows and all(0 <= c < cols for c in got)
        best = min(sum(cost[r][c] for r, c in enumerate(p)) for p in itertools.permutations(range(cols), rows))
        assert sum(cost[r][c] for r, c in enumerate(got)) == best
    with pytest.raises(PlanningError, match="cannot assign 3 rows to 2 columns"):
        assign([[0, 0]] * 3)


def test_a_stage_lost_on_pp3_dp2_regrids_the_four_survivors_onto_two_pipelines_of_two():
    """PP=3 x DP=2 over 6 layers, both replicas of stage 1 (layers 2-3) dead: the four survivors
    go to two 2-stage pipelines (layers 0-2 | 3-5); each receives the fewest bytes, the layers no
    survivor holds come from the snapshots, the rest from surviving holders."""
    profile = LayerProfile.uniform(6)
    templates = plan_templates(profile, 2, 4)
    choice = instantiate(templates, 4, 8, tolerance=1)
    assert choice.counts == {2: 2}
    targets = positions(choice, templates)
    assert [(t.first, t.last) for t in targets] == [(0, 3), (3, 6), (0, 3), (3, 6)]
    held = {"p0s0": [0, 1], "p1s0": [0, 1], "p0s2": [4, 5], "p1s2": [4, 5]}
    plan = plan_regrid(held, targets, [10.0] * 6)
    assert sorted((t.first, t.last) for t in plan.assignment.values()) == [(0, 3), (0, 3), (3, 6), (3, 6)]
    assert all(plan.assignment[s].first == 0 for s in ("p0s0", "p1s0"))  # nobody swaps sides
    assert plan.bytes_moved == 40.0 and plan.bytes_from_snapshots == 40.0  # layers 2 and 3, twice each
    assert not plan.idle


def test_random_regrids_receive_the_fewest_bytes_and_name_valid_sources():
    rng = random.Random(9)
    for _ in range(150):
        layers = rng.randint(2, 8)
        sizes = [float(rng.randint(1, 9)) for _ in range(layers)]
        survivors = {}
        for s in range(rng.randint(1, 6)):
            a = rng.randrange(layers)
            b = rng.randint(a + 1, layers)
            survivors[f"w{s}"] = list(range(a, b)) if rng.random() < 0.9 else []
        count = rng.randint(1, len(survivors))
        cuts = sorted(rng.sample(range(1, layers), min(count - 1, layers - 1)))
        bounds = [0, *cuts, layers]
        targets = [Position(0, k, bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
        plan = plan_regrid(survivors, targets, sizes)
        names = list(survivors)

        def lacking(s, t):
            return sum(sizes[i] for i in t.layers() if i not in survivors[s])

        best = min(sum(lacking(names[c], t) for t, c in zip(targets, p))
                   for p in itertools.permutations(range(len(names)), len(targets)))
        assert plan.bytes_moved == best
        assert sorted(plan.assignment.values(), key=lambda t: t.stage) == targets
        assert set(plan.idle) | set(plan.assignment) == set(names)
        for m in plan.moves:
            assert m.layer in plan.assignment[m.to].layers() and m.layer not in survivors[m.to]
            holders = [s for s in names if m.layer in survivors[s]]
            assert (m.source is None) == (not holders) and (m.source is None or m.source in holders)
        assert plan.busiest_sender() <= plan.bytes_moved


def test_too_few_survivors_is_named():
    with pytest.raises(PlanningError, match="3 positions for 2 survivors"):
        plan_regrid({"a": [0], "b": [1]}, [Position(0, k, k, k + 1) for k in range(3)], [1.0] * 3)


def test_sends_spread_over_the_surviving_holders():
    """Two survivors hold everything, two joiners hold nothing: the holders keep a position each
    (nothing to receive), the joiners take the others, and the holders share the sending."""
    held = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [], "d": []}
    targets = [Position(p, k, 2 * k, 2 * k + 2) for p in range(2) for k in range(2)]
    plan = plan_regrid(held, targets, [5.0] * 4)
    assert plan.bytes_moved == 20.0 and plan.bytes_from_snapshots == 0.0
    assert {m.to for m in plan.moves} == {"c", "d"}
    assert plan.busiest_sender() == 10.0  # half each, in parallel
