"""The resilient forward-backward over megatron-core's GPTModel (tied embeddings) on CPU: PP=2 x DP=2
over gloo against a single-process reference of the same model and samples, fault-free and with a
failed replica's micro-batches re-routed; installation into megatron-core's factory."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from dist_harness import run_workers
import megatron_programs as mp

ITERATIONS, PP, DP, MICRO, CLIP = 3, 2, 2, 4, 1.0
# summation order (a stage's gradients summed over its replicas, re-routed micro-batches on one rank)
# differs from the reference in the last bits; Adam's normalisation lifts that to ~1e-6 on some
# machines' kernels. A lost or doubled micro-batch moves weights by a step's size (~1e-3).
TOL = 1e-5
SGD_CLIP = 0.6  # SGD's steps shrink the norm below 1.0: clip lower so that clipping is exercised


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("megatron") / "init.pt")
    out = run_workers(mp.reference, 1, args=(init, ITERATIONS, DP, MICRO, CLIP), timeout_s=240)[0]
    return init, out


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("megatron") / "init.pt")
    out = run_workers(mp.reference, 1, args=(init, ITERATIONS, DP, MICRO, SGD_CLIP, "sgd"), timeout_s=240)[0]
    return init, out


def _check(results, ref, idle=(), tp=1, clip=CLIP):
    trained = [r for r in results if (r["pipeline"], r["stage"]) not in idle]
    assert len(trained) == (PP * DP - len(idle)) * tp
    for r in trained:
        for name, value in r["params"].items():
            want = ref["params"][name]
            dim = r["split"][name]
            if dim is not None:  # this tensor-parallel rank's shard of the reference weight
                want = want.chunk(tp, dim=dim)[r["tp_rank"]]
            diff = float((value - want).abs().max())
            assert diff < TOL, (r["stage"], r["pipeline"], name, diff)
        assert r["logged"] == ([0] * ITERATIONS if r["stage"] < PP - 1 else r["logged"])
        assert all(ok for ok, _ in r["results"])
    # evaluation (forward_only): the last stage returns the logging dicts of the micro-batches it
    # evaluated (its tensor-parallel ranks alike); over the surviving last stages, every micro-batch
    # of every pipeline once, each equal to the reference's
    got = sorted(v for r in trained if r["stage"] == PP - 1 and r["tp_rank"] == 0 for v in r["evals"])
    want = sorted(ref["evals"].values())
    assert [t for _, t in got] == [t for _, t in want]
    assert all(abs(a - b) < 1e-4 for (a, _), (b, _) in zip(got, want)), (got, want)
    for r in trained:
        if r["stage"] < PP - 1:
            assert r["evals"] == []
        elif tp > 1:
            twin = next(x for x in trained if (x["stage"], x["pipeline"]) == (r["stage"], r["pipeline"])
                        and x["tp_rank"] != r["tp_rank"])
            assert twin["evals"] == r["evals"]
    norms = {tuple(n for _, n in r["results"]) for r in trained}
    assert len(norms) == 1  # every stage clipped with the one global norm
    assert max(next(iter(norms))) > clip  # and clipping took effect in some iteration


@pytest.mark.timeout(600)
def test_fault_free_pp2_dp2_matches_the_single_process_reference(reference):
    init, ref = reference
    results = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS, PP, MICRO, CLIP, [], False, "recycle"),
                          timeout_s=300)
    _check(results, ref)
    for r in results:  # the last stage returns megatron-core's logging dicts, one per micro-batch
        assert r["logged"] == ([MICRO] * ITERATIONS if r["stage"] == PP - 1 else [0] * ITERATIONS)


@pytest.mark.timeout(600)
def test_a_failed_replicas_micro_batches_rerouted_keep_the_reference_step(reference):
    """Replica p1s0 idles; its micro-batches run on p0s0 (decoupled B/W, staggered steps), and every
    surviving stage ends equal to the reference that trained every sample."""
    init, ref = reference
    results = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS, PP, MICRO, CLIP, ["1:0"], True, "recycle"),
                          timeout_s=300)
    _check(results, ref, idle=[(1, 0)])
    idle = next(r for r in results if (r["pipeline"], r["stage"]) == (1, 0))
    assert idle["results"] == [None] * ITERATIONS
    # the last stage of pipeline 0 computed its own micro-batches; pipeline 1's last stage too (re-routing
    # only moves the dead replica's stage)
    assert all(r["logged"] == [MICRO] * ITERATIONS for r in results if r["stage"] == PP - 1)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_megatron_cores_activation_recompute_is_taken_over_at_stage_granularity(reference, recompute):
    """The model built with megatron-core's activation recompute (Megatron-LM's --recompute-granularity
    full / selective), whose checkpoint function is reentrant (no B/W split through it) and CUDA-only:
    F keeps the stage input, B recomputes the chunk with megatron-core's recompute off; with a failed
    replica re-routed, every stage ends at the reference's weights and each micro-batch is logged once."""
    init, ref = reference
    results = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS, PP, MICRO, CLIP, ["1:0"], True, "recycle",
                                                       1, "adam", "cpu", None, None, recompute), timeout_s=300)
    _check(results, ref, idle=[(1, 0)])
    assert all(r["logged"] == [MICRO] * ITERATIONS for r in results if r["stage"] == PP - 1)


