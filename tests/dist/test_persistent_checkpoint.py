"""Persistent checkpoint tier: ``AsyncPersistentCheckpointEngine`` (asynchronous, atomic, keep_last).

Unit tests in one process (a slow writer injected by monkeypatching ``torch.save``), and a
4-process gloo job (2 stages x 2 pipelines) of vanilla DeepSpeed's PipelineEngine on the example
GPT: save, train on, save, then a fresh engine loads both checkpoints bitwise.
"""

from __future__ import annotations

import copy
import glob
import os
import sys
import time

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from dist_harness import run_workers
from ds_resilience.checkpoint import persistent as P
from ds_resilience.checkpoint.persistent import CheckpointWriteError, complete_tags, latest_complete_tag
from ds_resilience.integrations.ds_checkpoint_engine import AsyncPersistentCheckpointEngine, install

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
SLOW_S = 0.6


@pytest.fixture
def slow_save(monkeypatch):
    real = torch.save

    def slow(obj, f, *args, **kwargs):
        time.sleep(SLOW_S)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow)
    return slow


def _state():
    return {"module": {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "b": torch.ones(7)},
            "optimizer": {"state": {0: {"exp_avg": torch.full((5,), 2.0), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "global_steps": 4, "names": ["a", "b"]}


def _save_tag(ce, save_dir, tag, state, *, latest=True, name="mp_rank_00_model_states.pt"):
    info = CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=latest)
    ce.create(info)
    ce.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    path = os.path.join(save_dir, tag, name)
    ce.save(state, path)
    return info, path


def test_engine_api_matches_deepspeed():
    ce = AsyncPersistentCheckpointEngine(keep_last=2)  # instantiable: every abstract method implemented
    assert ce.is_decoupled() and not ce.preserves_storage_sharing()
    assert ce.is_data_parallel_writer(0) and not ce.is_data_parallel_writer(1)
    assert ce.get_commit_info() is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            AsyncPersistentCheckpointEngine(keep_last=bad)
    ce.close()


def test_save_returns_before_the_write_finishes(tmp_path, slow_save):
    ce = AsyncPersistentCheckpointEngine()
    info, path = _save_tag(ce, str(tmp_path), "global_step1", _state())
    assert not os.path.exists(path)  # save() returned while the (slow) write is still running
    assert ce.pending_tags() == ["global_step1"]
    ce.poll()  # non-blocking: nothing finished yet, nothing committed
    assert not os.path.exists(tmp_path / "global_step1" / ".complete-rank0")
    ce.commit(info)  # waits for the write
    assert os.path.isfile(path) and os.path.isfile(tmp_path / "global_step1" / ".complete-rank0")
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert len(ce.write_seconds) == 1
    ce.close()


def test_snapshot_is_not_affected_by_mutating_live_tensors(tmp_path, slow_save):
    ce = AsyncPersistentCheckpointEngine()
    state = _state()
    expect = copy.deepcopy(state)
    param = torch.nn.Parameter(torch.randn(4, 4))
    state["module"]["p"] = param
    expect["module"]["p"] = param.detach().clone()
    view = state["module"]["w"][2:4]  # a view of a bigger storage
    state["module"]["view"] = view
    expect["module"]["view"] = view.clone()
    info, path = _save_tag(ce, str(tmp_path), "global_step1", state)
    # training goes on: in-place updates, container changes
    state["module"]["w"].add_(5.0)
    state["module"]["b"].zero_()
    with torch.no_grad():
        param.mul_(-3)
    state["optimizer"]["state"][0]["exp_avg"].fill_(-1)
    state["optimizer"]["param_groups"][0]["lr"] = 99.0
    state["names"].append("c")
    ce.wait()
    got = ce.load(path)
    assert torch.equal(got["module"]["w"], expect["module"]["w"])
    assert torch.equal(got["module"]["b"], expect["module"]["b"])
    assert torch.equal(got["module"]["p"], expect["module"]["p"])
    assert torch.equal(got["module"]["view"], expect["module"]["view"])
    assert got["module"]["view"].untyped_storage().nbytes() == 2 * 100 * 4  # compact copy, not the storage
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], expect["optimizer"]["state"][0]["exp_avg"])
    assert got["optimizer"]["param_groups"][0]["lr"] == 0.1 and got["names"] == ["a", "b"]
    ce.close()


def test_load_waits_for_a_write_in_flight(tmp_path, slow_save):
    ce = AsyncPersistentCheckpointEngine()
    _, path = _save_tag(ce, str(tmp_path), "t", _state())
    other = AsyncPersistentCheckpointEngine()  # e.g. a fresh engine in the same process
    assert torch.equal(other.load(path)["module"]["w"], _state()["module"]["w"])
    ce.close()
    other.close()


