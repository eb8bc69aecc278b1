"""Gemini's in-memory checkpoint placement: structure, exact recovery probability, retrieval, CLI."""

import argparse
import json
import subprocess
import sys
from itertools import combinations
from math import comb

import pytest

from ds_resilience.errors import ConfigError, PlanningError, ResilienceError
from ds_resilience.planning.placement import (
    Placement,
    brute_force_probability,
    corollary_lower_bound,
    lost_checkpoints,
    place,
    placement_from_holders,
    recovery_probabilities,
    recovery_probability,
    retrieval_plan,
    survivable_failure_sets,
)
from ds_resilience.planning import placement_cli

GRID = [(n, m) for n in range(1, 9) for m in range(1, n + 1)]


def independent_count(holders, n, k):
    """Survivable k-sets, counted without the module: a failed machine needs an alive holder."""
    return sum(all(set(holders[i]) - set(f) for i in f) for f in combinations(range(n), k))


# --- exact probability ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", GRID)
def test_probability_equals_brute_force_for_every_small_placement(n, m):
    p = place(n, m)
    probs = recovery_probabilities(p, n)
    assert len(probs) == n + 1
    for k in range(n + 1):
        exact = recovery_probability(p, k)
        assert exact == brute_force_probability(p, k) == probs[k]
        assert survivable_failure_sets(p)[k] == independent_count(p.holders, n, k)
        assert exact == independent_count(p.holders, n, k) / comb(n, k)


@pytest.mark.parametrize("n, m", [(n, m) for n in range(1, 13) for m in range(1, n + 1)])
def test_basic_probability_facts(n, m):
    probs = recovery_probabilities(place(n, m), n)
    assert probs[0] == 1.0
    assert all(pr == 1.0 for pr in probs[:m])  # fewer failures than copies: nothing lost
    assert probs[n] == 0.0  # everything failed
    assert all(a >= b for a, b in zip(probs, probs[1:]))  # more failures never help


def test_known_values_from_the_digest():
    # checkpoint.md §1.1: N=16, m=2: 0.933 at k=2, 0.800 at k=3; N=128, m=2, k=2: 0.992;
    # mixed: N=5, m=2 -> 0.600 and N=7, m=2 -> 0.762 at k=2.
    assert recovery_probability(place(16, 2), 2) == pytest.approx(0.9333, abs=1e-4)
    assert recovery_probability(place(16, 2), 3) == pytest.approx(0.8, abs=1e-12)
    assert recovery_probability(place(128, 2), 2) == pytest.approx(1 - 64 / comb(128, 2))
    assert recovery_probability(place(5, 2), 2) == pytest.approx(0.6)
    assert recovery_probability(place(7, 2), 2) == pytest.approx(16 / 21)


