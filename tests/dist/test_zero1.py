"""ZeRO stage 1 inside a stage's surviving replicas (``runtime/zero.py``): the optimizer state
sharded, and training exactly as ZeRO-0 fault-free, with a failed replica, in bf16 with clipping,
and across a live death and a re-join (``test_live``)."""

from __future__ import annotations

import pytest
import torch

from conformance_programs import run_case
from dist_harness import run_workers
from test_conformance import assert_same_params


def zero_run(case, world=4, timeout_s=400):
    return run_workers(run_case, world, args=(case,), timeout_s=timeout_s)


@pytest.mark.timeout(450)
def test_zero1_trains_as_zero0_and_shards_the_state():
    case = {"model": "gpt", "pp": 2, "steps": 4, "engines": ["resilient"],
            "variants": {"z0": {}, "z1": {"zero": 1}}}
    results = zero_run(case)
    assert_same_params(results, "z0/resilient", "z1/resilient", rtol=0, atol=0)
    for r in results:
        assert r["z1/resilient"]["losses"] == r["z0/resilient"]["losses"]
        z = r["z1/resilient"]["zero"]
        assert z["members"] == [0, 1]
        assert abs(z["shard"] - z["total"] / 2) <= 1, z
        assert z["state_bytes"] == 2 * 4 * z["shard"]  # Adam: two fp32 moments of the shard only


@pytest.mark.timeout(450)
def test_zero1_with_a_failed_replica_bf16_and_clipping_equals_zero0():
    """PP=2 x DP=3, pipeline 1's stage 1 failed (simulated): stage 1's state is sharded over the two
    survivors. bf16 with fp32 masters and DeepSpeed's default clipping (speculative, validated):
    ZeRO-1 equals ZeRO-0 in the same configuration, masters included."""
    case = {"model": "gpt", "pp": 2, "steps": 4, "engines": ["resilient"], "precision": "bf16", "clip": 1.0,
            "failed": ["1:1"], "variants": {"z0": {}, "z1": {"zero": 1}}}
    results = zero_run(case, world=6)
    assert_same_params(results, "z0/resilient", "z1/resilient", rtol=0, atol=0)
    for r in results:
        a, b = r["z0/resilient"], r["z1/resilient"]
        if not b["alive"]:
            continue
        assert b["losses"] == a["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"]))
        assert b["zero"]["members"] == ([0, 1, 2] if b["stage"] == 0 else [0, 2])
        assert abs(b["zero"]["shard"] - b["zero"]["total"] / len(b["zero"]["members"])) <= 1
    assert any(sum(r["z1/resilient"]["validation"].values()) for r in results if r["z1/resilient"]["alive"])


ZERO1 = {"zero_optimization": {"stage": 1}}


