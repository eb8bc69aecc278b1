"""``ds_resilience.initialize`` does around its engine what ``deepspeed.initialize`` (0.19.8) does
around DeepSpeed's (issue 41 item 5), and refuses by name what that would build but this engine
cannot run. One process: the engine is a stand-in that records what it was built with and does
with its arguments what DeepSpeed's engine does (Muon's parameter groups, the GC policy), and
torch.distributed is never started."""

from __future__ import annotations

import argparse
import base64
import gc
import json
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")

import ds_resilience  # noqa: E402
from ds_resilience.errors import ConfigError  # noqa: E402
from ds_resilience.integrations import deepspeed as dsi  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def pipeline_module(cls=None):
    """A ``PipelineModule`` (or subclass) instance without its topology (which needs a process
    group): a 2-D weight, a bias and an embedding, one stage."""
    from deepspeed.pipe import PipelineModule

    cls = cls or PipelineModule
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.embed = torch.nn.Embedding(8, 4)
    module.body = torch.nn.Linear(4, 4)
    module.num_stages = 1
    module.mpu = lambda: None
    return module


class StandInEngine:
    """Records its arguments and the state around its build; does with them what DeepSpeed's
    engine does (a Muon config: the parameter groups it builds need every ``use_muon`` tag)."""

    built: list["StandInEngine"] = []

    def __init__(self, **kwargs):
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero import partition_parameters

        self.kwargs = kwargs
        self._config = kwargs["config_class"]
        self._python_gc_generation = None
        context = partition_parameters.top_level_context
        self.zero_init_patched_while_built = None if context is None else context.patched
        if self._config.optimizer_name == "muon":
            self.groups = DeepSpeedEngine._muon_param_groups(list(kwargs["model"].parameters()),
                                                            self._config.optimizer_params or {})
        self.optimizer = self.training_dataloader = self.lr_scheduler = None
        StandInEngine.built.append(self)

    def _configure_python_gc(self):
        from deepspeed.runtime.engine import DeepSpeedEngine

        DeepSpeedEngine._configure_python_gc(self)

    def destroy(self):
        from deepspeed.runtime.python_gc import python_gc_manager

        if self._python_gc_generation is not None:
            python_gc_manager.release(self._python_gc_generation)
            self._python_gc_generation = None


@pytest.fixture
def stand_in(monkeypatch):
    """The engine replaced, no process group, no agent; yields the list of init_distributed calls."""
    import deepspeed.comm

    calls = []
    StandInEngine.built = []
    monkeypatch.setattr(dsi, "ResilientPipelineEngine", StandInEngine)
    monkeypatch.setattr(dsi, "launch_env", lambda: None)
    monkeypatch.setattr(deepspeed.comm, "init_distributed", lambda **kw: calls.append(kw))
    yield calls


def init(config, model=None, **kwargs):
    return ds_resilience.initialize(model=model if model is not None else pipeline_module(), config=config, **kwargs)


# --- set_optimizer_flags ------------------------------------------------------------------------
def test_muon_parameters_are_tagged_before_the_engine_builds_its_optimizer(stand_in):
    """``deepspeed.set_optimizer_flags``: with ``"Muon"`` every parameter gets ``use_muon`` (2-D
    weights outside embeddings: True), which DeepSpeed's Muon parameter groups require."""
    model = pipeline_module()
    engine, *_ = init({**BASE, "optimizer": {"type": "Muon", "params": {"lr": 0.02}}}, model)
    assert model.body.weight.use_muon is True
    assert model.body.bias.use_muon is False and model.embed.weight.use_muon is False
    assert {g["name"]: len(g["params"]) for g in engine.groups} == {"muon-params": 1, "adam-params": 2}


# --- the Python GC policy -----------------------------------------------------------------------
def test_disable_python_gc_turns_automatic_gc_off_until_the_engine_is_destroyed(stand_in):
    assert gc.isenabled()
    engine, *_ = init({**BASE, "disable_python_gc": True})
    try:
        assert not gc.isenabled()
    finally:
        engine.destroy()
        gc.enable()
    assert gc.isenabled()
    engine, *_ = init(BASE)  # the default leaves it alone
    assert gc.isenabled() and engine._python_gc_generation is None


# --- zero.Init's wrappers -----------------------------------------------------------------------
class FakeInitContext:
    """A ``deepspeed.zero.Init`` context in force (its module and tensor wrappers patched in)."""

    patched = True

    def unpatch_init_and_builtins(self):
        self.patched = False

    def patch_init_and_builtins(self):
        self.patched = True


def test_zero_init_wrappers_are_off_while_the_engine_is_built_and_back_after(stand_in, monkeypatch):
    from deepspeed.runtime.zero import partition_parameters

    context = FakeInitContext()
    monkeypatch.setattr(partition_parameters, "top_level_context", context)
    init(BASE)
    assert StandInEngine.built[-1].zero_init_patched_while_built is False
    assert context.patched
    monkeypatch.setattr(dsi, "ResilientPipelineEngine", lambda **kw: 1 / 0)  # a failed build puts them back too
    with pytest.raises(ZeroDivisionError):
        init(BASE)
    assert context.patched