@pytest.mark.timeout(600)
def test_bf16_behind_float16module_with_fp32_masters_keeps_the_reference_step(reference):
    """Megatron-LM's bf16 setup (the chunk behind Float16Module, tied embeddings inside it) with
    fp32 master weights: a failed replica re-routed, each stage's fp32 masters end where a bf16
    single-process reference (every micro-batch's gradient accumulated in fp32, the global norm
    clipped on the masters) ends. bf16 rounds each micro-batch's gradient differently when the
    loss is formed in another order, so the measure is each tensor's distance to the reference
    relative to how far it trained: 0.7% at most measured (SGD; Adam's sign-like first steps lift
    near-zero gradients' rounding to ~25% on biases), where a lost or doubled micro-batch (1/8 of
    the gradient) or an unsummed tied embedding is several times that."""
    init, _ = reference
    ref = run_workers(mp.reference_bf16, 1, args=(init, ITERATIONS, DP, MICRO, SGD_CLIP, "sgd"), timeout_s=240)[0]
    results = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS, PP, MICRO, SGD_CLIP, ["1:0"], True, "recycle",
                                                       1, "sgd", "cpu", None, None, None, True), timeout_s=300)
    start = {name: w.to(torch.bfloat16).float() for name, w in torch.load(init).items()}
    trained = [r for r in results if (r["pipeline"], r["stage"]) != (1, 0)]
    assert len(trained) == PP * DP - 1
    for r in trained:
        for name, value in r["params"].items():
            assert value.dtype == torch.float32  # the masters
            want = ref["params"][name]
            relative = float((value - want).norm() / (want - start[name]).norm())
            assert relative < 0.02, (r["stage"], r["pipeline"], name, relative)
        assert all(ok for ok, _ in r["results"])


@pytest.mark.timeout(600)
def test_tp2_inside_each_stage_with_a_failed_replica_keeps_the_reference_step(reference_sgd):
    """TP=2 x PP=2 x DP=2 (8 ranks): every tensor-parallel rank runs the plan in its plane; one dead
    replica (both of its tensor-parallel ranks idle) is re-routed; every shard ends equal to the
    matching shard of the single-process reference. SGD here: tensor parallelism sums partial
    products in another order, and Adam's m / sqrt(v) turns that rounding on near-zero gradient
    elements into ~5e-6 (fault-free too); the gradient norms agree to 1e-8."""
    init, ref = reference_sgd
    results = run_workers(mp.pipelined, PP * DP * 2, args=(init, ITERATIONS, PP, MICRO, SGD_CLIP, ["1:1"],
                                                           True, "recycle", 2, "sgd"), timeout_s=400)
    _check(results, ref, idle=[(1, 1)], tp=2, clip=SGD_CLIP)
    assert sum(1 for r in results if r["results"] == [None] * ITERATIONS) == 2  # the replica's two ranks
    assert any(r["split"][n] is not None for r in results for n in r["split"])  # sharded weights were compared


@pytest.mark.timeout(600)
def test_a_megatron_format_checkpoint_written_by_survivors_restarts_exactly(reference, tmp_path):
    """Two iterations with replica p0s0 (data-parallel rank 0 of stage 0) idle: its stage's shard
    is written by p1s0, in Megatron-LM's layout; a fresh fault-free job loads it (weights, Adam's
    moments and step) and trains the third iteration: the reference's three-iteration weights."""
    from ds_resilience.megatron.checkpoint import TRACKER, checkpoint_file

    init, ref = reference
    saved = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS - 1, PP, MICRO, CLIP, ["0:0"], True, "recycle",
                                                     1, "adam", "cpu", str(tmp_path)), timeout_s=300)
    writers = sorted((r["pipeline"], r["stage"]) for r in saved if r["saved"])
    assert writers == [(0, 1), (1, 0)]  # stage 0's writer is the surviving replica
    assert (tmp_path / TRACKER).read_text() == str(ITERATIONS - 1)
    for stage in range(PP):
        assert checkpoint_file(tmp_path, ITERATIONS - 1, 0, stage, PP).is_file()
    shard = torch.load(checkpoint_file(tmp_path, ITERATIONS - 1, 0, 0, PP), weights_only=False)
    assert shard["checkpoint_version"] == 3.0 and shard["iteration"] == ITERATIONS - 1
    assert {"model", "optimizer", "rng_state", "args"} <= set(shard)
    resumed = run_workers(mp.pipelined, PP * DP, args=(init, ITERATIONS, PP, MICRO, CLIP, [], False, "recycle", 1,
                                                       "adam", "cpu", None, str(tmp_path)), timeout_s=300)
    assert all(r["start"] == ITERATIONS - 1 for r in resumed)
    for r in resumed:
        for name, value in r["params"].items():
            assert float((value - ref["params"][name]).abs().max()) < TOL, (r["stage"], r["pipeline"], name)