def test_mixed_gap_to_the_optimum_is_gemini_bound():
    # Gemini: the mixed strategy is within (2m-3)/C(N,m) of the optimum. For m=2, k=2 a placement
    # gives each machine one partner; a failed pair is lost iff it is a {machine, partner} pair,
    # and N machines name at least ceil(N/2) distinct pairs, so the optimum is 1 - ceil(N/2)/C(N,2).
    for n in (5, 7, 9, 11):
        mixed = recovery_probability(place(n, 2), 2)
        optimum = 1 - ((n + 1) // 2) / comb(n, 2)
        assert optimum - mixed == pytest.approx((2 * 2 - 3) / comb(n, 2))


@pytest.mark.parametrize("n, m", [(4, 2), (8, 2), (16, 2), (16, 4), (9, 3), (12, 3)])
def test_group_placement_meets_gemini_corollary(n, m):
    p = place(n, m)
    for k in range(n + 1):
        assert recovery_probability(p, k) >= corollary_lower_bound(n, m, k) - 1e-12
    # the corollary is exact at k = m (the lost sets are exactly the N/m whole groups)
    assert recovery_probability(p, m) == pytest.approx(corollary_lower_bound(n, m, m))


def test_large_placements_are_exact_and_fast():
    p = place(1000, 3)  # 332 groups of 3 and a ring of 4
    probs = recovery_probabilities(p, 6)
    assert probs[:3] == (1.0, 1.0, 1.0)
    lost3 = 332 + 4  # whole groups of 3, plus windows of 3 in the 4-ring
    assert probs[3] == pytest.approx(1 - lost3 / comb(1000, 3))
    # one ring of 40, window 25, 30 failed: lost iff the 10 survivors leave a cyclic gap of >= 25,
    # i.e. they sit in 15 consecutive positions: 40 choices of the first survivor after the gap,
    # C(14, 9) for the other nine.
    assert recovery_probability(place(40, 25), 30) == pytest.approx(1 - 40 * comb(14, 9) / comb(40, 30))


@pytest.mark.parametrize("n", range(9, 15))
def test_ring_counting_formula_on_larger_rings(n):
    for m in range(2, n):
        p = place(n, m)
        if n % m:
            assert survivable_failure_sets(p) == tuple(independent_count(p.holders, n, k) for k in range(n + 1))


def test_hand_built_placement_uses_the_generic_counter():
    # a "star-ish" placement that is neither group nor ring: 0 and 1 are held by 2, 2 by 0
    p = placement_from_holders(4, 2, {0: [0, 2], 1: [1, 2], 2: [0, 2], 3: [3, 1]})
    assert p.groups == ((0, 1, 2, 3),)
    for k in range(5):
        assert recovery_probability(p, k) == brute_force_probability(p, k)


# --- structure ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(n, m) for n in range(1, 13) for m in range(1, n + 1) if n % m == 0])
def test_group_placement_structure(n, m):
    p = place(n, m)
    assert p.kind == "group"
    assert p.groups == tuple(tuple(range(s, s + m)) for s in range(0, n, m))
    for group in p.groups:
        for i in group:
            assert p.holders[i] == group  # every member holds every member's checkpoint
            assert p.stored_on(i) == group
            assert p.group_of(i) == group


def test_mixed_placement_n5_m2():
    p = place(5, 2)
    assert p.kind == "mixed"
    assert p.groups == ((0, 1), (2, 3, 4))  # checkpoint.md §6 T1
    # ring in the last group: each machine is held by itself and its successor
    assert p.holders == ((0, 1), (0, 1), (2, 3), (3, 4), (2, 4))
    assert all(len(hs) == 2 and i in hs for i, hs in enumerate(p.holders))
    assert [len(p.stored_on(i)) for i in range(5)] == [2] * 5  # every machine stores m checkpoints


@pytest.mark.parametrize("n, m", [(n, m) for n in range(2, 16) for m in range(2, n + 1) if n % m])
def test_mixed_placement_structure(n, m):
    p = place(n, m)
    assert p.kind == "mixed"
    sizes = [len(g) for g in p.groups]
    assert sizes == [m] * (n // m - 1) + [m + n % m]
    assert sorted(x for g in p.groups for x in g) == list(range(n))
    ring = p.groups[-1]
    size = len(ring)
    for j, x in enumerate(ring):
        assert p.holders[x] == tuple(sorted(ring[(j + d) % size] for d in range(m)))
    for i in range(n):
        assert len(p.holders[i]) == m and i in p.holders[i]
        assert len(p.stored_on(i)) == m  # the load is balanced: each machine stores m checkpoints


def test_placement_is_frozen_and_validated():
    p = place(4, 2)
    with pytest.raises(AttributeError):
        p.replicas = 3
    with pytest.raises(PlanningError, match="does not hold its own"):
        Placement(machines=2, replicas=1, groups=((0, 1),), holders=((1,), (0,)))
    with pytest.raises(PlanningError, match="expected replicas=2"):
        Placement(machines=2, replicas=2, groups=((0, 1),), holders=((0, 1), (1,)))
    with pytest.raises(PlanningError, match="outside its placement group"):
        Placement(machines=4, replicas=2, groups=((0, 1), (2, 3)), holders=((0, 2), (0, 1), (2, 3), (2, 3)))
    with pytest.raises(PlanningError, match="sorted and distinct"):
        Placement(machines=2, replicas=2, groups=((0, 1),), holders=((1, 0), (0, 1)))
    with pytest.raises(PlanningError, match="no placement group"):
        Placement(machines=3, replicas=1, groups=((0, 1),), holders=((0,), (1,), (2,)))


# --- retrieval ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, m", [(4, 2), (5, 2), (6, 3), (7, 3), (8, 2)])
def test_retrieval_plans_pick_alive_holders(n, m):
    p = place(n, m)
    for k in range(n + 1):
        for failed in combinations(range(n), k):
            dead = set(failed)
            lost = [i for i in failed if set(p.holders[i]) <= dead]
            assert list(lost_checkpoints(p, dead)) == lost
            if lost:
                with pytest.raises(PlanningError) as err:
                    retrieval_plan(p, dead)
                assert f"machines {lost}" in str(err.value)
                continue
            plan = retrieval_plan(p, dead)
            assert set(plan) == dead
            for i, src in plan.items():
                assert src in p.holders[i] and src not in dead
                assert src == min(h for h in p.holders[i] if h not in dead)


def test_retrieval_plan_examples():
    p = place(5, 2)
    assert retrieval_plan(p, set()) == {}
    assert retrieval_plan(p, {1, 3}) == {1: 0, 3: 4}
    assert retrieval_plan(p, {2}) == {2: 3}
    with pytest.raises(PlanningError, match=r"checkpoints of machines \[3\] are lost") as err:
        retrieval_plan(p, {3, 4})
    assert "persistent tier" in str(err.value)
    with pytest.raises(PlanningError, match="machine 7 out of range"):
        retrieval_plan(p, {7})


# --- impossible inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "machines, replicas, fragment",
    [
        (0, 1, "machines: must be an integer >= 1, got 0"),
        (-3, 1, "got -3"),
        (4, 0, r"replicas: must be an integer in \[1, 4\].*got 0"),
        (4, 5, r"replicas: must be an integer in \[1, 4\].*got 5"),
        (3, 2.0, "got 2.0"),
    ],
)
def test_impossible_placements_raise_config_error(machines, replicas, fragment):
    with pytest.raises(ConfigError, match=fragment):
        place(machines, replicas)


@pytest.mark.parametrize("k", [-1, 9, 100])
def test_failures_out_of_range(k):
    p = place(8, 2)
    for fn in (recovery_probability, brute_force_probability, recovery_probabilities):
        with pytest.raises(PlanningError, match=rf"failures must be an integer in \[0, 8\].*got {k}"):
            fn(p, k)


# --- sanity: more replicas --------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 61))
def test_more_replicas_never_lower_the_probability_for_small_m(n):
    """m -> m+1 never lowers Pr for m <= 3 (the practical range), nor for any m when k <= m+1."""
    probs = {m: recovery_probabilities(place(n, m), n) for m in range(1, n + 1)}
    for m in range(1, n):
        for k in range(n + 1):
            if m <= 3 or k <= m + 1:
                assert probs[m + 1][k] >= probs[m][k], (n, m, k)


def test_nested_group_placements_are_monotone():
    # when m | m' | N every holder set for m is inside the one for m': Pr can only grow
    for n, m, m2 in [(8, 2, 4), (8, 4, 8), (12, 2, 6), (12, 3, 6), (16, 2, 8)]:
        a, b = recovery_probabilities(place(n, m), n), recovery_probabilities(place(n, m2), n)
        assert all(y >= x for x, y in zip(a, b))


def test_known_non_monotone_case_of_gemini_mixed_placement():
    """Not a bug: Gemini's ring can lose to a smaller m at many failures.

    N=8: m=4 is two groups of 4 (lost only if a whole group fails); m=5 is one ring of 8 where any
    5 consecutive failed machines lose a checkpoint. With 6 failures (2 alive): 16/28 vs 12/28.
    """
    assert recovery_probability(place(8, 4), 6) == pytest.approx(16 / 28)
    assert recovery_probability(place(8, 5), 6) == pytest.approx(12 / 28)


# --- CLI ------------------------------------------------------------------------------------------


def cli(*argv):
    parser = argparse.ArgumentParser(prog="ds-resilience")
    placement_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["placement", *argv])
    assert args.handler is placement_cli.run
    return args.handler(args)


