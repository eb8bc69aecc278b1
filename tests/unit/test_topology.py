import pytest

from ds_resilience.errors import TopologyError
from ds_resilience.topology import Topology, Worker, parse_worker


@pytest.mark.parametrize("dp,pp", [(1, 1), (2, 2), (3, 4), (4, 3), (8, 2)])
def test_rank_order_matches_deepspeed_process_topology(dp, pp):
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    ds = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
    topo = Topology(dp=dp, pp=pp)
    for s in range(pp):
        for p in range(dp):
            w = Worker(pipeline=p, stage=s)
            assert topo.rank(w) == ds.get_rank(pipe=s, data=p)
            assert topo.coord(topo.rank(w)) == (w, 0)
            assert topo.worker(topo.worker_index(w)) == w


def test_tensor_parallel_rank_order_matches_deepspeed():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    ds = PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=2)
    topo = Topology(dp=2, pp=3, tp=2)
    for s in range(3):
        for p in range(2):
            for t in range(2):
                assert topo.rank(Worker(pipeline=p, stage=s), t) == ds.get_rank(pipe=s, data=p, model=t)


def test_without_and_stage_peers():
    topo = Topology(dp=3, pp=2)
    t2 = topo.without([Worker(pipeline=1, stage=0)])
    assert not t2.is_alive(Worker(pipeline=1, stage=0))
    assert t2.stage_peers(0) == (Worker(pipeline=0, stage=0), Worker(pipeline=2, stage=0))
    assert t2.stage_peers(1) == topo.stage_peers(1)
    t3 = t2.without([Worker(pipeline=0, stage=0), Worker(pipeline=2, stage=0)])
    assert t3.uncovered_stages() == (0,)
    assert topo.failed == frozenset()  # without() copies
    assert t3.healthy() == topo


@pytest.mark.parametrize(
    "bad, fragment",
    [
        (Worker(pipeline=3, stage=0), "pipeline 3 out of range, allowed 0..2"),
        (Worker(pipeline=0, stage=2), "stage 2 out of range, allowed 0..1"),
    ],
)
def test_out_of_range_worker_named(bad, fragment):
    with pytest.raises(TopologyError, match=fragment):
        Topology(dp=3, pp=2).without([bad])


@pytest.mark.parametrize("kwargs", [dict(dp=0, pp=1), dict(dp=1, pp=-1), dict(dp=1, pp=1, tp=0), dict(dp=True, pp=2)])
def test_bad_sizes(kwargs):
    with pytest.raises(TopologyError):
        Topology(**kwargs)


@pytest.mark.parametrize("text", ["1", "a:b", "1:2:3", "-1:0", ""])
def test_parse_worker_rejects(text):
    with pytest.raises(TopologyError, match="pipeline:stage"):
        parse_worker(text)


def test_parse_worker():
    assert parse_worker(" 2:3 ") == Worker(pipeline=2, stage=3)
    assert str(Worker(pipeline=2, stage=3)) == "2:3"


def test_a_rank_table_names_a_reformed_grids_workers_by_the_survivors_ranks():
    grid = Topology(dp=2, pp=2, ranks=(5, 0, 4, 1))  # worker index s * dp + p -> the agent's rank
    assert [grid.rank(w) for w in grid.workers()] == [5, 0, 4, 1]
    assert grid.coord(4) == (Worker(pipeline=0, stage=1), 0)
    assert grid.has_rank(4) and not grid.has_rank(2) and not Topology(dp=2, pp=2).has_rank(4)
    with pytest.raises(TopologyError, match=r"rank 2 is not in this grid, whose ranks are \[0, 1, 4, 5\]"):
        grid.coord(2)
    failed = grid.without([Worker(pipeline=1, stage=0)])
    assert failed.ranks == grid.ranks and failed.healthy() == grid
    assert [failed.rank(w) for w in failed.alive_workers()] == [5, 4, 1]
    assert grid != Topology(dp=2, pp=2)
    for bad in [(0, 1, 2), (0, 0, 1, 2), (0, 1, 2, -3), (0, 1, 2, True)]:
        with pytest.raises(TopologyError, match="distinct integers"):
            Topology(dp=2, pp=2, ranks=bad)
    with pytest.raises(TopologyError, match="tp == 1"):
        Topology(dp=1, pp=2, tp=2, ranks=(0, 1))
