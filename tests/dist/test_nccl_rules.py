"""NCCL's point-to-point rules in the IR: FIFO matching per pair (validator rule 7), one stream per
pair with sends that wait for their receive (the replay's ``blocking_sends``), and the early
receive posts that make every schedule run under them (``ir/pairs.py``)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import ScheduleError
from ds_resilience.ir import parse_action, validate
from ds_resilience.ir.pairs import early_posts, pair_order, replay_nccl
from ds_resilience.ir.replay import message_key, replay
from ds_resilience.planning.generators import decoupled, one_f_one_b
from ds_resilience.planning.lowering import compute_orders, lower
from ds_resilience.planning.planner import plan
from ds_resilience.topology import Worker


def _names(schedule, w):
    return [str(a) for a in schedule.workers[w]]


def _issue_sequences(schedule, posts):
    """What each side of each pair issues on the pair's stream, in order, when the runtime follows
    ``posts``: per (worker, peer), the message keys of its sends and receive posts."""
    issued = {}
    for w, actions in enumerate(schedule.workers):
        done = set()
        for i, a in enumerate(actions):
            for j in posts[w].get(i, ()):
                done.add(j)
                issued.setdefault((w, actions[j].peer), []).append(message_key(w, actions[j]))
            if a.kind.is_send or (a.kind.is_recv and i not in done):
                issued.setdefault((w, a.peer), []).append(message_key(w, a))
    return issued


def test_one_f_one_b_deadlocks_under_nccl_unless_receives_are_posted_early():
    s = one_f_one_b(1, 2, 3)
    # stage 0 sends activation 1, then waits for gradient 0; stage 1 sends gradient 0, then waits
    # for activation 1: on one stream per pair each send waits for a receive queued behind the other
    late = replay_nccl(s, early=False)
    assert late.blocked == {0: _names(s, 0).index("p0s0RG0<1"), 1: _names(s, 1).index("p0s1RA1<0")}
    posts = early_posts(s)
    assert any(posts), "some receive must be posted before a send"
    for pair_posts in (posts, ({}, {})):
        issued = _issue_sequences(s, pair_posts)
        mirrored = issued[0, 1] == issued[1, 0]
        assert mirrored == (pair_posts is posts)  # with the early posts both sides issue the same sequence
    early = replay_nccl(s)
    assert not early.blocked
    assert early.makespan == replay(s).makespan  # unit costs, no transfer time: nothing waits longer


@pytest.mark.parametrize("variant", ["adaptive", "recycle"])
def test_pair_order_is_causal_and_early_posts_mirror_every_pair(variant):
    p = plan(3, 4, 6, [Worker(pipeline=1, stage=2)], variant=variant, solver="heuristic")
    s = p.schedule
    order = pair_order(s)
    position = {item: k for seq in order.values() for k, item in enumerate(seq)}
    for w, actions in enumerate(s.workers):
        waited = {}  # peer -> the latest pair-order position of a message from it this worker waited for
        last_send = {}
        for a in actions:
            if not (a.kind.is_send or a.kind.is_recv):
                continue
            k = position[message_key(w, a), 0]
            if a.kind.is_send:
                # a send to q comes after every message from q its worker waited for, and after its earlier sends to q
                assert k > waited.get(a.peer, -1) and k > last_send.get(a.peer, -1)
                last_send[a.peer] = k
            else:
                waited[a.peer] = max(k, waited.get(a.peer, -1))
    issued = _issue_sequences(s, early_posts(s))
    for (w, peer), seq in issued.items():
        assert seq == issued[peer, w], (w, peer)


def test_a_receive_out_of_send_order_is_rejected():
    s = one_f_one_b(1, 2, 3)
    # stage 1 runs micro-batch 1 first and takes its activation first: fine with gloo's tags, but
    # NCCL would deliver activation 0 into micro-batch 1's buffer
    tokens = ["p0s1RA1<0", "p0s1F1", "p0s1BW1", "p0s1SG1>0", "p0s1RA0<0", "p0s1F0", "p0s1BW0", "p0s1SG0>0",
              "p0s1RA2<0", "p0s1F2", "p0s1BW2", "p0s1SG2>0", "s1RD", "s1OPT"]
    bad = replace(s, workers=(s.workers[0], tuple(parse_action(t) for t in tokens)), name="swapped")
    with pytest.raises(ScheduleError, match=r"worker 0 sends its messages to worker 1 in another order \(act p0s0 mb0 "
                                            r"before act p0s0 mb1\); NCCL matches a pair's messages in order"):
        validate(bad)


def test_lowering_receives_in_send_order():
    # a receiver that runs micro-batch 2's forward before micro-batch 1's still receives 1 first
    s = one_f_one_b(1, 2, 3)
    orders = compute_orders(s)
    f = [a for a in orders[1] if str(a).startswith("p0s1F")]
    rest = [a for a in orders[1] if not str(a).startswith("p0s1F")]
    swapped = [f[0], rest[0], f[2], f[1]] + rest[1:]  # F0 BW0 F2 F1 BW1 BW2
    lowered = lower([orders[0], swapped], dp=1, pp=2, microbatches=3)
    validate(lowered)
    names = _names(lowered, 1)
    assert names.index("p0s1RA1<0") < names.index("p0s1RA2<0") < names.index("p0s1F2") < names.index("p0s1F1")
    assert not replay_nccl(lowered).blocked


def test_lowering_reorders_exactly_the_receivers_out_of_send_order(monkeypatch):
    """The lowering checks each pair's message order as it emits it and reorders only the workers
    with a pair out of order: its output is what reordering every worker gives."""
    from ds_resilience.planning import lowering

    full = lowering._receives_in_send_order
    reordered: list[set] = []
    monkeypatch.setattr(lowering, "_receives_in_send_order",
                        lambda workers, only=None: reordered.append(set(only)) or full(workers, only))
    rng = random.Random(7)
    for _ in range(20):
        dp, pp, m = rng.randint(1, 3), rng.randint(2, 4), rng.randint(3, 6)
        orders = compute_orders(one_f_one_b(dp, pp, m))
        for w in range(dp, dp * pp):  # stages > 0: swap two forwards in a row where there are some
            acts = orders[w]
            pairs = [i for i in range(len(acts) - 1) if acts[i].kind.name == "F" == acts[i + 1].kind.name]
            if pairs and rng.random() < 0.7:
                i = rng.choice(pairs)
                acts[i], acts[i + 1] = acts[i + 1], acts[i]
        lowered = lower(orders, dp=dp, pp=pp, microbatches=m)
        assert full(list(lowered.workers)) == list(lowered.workers)  # nothing left to move
        validate(lowered)
    assert len(reordered) >= 5 and all(reordered)


@pytest.mark.parametrize("seed", range(3))
def test_every_plan_runs_under_nccl_rules(seed):
    """Random grids, costs, failure sets, variants, tied groups and both solvers: every plan passes
    the validator (rule 7 included) and its steady state completes under NCCL's rules."""
    rng = random.Random(seed)
    for _ in range(6):
        dp, pp = rng.randint(1, 3), rng.randint(2, 4)
        m = rng.randint(pp, 2 * pp)
        cost = CostModel.from_dict({"name": "random", "t_f": [rng.uniform(0.5, 2) for _ in range(pp)],
                                    "t_b": [rng.uniform(0.5, 2) for _ in range(pp)],
                                    "t_w": [rng.uniform(0.2, 2) for _ in range(pp)]})
        cells = [Worker(pipeline=p, stage=s) for p in range(dp) for s in range(pp)]
        failed = [] if dp == 1 else rng.sample(cells, rng.randint(0, 1))
        tied = ((0, pp - 1),) if rng.random() < 0.3 else ()
        for variant in ("adaptive", "decoupled", "recycle"):
            solver = "cpsat" if rng.random() < 0.25 else "heuristic"
            p = plan(dp, pp, m, failed, cost=cost, variant=variant, solver=solver, time_limit_s=2.0, tied=tied)
            validate(p.schedule)
            r = replay_nccl(p.schedule, cost, repeat=3)
            assert not r.blocked, (dp, pp, m, failed, variant, solver)
    for dp, pp, m in ((2, 4, 8), (3, 3, 5)):
        assert not replay_nccl(decoupled(dp, pp, m, CostModel.unit()), repeat=2).blocked


