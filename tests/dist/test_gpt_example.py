"""The example GPT and synthetic data (examples/gpt_model.py) and the vanilla DeepSpeed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import gpt_model as g  # noqa: E402

CONFIG = os.path.join(REPO, "configs", "gpt_cpu_pp2_dp2.json")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    from dist_harness import free_port

    return free_port()  # below the ephemeral range: see there


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (EXAMPLES, REPO, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


# --- (a) model --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_model_forward_backward(dtype):
    cfg = g.GPTConfig(dtype=dtype)
    model = g.build_full_model(cfg, seed=3)
    assert [type(m) for m in model] == [g.EmbeddingLayer] + [g.Block] * cfg.n_layers + [g.Head]
    assert all(p.dtype == dtype for p in model.parameters())
    tokens, labels = g.SyntheticCorpus(cfg, seed=3).batch(range(4))
    assert tokens.shape == labels.shape == (4, cfg.seq_len) and tokens.dtype == torch.int64
    logits = model(tokens)
    assert logits.shape == (4, cfg.seq_len, cfg.vocab_size) and logits.dtype == dtype
    loss = g.gpt_loss_fn(logits, labels)
    assert torch.isfinite(loss) and loss.dtype == dtype
    assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.2  # small init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_attention_is_causal():
    cfg = g.GPTConfig(n_layers=2)
    model = g.build_full_model(cfg, seed=0)
    tokens, _ = g.SyntheticCorpus(cfg, seed=0).batch([0])
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=0)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_parameter_count_and_names():
    cfg = g.GPTConfig()
    model = g.build_full_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 214_496
    assert all(name.split(".")[0].isdigit() for name in model.state_dict())  # "<layer>.<param>"


def test_config_is_checked():
    with pytest.raises(ValueError, match="n_heads"):
        g.GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        g.GPTConfig(dtype=torch.float16)


# --- (b) same seed => same weights, whoever builds the layer ------------------------------------
def test_layer_weights_do_not_depend_on_build_order_or_global_rng():
    cfg = g.GPTConfig()
    full = g.build_full_model(cfg, seed=7)
    specs = g.gpt_layer_specs(cfg, seed=7)
    assert len(specs) == cfg.n_layers + 2
    torch.manual_seed(12345)  # a different global RNG state must not matter
    for index in reversed(range(len(specs))):  # build the last stage's layers first
        layer = specs[index].build()
        reference = full[index].state_dict()
        assert layer.state_dict().keys() == reference.keys()
        for key, value in layer.state_dict().items():
            assert torch.equal(value, reference[key]), (index, key)
    other = g.build_full_model(cfg, seed=8)
    assert not torch.equal(other[1].qkv.weight, full[1].qkv.weight)
    assert not torch.equal(full[1].qkv.weight, full[2].qkv.weight)  # layers differ from each other


_STAGE_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    import deepspeed
    import gpt_model as g
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    cfg = g.GPTConfig()
    module = g.build_pipeline_module(cfg, num_stages=2, seed=11, partition_method=sys.argv[2])
    torch.save({"stage": module.stage_id, "state_dict": module.state_dict()},
               os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pt"))
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["uniform", "parameters"])
def test_pipeline_stages_hold_the_full_models_weights(tmp_path, method):
    """Two real gloo processes build a P=2 PipelineModule; each stage's layers equal the full model's."""
    script = tmp_path / "stage.py"
    script.write_text(_STAGE_SCRIPT)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), method], cwd=REPO,
                              env=_child_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                             MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    full = g.build_full_model(g.GPTConfig(), seed=11).state_dict()
    merged = {}
    for rank in range(2):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["stage"] == rank
        layers = {int(k.split(".")[0]) for k in saved["state_dict"]}
        assert layers and not layers & {int(k.split(".")[0]) for k in merged}
        merged.update(saved["state_dict"])
    assert merged.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(merged[key], value), key


# --- (c) data -------------------------------------------------------------------------------------
def test_samples_are_pure_functions_of_seed_and_index():
    cfg = g.GPTConfig()
    a, b = g.SyntheticCorpus(cfg, seed=5), g.SyntheticCorpus(cfg, seed=5)
    for index in (0, 1, 17, 10**9):
        ta, la = a.sample(index)
        tb, lb = b.sample(index)
        assert torch.equal(ta, tb) and torch.equal(la, lb)
        assert ta.shape == la.shape == (cfg.seq_len,) and ta.dtype == la.dtype == torch.int64
        assert torch.equal(ta[1:], la[:-1])  # labels are the next tokens
        assert 0 <= int(ta.min()) and int(ta.max()) < cfg.vocab_size
    assert not torch.equal(a.sample(0)[0], a.sample(1)[0])
    assert not torch.equal(a.sample(0)[0], g.SyntheticCorpus(cfg, seed=6).sample(0)[0])
    with pytest.raises(ValueError):
        a.sample(-1)


def test_corpus_mixes_markov_walks_and_repeated_patterns():
    cfg = g.GPTConfig()
    corpus = g.SyntheticCorpus(cfg, seed=0)
    periodic = 0
    for index in range(200):
        tokens, labels = corpus.sample(index)
        seq = torch.cat([tokens, labels[-1:]])
        if any(torch.equal(seq[k:], seq[:-k]) for k in range(3, 9)):
            periodic += 1
            continue
        for prev, nxt in zip(seq[:-1].tolist(), seq[1:].tolist()):
            assert corpus.transition[prev, nxt] > 0  # every step of a walk follows the chain
    assert 20 < periodic < 80  # copy_fraction 0.25


def test_micro_batch_layout_and_iterator_order():
    cfg = g.GPTConfig(seq_len=8)
    corpus = g.SyntheticCorpus(cfg, seed=1)
    dp, M, b = 3, 4, 2
    seen = {}
    for p in range(dp):
        it = g.data_iterator(corpus, pipeline=p, dp=dp, microbatches=M, micro_batch_size=b)
        for i in range(3):
            for m in range(M):
                x, y = next(it)
                ex, ey = g.micro_batch(corpus, pipeline=p, iteration=i, microbatch=m, dp=dp,
                                       microbatches=M, micro_batch_size=b)
                assert x.shape == y.shape == (b, cfg.seq_len)
                assert torch.equal(x, ex) and torch.equal(y, ey)
                start = g.sample_index(pipeline=p, iteration=i, microbatch=m, dp=dp, microbatches=M,
                                       micro_batch_size=b)
                assert torch.equal(x, corpus.batch(range(start, start + b))[0])
                for k in range(start, start + b):
                    assert k not in seen, (k, seen.get(k), (p, i, m))
                    seen[k] = (p, i, m)
    # the shards tile the global batches exactly: iteration i is samples [i*G, (i+1)*G)
    G = dp * M * b
    assert sorted(seen) == list(range(3 * G))
    for k, (p, i, m) in seen.items():
        assert i == k // G and p == (k % G) // (M * b)  # contiguous shard per pipeline
    # resuming mid-run gives the same stream
    late = g.data_iterator(corpus, pipeline=1, dp=dp, microbatches=M, micro_batch_size=b, start_iteration=2)
    x, _ = next(late)
    assert torch.equal(x, g.micro_batch(corpus, pipeline=1, iteration=2, microbatch=0, dp=dp,
                                        microbatches=M, micro_batch_size=b)[0])
    with pytest.raises(ValueError):
        g.micro_batch(corpus, pipeline=dp, iteration=0, microbatch=0, dp=dp, microbatches=M, micro_batch_size=b)
    with pytest.raises(ValueError):
        g.micro_batch(corpus, pipeline=0, iteration=0, microbatch=M, dp=dp, microbatches=M, micro_batch_size=b)


# --- (d) learnable -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_loss_decreases_with_adam():
    cfg = g.GPTConfig()
    model = g.build_full_model(cfg, seed=0)
    corpus = g.SyntheticCorpus(cfg, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = g.data_iterator(corpus, pipeline=0, dp=1, microbatches=1, micro_batch_size=16)
    losses = []
    start = time.perf_counter()
    for _ in range(60):
        x, y = next(data)
        loss = g.gpt_loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert time.perf_counter() - start < 20
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 4.2 and last < first - 1.0, (first, last)


# --- config ---------------------------------------------------------------------------------------
def test_cpu_config_is_accepted():
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_resilience.config import load_resilience_config

    resilience = load_resilience_config(CONFIG)
    assert (resilience.schedule, resilience.variant) == ("1f1b", "recycle")
    with open(CONFIG, encoding="utf-8") as fh:
        config = json.load(fh)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 4
    # DeepSpeed's defaults, as a user's config has them: "Adam" is DeepSpeed's FusedAdam, clipping 1.0
    assert config["optimizer"]["type"] == "Adam" and "torch_adam" not in config["optimizer"]["params"]
    ds = DeepSpeedConfig(config)  # DeepSpeed 0.19.8 ignores the unknown "resilience" and "_comment" keys
    assert ds.gradient_accumulation_steps == 4 and ds.train_micro_batch_size_per_gpu == 2
    assert ds.gradient_clipping == 1.0 and not ds.bfloat16_config.enabled  # fp32: see the file's "_comment"


# --- (e) the vanilla DeepSpeed run ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vanilla_deepspeed_pipeline_run(tmp_path):
    dump = tmp_path / "dump.pt"
    with open(CONFIG, encoding="utf-8") as fh:
        config = json.load(fh)
    # compared below with unclipped torch.optim.Adam in one process: clipping off (vanilla clips a
    # pipeline by its first stage's norm); "Adam" stays DeepSpeed's FusedAdam (weight_decay 0: Adam)
    config["gradient_clipping"] = 0.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4",
           "--master_port", str(_free_port()), os.path.join("examples", "vanilla_train.py"),
           "--deepspeed_config", str(tmp_path / "config.json"), "--steps", "3", "--dump", str(dump)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=225)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail("vanilla run timed out:\n" + out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, out[-3000:]
    losses = [float(line.split()[3]) for line in steps]
    assert all(0 < v < 10 for v in losses)

    # the dump: the whole model in the full model's names, DP replicas equal, and the same math as a
    # single-process reference (global batch = dp * micro-batches * micro-batch size, mean loss)
    saved = torch.load(dump)
    assert saved["losses"] == pytest.approx(losses, abs=1e-6)
    cfg, seed = g.GPTConfig(), saved["config"]["seed"]
    model = g.build_full_model(cfg, seed)
    assert saved["state_dict"].keys() == model.state_dict().keys()
    ranks = saved["ranks"]
    assert sorted(ranks) == [0, 1, 2, 3]
    for a in ranks.values():
        for b in ranks.values():
            if a["stage"] == b["stage"]:
                for key, value in a["state_dict"].items():
                    assert torch.equal(value, b["state_dict"][key]), key
    dp, M, mbs = (saved["config"][k] for k in ("dp", "microbatches", "micro_batch_size"))
    corpus = g.SyntheticCorpus(cfg, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    reference = []
    for it in range(3):
        opt.zero_grad()
        total = 0.0
        for p in range(dp):
            for m in range(M):
                x, y = g.micro_batch(corpus, pipeline=p, iteration=it, microbatch=m, dp=dp,
                                     microbatches=M, micro_batch_size=mbs)
                loss = g.gpt_loss_fn(model(x), y) / (dp * M)
                loss.backward()
                total += loss.item()
        opt.step()
        reference.append(total)
    assert reference == pytest.approx(saved["losses"], abs=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(saved["state_dict"][key], value, rtol=0, atol=1e-5)
