"""Megatron argument hooks (extra_args_provider contract) and the PTD-P grid (a replica is a
tensor-parallel group), checked against megatron-core's own rank generator."""

from __future__ import annotations

import argparse
import json

import pytest

from ds_resilience.errors import ConfigError
from ds_resilience.megatron import PTDPGrid, add_resilience_args, config_from_args, with_resilience_args
from ds_resilience.topology import Worker
from megatron_parser import megatron_parser, parse_and_validate

def validated(argv, *, world_size):
    """Megatron-LM's parse (with our hook as its extra_args_provider), then its validation."""
    return parse_and_validate(argv, world_size=world_size, extra_args_provider=add_resilience_args)


BASE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
        "--global-batch-size", "16"]


# --- the hook ----------------------------------------------------------------------------------------
def test_the_hook_adds_a_resilience_group_and_returns_the_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    assert add_resilience_args(parser) is parser
    titles = [g.title for g in parser._action_groups]
    assert "resilience" in titles
    args = parser.parse_args([])
    assert args.resilience is False and args.resilience_config is None
    assert args.resilience_variant is None and args.resilience_max_failures is None  # "not given"


def test_unknown_and_abbreviated_flags_are_still_rejected(capsys):
    parser = megatron_parser(add_resilience_args)
    for bad in (["--resilience-bogus", "1"], ["--resil"], ["--resilience-variant", "fastest"],
                ["--resilience-snapshot-interval", "0"], ["--resilience-memory-cap", "lots"]):
        with pytest.raises(SystemExit):
            parser.parse_args(BASE + bad)
    err = capsys.readouterr().err
    assert "unrecognized arguments: --resilience-bogus" in err and "invalid choice: 'fastest'" in err
    assert "expected an integer >= 1, got 0" in err and "cannot read 'lots'" in err


def test_a_users_own_provider_chains_before_ours():
    def own(parser):
        parser.add_argument_group(title="mine").add_argument("--my-flag", type=int, default=3)
        return parser

    args = megatron_parser(with_resilience_args(own)).parse_args(BASE + ["--my-flag", "4", "--resilience"])
    assert args.my_flag == 4 and args.resilience
    with pytest.raises(TypeError, match="must return the parser"):
        megatron_parser(with_resilience_args(lambda p: None))


# --- mapping Megatron's arguments ------------------------------------------------------------------------
def test_megatrons_arguments_map_onto_the_job_and_the_section():
    args = validated(BASE + ["--bf16", "--clip-grad", "0.5", "--seed", "7", "--train-iters", "20",
                                      "--resilience", "--resilience-max-failures", "2", "--resilience-variant",
                                      "auto", "--resilience-snapshot-interval", "3", "--resilience-memory-cap",
                                      "24GiB", "--use-distributed-optimizer"], world_size=16)
    job = config_from_args(args)
    assert (job.tp, job.pp, job.dp, job.world_size) == (2, 2, 4, 16)
    assert job.microbatches == 16 // (2 * 4) == 2
    assert (job.precision, job.clip_grad, job.seed, job.train_iters) == ("bf16", 0.5, 7, 20)
    assert job.enabled and job.distributed_optimizer
    c = job.config
    assert (c.max_failures, c.variant, c.microbatches, c.seed) == (2, "auto", 2, 7)
    assert c.checkpoint.interval == 3 and c.planner.memory_cap == "24GiB"


def test_defaults_follow_megatron(tmp_path):
    args = validated(["--micro-batch-size", "4"], world_size=2)
    job = config_from_args(args)
    assert (job.tp, job.pp, job.dp, job.global_batch_size, job.microbatches) == (1, 1, 2, 8, 1)
    assert (job.precision, job.clip_grad, job.seed) == ("fp32", 1.0, 1234)
    assert not job.enabled and job.config.variant is None  # unset: recycle with unit costs, auto with a cost model
    assert job.config.variant_for(job.config.cost()) == "recycle"


def test_the_config_file_is_the_deepspeed_section_or_the_section_alone(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "resilience": {"max_failures": 2, "checkpoint": {"replicas": 3}}}))
    alone = tmp_path / "section.json"
    alone.write_text(json.dumps({"max_failures": 2, "checkpoint": {"replicas": 3}}))
    for path in (ds, alone):
        job = config_from_args(validated(BASE + ["--resilience-config", str(path)], world_size=16))
        assert job.enabled and job.config.max_failures == 2 and job.config.checkpoint.replicas == 3
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_failure": 2}))
    with pytest.raises(ConfigError, match="max_failure"):
        config_from_args(validated(BASE + ["--resilience-config", str(bad)], world_size=16))


def test_contradictions_name_both_settings(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"variant": "adaptive", "microbatches": 4, "seed": 1234}))
    with pytest.raises(ConfigError) as exc:
        config_from_args(validated(BASE + ["--resilience-config", str(path), "--resilience-variant",
                                                    "recycle"], world_size=16))
    assert "--resilience-variant" in str(exc.value) and "resilience.variant" in str(exc.value)
    with pytest.raises(ConfigError) as exc:  # 16 / (2 x 4) = 2 micro-batches per pipeline, not 4
        config_from_args(validated(BASE + ["--resilience-config", str(path)], world_size=16))
    assert "resilience.microbatches" in str(exc.value) and "--global-batch-size" in str(exc.value)
    path.write_text(json.dumps({"seed": 5}))
    with pytest.raises(ConfigError, match=r"resilience.seed.*--seed 1234"):
        config_from_args(validated(BASE + ["--resilience-config", str(path)], world_size=16))
    # the same value in both places is no contradiction
    path.write_text(json.dumps({"variant": "recycle", "microbatches": 2}))
    job = config_from_args(validated(BASE + ["--resilience-config", str(path), "--resilience-variant",
                                                      "recycle"], world_size=16))
    assert job.config.variant == "recycle"


