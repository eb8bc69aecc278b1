"""The failure-trace simulator: hand-computed scenarios, accounting, determinism, the reproduction of
Oobleck's Table 2 and of ReCycle's table shape, the CLI (ds_resilience against every
baseline on every trace: test_jobsim_baselines.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from ds_resilience.errors import ResilienceError
from ds_resilience.sim import SYSTEMS, load_model, load_trace, periodic_trace, poisson_trace, simulate_system
from ds_resilience.sim.cli import add_parser, run
from ds_resilience.sim.jobsim import BREAKDOWN_KEYS
from ds_resilience.sim.models import MODEL_NAMES, ModelProfileError, PlanCache, ThroughputTable, profile_from_dict
from ds_resilience.sim.systems import mean_over_redraws
from ds_resilience.sim.traces import SimulationError, parse_events

TRACES = Path(__file__).resolve().parents[3] / "configs" / "traces"


def tiny(**systems):
    """A 2-node (4-node for Bamboo) profile whose figures are easy to follow by hand."""
    data = {
        "name": "tiny", "global_batch": 100, "layers": 4, "params_billion": 0.1, "nodes": len(next(iter(systems.values()))["throughput"]),
        "boot_s": 0.0, "dp": 1, "pp": 2, "microbatches": 2, "anchor_throughput": 10.0, "systems": systems,
    }
    return profile_from_dict(data)


def events(*rows):
    return parse_events([f"{int(t * 1000)},{k},{n}" for t, k, n in rows], source="hand")


def breakdown(result):
    return {k: round(v, 6) for k, v in result.breakdown}


# --- hand-computed scenarios -------------------------------------------------------------------


def test_oobleck_one_failure_by_hand():
    # 2 nodes: 10 s per iteration (100 samples at 10/s), 1 node: 20 s; reconfiguration 2 s
    model = tiny(oobleck={"throughput": [10.0, 5.0], "reconfigure_s": 2.0})
    trace = events((0, "add", "a"), (0, "add", "b"), (105, "remove", "b"), (200, "add", "end"))
    r = simulate_system(trace, model, "oobleck")
    # start after the 2 s rendezvous; 10 iterations to 102; the one in flight (102-112) is lost at
    # 105 (3 s); pause to 107; 20 s iterations end at 127, 147, 167, 187; the one cut at 200 is dropped
    assert (r.start_s, r.end_s, r.iterations) == (2.0, 187.0, 14)
    assert breakdown(r) == {"useful": 180.0, "redundant": 0.0, "checkpoint": 0.0, "recovery": 2.0, "lost": 3.0, "idle": 0.0}
    assert r.throughput == pytest.approx(1400 / 185)
    # a failure within 2 s of the iteration's end lets it finish (the published simulator's grace)
    late = simulate_system(events((0, "add", "a"), (0, "add", "b"), (111, "remove", "b"), (200, "add", "end")), model, "oobleck")
    assert breakdown(late) == {"useful": 190.0, "redundant": 0.0, "checkpoint": 0.0, "recovery": 1.0, "lost": 0.0, "idle": 0.0}
    assert late.throughput == pytest.approx(1500 / 191)


def test_varuna_checkpoint_and_rollback_by_hand():
    model = tiny(varuna={"throughput": [10.0, 5.0], "restart_s": 5.0, "checkpoint_s": 1.0, "checkpoint_every": 3})
    trace = events((0, "add", "a"), (0, "add", "b"), (90, "remove", "b"), (190, "add", "end"))
    r = simulate_system(trace, model, "varuna")
    # restart pause 5 - 1 = 4 s; checkpoints (1 s) after iterations 3 and 6 (ends 34 and 65); the
    # failure at 90 loses the iteration in flight (86-90) and rolls back iterations 7-8 (20 s);
    # restart to 94; checkpoint after the first iteration (114) and the third (155); 176 completes
    assert (r.start_s, r.end_s, r.iterations) == (4.0, 176.0, 12)
    assert breakdown(r) == {"useful": 140.0, "redundant": 0.0, "checkpoint": 4.0, "recovery": 4.0, "lost": 24.0, "idle": 0.0}
    assert r.samples == 1000 and r.throughput == pytest.approx(1000 / 172)


def test_bamboo_fail_over_rebalance_and_spare_loss_by_hand():
    model = tiny(bamboo={"throughput": [10.0, 5.0, 5.0, 2.5], "rebalance_s": 3.0, "fatal_restart_s": 30.0,
                         "stages": 2, "slowdown": 1.5, "redundant_fraction": 0.25})
    trace = events(*[(0, "add", n) for n in "abcd"], (65, "remove", "d"), (120, "remove", "c"), (180, "add", "end"))
    r = simulate_system(trace, model, "bamboo")
    # global rendezvous to 30 s; 2 pipelines x 2 stages at 10 s; d (stage 1) fails at 65: c covers it,
    # the rest of the iteration runs 1.5x slower (ends 72.5), then a 3 s rebalance to 1 pipeline
    # (20 s) with c spare; losing spare c at 120 slows the job 1.5x again until the next rebalance
    busy = 10 + 10 + 10 + 12.5 + 20 + 20 + 27.75 + 30
    assert (r.start_s, r.end_s, r.iterations) == (30.0, 173.25, 8)
    assert breakdown(r) == {"useful": 0.75 * busy, "redundant": 0.25 * busy, "checkpoint": 0.0, "recovery": 3.0, "lost": 0.0, "idle": 0.0}
    assert r.throughput == pytest.approx(800 / 143.25)


def test_bamboo_out_of_memory_never_runs():
    r = simulate_system(load_trace(TRACES / "6h.csv"), load_model("gpt3-2.7b"), "bamboo")
    assert r.throughput == 0.0 and r.iterations == 0 and sum(v for _, v in r.breakdown) == 0.0


@pytest.fixture(scope="module")
def store():
    """One plan store for the whole module: profiles with equal layer counts share plans."""
    return {}


def test_planner_systems_without_failures(store):
    model = load_model("gpt3-medium")
    cache = PlanCache(model, store=store)
    assert cache.healthy_1f1b_s == pytest.approx(model.global_batch / model.anchor_throughput)
    trace = events(*[(0, "add", f"n{i}") for i in range(30)], (3600, "add", "end"))
    planned = cache.plan_s(model.dp, model.pp, ())
    assert planned < cache.healthy_1f1b_s  # the planned healthy schedule has no 1F1B bubble
    ds = simulate_system(trace, model, "ds_resilience", cache=cache)
    assert ds.throughput == pytest.approx(model.global_batch / planned)
    assert simulate_system(trace, model, "ds_resilience", cache=cache, healthy="1f1b").throughput == pytest.approx(model.anchor_throughput)
    assert simulate_system(trace, model, "recycle", cache=cache).throughput == pytest.approx(model.anchor_throughput)
    cr = simulate_system(trace, model, "checkpoint_restart", cache=cache, checkpoint_interval=10)
    t = cache.healthy_1f1b_s
    assert cr.throughput == pytest.approx(model.global_batch * 10 / (10 * t + model.checkpoint_s), rel=0.01)


def test_ds_resilience_one_failure(store):
    from ds_resilience.topology import Worker

    model = load_model("bert-large")
    cache = PlanCache(model, store=store)
    trace = events(*[(0, "add", f"n{i}") for i in range(30)], (1800, "remove", "n7"), (3600, "add", "end"))
    r = simulate_system(trace, model, "ds_resilience", cache=cache)
    b = r.breakdown_dict
    healthy = cache.plan_s(model.dp, model.pp, ())
    one_hole = max(cache.plan_s(model.dp, model.pp, {Worker(pipeline=0, stage=s)}) for s in range(model.pp))
    assert 0 < b["lost"] < healthy  # only the iteration in flight
    # detection alone, or with a re-grid onto one of the depths it may choose (its measured pause)
    pauses = [model.detect_s] + [model.detect_s + model.regrid_pause_s(pp) for pp in model.stage_options()]
    assert b["recovery"] in [pytest.approx(p) for p in pauses]
    assert b["checkpoint"] == b["idle"] == b["redundant"] == 0.0
    share = (b["lost"] + b["recovery"]) / r.wall_s
    assert model.global_batch / one_hole * (1 - share) < r.throughput < model.global_batch / healthy


# --- accounting and determinism ----------------------------------------------------------------


@pytest.mark.parametrize("trace_name", ["10m.csv", "g4dn-trace.csv", "poisson"])
def test_breakdown_sums_to_the_window_for_every_system(trace_name, store):
    model = load_model("gpt3-medium")
    cache = PlanCache(model, store=store)
    trace = poisson_trace("20m", seed=2, duration="8h", repair="1h") if trace_name == "poisson" else load_trace(TRACES / trace_name)
    for system in SYSTEMS:
        r = simulate_system(trace, model, system, cache=cache)
        total = sum(v for _, v in r.breakdown)
        if system == "bamboo":
            assert total == 0.0
            continue
        assert [k for k, _ in r.breakdown] == list(BREAKDOWN_KEYS)
        assert all(v >= 0 for _, v in r.breakdown)
        assert total == pytest.approx(r.wall_s, rel=1e-9, abs=1e-6), system
        assert r.throughput == pytest.approx(r.samples / r.wall_s)
        assert r.end_s <= trace.end_s


def test_runs_are_deterministic(store):
    model = load_model("gpt2")
    trace = load_trace(TRACES / "scale_gcp-trace.csv")
    for system in SYSTEMS:
        a = simulate_system(trace, model, system, cache=PlanCache(model, store=store))
        b = simulate_system(trace, model, system, cache=PlanCache(model, store={}))
        assert a == b, system


# --- Oobleck's Table 2 ---------------------------------------------------------------------------

FREQS = ("6h", "1h", "10m")
TABLE2 = {  # samples/s; None: out of memory (the published table leaves the cell empty)
    "bamboo": {"bert-large": (77.04, 75.60, 69.84), "gpt2": (17.47, 17.13, 16.01),
               "gpt3-medium": (None,) * 3, "gpt3-2.7b": (None,) * 3, "gpt3-6.7b": (None,) * 3},
    "varuna": {"bert-large": (259.57, 245.39, 168.15), "gpt2": (86.42, 83.94, 69.67), "gpt3-medium": (29.52, 27.61, 20.71),
               "gpt3-2.7b": (7.27, 6.41, 0.36), "gpt3-6.7b": (4.02, 2.91, 0.12)},
    "oobleck": {"bert-large": (287.10, 286.28, 282.11), "gpt2": (85.59, 85.42, 84.80), "gpt3-medium": (29.30, 29.21, 28.70),
                "gpt3-2.7b": (7.29, 7.23, 6.89), "gpt3-6.7b": (4.33, 4.22, 3.55)},
}
NOT_REPRODUCED = {  # (system, model, freq): why (see docs/benchmarks/simulator.md); strict: fixing one flags it here
    ("varuna", "gpt2", "10m"): "model gives 67.10 (-3.7%): restart/rollback details of the unreleased version",
    ("varuna", "gpt3-2.7b", "1h"): "model gives 6.10 (-4.9%): same",
    ("varuna", "gpt3-2.7b", "10m"): "model gives 0.84 (+134%): one iteration survives per 10-minute interval; "
                                     "the published 0.36 needs a checkpoint that straddles the next failure to count",
    ("varuna", "gpt3-6.7b", "10m"): "model gives 0.00: the 581 s restart leaves no room for an iteration; the "
                                     "published 0.12 is one iteration from a restart the artifact lets finish after a second failure",
}
CELLS = [
    pytest.param(s, m, f, p, marks=[pytest.mark.xfail(strict=True, reason=NOT_REPRODUCED[(s, m, f)])] if (s, m, f) in NOT_REPRODUCED else [])
    for s, models in TABLE2.items() for m, row in models.items() for f, p in zip(FREQS, row)
]


@pytest.mark.parametrize("system,model_name,freq,published", CELLS)
def test_oobleck_table2_cell_within_3_percent(system, model_name, freq, published):
    model = load_model(model_name)
    trace = load_trace(TRACES / f"{freq}.csv")
    if system == "bamboo":  # depends on which node fails: mean over redraws of the victims
        got = mean_over_redraws(trace, model, "bamboo", draws=64, seed=0)
    else:
        got = simulate_system(trace, model, system).throughput
    if published is None:
        assert got == 0.0  # out of memory, as published
    else:
        assert got == pytest.approx(published, rel=0.03)


# --- ReCycle's table shape ---------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["gpt3-medium", "gpt3-2.7b", "gpt3-6.7b", "bert-large"])
def test_recycle_shape_at_30m(model_name, store):
    """Failures every 30 minutes on average, failed nodes repaired after 4 h, 24 h: ReCycle > Oobleck > Bamboo."""
    model = load_model(model_name)
    cache = PlanCache(model, store=store)
    tput = {s: 0.0 for s in ("recycle", "oobleck", "bamboo", "ds_resilience")}
    for seed in (0, 1):
        trace = poisson_trace("30m", seed=seed, duration="24h", repair="4h")
        for s in tput:
            tput[s] += simulate_system(trace, model, s, cache=cache).throughput / 2
    assert tput["ds_resilience"] > tput["recycle"] > tput["oobleck"] > tput["bamboo"]
    assert 0.6 < tput["recycle"] / model.anchor_throughput < 1.0  # ReCycle never beats fault-free DeepSpeed


# --- model profiles ----------------------------------------------------------------------------


def test_builtin_profiles_load_and_calibrate(store):
    for name in MODEL_NAMES:
        model = load_model(name)
        assert model.name == name and model.oobleck is not None and model.varuna is not None
        cache = PlanCache(model, store=store)
        assert cache.healthy_1f1b_s == pytest.approx(model.global_batch / model.anchor_throughput)
    assert load_model("gpt3-6.7b").min_stages == 3 and load_model("bert-large").min_stages == 2
    assert load_model("gpt3-2.7b").bamboo is None  # out of memory


def test_throughput_table_lookup():
    t = ThroughputTable(max_nodes=4, values=(40.0, 30.0, 20.0))
    assert (t.at(9), t.at(4), t.at(3), t.at(2), t.at(1)) == (40.0, 40.0, 30.0, 20.0, 10.0)
    assert ThroughputTable(max_nodes=2, values=(1.0, 0.0)).at(1) == 0.0


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelProfileError, match="unknown model 'gpt5'; known models: bert-large, gpt2"):
        load_model("gpt5")
    good = json.loads((Path(__file__).resolve().parents[3] / "configs/models/gpt2.json").read_text())
    for patch, message in [({"colour": "red"}, "unknown keys \\['colour'\\]"), ({"layers": 0}, "layers must be an integer >= 1"),
                           ({"anchor_throughput": -1}, "anchor_throughput must be a number > 0"),
                           ({"systems": {"deepspeed": {}}}, "unknown system 'deepspeed'")]:
        with pytest.raises(ModelProfileError, match=message):
            profile_from_dict({**good, **patch})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**good, "name": "mine", "global_batch": 2048}))
    assert load_model(str(path)).global_batch == 2048  # add a model from a JSON profile


def test_unknown_system_is_rejected():
    with pytest.raises(SimulationError, match="unknown system 'horovod'; allowed: ds_resilience"):
        simulate_system(periodic_trace("1h"), load_model("gpt2"), "horovod")


# --- the CLI -----------------------------------------------------------------------------------


def cli(*argv):
    parser = argparse.ArgumentParser(prog="ds-resilience")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    return args.handler(args)


def test_cli_json_keys(capsys, tmp_path):
    png = tmp_path / "tput.png"
    assert cli("--trace", str(TRACES / "10m.csv"), "--model", "gpt2", "--systems", "all", "--json", "--png", str(png)) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["systems"]) == {"ds_resilience", "recycle", "oobleck", "bamboo", "varuna", "checkpoint_restart"}
    for s in out["systems"].values():
        assert isinstance(s["throughput"], float) and set(s["breakdown"]) == set(BREAKDOWN_KEYS)
    assert out["trace"]["removals"] == 15 and out["model"] == "gpt2"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_cli_mtbf_table_and_errors(capsys):
    assert cli("--mtbf", "45m", "--seed", "4", "--model", "bert-large", "--systems", "oobleck,varuna") == 0
    text = capsys.readouterr().out
    assert "oobleck" in text and "varuna" in text and "samples/s" in text and "bamboo" not in text
    with pytest.raises(SimulationError, match="must be > 0"):
        cli("--mtbf=-30m", "--model", "gpt2")
    with pytest.raises(ModelProfileError, match="unknown model"):
        cli("--mtbf", "30m", "--model", "nope")
    with pytest.raises(SimulationError, match="unknown systems \\['flux'\\]"):
        cli("--mtbf", "30m", "--model", "gpt2", "--systems", "oobleck,flux")
    with pytest.raises(ResilienceError, match="checkpoint-interval"):
        cli("--mtbf", "30m", "--model", "gpt2", "--checkpoint-interval", "0")
