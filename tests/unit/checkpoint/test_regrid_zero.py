"""ZeRO-1 in a live re-grid (``integrations/ds_regrid_zero.py``): shards of a stage summed whole,
laid out per parameter as the unsharded optimizer holds them, and cut again for a new partition."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ds_resilience.integrations.ds_regrid_zero import assemble, reshard_state, unshard, unsharded_param_groups
from ds_resilience.runtime.zero import Partition, ShardedOptimizer

SHAPES = [(4, 3), (5,), (2, 2)]


class OneWorld:
    """A survivors' group of one member: every collective is local."""

    index, me = {0: 0}, 0

    def all_gather_json(self, mine):
        return [mine]

    def all_reduce(self, t):
        return t


def reference():
    """Adam over three parameters after two steps: the unsharded state the shards are cut from."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = torch.optim.Adam(params, lr=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt.state_dict()


def shards(sd, members):
    flat = {k: torch.cat([sd["state"][i][k].reshape(-1) for i in range(3)]) for k in ("exp_avg", "exp_avg_sq")}
    part = Partition(tuple(members), (sum(torch.Size(s).numel() for s in SHAPES),))
    hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    out = []
    for i in range(len(members)):
        lo, hi = part.bounds(0, i)
        out.append({"zero_stage": 1, "partition": part.to_json(), "index": i,
                    "optimizer": {"state": {0: {"step": sd["state"][0]["step"].clone(),
                                                **{k: v[lo:hi].clone() for k, v in flat.items()}}},
                                  "param_groups": [{**hyper, "params": [0]}]}})
    return out


def test_shards_made_whole_equal_the_unsharded_state_and_cut_again_for_a_new_partition():
    params, sd = reference()
    held = shards(sd, [0, 1])
    full = assemble(OneWorld(), [(2, held[0]), (2, held[1])], need={2})
    state = unshard(held[0], full[2], [[0, 1, 2]], [p.detach() for p in params])
    for i in range(3):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][i][k], sd["state"][i][k]), (i, k)
        assert float(state["state"][i]["step"]) == 2.0
    assert state["param_groups"][0]["params"] == [0, 1, 2] and state["param_groups"][0]["lr"] == 0.1
    # the new stage: three replicas, this one the second
    fresh = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    sharded = ShardedOptimizer(torch.optim.Adam(fresh, lr=0.5), me=5, members=(1, 5, 7))
    engine = SimpleNamespace(sharded_optimizer=sharded, optimizer=sharded, stage_host=SimpleNamespace(parameters=fresh))
    assert unsharded_param_groups(engine)[0]["params"] == [0, 1, 2]
    shard = reshard_state(state, engine)
    sharded.load_state_dict(shard)
    assert not sharded.stale
    lo, hi = sharded.partition.bounds(0, 1)
    whole = torch.cat([sd["state"][i]["exp_avg"].reshape(-1) for i in range(3)])
    assert torch.equal(sharded.optimizer.state_dict()["state"][0]["exp_avg"], whole[lo:hi])


def test_a_range_held_by_no_one_is_named():
    params, sd = reference()
    held = shards(sd, [0, 1])
    try:
        assemble(OneWorld(), [(2, held[0])], need={2})
    except RuntimeError as exc:
        assert "pipelines [1]" in str(exc)
    else:
        raise AssertionError("a missing range must be an error")


def test_with_zero1_the_regrid_starts_from_a_step_every_dead_ranks_snapshot_holds():
    """PP=3 x DP=2, both replicas of stage 1 (ranks 2, 3) dead: the layers come from one of them,
    the ZeRO-1 shards from both, so the step the survivors agree on must hold both snapshots (one
    killed mid-commit leaves its newest step out); a dead rank of a stage that lives on counts too."""
    from ds_resilience.integrations.ds_regrid import snapshot_owners
    from ds_resilience.topology import Topology

    grid = Topology(dp=2, pp=3)
    assert snapshot_owners(grid, [2, 3], zero=False) == [2]
    assert snapshot_owners(grid, [2, 3], zero=True) == [2, 3]
    assert snapshot_owners(grid, [2, 3, 4], zero=True) == [2, 3, 4]
    assert snapshot_owners(grid, [4], zero=False) == []