# --- the sharded optimizer alone (no processes) -------------------------------------------------------
def _params(seed=0, shapes=((5, 3), (7,), (2, 2))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_partition_is_contiguous_balanced_and_covers_every_element():
    from ds_resilience.runtime.zero import Partition

    part = Partition((0, 2, 5), (10, 3))
    for g, total in enumerate(part.numels):
        ranges = [part.bounds(g, i) for i in range(3)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert max(h - l for l, h in ranges) - min(h - l for l, h in ranges) <= 1
    with pytest.raises(Exception, match="not a member"):
        part.index(1)


class _Group:
    """A stage group of ``n`` members in one process (threads): sum and JSON gather, or a failure."""

    def __init__(self, n, fail=False):
        import threading

        self.n, self.fail = n, fail
        self.barrier = threading.Barrier(n)
        self.slots = [None] * n

    def member(self, i):
        group = self

        class _Member:
            me, index, ranks = i, {k: k for k in range(group.n)}, tuple(range(group.n))

            def __len__(self):
                return group.n

            def all_reduce(self, tensor):
                if group.fail:
                    raise RuntimeError("peer closed the connection")
                group.slots[i] = tensor.clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                tensor.copy_(total)

            def all_gather_json(self, value):
                import json

                group.slots[i] = json.dumps(value)
                group.barrier.wait()
                out = [json.loads(v) for v in group.slots]
                group.barrier.wait()
                return out

        return _Member()


def _together(fns):
    import threading

    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors


def test_shards_step_die_reshard_and_rejoin_as_the_unsharded_optimizer():
    """Two replicas step their ranges and gather; replica 1 dies and replica 0 re-shards alone from
    its state (as the snapshot tier gives it); a fresh replica re-joins with replica 0's state and
    both re-shard over two. Parameters and Adam's moments stay equal to one unsharded Adam."""
    from ds_resilience.runtime.zero import ShardedOptimizer

    ref = _params()
    ref_opt = torch.optim.Adam(ref, lr=1e-2, weight_decay=0.1)
    pair = _Group(2)
    reps = [_params() for _ in range(2)]
    shards = [ShardedOptimizer(torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1), me=i, members=(0, 1),
                               group=lambda i=i: pair.member(i)) for i, ps in enumerate(reps)]

    def step(k, members):
        _grads(ref, k)
        ref_opt.step()
        for i in members:
            _grads(reps[i], k)
        _together([shards[i].step for i in members])
        for i in members:
            assert all(torch.equal(p, q) for p, q in zip(ref, reps[i])), (k, i)

    for k in range(3):
        step(k, (0, 1))
    assert all(sh.shard_numel < sum(sh.numels) for sh in shards)
    dead = shards[1].state_dict()  # what its snapshot holds
    moved = shards[0].reshard([0], None, [dead])
    assert moved["from"] == [0, 1] and moved["to"] == [0] and shards[0].shard_numel == sum(shards[0].numels)
    for k in range(3, 5):
        step(k, (0,))
    # re-join: a fresh replica takes replica 0's state (the handover), both re-shard over [0, 1]
    reps[1] = _params(seed=9)
    with torch.no_grad():
        for p, q in zip(reps[1], reps[0]):
            p.copy_(q)
    shards[1] = ShardedOptimizer(torch.optim.Adam(reps[1], lr=1e-2, weight_decay=0.1), me=1, members=(0, 1),
                                 group=lambda: pair.member(1))
    shards[1].load_state_dict(shards[0].state_dict())
    assert shards[1].stale
    _together([lambda: shards[0].reshard([0, 1], pair.member(0)), lambda: shards[1].reshard([0, 1], pair.member(1))])
    assert not shards[0].stale and not shards[1].stale
    for k in range(5, 7):
        step(k, (0, 1))
    ref_moments = torch.cat([ref_opt.state[p]["exp_avg_sq"].reshape(-1) for p in ref])
    mine = torch.cat([next(iter(sh.optimizer.state.values()))["exp_avg_sq"] for sh in shards])
    assert torch.equal(mine, ref_moments)


def test_a_step_whose_gather_fails_leaves_the_shard_as_before():
    from ds_resilience.runtime.zero import ShardedOptimizer

    ps = _params()
    sh = ShardedOptimizer(torch.optim.Adam(ps, lr=1e-2), me=0, members=(0, 1), group=lambda: _Group(2, fail=True).member(0))
    before = [p.detach().clone() for p in ps]
    _grads(ps, 0)
    with pytest.raises(RuntimeError, match="peer closed"):
        sh.step()
    assert not sh.optimizer.state[sh.optimizer.param_groups[0]["params"][0]], "the moments moved without the step"
    assert all(torch.equal(a, p) for a, p in zip(before, ps))


def test_a_peers_shard_must_be_resharded_before_stepping_and_states_are_checked():
    from ds_resilience.checkpoint.state import StateMismatch
    from ds_resilience.runtime.zero import ShardedOptimizer

    a = ShardedOptimizer(torch.optim.SGD(_params(), lr=0.1, momentum=0.9), me=0, members=(0, 1))
    b = ShardedOptimizer(torch.optim.SGD(_params(), lr=0.1, momentum=0.9), me=1, members=(0, 1))
    b.load_state_dict(a.state_dict())  # a re-join's handover: the donor's range
    assert b.stale
    with pytest.raises(Exception, match="re-shard before stepping"):
        b.step()
    with pytest.raises(StateMismatch, match="ZeRO-1 shard"):
        b.load_state_dict(torch.optim.SGD(_params(), lr=0.1).state_dict())
    other = ShardedOptimizer(torch.optim.SGD(_params(shapes=((3,),)), lr=0.1), me=0, members=(0,))
    with pytest.raises(StateMismatch, match="elements"):
        b.load_state_dict(other.state_dict())
    with pytest.raises(Exception, match="held by no member"):
        b.reshard([0, 1], None)  # alone it holds range 0 only: range 1 is nowhere


def test_non_elementwise_optimizers_and_zero_2_3_are_refused():
    from ds_resilience.errors import ConfigError
    from ds_resilience.integrations.deepspeed import _split_config as parse_config
    from ds_resilience.runtime.zero import ShardedOptimizer

    with pytest.raises(ConfigError, match="elementwise"):
        ShardedOptimizer(torch.optim.LBFGS(_params()))
    for stage in (2, 3):
        with pytest.raises(ConfigError, match="stages 0 and 1"):
            parse_config({"zero_optimization": {"stage": stage}, "resilience": {}})
    data, _, _ = parse_config({"zero_optimization": {"stage": 1}, "resilience": {}})
    assert data["zero_optimization"]["stage"] == 1


@pytest.mark.timeout(450)
def test_zero1_checkpoint_round_trip_continues_identically(tmp_path):
    """save_checkpoint / load_checkpoint with ZeRO-1 (bf16, fp32 masters): the stage's shards are
    consolidated into DeepSpeed's file, and each loading replica keeps its range; the loaded job
    ends where the uninterrupted one does."""
    from conformance_programs import round_trip

    case = {"model": "gpt", "pp": 2, "steps": 4, "save_after": 2, "zero": 1, "precision": "bf16",
            "engines": ["resilient"]}
    results = run_workers(round_trip, 4, args=(case, str(tmp_path)), timeout_s=420)
    assert_same_params(results, "resilient-uninterrupted", "resilient->resilient", rtol=0, atol=0)
