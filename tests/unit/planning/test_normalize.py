"""Failure normalization: equal keys exactly for failure sets that are pipeline relabellings."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ds_resilience.planning.normalize import normalize
from ds_resilience.topology import Worker


@st.composite
def failure_sets(draw):
    dp = draw(st.integers(1, 6))
    pp = draw(st.integers(1, 5))
    cells = [Worker(pipeline=p, stage=s) for p in range(dp) for s in range(pp)]
    failed = draw(st.sets(st.sampled_from(cells), max_size=len(cells)))
    perm = draw(st.permutations(range(dp)))
    return dp, pp, frozenset(failed), tuple(perm)


def relabel(failed, perm):
    return frozenset(Worker(pipeline=perm[w.pipeline], stage=w.stage) for w in failed)


@settings(max_examples=300, deadline=None)
@given(failure_sets())
def test_relabelled_sets_share_a_key_and_map_back(case):
    dp, pp, failed, perm = case
    a, b = normalize(dp, pp, failed), normalize(dp, pp, relabel(failed, perm))
    assert a.key == b.key
    assert a.canonical == b.canonical
    # the permutation maps the canonical set back onto the actual one
    assert relabel(a.canonical, a.from_canonical) == failed
    assert relabel(failed, a.to_canonical) == a.canonical
    assert sorted(a.to_canonical) == list(range(dp))


def test_keys_separate_exactly_the_relabelling_classes():
    for dp, pp in [(2, 2), (3, 2), (2, 3), (3, 3)]:
        cells = [Worker(pipeline=p, stage=s) for p in range(dp) for s in range(pp)]
        sets = [frozenset(c) for r in range(len(cells) + 1) for c in itertools.combinations(cells, r)]
        perms = list(itertools.permutations(range(dp)))
        for x, y in itertools.combinations(sets, 2):
            same_class = any(relabel(x, p) == y for p in perms)
            assert (normalize(dp, pp, x).key == normalize(dp, pp, y).key) == same_class, (x, y)


def test_key_is_independent_of_which_pipeline_failed():
    keys = {normalize(4, 3, [Worker(pipeline=p, stage=1)]).key for p in range(4)}
    assert len(keys) == 1
    assert normalize(4, 3, [Worker(pipeline=0, stage=1)]).key != normalize(4, 3, [Worker(pipeline=0, stage=2)]).key
