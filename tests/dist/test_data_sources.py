"""A DeepSpeed user's data, re-routed: ``training_data`` and ``train_batch(data_iter)`` + ``data_iter_factory``.

The distributed tests run PP=2 x DP=2 on real gloo processes (``tests/dist/data_programs.py``) with a
dataset whose items carry their sample index: the engine's dataset source must yield exactly what
DeepSpeed's own loader yields for each data-parallel rank (over more than one epoch), a re-routed
micro-batch must train on the samples the failed worker would have used (recorded by the model's
first layer and the loss function), and the parameters must equal a fault-free run's. The unit
tests hold the sampling arithmetic against torch's ``DistributedSampler`` and ``DataLoader``.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from data_programs import (MICROBATCHES, IndexedDataset, Stream, loader_streams, pipeline_stream, rejections,
                           train_scenarios)
from dist_harness import run_workers
from ds_resilience.errors import ConfigError, ResilienceError
from ds_resilience.integrations.ds_data import (DatasetSource, FactorySource, IteratorSource, LoaderSpec,
                                                reroute_data_error, unfed_reason)


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _flat(batch):
    x, (y, i) = batch
    return [x, y, i]


# --- the sampling arithmetic, in one process ------------------------------------------------------
@pytest.mark.parametrize("size,dp,bs,drop_last,sampler_drop_last,shuffle",
                         [c for c in itertools.product([7, 10, 13], [1, 2, 3], [1, 2, 4], [False, True], [False, True],
                                                       [False, True]) if c[0] // c[1] >= c[2]])
def test_dataset_source_is_distributed_sampler_plus_dataloader_repeated(size, dp, bs, drop_last, sampler_drop_last,
                                                                        shuffle):
    """Batch k of pipeline p is the k-th batch of RepeatingLoader(DataLoader(DistributedSampler(rank=p)))."""
    ds = IndexedDataset(size)
    spec = LoaderSpec(batch_size=bs, drop_last=drop_last, sampler_drop_last=sampler_drop_last, shuffle=shuffle, seed=3)
    source = DatasetSource(ds, dp=dp, microbatches=3, spec=spec)
    for p in range(dp):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=dp, rank=p, shuffle=shuffle, seed=3,
                                                      drop_last=sampler_drop_last)
        epoch = list(torch.utils.data.DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=drop_last))
        for k, batch in enumerate(epoch * 3):  # three epochs
            assert _same(_flat(source(p, k // 3, k % 3)), _flat(batch)), (p, k)


def test_own_pipeline_streams_through_loader_workers_and_any_access_order_reads_the_same():
    """The own pipeline's prefetching stream (2 worker processes) serves any order of requests,
    backwards (a rollback) and far ahead (a load or a restart) included, with the same batches."""
    ds = IndexedDataset(23)
    source = DatasetSource(ds, dp=2, microbatches=4, spec=LoaderSpec(batch_size=2, num_workers=2), own=1)
    reference = {p: list(itertools.islice(pipeline_stream(ds, p, 2), 400)) for p in range(2)}
    try:
        for i in [0, 1, 2, 2, 1, 3, 4, 9, 3, 10, 11, 40, 41, 40, 42]:
            for p in (1, 0, 1):
                for m in range(4):
                    assert _same(_flat(source(p, i, m)), _flat(reference[p][i * 4 + m])), (p, i, m)
        assert source.reads["stream"] > 0 and source.reads["direct"] > 0
        assert 1 < source.reads["restarts"] < 8  # re-created behind it and far ahead, not at every step
    finally:
        source.close()


def test_iterable_dataset_and_iterator_only_are_rejected_only_where_a_pipeline_can_lose_both_ends():
    """A pipeline's surviving end relays its data (planning/data_relay.py): only a tolerance that
    lets a pipeline lose both ends (one failure with one stage, two otherwise) needs an
    addressable source, and the error names what to pass."""
    both = unfed_reason(2, 2)
    assert unfed_reason(2, 1) is None and unfed_reason(4, 1) is None
    assert unfed_reason(1, 1) and "only worker" in unfed_reason(1, 1) and "max_failures 2" in both
    for unfed in (None, both):
        assert reroute_data_error(IndexedDataset(), None, None, unfed=unfed) is None
        assert reroute_data_error(None, lambda *a: None, None, unfed=unfed) is None
        assert reroute_data_error(Stream(), None, lambda p, i: iter(()), unfed=unfed) is None
    assert reroute_data_error(Stream(), None, None) is None and reroute_data_error(None, None, None) is None
    err = reroute_data_error(Stream(), None, None, unfed=both)
    assert isinstance(err, ConfigError) and err.path == "training_data" and "iterable-style" in str(err)
    err = reroute_data_error(None, None, None, unfed=both)
    assert isinstance(err, ConfigError) and err.path == "batch_source" and "both the first and the last" in str(err)
    for name in ("training_data=", "batch_source=", "data_iter_factory=", "max_failures"):
        assert name in str(err)


class _Engine:
    """What IteratorSource reads of an engine."""

    def __init__(self, pipeline, iterator):
        self.me = type("W", (), {"pipeline": pipeline})()
        self.data_iterator = iterator


def test_a_relaunched_worker_skips_the_items_its_pipeline_ran_before():
    """A re-joined (or restarted) worker's script builds its data_iter as at the job's start; the
    iteration it resumes at reads the items DeepSpeed's order gives that iteration."""
    source = IteratorSource(_Engine(0, iter(range(100))), 3, catch_up=True)
    assert [source(0, 4, 0), source(0, 4, 2), source(0, 5, 0)] == [12, 14, 15]
    assert source.skipped == 12
    fresh = IteratorSource(_Engine(0, iter(range(100))), 3)  # a fresh job: positional, as DeepSpeed
    assert fresh(0, 4, 0) == 0 and fresh.skipped == 0


