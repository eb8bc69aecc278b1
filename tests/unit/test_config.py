"""The "resilience" config section: defaults, round trip, and strict errors naming the key path."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ds_resilience import config as config_module
from ds_resilience.config import (
    CheckpointConfig,
    DetectorConfig,
    FaultInjection,
    PlannerConfig,
    ResilienceConfig,
    load_resilience_config,
)
from ds_resilience.costs import CostModel
from ds_resilience.errors import ConfigError
from ds_resilience.topology import Worker

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_JSON = REPO / "configs" / "default_resilience.json"

FAULT = {"rank": 3, "step": 7, "point": "mid_backward", "kind": "sigkill"}


def parse(section):
    return ResilienceConfig.from_dict(section)


def error(section) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(section)
    return info.value


def leaf_paths(data, prefix=""):
    """Dotted paths of every leaf key of a nested dict (lists are leaves)."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from leaf_paths(value, path + ".")
        else:
            yield path


# --- defaults and round trip ------------------------------------------------------------------
def test_defaults():
    cfg = ResilienceConfig()
    assert (cfg.enabled, cfg.schedule, cfg.variant, cfg.max_failures) == (True, "1f1b", None, 1)
    assert (cfg.microbatches, cfg.simulate_failed, cfg.cost_model, cfg.fault_injection) == (None, (), None, ())
    assert cfg.planner == PlannerConfig(
        solver="cpsat", time_limit_s=10.0, cache_dir=".plan_cache", workers=0, memory_cap=None, all_coverable=False
    )
    assert cfg.detector == DetectorConfig(
        heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, store_timeout_s=30.0, pg_timeout_s=60.0
    )
    assert cfg.checkpoint == CheckpointConfig(
        enabled=True, interval=1, replicas=2, gpu_buffer_mb=128, num_sub_buffers=4,
        persistent_interval=100, persistent_dir=None, keep_last=2, stall_budget=0.02,
    )
    assert parse(None) == parse({}) == cfg
    assert load_resilience_config({"train_batch_size": 8}) == cfg  # no section: defaults