# --- installation and the interface ----------------------------------------------------------------
def test_install_reaches_the_training_loop_whatever_the_import_order(monkeypatch):
    import megatron.core.pipeline_parallel as package
    from megatron.core.pipeline_parallel import schedules

    from ds_resilience.megatron.factory import install, uninstall

    original = schedules.get_forward_backward_func
    before = types.ModuleType("megatron_training_before")  # Megatron-LM's training.py, imported first
    before.get_forward_backward_func = original
    monkeypatch.setitem(sys.modules, before.__name__, before)
    marker = object()
    try:
        factory = install(marker)  # type: ignore[arg-type]
        assert before.get_forward_backward_func is factory
        assert package.get_forward_backward_func is factory and schedules.get_forward_backward_func is factory
        assert factory() is marker and factory(pp_size=2, vp_size=None, schedule_pg_collection=None) is marker
        with pytest.raises(Exception, match="interleaving"):
            factory(vp_size=2)
        after = types.ModuleType("megatron_training_after")  # imported after install(): by name from the package
        exec("from megatron.core.pipeline_parallel import get_forward_backward_func", after.__dict__)
        assert after.get_forward_backward_func() is marker
    finally:
        uninstall()
    assert before.get_forward_backward_func is original and package.get_forward_backward_func is original


def test_unknown_keywords_are_named_and_the_training_loops_step_needs_a_schedule_step():
    from ds_resilience.errors import ResilienceError
    from ds_resilience.megatron import ResilientForwardBackward, ResilientOptimizer

    from ds_resilience.megatron.args import add_resilience_args, config_from_args
    import argparse

    args = add_resilience_args(argparse.ArgumentParser()).parse_args(["--resilience"])
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size = 1, 2, 2
    args.micro_batch_size, args.global_batch_size = 1, 4
    job = config_from_args(args)
    layer = torch.nn.Linear(2, 2)
    opt = ResilientOptimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    fb = ResilientForwardBackward(job, opt)
    with pytest.raises(TypeError, match=r"unknown keywords \['overlap_moe'\]"):
        fb(forward_step_func=None, data_iterator=None, model=layer, num_microbatches=2, seq_length=1,
           micro_batch_size=1, overlap_moe=True)
    with pytest.raises(ResilienceError, match="without a resilient forward-backward"):
        opt.step()
    assert opt.param_groups[0]["lr"] == 0.1  # the rest is the wrapped optimizer's
    with pytest.raises(TypeError, match="ResilientOptimizer"):
        ResilientForwardBackward(job, torch.optim.SGD(layer.parameters(), lr=0.1))


def test_the_device_safe_core_attention_is_causal_softmax_attention():
    out = run_workers(mp.attention_check, 1, timeout_s=120)[0]
    assert out["diff"] < 1e-5 and out["is_subclass"]


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_linear_layers_get_a_fast_w_equal_to_their_own_backward(tp):
    # megatron-core's linear layers are an autograd Function whose backward computes both
    # gradients: B defers the weight gradient (no wasted wgrad), W computes it without a second
    # input-gradient matmul or tensor-parallel all-reduce; biases added on their own (skip_bias_add)
    # and LayerNorms take their fast W too
    results = run_workers(mp.split_check, tp, args=(tp,), timeout_s=180)
    for out in results:
        assert out["equal"] and not out["main_grad"]
        assert out["autograd"] == [0, 0] and out["fast"][0] == out["fast"][1] > 0