def test_cli_json(capsys):
    assert cli("--machines", "5", "--replicas", "2", "--failures", "3", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["groups"] == [[0, 1], [2, 3, 4]]
    assert d["holders"] == [[0, 1], [0, 1], [2, 3], [3, 4], [2, 4]]
    assert d["kind"] == "mixed" and d["failures"] == 3
    assert d["probabilities"] == pytest.approx([1.0, 1.0, 0.6, 0.0])
    assert d["probability"] == d["probabilities"][-1] == 0.0
    assert cli("--machines", "16", "--replicas", "2", "--failures", "3", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kind"] == "group" and len(d["groups"]) == 8
    assert d["probability"] == pytest.approx(0.8) and len(d["probabilities"]) == 4


def test_cli_text(capsys):
    assert cli("--machines", "5", "--replicas", "2", "--failures", "2") == 0
    out = capsys.readouterr().out
    assert "mixed placement" in out and "groups: [0, 1] [2, 3, 4]" in out
    assert "  4: 2, 4" in out
    assert "2 failed: 0.600000" in out


def test_cli_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"replicas.*\[1, 3\].*got 4"):
        cli("--machines", "3", "--replicas", "4", "--failures", "1")
    with pytest.raises(PlanningError, match=r"failures.*\[0, 3\].*got 5"):
        cli("--machines", "3", "--replicas", "2", "--failures", "5")
    assert issubclass(ConfigError, ResilienceError)  # the CLI's main() reports it with exit code 2


def test_placement_modules_import_no_torch():
    code = (
        "import sys\n"
        "import ds_resilience.planning.placement, ds_resilience.planning.placement_cli\n"
        "print(','.join(m for m in ('torch', 'deepspeed', 'triton', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