def test_values_are_frozen_and_hashable():
    cfg = parse({"simulate_failed": ["0:1"], "fault_injection": [FAULT]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_failures = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.planner.solver = "highs"
    assert isinstance(cfg.simulate_failed, tuple) and isinstance(cfg.fault_injection, tuple)
    hash(cfg.planner), hash(cfg.fault_injection)


NON_DEFAULT = [
    {},
    {"enabled": False, "schedule": "decoupled", "variant": "adaptive", "max_failures": 3, "microbatches": 8},
    {"simulate_failed": ["0:1", "2:0"], "cost_model": "costs/gpt.json"},
    {"cost_model": {"name": "x", "t_f": [1, 2], "t_b": 2, "p2p_latency": 0.5, "p2p_bandwidth": 10}},
    {"planner": {"solver": "heuristic", "time_limit_s": 1, "cache_dir": "/tmp/c", "workers": 4, "memory_cap": 3,
                 "all_coverable": True}},
    {"detector": {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 2, "store_timeout_s": 3, "pg_timeout_s": 4}},
    {"fault_injection": [{**FAULT, "seconds": None, "speed": None, "steps": None},
                         {"rank": 0, "step": 0, "point": "in_replan", "kind": "delay", "seconds": 2.5, "speed": None,
                          "steps": None},
                         {"rank": 1, "step": 2, "point": "before_forward", "kind": "slow", "seconds": None,
                          "speed": 0.5, "steps": 10}]},
    {"checkpoint": {"enabled": False, "interval": 5, "replicas": 3, "gpu_buffer_mb": 64, "num_sub_buffers": 2,
                    "persistent_interval": 10, "persistent_dir": "/ckpt", "keep_last": 1, "stall_budget": 1}},
]


@pytest.mark.parametrize("section", NON_DEFAULT)
def test_round_trip(section):
    cfg = parse(section)
    out = cfg.to_dict()
    assert json.loads(json.dumps(out)) == out  # plain JSON
    assert parse(out) == cfg
    assert parse(json.loads(json.dumps(out))) == cfg
    for path in leaf_paths(section):  # every given value is kept
        value, got = section, out
        for key in path.split("."):
            value, got = value[key], got[key]
        if key != "cost_model" and not isinstance(value, dict):
            assert got == value, path


def test_parsed_types():
    cfg = parse({"simulate_failed": ["1:2", " 0:3 "], "fault_injection": [FAULT],
                 "planner": {"time_limit_s": 2}, "cost_model": {"t_f": [1, 2]}})
    assert cfg.simulate_failed == (Worker(pipeline=1, stage=2), Worker(pipeline=0, stage=3))
    assert cfg.fault_injection == (FaultInjection(rank=3, step=7, point="mid_backward", kind="sigkill"),)
    assert cfg.planner.time_limit_s == 2.0 and isinstance(cfg.planner.time_limit_s, float)
    assert cfg.cost_model == CostModel(t_f=(1.0, 2.0))


def test_default_json_file_parses_to_defaults_and_lists_every_key():
    data = json.loads(DEFAULT_JSON.read_text())
    assert load_resilience_config(DEFAULT_JSON) == ResilienceConfig()
    assert load_resilience_config(str(DEFAULT_JSON)) == ResilienceConfig()
    assert data["resilience"] == ResilienceConfig().to_dict()  # every key, at its default


def test_default_json_file_is_a_valid_deepspeed_config():
    DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig
    ds = DeepSpeedConfig(json.loads(DEFAULT_JSON.read_text()))
    assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps


def _shipped_deepspeed_configs():
    """The DeepSpeed configs a user copies: configs/*.json and the examples' JSON files that hold a
    batch size (cost models, model profiles and traces are not DeepSpeed configs)."""
    files = sorted((REPO / "configs").glob("*.json")) + sorted((REPO / "examples").rglob("*.json"))
    out = []
    for f in files:
        data = json.loads(f.read_text())
        if isinstance(data, dict) and {"train_batch_size", "train_micro_batch_size_per_gpu"} & data.keys():
            out.append(f)
    return out


SHIPPED = _shipped_deepspeed_configs()


def test_the_shipped_configs_are_found():
    names = {f.relative_to(REPO).as_posix() for f in SHIPPED}
    assert {"configs/default_resilience.json", "configs/gpt_cpu_pp2_dp2.json", "configs/gpt_cpu_pp2_dp2_failed.json",
            "examples/deepspeed_pipe/ds_config.json"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda f: f.relative_to(REPO).as_posix())
def test_a_shipped_config_uses_deepspeeds_defaults_unless_its_comment_says_why(path):
    """Issue 41 item 7: the configs users copy run the path users run. "Adam" without
    ``torch_adam`` (DeepSpeed's FusedAdam) and ``gradient_clipping`` at DeepSpeed's default 1.0, unless
    the file's top-level ``"_comment"`` names the key and says why; both DeepSpeed and our parser
    accept the config with that key (DeepSpeed ignores unknown top-level keys; ours reads the
    ``"resilience"`` section alone, where an unknown key is an error)."""
    DeepSpeedConfig = pytest.importorskip("deepspeed.runtime.config").DeepSpeedConfig
    data = json.loads(path.read_text())
    comment = data.get("_comment", "")
    assert isinstance(comment, str)
    ds = DeepSpeedConfig(dict(data))
    load_resilience_config(path)  # the "resilience" section, if any, parses
    optimizer = data.get("optimizer")
    if optimizer is not None and "torch_adam" in optimizer.get("params", {}):
        assert "torch_adam" in comment, f"{path.name}: torch_adam without a reason in its _comment"
    if ds.gradient_clipping != 1.0:
        assert "gradient_clipping" in comment, f"{path.name}: gradient_clipping {ds.gradient_clipping} without a reason"
    if data.get("bf16", {}).get("enabled") is False:  # written off: a template otherwise says bf16
        assert "bf16" in comment, f"{path.name}: fp32 without a reason in its _comment"


def test_the_user_template_is_deepspeeds_defaults_in_bf16():
    data = json.loads(DEFAULT_JSON.read_text())
    assert data["optimizer"]["type"] == "Adam" and "torch_adam" not in data["optimizer"]["params"]
    assert data["gradient_clipping"] == 1.0 and data["bf16"] == {"enabled": True}


def test_a_comment_belongs_at_the_top_level_not_in_the_resilience_section():
    load_resilience_config({"_comment": "why", "resilience": {}})
    with pytest.raises(ConfigError, match="resilience._comment"):
        load_resilience_config({"resilience": {"_comment": "why"}})


def test_docstring_table_lists_every_key():
    doc = config_module.__doc__
    for path in leaf_paths(ResilienceConfig().to_dict()):
        assert re.search(rf"^\s+{re.escape(path)}\s", doc, re.M), path
    for name in ("rank", "step", "point", "kind"):
        assert f"fault_injection[].{name}" in doc


def test_every_field_is_documented():
    for cls in (ResilienceConfig, PlannerConfig, DetectorConfig, FaultInjection, CheckpointConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name}"


# --- unknown keys -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, path, suggestion",
    [
        ({"max_failure": 2}, "resilience.max_failure", "max_failures"),
        ({"planner": {"solvr": "cpsat"}}, "resilience.planner.solvr", "solver"),
        ({"detector": {"heartbeat_timeout": 1}}, "resilience.detector.heartbeat_timeout", "heartbeat_timeout_s"),
        ({"checkpoint": {"replica": 2}}, "resilience.checkpoint.replica", "replicas"),
        ({"fault_injection": [FAULT, {**FAULT, "kinds": "exit"}]}, "resilience.fault_injection[1].kinds", "kind"),
    ],
)
def test_unknown_key_names_path_and_suggests(section, path, suggestion):
    exc = error(section)
    assert exc.path == path
    assert f"did you mean {suggestion!r}" in str(exc)
    assert str(exc).startswith(path + ":")
    assert "allowed keys:" in str(exc)


def test_unknown_key_lists_allowed_keys_without_close_match():
    exc = error({"planner": {"zzz": 1}})
    assert exc.path == "resilience.planner.zzz"
    assert "did you mean" not in str(exc)
    for name in ("solver", "time_limit_s", "cache_dir", "workers", "memory_cap", "all_coverable"):
        assert name in str(exc)


# --- wrong types ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, path, expected",
    [
        ({"max_failures": "2"}, "resilience.max_failures", "an integer"),
        ({"max_failures": True}, "resilience.max_failures", "an integer"),
        ({"max_failures": 1.0}, "resilience.max_failures", "an integer"),
        ({"microbatches": False}, "resilience.microbatches", "an integer"),
        ({"enabled": 1}, "resilience.enabled", "a boolean"),
        ({"enabled": None}, "resilience.enabled", "a boolean"),
        ({"schedule": 1}, "resilience.schedule", "a string"),
        ({"planner": []}, "resilience.planner", "an object"),
        ({"planner": None}, "resilience.planner", "an object"),
        ({"checkpoint": [1]}, "resilience.checkpoint", "an object"),
        ({"planner": {"time_limit_s": "10"}}, "resilience.planner.time_limit_s", "a number"),
        ({"planner": {"time_limit_s": True}}, "resilience.planner.time_limit_s", "a number"),
        ({"detector": {"pg_timeout_s": float("nan")}}, "resilience.detector.pg_timeout_s", "a finite number"),
        ({"checkpoint": {"persistent_dir": 3}}, "resilience.checkpoint.persistent_dir", "a string"),
        ({"simulate_failed": "0:1"}, "resilience.simulate_failed", "a list"),
        ({"simulate_failed": [1]}, "resilience.simulate_failed[0]", "a 'pipeline:stage' string"),
        ({"fault_injection": {"rank": 0}}, "resilience.fault_injection", "a list"),
        ({"fault_injection": [FAULT, "x"]}, "resilience.fault_injection[1]", "an object"),
        ({"fault_injection": [{**FAULT, "rank": "3"}]}, "resilience.fault_injection[0].rank", "an integer"),
        ({"cost_model": 3}, "resilience.cost_model", "a path (string) or an object"),
        ({"cost_model": [1.0]}, "resilience.cost_model", "a path (string) or an object"),
    ],
)
def test_wrong_type_names_path_value_and_expected_type(section, path, expected):
    exc = error(section)
    assert exc.path == path
    assert f"expected {expected}" in str(exc)