def test_rendezvous_sends_wait_for_the_posted_receive():
    """With transfer time, a message the receiver posts late cannot be buffered in advance: the
    NCCL replay is never faster than the buffered one, and here strictly slower on some message."""
    s = one_f_one_b(1, 2, 4)
    cost = CostModel.from_dict({"name": "links", "t_f": [1, 1], "t_b": [1, 1], "t_w": [1, 1],
                                "activation_bytes": [1e6, 1e6], "p2p_bandwidth": 1e6, "p2p_latency": 0.0})
    buffered, nccl = replay(s, cost), replay_nccl(s, cost)
    assert not nccl.blocked
    assert nccl.makespan >= buffered.makespan - 1e-9
    later = [n[3] - b[3] for b, n in zip(sorted(buffered.raw_messages), sorted(nccl.raw_messages))]
    assert max(later) > 0 and min(later) >= -1e-9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("matching,expected", [("tags", [2.0, 1.0]), ("fifo", [1.0, 2.0])])
def test_fifo_matching_ignores_tags_as_nccl_does(matching, expected):
    """The CPU test mode of the transport (DSR_P2P_MATCHING=fifo, under which tests/dist/test_engine.py
    runs the engine too) really matches as NCCL does: the first receive gets the first message."""
    from dist_harness import run_workers
    from nccl_programs import matching_probe

    results = run_workers(matching_probe, 2, args=(matching,), timeout_s=100)
    assert results[1] == expected


def test_matching_mode_is_checked(monkeypatch):
    from ds_resilience.comm.groups import default_matching

    monkeypatch.setenv("DSR_P2P_MATCHING", "tag")
    with pytest.raises(ValueError, match=r"DSR_P2P_MATCHING='tag'; allowed: tags, fifo"):
        default_matching()
    monkeypatch.delenv("DSR_P2P_MATCHING")
    assert default_matching() == "tags"