def test_crash_between_writes_is_never_loaded(tmp_path, monkeypatch):
    ce = AsyncPersistentCheckpointEngine(keep_last=5)
    save_dir = str(tmp_path)
    info1, path1 = _save_tag(ce, save_dir, "global_step1", _state())
    ce.wait()
    real_replace = os.replace

    def crash(src, dst):  # the process "dies" after the tmp file, before the rename
        if dst.endswith(".pt"):
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(P.os, "replace", crash)
    info2, path2 = _save_tag(ce, save_dir, "global_step2", _state(), name="layer_01-model_states.pt")
    with pytest.raises(CheckpointWriteError, match="layer_01-model_states.pt"):
        ce.commit(info2)
    monkeypatch.setattr(P.os, "replace", real_replace)
    tag2 = tmp_path / "global_step2"
    assert glob.glob(str(tag2 / "layer_01-model_states.pt.tmp-*")), "the torn write's tmp file is left"
    assert not os.path.exists(path2) and not os.path.exists(tag2 / ".complete-rank0")
    # DeepSpeed's loaders glob `layer_XX-*model_states.pt`: the tmp file never matches
    assert glob.glob(str(tag2 / "layer_01-*model_states.pt")) == []
    with pytest.raises(FileNotFoundError, match="never loaded"):
        ce.load(path2)
    assert complete_tags(save_dir, 1) == ["global_step1"]
    assert latest_complete_tag(save_dir, 1) == "global_step1"
    ce.poll()
    assert (tmp_path / "latest").read_text() == "global_step1"  # never points at the torn tag
    ce.close()


def test_commit_timeout_names_the_file(tmp_path, monkeypatch):
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (time.sleep(1.5), real(*a, **k)))
    ce = AsyncPersistentCheckpointEngine(timeout_s=0.2)
    info, path = _save_tag(ce, str(tmp_path), "global_step1", _state())
    with pytest.raises(CheckpointWriteError, match="mp_rank_00_model_states.pt.*did not finish"):
        ce.commit(info)
    assert not os.path.exists(tmp_path / "global_step1" / ".complete-rank0")
    ce.wait(timeout_s=10)
    assert os.path.exists(tmp_path / "global_step1" / ".complete-rank0")
    ce.close()


def test_keep_last_prunes_only_old_complete_tags(tmp_path):
    save_dir = str(tmp_path)
    ce = AsyncPersistentCheckpointEngine(keep_last=2)
    os.makedirs(tmp_path / "notes")  # foreign directory: no markers, never touched
    for step in (10, 20, 30):
        ce.commit(_save_tag(ce, save_dir, f"global_step{step}", _state())[0])
        time.sleep(0.01)
    assert sorted(os.listdir(save_dir)) == ["global_step20", "global_step30", "latest", "notes"]
    # a newer tag that is incomplete (pending write, then a torn tmp file) must survive pruning
    os.makedirs(tmp_path / "global_step40")
    (tmp_path / "global_step40" / "mp_rank_00_model_states.pt.tmp-1").write_bytes(b"torn")
    ce.commit(_save_tag(ce, save_dir, "global_step50", _state())[0])
    assert sorted(os.listdir(save_dir)) == ["global_step30", "global_step40", "global_step50", "latest", "notes"]
    assert (tmp_path / "latest").read_text() == "global_step50"
    ce.close()