def test_iterator_source_replays_the_current_and_the_previous_iteration():
    """A stage that stepped ahead into iteration 3 and is rolled back to 2 replays 2 from what it
    kept; an iteration it has not read reads on (a load went back), as DeepSpeed does."""
    source = IteratorSource(_Engine(0, iter(range(100))), 2)
    assert [source(0, 0, 0), source(0, 0, 1), source(0, 1, 0), source(0, 1, 1), source(0, 2, 0)] == [0, 1, 2, 3, 4]
    assert [source(0, 1, 1), source(0, 1, 0), source(0, 2, 1), source(0, 3, 0)] == [3, 2, 5, 6]
    assert source(0, 1, 0) == 7  # gone: read on
    with pytest.raises(ResilienceError, match="data_iter_factory"):
        source(1, 3, 0)


def test_factory_source_keeps_one_iterator_per_pipeline_in_step_and_recreates_it_when_behind():
    made = []

    def factory(p, i):
        made.append((p, i))
        return ((p, k // 2, k % 2) for k in itertools.count(i * 2))

    source = FactorySource(factory, 2)
    assert [source(1, i, m) for i in range(3) for m in range(2)] == [(1, i, m) for i in range(3) for m in range(2)]
    assert source(1, 3, 1) == (1, 3, 1) and source(1, 3, 0) == (1, 3, 0)  # read on, kept
    assert source(0, 5, 0) == (0, 5, 0)
    assert made == [(1, 0), (0, 5)]
    assert source(1, 2, 1) == (1, 2, 1)  # the previous iteration is kept
    assert source(1, 0, 0) == (1, 0, 0)  # a rollback behind it: a new iterator at that iteration
    assert source(1, 30, 0) == (1, 30, 0)  # far ahead (a load): a new one, not 60 reads
    assert made == [(1, 0), (0, 5), (1, 0), (1, 30)]


def test_train_batch_data_iter_replaces_training_data_as_in_deepspeed():
    """While the engine holds the loader DeepSpeed built from training_data, every micro-batch comes
    from the dataset source; train_batch(data_iter) (DeepSpeed's set_dataiterator drops the loader)
    switches the own pipeline to the iterator and the others to data_iter_factory."""
    from ds_resilience.integrations.ds_data import EngineData

    engine = _Engine(0, None)
    engine.training_dataloader = loader = object()
    dataset = lambda p, i, m: ("dataset", p, i, m)  # noqa: E731
    data = EngineData(engine, 2, dataset=dataset, factory=FactorySource(lambda p, i: iter(range(i * 2, 100)), 2))
    assert data.loader is loader and data(1, 0, 0) == ("dataset", 1, 0, 0) and data(0, 0, 1) == ("dataset", 0, 0, 1)
    engine.training_dataloader, engine.data_iterator = None, iter("abcd")  # set_dataiterator(data_iter)
    assert [data(0, 1, 0), data(0, 1, 1), data(1, 1, 0)] == ["a", "b", 2]


# --- distributed: PP=2 x DP=2 against DeepSpeed ----------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", [{}, {"collate": True, "drop_last": True, "size": 22}], ids=["default", "collate_drop_last"])
def test_dataset_source_yields_what_deepspeeds_training_dataloader_yields(variant):
    """(a) For each pipeline, the source's micro-batches equal DeepSpeed's own training_dataloader's
    for that data-parallel rank, batch for batch, over more than two epochs, on every rank."""
    batches = 15  # > 2 epochs of 6 (5 with drop_last)
    results = run_workers(loader_streams, 4, args=(batches, variant), timeout_s=280)
    theirs = {r["pipeline"]: r["theirs"] for r in results}
    assert set(theirs) == {0, 1}
    for r in results:
        for p in (0, 1):
            for k in range(batches):
                assert _same(r["ours"][p][k], theirs[p][k]), (r["pipeline"], r["stage"], p, k)
        assert r["workers"] == 2 and r["reads"]["stream"] > 0  # DeepSpeed's default: 2 loader workers
    if variant.get("collate"):  # the user's collate_fn was applied
        x = theirs[0][0][0]
        raw = torch.stack([IndexedDataset()[int(i)][0] for i in x[:, 0]])
        assert torch.equal(x[:, 1:], raw[:, 1:] * 0.5)


def _expected_ids(steps: int) -> dict[int, Counter]:
    """step -> the multiset of every pipeline's micro-batch sample ids in that step (DeepSpeed's order)."""
    out: dict[int, Counter] = {}
    for p in (0, 1):
        stream = list(itertools.islice(pipeline_stream(IndexedDataset(), p, 2), steps * MICROBATCHES))
        for k, (_, (_, ids)) in enumerate(stream):
            out.setdefault(k // MICROBATCHES, Counter())[tuple(int(v) for v in ids)] += 1
    return out


def _by_stage(results, name):
    out = {}
    for r in results:
        s = r[name]
        if s["alive"]:
            out.setdefault(s["stage"], s["params"])
    return out


SCENARIOS = [
    {"name": "vanilla", "engine": "vanilla", "data": "training_data"},
    {"name": "td", "engine": "resilient", "data": "training_data"},
    {"name": "td_first", "engine": "resilient", "data": "training_data", "failed": ["1:0"]},
    {"name": "td_last", "engine": "resilient", "data": "training_data", "failed": ["1:1"]},
    {"name": "it", "engine": "resilient", "data": "data_iter"},
    {"name": "it_first", "engine": "resilient", "data": "data_iter", "failed": ["1:0"]},
    {"name": "it_last", "engine": "resilient", "data": "data_iter", "failed": ["0:1"]},
    {"name": "relay_first", "engine": "resilient", "data": "iter_only", "failed": ["1:0"]},
    {"name": "relay_last", "engine": "resilient", "data": "iter_only", "failed": ["0:1"]},
]


@pytest.fixture(scope="module")
def trained():
    steps = 6  # 12 micro-batches per pipeline: two epochs of 6
    return steps, run_workers(train_scenarios, 4, args=(SCENARIOS, steps), timeout_s=380)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["td", "td_first", "td_last", "it", "it_first", "it_last", "relay_first",
                                  "relay_last"])
def test_rerouted_microbatches_train_on_the_failed_workers_samples_and_match_fault_free(trained, name):
    """(b) training_data, (c) train_batch(data_iter) + data_iter_factory and (e) train_batch(data_iter)
    alone, the failed end's micro-batches relayed by its pipeline's other end: in every step, the
    micro-batches run on the survivors (first-stage inputs and last-stage labels) are exactly every
    pipeline's, the failed worker's included, and the parameters equal vanilla DeepSpeed's."""
    steps, results = trained
    expected = _expected_ids(steps)
    for where, stage in (("in", 0), ("loss", 1)):
        seen: dict[int, Counter] = {}
        for r in results:
            s = r[name]
            if s["stage"] == stage:
                for w, step, ids in s["seen"]:
                    if w == where:
                        seen.setdefault(step, Counter())[ids] += 1
        assert seen == expected, (name, where)
    failed = next(sc.get("failed") for sc in SCENARIOS if sc["name"] == name)
    if failed:
        (w,) = failed
        p, s = map(int, w.split(":"))
        peer = next(r[name] for r in results if r[name]["stage"] == s and r[name]["pipeline"] != p)
        own = [ids for where, _, ids in peer["seen"] if where == ("in" if s == 0 else "loss")]
        assert len(own) == 2 * steps * MICROBATCHES  # its own and the failed worker's
    ref, got = _by_stage(results, "vanilla"), _by_stage(results, name)
    assert set(ref) == set(got) == {0, 1}
    for stage in ref:
        for n, t in ref[stage].items():
            assert torch.allclose(got[stage][n], t, rtol=1e-5, atol=1e-6), (name, stage, n, (got[stage][n] - t).abs().max())
    if name.startswith("it") and failed:
        # the peer made one iterator per failed pipeline and kept it in step (no re-creation per step)
        assert peer["factory_iterators"] == 1, peer["factory_iterators"]


@pytest.mark.timeout(200)
def test_initialize_rejects_a_data_path_that_cannot_reroute():
    """(d) Where a pipeline can lose both ends (a simulated failure set, or under the agent a
    tolerance of two), train_batch(data_iter) alone or an iterable-style training_data is a
    ConfigError at initialize naming what to pass; with one end left, or without re-routing,
    train_batch(data_iter) alone works as in DeepSpeed."""
    results = run_workers(rejections, 4, timeout_s=180)
    for r in results:
        for name in ("simulated_iterator_only", "agent_iterator_only"):
            err = r[name]["error"]
            assert r[name]["error"] and r[name]["path"] == "batch_source", r[name]
            for what in ("training_data=", "batch_source=", "data_iter_factory="):
                assert what in err, err
        assert "pipeline(s) [1]" in r["simulated_iterator_only"]["error"]
        assert "max_failures 2" in r["agent_iterator_only"]["error"]
        err = r["agent_iterable_dataset"]  # (DeepSpeed's own loader cannot sample one at all)
        assert err["path"] == "training_data" and "iterable-style" in err["error"], err
        assert r["no_rerouting_iterator_only"]["error"] is None
        assert r["simulated_one_end_iterator_only"]["error"] is None  # the other end relays its data
    assert any(r["no_rerouting_iterator_only"]["loss"] is not None for r in results)
    assert any(r["simulated_one_end_iterator_only"]["loss"] is not None for r in results)


@pytest.mark.timeout(400)
def test_relayed_micro_batches_under_nccl_matching():
    """Under NCCL's matching (tags ignored, a pair's messages matched in posting order), the relay's
    messages come first on their pair in both directions' order: the relayed runs equal vanilla."""
    scenarios = [sc for sc in SCENARIOS if sc["name"] in ("vanilla", "relay_first", "relay_last")]
    results = run_workers(train_scenarios, 4, args=(scenarios, 3), timeout_s=380, env={"DSR_P2P_MATCHING": "fifo"})
    ref = _by_stage(results, "vanilla")
    for name in ("relay_first", "relay_last"):
        got = _by_stage(results, name)
        for stage in ref:
            for n, t in ref[stage].items():
                assert torch.allclose(got[stage][n], t, rtol=1e-5, atol=1e-6), (name, stage, n)