class _MegatronLikeOptimizer:
    """megatron-core's optimizer protocol (FP32Optimizer / Float16OptimizerWithFloat16Params): step()
    = prepare_grads, clip over the model-parallel group, step_with_ready_grads."""

    def __init__(self, params, clip_grad=1.0, grad_scaler=None):
        self.inner = torch.optim.SGD(params, lr=1.0)
        self.config = types.SimpleNamespace(clip_grad=clip_grad)
        self.grad_scaler = grad_scaler
        self.calls = []

    def prepare_grads(self):
        self.calls.append("prepare_grads")
        return False

    def step_with_ready_grads(self):
        self.calls.append("step_with_ready_grads")
        self.inner.step()
        return True

    def step(self):
        raise AssertionError("megatron-core's step() would clip over the model-parallel group")

    def zero_grad(self, set_to_none=True):
        self.calls.append("zero_grad")
        self.inner.zero_grad(set_to_none=set_to_none)


def test_a_megatron_core_optimizer_steps_without_its_model_parallel_clipping():
    from ds_resilience.errors import ConfigError
    from ds_resilience.megatron import ResilientOptimizer

    layer = torch.nn.Linear(2, 1, bias=False)
    inner = _MegatronLikeOptimizer(layer.parameters(), clip_grad=1.0)
    opt = ResilientOptimizer(inner)
    assert opt.megatron and inner.config.clip_grad == 0.0 and opt.megatron_clip_grad == 1.0
    layer.weight.grad = torch.ones_like(layer.weight)
    before = layer.weight.detach().clone()
    opt.grad_norm = lambda: 3.5
    opt.run_step()
    assert inner.calls == ["prepare_grads", "step_with_ready_grads", "zero_grad"]
    assert torch.equal(layer.weight, before - 1.0)
    assert opt.step() == (True, 3.5, None)
    with pytest.raises(ConfigError, match="--fp16"):
        ResilientOptimizer(_MegatronLikeOptimizer(layer.parameters(), grad_scaler=object()))


def test_a_model_wrapped_in_megatrons_ddp_is_refused_not_trained_wrong():
    results = run_workers(mp.ddp_refusal, 1, timeout_s=120)
    assert "wrap_with_ddp=False" in results[0]


def test_a_bf16_job_without_fp32_masters_is_refused_not_trained_in_bf16():
    results = run_workers(mp.ddp_refusal, 1, args=(True,), timeout_s=120)
    assert "with_fp32_masters" in results[0] and "--bf16" in results[0]


def test_the_plane_view_sees_replicas_where_the_agent_sees_ranks():
    """Under the agent a tensor-parallel job's recovery plans over replicas: a dead rank fails its
    replica (its live tensor-parallel peer is out too), a replica's ranks vote together and it
    resumes at the fewest steps any of them took."""
    from ds_resilience.epochs import EpochRecord
    from ds_resilience.megatron.grid import PTDPGrid
    from ds_resilience.megatron.live import PlaneView

    grid = PTDPGrid(tp=2, pp=2, dp=2)
    topology = grid.topology()
    view = PlaneView(grid, topology, rank=5)
    assert not view.leader and PlaneView(grid, topology, rank=4).leader
    record = EpochRecord(epoch=2, failed=(3,), alive=(0, 1, 2, 4, 5, 6, 7), kind="crash", reason="rank 3 crashed")
    workers = view.workers(record)
    dead = grid.coord(3)[0]
    assert [topology.coord(r)[0] for r in workers.failed] == [dead]
    assert sorted(topology.coord(r)[0] for r in workers.alive) == sorted(w for w in topology.workers() if w != dead)
    assert view.ranks(workers.failed) == list(grid.replica(dead)) == [2, 3]
    assert view.worker_steps({0: 4, 1: 5, 4: 5, 5: 5}) == {topology.rank(grid.coord(0)[0]): 4,
                                                           topology.rank(grid.coord(4)[0]): 5}


def test_the_resilient_scheduler_is_stepped_by_the_schedule_and_checks_the_loops_increment():
    """megatron-core's OptimizerParamScheduler, wrapped: the schedule steps it by the global batch
    size right after each update (what Megatron-LM's train_step does after optimizer.step()); the
    loop's own call changes nothing, and a different increment (a ramp-up) is an error."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ds_resilience.errors import ConfigError
    from ds_resilience.megatron.optimizer import ResilientScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    inner = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=32, lr_decay_steps=160,
                                    lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=160,
                                    wd_incr_style="constant")
    sched = ResilientScheduler(inner)
    sched.increment = 16
    sched.run_step()
    assert inner.num_steps == 16 and opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step(increment=16)  # the training loop's call: already done
    assert inner.num_steps == 16 and sched.state_dict()["num_steps"] == 16
    with pytest.raises(ConfigError, match="global batch size 16"):
        sched.step(increment=8)
    with pytest.raises(TypeError, match="load_state_dict"):
        ResilientScheduler(object())