# --- distributed: vanilla DeepSpeed PipelineEngine, 2 stages x 2 pipelines, gloo --------------
def _opt_state(engine):
    sd = engine.optimizer.state_dict()
    return {k: {n: (v.detach().clone() if torch.is_tensor(v) else v) for n, v in s.items()}
            for k, s in sd["state"].items()}


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _bitwise(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_bitwise(a, b):
    if a.keys() != b.keys():
        return False
    for k in a:
        if a[k].keys() != b[k].keys():
            return False
        for n in a[k]:
            x, y = a[k][n], b[k][n]
            if not (torch.equal(x, y) if torch.is_tensor(x) else x == y):
                return False
    return True


def pipeline_checkpoint_program(rank, world, save_dir, d_model, reps):
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import deepspeed
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
    from engine_programs import MICRO_BATCH_SIZE, ds_config
    from gpt_model import GPTConfig, SyntheticCorpus, build_pipeline_module, data_iterator

    deepspeed.init_distributed(dist_backend="gloo")
    pp, mb = 2, 2
    dp = world // pp
    cfg = GPTConfig(n_layers=4, d_model=d_model)
    corpus = SyntheticCorpus(cfg, seed=11)

    def make(seed):
        module = build_pipeline_module(cfg, num_stages=pp, seed=seed)
        engine, *_ = deepspeed.initialize(model=module, config=ds_config(microbatches=mb, dp=dp),
                                          model_parameters=[p for p in module.parameters() if p.requires_grad])
        it = data_iterator(corpus, pipeline=engine.grid.data_parallel_id, dp=dp, microbatches=mb,
                           micro_batch_size=MICRO_BATCH_SIZE)
        return module, engine, it

    out = {}
    module, engine, it = make(5)
    if reps == 0:
        ce = install(engine, keep_last=2)
        assert engine.checkpoint_engine is ce
        for _ in range(2):
            engine.train_batch(it)
        t0 = time.perf_counter()
        engine.save_checkpoint(save_dir, tag="global_step2")
        out["save_s"] = time.perf_counter() - t0
        saved1 = (_params(module), _opt_state(engine))
        for _ in range(2):  # mutates the live tensors while the writes may still be in flight
            engine.train_batch(it)
        engine.save_checkpoint(save_dir, tag="global_step4")
        saved2 = (_params(module), _opt_state(engine))
        ce.flush(timeout_s=120)
        out["tags_after_two"] = sorted(os.listdir(save_dir))
        out["latest"] = open(os.path.join(save_dir, "latest")).read()

        fresh_module, fresh, _ = make(99)  # different init: a load must change it
        out["fresh_differs"] = not _bitwise(_params(fresh_module), saved1[0])
        install(fresh, keep_last=2)
        fresh.load_checkpoint(save_dir, tag="global_step2")
        out["load1_params"] = _bitwise(_params(fresh_module), saved1[0])
        out["load1_opt"] = _opt_bitwise(_opt_state(fresh), saved1[1])
        fresh.load_checkpoint(save_dir)  # tag from `latest`
        out["load2_params"] = _bitwise(_params(fresh_module), saved2[0])
        out["load2_opt"] = _opt_bitwise(_opt_state(fresh), saved2[1])
        out["global_steps"] = fresh.global_steps

        # keep_last=1: after the next complete save only the newest tag is left
        ce1 = install(engine, keep_last=1)
        engine.train_batch(it)
        engine.save_checkpoint(save_dir, tag="global_step5")
        engine.train_batch(it)  # the commit is driven by the next step (non-blocking poll)
        ce1.flush(timeout_s=120)
        torch.distributed.barrier()
        out["tags_after_keep1"] = sorted(os.listdir(save_dir))
        out["latest_after_keep1"] = open(os.path.join(save_dir, "latest")).read()
    else:  # stall of save_checkpoint: DeepSpeed's TorchCheckpointEngine vs the async engine, same run
        default = TorchCheckpointEngine(engine._config)
        async_ce = AsyncPersistentCheckpointEngine(engine._config, keep_last=2)
        engine.train_batch(it)
        times = {"torch": [], "async": [], "step": []}
        for r in range(reps):
            for name, ce in (("torch", default), ("async", async_ce)):
                engine.checkpoint_engine = ce
                torch.distributed.barrier()
                t0 = time.perf_counter()
                engine.save_checkpoint(os.path.join(save_dir, name), tag=f"r{r}")
                times[name].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.train_batch(it)
                times["step"].append(time.perf_counter() - t0)
            async_ce.flush(timeout_s=120)
        out["times"] = times
        out["write_s"] = list(async_ce.write_seconds)
    torch.distributed.barrier()
    return out


def test_pipeline_engine_save_load_bitwise_and_keep_last(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    results = run_workers(pipeline_checkpoint_program, 4, args=(save_dir, 64, 0), timeout_s=240)
    for rank, r in enumerate(results):
        assert r["fresh_differs"], rank
        assert r["load1_params"] and r["load1_opt"], f"rank {rank}: first checkpoint not restored bitwise"
        assert r["load2_params"] and r["load2_opt"], f"rank {rank}: second checkpoint not restored bitwise"
        assert r["tags_after_two"] == ["global_step2", "global_step4", "latest"]
        assert r["latest"] == "global_step4"
        assert r["tags_after_keep1"] == ["global_step5", "latest"], r["tags_after_keep1"]
        assert r["latest_after_keep1"] == "global_step5"
    for tag in ("global_step5",):
        markers = sorted(glob.glob(os.path.join(save_dir, tag, ".complete-rank*")))
        assert [os.path.basename(m) for m in markers] == [f".complete-rank{r}" for r in range(4)]
    assert not glob.glob(os.path.join(save_dir, "*", "*.tmp-*"))


def test_resilient_engine_save_and_load_checkpoint_go_through_the_persistent_tier(tmp_path):
    import engine_programs

    out = run_workers(engine_programs.resilient_save_load, 4, args=(str(tmp_path),), timeout_s=240)
    for r in out:
        assert r["async"] and r["moved"] and r["back"] and r["steps"] == 2, r
    tags = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert tags == ["b"], tags  # keep_last = 1 pruned "a" once "b" was complete
    assert (tmp_path / "latest").read_text().strip() == "b"


def test_load_maps_tensors_to_host_memory_unless_told_otherwise(tmp_path, monkeypatch):
    """A file written from ``cuda:k`` must load on a node with fewer GPUs (or after the rank moved):
    without a ``map_location`` the engine reads into host memory; a caller's choice is kept."""
    ce = AsyncPersistentCheckpointEngine()
    path = str(tmp_path / "x.pt")
    torch.save({"w": torch.ones(2)}, path)
    seen = []
    real = torch.load
    monkeypatch.setattr(P.torch, "load", lambda *a, **k: seen.append(k["map_location"]) or real(*a, **k))
    assert torch.equal(ce.load(path)["w"], torch.ones(2))
    ce.load(path, map_location=None)
    keep = lambda storage, loc: storage  # noqa: E731 (DeepSpeed's own map_location)
    ce.load(path, map_location=keep)
    assert seen == ["cpu", "cpu", keep]