@pytest.mark.parametrize("value, shown", [("2", "'2' (string)"), (True, "True (boolean)"), ([1], "[1] (list)")])
def test_wrong_type_shows_the_value(value, shown):
    assert shown in str(error({"checkpoint": {"interval": value}}))


def test_int_accepted_where_number_expected():
    assert parse({"checkpoint": {"stall_budget": 1}}).checkpoint.stall_budget == 1.0


# --- ranges and choices -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "section, path, allowed",
    [
        ({"max_failures": -1}, "resilience.max_failures", ">= 0"),
        ({"microbatches": 0}, "resilience.microbatches", ">= 1"),
        ({"planner": {"workers": -2}}, "resilience.planner.workers", ">= 0"),
        ({"planner": {"memory_cap": 0}}, "resilience.planner.memory_cap", "> 0"),
        ({"planner": {"time_limit_s": 0}}, "resilience.planner.time_limit_s", "> 0"),
        ({"detector": {"heartbeat_interval_s": -0.5}}, "resilience.detector.heartbeat_interval_s", "> 0"),
        ({"detector": {"store_timeout_s": 0.0}}, "resilience.detector.store_timeout_s", "> 0"),
        ({"checkpoint": {"interval": 0}}, "resilience.checkpoint.interval", ">= 1"),
        ({"checkpoint": {"replicas": 0}}, "resilience.checkpoint.replicas", ">= 1"),
        ({"checkpoint": {"gpu_buffer_mb": 0}}, "resilience.checkpoint.gpu_buffer_mb", ">= 1"),
        ({"checkpoint": {"keep_last": 0}}, "resilience.checkpoint.keep_last", ">= 1"),
        ({"checkpoint": {"stall_budget": 0}}, "resilience.checkpoint.stall_budget", "> 0 and <= 1"),
        ({"checkpoint": {"stall_budget": 1.5}}, "resilience.checkpoint.stall_budget", "> 0 and <= 1"),
        ({"fault_injection": [{**FAULT, "step": -1}]}, "resilience.fault_injection[0].step", ">= 0"),
    ],
)
def test_out_of_range(section, path, allowed):
    exc = error(section)
    assert exc.path == path
    assert f"must be {allowed}" in str(exc)