def test_parameters_partitioned_by_zero_init_are_refused(stand_in):
    model = pipeline_module()
    model.body.weight.ds_id = 0  # what zero.Init leaves on a parameter it partitioned
    with pytest.raises(ConfigError, match="zero.Init"):
        init(BASE, model)
    assert not StandInEngine.built and not stand_in


# --- the engine class ---------------------------------------------------------------------------
def test_a_dualpipev_module_is_refused_and_runs_on_deepspeeds_engine_with_resilience_off(stand_in, monkeypatch):
    """``deepspeed.initialize`` builds a ``DualPipeVEngine`` for a ``DualPipeVModule`` (two stages a
    rank, in a V), which the planner's schedules do not place: refused by name; with resilience off
    it goes to ``deepspeed.initialize``, which picks that engine."""
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    with pytest.raises(ConfigError, match="DualPipeV"):
        init(BASE, pipeline_module(DualPipeVModule))
    assert not StandInEngine.built and not stand_in
    seen = {}
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: seen.update(kw) or ("engine", None, None, None))
    model = pipeline_module(DualPipeVModule)
    assert init({**BASE, "resilience": {"enabled": False}}, model)[0] == "engine"
    assert seen["model"] is model and "resilience" not in seen["config"]


# --- AutoTP -------------------------------------------------------------------------------------
def test_autotp_above_one_is_refused_and_one_sets_the_training_mode(stand_in, monkeypatch):
    from deepspeed.module_inject import layers
    from deepspeed.runtime.tensor_parallel import init_utils

    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size"):
        init({**BASE, "tensor_parallel": {"autotp_size": 2}})
    monkeypatch.setattr(init_utils, "_TP_MODEL_INIT_ARGS", {"tp_size": 2, "dtype": torch.float32, "tp_group": None})
    with pytest.raises(ConfigError, match="tp_model_init"):
        init(BASE)
    assert not StandInEngine.built
    monkeypatch.setattr(init_utils, "_TP_MODEL_INIT_ARGS", None)
    monkeypatch.setattr(layers, "DEEPSPEED_AUTOTP_MODE", layers.AUTOTP_MODE.INFERENCE)
    init({**BASE, "tensor_parallel": {"autotp_size": 1}})
    assert layers.DEEPSPEED_AUTOTP_MODE == layers.AUTOTP_MODE.TRAINING


# --- the config and the arguments, as DeepSpeed reads them ----------------------------------------
def test_the_config_is_read_as_deepspeed_reads_it(tmp_path):
    """hjson (comments, unquoted keys; a duplicate key is an error) and a base64-encoded string,
    as ``DeepSpeedConfig`` and ``load_ds_config`` take them; the shipped configs read the same."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    f = tmp_path / "ds.json"
    f.write_text('{\n  // a comment\n  train_micro_batch_size_per_gpu: 2,\n  "resilience": {"max_failures": 1}\n}\n')
    data, resilience, base_dir = dsi._split_config(f)
    assert data == {"train_micro_batch_size_per_gpu": 2} and resilience.max_failures == 1 and base_dir == tmp_path
    encoded = base64.urlsafe_b64encode(json.dumps(BASE).encode()).decode()
    assert dsi._split_config(encoded)[0] == BASE == load_ds_config(encoded)
    f.write_text('{"steps_per_print": 1, "steps_per_print": 2}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        dsi._split_config(f)
    with pytest.raises(ConfigError, match="does not exist"):
        dsi._split_config(tmp_path / "missing.json")
    for path in sorted((REPO / "configs").glob("gpt_cpu_*.json")) + [REPO / "configs" / "default_resilience.json"]:
        theirs = dict(load_ds_config(str(path)))
        theirs.pop("resilience")
        assert dsi._split_config(str(path))[0] == theirs


def test_args_keep_their_config_path_and_the_deprecated_deepscale_config_is_taken(stand_in, tmp_path):
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(BASE))
    args = argparse.Namespace(deepspeed_config=str(f), local_rank=-1)
    ds_resilience.initialize(args=args, model=pipeline_module())
    assert args.deepspeed_config == str(f)  # deepspeed.initialize leaves it as given
    assert StandInEngine.built[-1].kwargs["config"]["train_micro_batch_size_per_gpu"] == 1
    args = argparse.Namespace(deepscale_config=str(f), deepspeed_config=None)
    ds_resilience.initialize(args=args, model=pipeline_module())
    assert (args.deepspeed_config, args.deepscale_config) == (str(f), None)  # as deepspeed.initialize moves it
    with pytest.raises(ConfigError, match="deepscale_config"):
        ds_resilience.initialize(args=argparse.Namespace(deepscale_config=str(f), deepspeed_config=str(f)),
                                 model=pipeline_module())


def test_the_version_line_is_logged(stand_in, monkeypatch):
    import deepspeed.utils

    lines = []
    monkeypatch.setattr(deepspeed.utils, "log_dist", lambda message, ranks=None, **kw: lines.append((message, ranks)))
    init(BASE)
    assert lines and lines[0][0].startswith(f"DeepSpeed info: version={deepspeed.__version__}") and lines[0][1] == [0]
