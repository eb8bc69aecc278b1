"""Timeline simulator: spans, links, latency, memory peaks and steady-state period."""

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import CostModelError
from ds_resilience.planning import decoupled, one_f_one_b, repeat
from ds_resilience.ir import complement, merge_spans, simulate


def test_busy_plus_idle_is_makespan_on_every_worker():
    t = simulate(decoupled(2, 3, 5))
    for w, busy in t.busy.items():
        total = sum(e - s for s, e in busy) + sum(e - s for s, e in t.idle[w])
        assert total == pytest.approx(t.makespan)


def test_links_and_their_idle_spans():
    cost = CostModel(activation_bytes=(100.0,), p2p_bandwidth=200.0)  # 0.5 per message
    s = one_f_one_b(1, 3, 3)
    t = simulate(s, cost)
    # stage 0 -> 1 carries 3 activations, stage 1 -> 0 carries 3 gradients
    assert set(t.link_busy) == {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert sum(e - s for s, e in t.link_busy[(0, 1)]) == pytest.approx(1.5)
    for link, busy in t.link_busy.items():
        idle = t.link_idle[link]
        assert sum(e - s for s, e in busy + idle) == pytest.approx(t.makespan)


@pytest.mark.parametrize("latency", [0.0, 0.25, 1.0])
def test_latency_on_the_critical_path(latency):
    # One micro-batch through 3 stages: F F F BW BW BW and 2 boundaries each way.
    t = simulate(one_f_one_b(1, 3, 1), CostModel(p2p_latency=latency))
    assert t.makespan == pytest.approx(3 * 1 + 3 * 2 + 4 * latency)
    # With more micro-batches latency can only add time, and at least on the two chains.
    t6 = simulate(one_f_one_b(1, 4, 6), CostModel(p2p_latency=latency))
    assert t6.makespan >= 27 + 2 * 3 * latency - 1e-9


def test_optimizer_and_reduce_time_counted():
    base = simulate(one_f_one_b(2, 2, 2)).makespan
    t = simulate(one_f_one_b(2, 2, 2), CostModel(t_opt=(0.5,), t_reduce=(0.25,)))
    assert t.makespan == pytest.approx(base + 0.75)


def test_memory_peaks():
    t = simulate(decoupled(1, 4, 6))
    assert t.peak_activations == (4, 3, 2, 1)
    assert all(p <= s + 1 for s, p in enumerate(t.peak_pending_w))
    t1 = simulate(one_f_one_b(1, 4, 6))
    assert t1.peak_pending_w == (0, 0, 0, 0)


def test_steady_state_period_of_repeated_global_schedule_is_its_makespan():
    s = one_f_one_b(1, 4, 6)
    t = simulate(repeat(s, 4))
    assert t.iteration_time == pytest.approx(simulate(s).makespan)


def test_per_stage_costs_must_fit():
    with pytest.raises(CostModelError, match="expected 1 or pp=3"):
        simulate(one_f_one_b(1, 3, 3), CostModel(t_f=(1.0, 2.0)))


def test_span_helpers():
    assert merge_spans([(3, 4), (0, 1), (1, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert complement([(0, 2), (3, 4)], 0, 6) == [(2, 3), (4, 6)]
