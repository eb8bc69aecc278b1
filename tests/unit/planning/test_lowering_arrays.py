"""The array lowering of the C list scheduler's tasks equals the Python lowering of its orders.

Same schedule (every action, in order, per worker), and the same arrays for the C loops as read
back from the actions; plans through either path carry the same figures.
"""

import numpy as np
import pytest

from ds_resilience.costs import CostModel
from ds_resilience.ir import native
from ds_resilience.planning import planner
from ds_resilience.planning.lowering import lower
from ds_resilience.planning.lowering_arrays import lower_arrays
from ds_resilience.planning.reroute import reroute_assignment
from ds_resilience.topology import Topology, Worker

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C compiler here: {native.why_unavailable()}")

W = Worker
CASES = [
    (2, 2, 2, ()),
    (3, 4, 6, ()),
    (3, 4, 6, (W(pipeline=0, stage=1),)),
    (3, 4, 6, (W(pipeline=2, stage=0), W(pipeline=1, stage=3))),
    (4, 3, 5, (W(pipeline=0, stage=2), W(pipeline=1, stage=2), W(pipeline=3, stage=0))),
    (2, 1, 3, (W(pipeline=1, stage=0),)),
    (5, 2, 7, (W(pipeline=4, stage=1),)),
]
COST = CostModel(name="linked", t_f=(1.0, 1.5), t_b=(1.0, 1.75), t_w=(0.5, 1.0), p2p_latency=0.1,
                 activation_bytes=(3.0,), p2p_bandwidth=10.0)


def _listing(dp, pp, m, failed, split, w_cap, ties="first"):
    topology = Topology(dp=dp, pp=pp).without(failed)
    n = dp * pp
    return dict(dp=dp, pp=pp, microbatches=m, cost=COST if pp == 2 else CostModel.unit(),
                assignment=reroute_assignment(topology, m, ties=ties), split_backward=split, act_caps=[pp] * n,
                w_caps=[w_cap] * n, mem_caps=[float(2 * pp)] * n, start_times=None,
                mem_weights=[(1.0, 1.0)] * n), frozenset(topology.worker_index(w) for w in failed)


@pytest.mark.parametrize("tied", [(), "ends"])
@pytest.mark.parametrize("split,w_cap", [(True, 1), (True, 3), (True, None), (False, None)])
@pytest.mark.parametrize("dp,pp,m,failed", CASES)
def test_array_lowering_equals_the_python_lowering(dp, pp, m, failed, split, w_cap, tied):
    tied = ((0, pp - 1),) if tied and pp > 1 else ()
    for ties in ("first", "last"):
        listing, failed_idx = _listing(dp, pp, m, failed, split, w_cap, ties)
        orders, _ = native.list_orders(**listing)
        raw, _ = native.list_orders(**listing, raw=True)
        options = dict(dp=dp, pp=pp, microbatches=m, failed=failed_idx, optimizer="staggered", name="x", tied=tied)
        fast = lower_arrays(raw, **options)
        assert fast is not None
        assert fast == lower(orders, **options)
        remembered = native._structure(fast, np)  # the arrays handed over with the schedule
        native._last = None
        read = native._structure(fast, np)  # the arrays read back from its actions
        for name in ("kinds", "stage", "mb", "pipe", "peer", "off", "s_order", "r_order", "link_id"):
            assert np.array_equal(getattr(remembered, name), getattr(read, name)), name
        assert (remembered.matched, remembered.pair_order, remembered.members) == (read.matched, read.pair_order,
                                                                                   read.members)


def test_a_pair_out_of_order_is_left_to_the_python_lowering():
    listing, failed_idx = _listing(3, 4, 6, (), True, 3)
    w, kind, p, m, owner = native.list_orders(**listing, raw=True)[0]
    # two tasks of one worker swapped: stage 1's first two forwards, so its sends to stage 2 cross
    first = np.flatnonzero((w == 3) & (kind == 0))[:2]
    m = m.copy()
    m[first] = m[first[::-1]]
    assert lower_arrays((w, kind, p, m, owner), dp=3, pp=4, microbatches=6, failed=failed_idx) is None


@pytest.mark.parametrize("variant", ["adaptive", "recycle"])
def test_plans_are_the_same_through_either_lowering(variant, monkeypatch):
    failed = [W(pipeline=0, stage=1), W(pipeline=2, stage=3)]
    fast = planner.plan(3, 4, 6, failed, variant=variant)
    monkeypatch.setattr(planner, "lower_arrays", lambda *a, **k: None)
    slow = planner.plan(3, 4, 6, failed, variant=variant)
    assert fast.schedule == slow.schedule
    assert (fast.iteration_time, fast.peak_memory, fast.best_fault_free_iteration_time) == (
        slow.iteration_time, slow.peak_memory, slow.best_fault_free_iteration_time)