def test_memory_cap_sizes_are_read_at_load():
    exc = error({"planner": {"memory_cap": "-2GiB"}})
    assert exc.path == "resilience.planner.memory_cap"
    assert "cannot read '-2GiB'" in str(exc) and "GIB" in str(exc)


@pytest.mark.parametrize(
    "section",
    [
        {"max_failures": 0},
        {"microbatches": 1},
        {"checkpoint": {"stall_budget": 1.0}},
        {"checkpoint": {"stall_budget": 1e-9}},
        {"planner": {"memory_cap": 1}},
        {"planner": {"memory_cap": 2.5}},
        {"planner": {"memory_cap": "24GiB"}},
    ],
)
def test_boundaries_accepted(section):
    assert parse(section).to_dict() != ResilienceConfig().to_dict()


@pytest.mark.parametrize(
    "section, path, value, allowed",
    [
        ({"schedule": "gpipe"}, "resilience.schedule", "gpipe", ("1f1b", "decoupled")),
        ({"variant": "oobleck"}, "resilience.variant", "oobleck", ("adaptive", "decoupled", "recycle")),
        ({"planner": {"solver": "gurobi"}}, "resilience.planner.solver", "gurobi", ("heuristic", "cpsat")),
        # the config accepts exactly what the planner supports: "highs" was once accepted here and
        # then rejected by the planner on rank 0 only, while the other ranks blocked on a broadcast
        ({"planner": {"solver": "highs"}}, "resilience.planner.solver", "highs", ("heuristic", "cpsat")),
        ({"fault_injection": [{**FAULT, "point": "after_forward"}]}, "resilience.fault_injection[0].point",
         "after_forward", ("before_forward", "mid_backward", "in_reduce", "in_optimizer")),
        ({"fault_injection": [{**FAULT, "kind": "sigterm"}]}, "resilience.fault_injection[0].kind", "sigterm",
         ("exit", "sigkill", "hang")),
    ],
)
def test_bad_choice_lists_allowed_values(section, path, value, allowed):
    exc = error(section)
    assert exc.path == path
    assert repr(value) in str(exc)
    for choice in allowed:
        assert repr(choice) in str(exc)


def test_every_config_solver_is_one_the_planner_runs():
    from ds_resilience.planning.planner import plan

    for solver in config_module.SOLVERS:  # a choice the planner rejected would fail here
        assert plan(2, 2, 2, [Worker(pipeline=0, stage=1)], solver=solver, time_limit_s=1.0).iteration_time > 0


def test_bad_choice_suggests_closest():
    assert "did you mean 'recycle'" in str(error({"variant": "recylce"}))