@pytest.mark.parametrize("extra, flag", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], "--num-layers-per-virtual-pipeline-stage"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (["--context-parallel-size", "2"], "--context-parallel-size"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    (["--num-experts", "8"], "--num-experts"),
    (["--rampup-batch-size", "4", "4", "100"], "--rampup-batch-size"),
])
def test_unsupported_megatron_features_are_rejected_naming_the_flag(extra, flag):
    world = 32 if "--context-parallel-size" in extra else 16
    with pytest.raises(ConfigError) as exc:
        config_from_args(validated(BASE + extra, world_size=world))
    assert flag in str(exc.value) and "not supported yet" in str(exc.value)


def test_a_batch_the_pipelines_cannot_share_evenly_is_an_error():
    with pytest.raises(ConfigError, match=r"--global-batch-size.*--micro-batch-size 2 x the data-parallel size 4"):
        config_from_args(validated(BASE[:-1] + ["12"], world_size=16))
    with pytest.raises(ConfigError, match="--bf16.*--fp16"):
        config_from_args(validated(BASE + ["--bf16", "--fp16"], world_size=16))
    with pytest.raises(ConfigError, match="after its validation"):
        config_from_args(argparse.Namespace(micro_batch_size=1))


# --- the PTD-P grid ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp, pp, dp, order", [(2, 2, 2, "tp-cp-ep-dp-pp"), (2, 3, 4, "tp-cp-ep-dp-pp"),
                                               (4, 2, 3, "tp-cp-ep-pp-dp"), (1, 4, 2, "tp-cp-ep-dp-pp")])
def test_groups_equal_megatron_cores_rank_generator(tp, pp, dp, order):
    from megatron.core.parallel_state import RankGenerator

    grid = PTDPGrid(tp=tp, pp=pp, dp=dp, order=order)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    as_set = lambda groups: {tuple(g) for g in groups}  # noqa: E731
    assert as_set(grid.tp_groups()) == as_set(gen.get_ranks("tp"))
    assert as_set(grid.dp_groups()) == as_set(gen.get_ranks("dp"))
    assert as_set(grid.pp_groups()) == as_set(gen.get_ranks("pp"))
    for rank in range(grid.world_size):
        worker, t = grid.coord(rank)
        assert grid.rank(worker, t) == rank
    if order == "tp-cp-ep-dp-pp":  # megatron-core's default is DeepSpeed's order: one grid for both
        topo = grid.topology()
        assert all(grid.rank(w, t) == topo.rank(w, t) for w in topo.workers() for t in range(tp))


def test_one_dead_rank_takes_its_tensor_parallel_replica_out():
    grid = PTDPGrid(tp=2, pp=2, dp=3)
    dead = grid.rank(Worker(pipeline=1, stage=1), tp_rank=1)
    topo = grid.topology([dead])
    assert topo.failed == {Worker(pipeline=1, stage=1)}
    assert topo.stage_peers(1) == (Worker(pipeline=0, stage=1), Worker(pipeline=2, stage=1))
    # both ranks of one replica dead is still one failed replica
    assert grid.failed_workers(grid.replica(Worker(pipeline=1, stage=1))) == {Worker(pipeline=1, stage=1)}


def test_a_failure_changes_exactly_the_groups_that_hold_its_replica():
    grid = PTDPGrid(tp=2, pp=3, dp=2)
    failed = Worker(pipeline=0, stage=2)
    changed = grid.changed_groups([failed])
    replica = set(grid.replica(failed))
    assert changed["tp"] == [grid.replica(failed)]
    assert len(changed["dp"]) == 2 and all(replica & set(g) for g in changed["dp"])  # stage 2, both tp ranks
    assert len(changed["pp"]) == 2 and len(changed["embedding"]) == 2  # pipeline 0, both tp ranks
    untouched = [g for g in grid.dp_groups() + grid.pp_groups() + grid.tp_groups() if not replica & set(g)]
    assert len(untouched) == len(grid.dp_groups() + grid.pp_groups() + grid.tp_groups()) - 5


def test_ptdp_keeps_a_tensor_parallel_group_inside_a_node():
    PTDPGrid(tp=4, pp=2, dp=2).check_nodes(8)
    PTDPGrid(tp=2, pp=2, dp=2).check_nodes(4)
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size.*divides 4"):
        PTDPGrid(tp=8, pp=1, dp=1).check_nodes(4)
    with pytest.raises(ConfigError, match="tp first"):
        PTDPGrid(tp=2, pp=2, dp=2, order="dp-tp-pp").check_nodes(2)
    with pytest.raises(ConfigError, match="not a megatron-core rank order"):
        PTDPGrid(tp=2, pp=2, dp=2, order="tp-pp")