# --- simulate_failed, fault_injection, detector -----------------------------------------------
@pytest.mark.parametrize("bad", ["1", "a:b", "1:2:3", "-1:0", "", "1:"])
def test_simulate_failed_bad_entry(bad):
    exc = error({"simulate_failed": ["0:0", bad]})
    assert exc.path == "resilience.simulate_failed[1]"
    assert "pipeline:stage" in str(exc)


@pytest.mark.parametrize("entries", [["0:1", "0:1"], ["1:0", "0:1", " 0:1"]])
def test_simulate_failed_duplicates_rejected(entries):
    exc = error({"simulate_failed": entries})
    assert exc.path == f"resilience.simulate_failed[{len(entries) - 1}]"
    assert "duplicate" in str(exc) and "0:1" in str(exc)


@pytest.mark.parametrize("missing", ["rank", "step", "point", "kind"])
def test_fault_injection_missing_key(missing):
    entry = {k: v for k, v in FAULT.items() if k != missing}
    exc = error({"fault_injection": [FAULT, entry]})
    assert exc.path == f"resilience.fault_injection[1].{missing}"
    assert "missing" in str(exc)


@pytest.mark.parametrize("interval, timeout", [(0.5, 0.5), (2.0, 1.0), (5, 5.0)])
def test_heartbeat_timeout_must_exceed_interval(interval, timeout):
    exc = error({"detector": {"heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout}})
    assert exc.path == "resilience.detector.heartbeat_timeout_s"
    assert "heartbeat_interval_s" in str(exc)
    assert parse({"detector": {"heartbeat_interval_s": interval, "heartbeat_timeout_s": interval + 0.1}})


def test_direct_construction_is_checked_with_relative_paths():
    with pytest.raises(ConfigError) as info:
        ResilienceConfig(max_failures=-1)
    assert info.value.path == "max_failures"
    with pytest.raises(ConfigError) as info:
        DetectorConfig(heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    assert info.value.path == "heartbeat_timeout_s"
    cfg = ResilienceConfig(simulate_failed=[Worker(pipeline=0, stage=1)], planner=PlannerConfig(workers=2))
    assert cfg.simulate_failed == (Worker(pipeline=0, stage=1),)
    assert cfg == parse({"simulate_failed": ["0:1"], "planner": {"workers": 2}})


def test_custom_root_path():
    with pytest.raises(ConfigError) as info:
        ResilienceConfig.from_dict({"planner": {"solver": "x"}}, path="ds.resilience")
    assert info.value.path == "ds.resilience.planner.solver"


# --- cost model -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "inline, fragment",
    [
        ({"t_f": -1}, "t_f"),
        ({"t_f": 0}, "t_f must be > 0"),
        ({"p2p_bandwidth": 0}, "p2p_bandwidth"),
        ({"t_fwd": 1}, "unknown keys"),
        ({"t_b": [1, "x"]}, "t_b"),
    ],
)
def test_inline_cost_model_errors(inline, fragment):
    exc = error({"cost_model": inline})
    assert exc.path == "resilience.cost_model"
    assert fragment in str(exc)


def test_cost_method(tmp_path):
    assert ResilienceConfig().cost() == CostModel.unit()
    inline = parse({"cost_model": {"t_f": 2}})
    assert inline.cost() == CostModel(t_f=(2.0,))
    (tmp_path / "c.json").write_text(json.dumps({"name": "file", "t_b": 3}))
    from_file = parse({"cost_model": "c.json"})
    assert from_file.cost_model == "c.json"
    assert from_file.cost(base_dir=tmp_path) == CostModel(name="file", t_b=(3.0,))
    assert parse({"cost_model": str(tmp_path / "c.json")}).cost(base_dir="/elsewhere").name == "file"
    with pytest.raises(ConfigError) as info:
        from_file.cost(base_dir=tmp_path / "nope")
    assert info.value.path == "resilience.cost_model" and "does not exist" in str(info.value)


# --- loading ----------------------------------------------------------------------------------
def test_load_from_file_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "resilience": {"max_failures": 2, "planner": {"workers": 1}}}))
    cfg = load_resilience_config(path)
    assert cfg.max_failures == 2 and cfg.planner.workers == 1
    assert load_resilience_config(str(path)) == cfg
    path.write_text(json.dumps({"resilience": {"planner": {"solver": "nope"}}}))
    with pytest.raises(ConfigError) as info:
        load_resilience_config(path)
    assert info.value.path == "resilience.planner.solver"


@pytest.mark.parametrize(
    "text, fragment",
    [(None, "cannot read"), ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object")],
)
def test_load_bad_file_names_the_file(tmp_path, text, fragment):
    path = tmp_path / "ds.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_resilience_config(path)
    assert info.value.path == str(path)
    assert fragment in str(info.value)


@pytest.mark.parametrize("section", [None, [], "on", True])
def test_load_non_object_section(section):
    with pytest.raises(ConfigError) as info:
        load_resilience_config({"resilience": section})
    assert info.value.path == "resilience"
    assert "expected an object" in str(info.value)


def test_load_from_dict():
    assert load_resilience_config({"resilience": {"variant": "adaptive"}}).variant == "adaptive"
    with pytest.raises(ConfigError):
        load_resilience_config(["resilience"])


def test_an_unset_variant_is_auto_with_measured_costs_and_recycle_with_unit_costs():
    """The default lets the job's own profile pick the variant per failure set (on a CPU the split
    backward can cost more than the bubbles it fills; on a GPU it pays); unit costs price B + W as
    one fused backward, where recycle is never slower, so they keep recycle. A configured variant
    is always kept."""
    from ds_resilience.costs import CostModel

    measured = CostModel(name="profile", t_f=(1.0, 1.0), t_b=(1.5, 1.5), t_w=(0.9, 0.9), t_fused=(2.0, 2.0))
    assert ResilienceConfig().variant is None
    assert ResilienceConfig().variant_for(CostModel.unit()) == "recycle"
    assert ResilienceConfig().variant_for(measured) == "auto"
    assert ResilienceConfig(cost_model="unit").variant_for(ResilienceConfig(cost_model="unit").cost()) == "recycle"
    given = ResilienceConfig(cost_model=str(REPO / "configs" / "costs_gpt_example.json"))
    assert given.variant_for(given.cost()) == "auto"
    for variant in ("adaptive", "decoupled", "recycle", "auto"):
        assert ResilienceConfig(variant=variant).variant_for(measured) == variant
        assert ResilienceConfig(variant=variant).variant_for(CostModel.unit()) == variant


def test_the_engine_picks_the_variant_before_pricing_the_step_check():
    """With clipping on (DeepSpeed's default 1.0) the engine prices its plans with the step check,
    which makes the unit model no longer equal ``CostModel.unit()``: the variant must be chosen from
    the configured costs first, or a job without a cost model would plan ``auto`` (about three times
    the first re-plan's time) on costs that cannot tell the variants apart."""
    from ds_resilience.costs import CostModel
    from ds_resilience.integrations.ds_plans import PlanSettings, schedule_provider
    from ds_resilience.topology import Topology

    def provider(limit: float, cost=None, **config):
        # what the engine's plans are built from (ds_engine._plan_settings)
        settings = PlanSettings(config=ResilienceConfig(max_failures=1, cost_model="unit", **config),
                                topology=Topology(dp=2, pp=2), microbatches=4, tied=[], clipping=limit > 0, fp16=False)
        return schedule_provider(settings, None, cost=cost, solver="heuristic")

    clipped = provider(1.0)
    assert clipped.variant == "recycle" and clipped.cost.step_check == "speculative"
    assert provider(0.0).variant == "recycle" and provider(0.0).cost.step_check == "none"
    assert provider(1.0, clipping="barrier").cost.step_check == "barrier"
    measured = CostModel(name="profile", t_f=(1.0, 1.0), t_b=(1.5, 1.5), t_w=(0.9, 0.9), t_fused=(2.0, 2.0))
    assert provider(1.0, cost=measured).variant == "auto"


def test_every_key_is_read_somewhere_in_the_package():
    """A key that is parsed and never read is a promise the code does not keep: every field of the
    config must be read (as an attribute) by some module other than config.py."""
    import ast
    from dataclasses import fields as dc_fields

    from ds_resilience.config import CheckpointConfig, DetectorConfig, FaultInjection, PlannerConfig

    package = REPO / "ds_resilience"
    read: set[str] = set()
    for path in package.rglob("*.py"):
        if path.name == "config.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
    for cls in (ResilienceConfig, PlannerConfig, DetectorConfig, FaultInjection, CheckpointConfig):
        unread = [f.name for f in dc_fields(cls) if f.name not in read]
        assert not unread, f"{cls.__name__}: {unread} are parsed but never read"
