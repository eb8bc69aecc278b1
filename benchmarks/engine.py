"""Engine figures: this engine against vanilla DeepSpeed, side by side in the same processes.

    python benchmarks/engine.py [--steps 30] [--rounds 3] [--d-model 128] [--layers 8]

4 CPU processes (PP=2 x DP=2) on gloo, the example GPT. Scenarios run one after the other in the
same processes, interleaved over several rounds so drift hits them alike:

* fault-free: vanilla DeepSpeed ``PipelineEngine`` (1F1B), this engine with 1F1B, this engine with
  the decoupled schedule (under unit costs: split on every stage), and the decoupled schedule as a
  user without a cost model gets it (``decoupled-profiled``: the engine profiles itself in the
  warm-up steps and re-lists the schedule with what it measured, fusing the backward on the stages
  where the split does not pay); throughput ratio against vanilla;
* one simulated failure (worker 1:1 idle): this engine with the planner's schedule for each
  variant; measured iteration time against the simulator's prediction for the schedule the engine
  ran, under a cost model calibrated from that run's own action timings, and against vanilla's
  fault-free time;
* ``--config-rows``, the DeepSpeed user's configuration: clipping 1.0 (and 100, a limit the norm
  stays under, so speculation holds) with the failure's staggered optimizer, once with the
  barrier and once speculative (validated after the step; its parameters
  must equal the barrier's), predicted with the step check in the cost model (measured scalar
  all-reduce / store round trip, the counted waits and rollbacks, OPT_STEP from the row without
  clipping); vanilla with its default clipping; bf16 against vanilla bf16; ZeRO-1.

The lab rows set ``gradient_clipping`` 0 (DeepSpeed's default is 1.0: see the config rows).

Iteration time = wall time of the timed steps / steps, measured between two barriers, slowest rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "examples"))

from dist_harness import run_workers  # noqa: E402

MBS = 2


def _program(rank: int, world: int, opts: dict) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    from gpt_model import GPTConfig, SyntheticCorpus, build_pipeline_module, data_iterator, micro_batch

    import ds_resilience

    deepspeed.init_distributed(dist_backend="gloo")
    pp, m, steps, warmup = opts["pp"], opts["microbatches"], opts["steps"], opts["warmup"]
    dp = world // pp
    cfg = GPTConfig(d_model=opts["d_model"], n_layers=opts["layers"], seq_len=opts["seq_len"], n_heads=4)
    corpus = SyntheticCorpus(cfg, seed=3)
    base = {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": m,
        "train_batch_size": MBS * m * dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,  # the lab rows: no clipping (DeepSpeed's default 1.0 is a config row)
    }
    out: dict = {}
    for rnd in range(opts["rounds"]):
        for sc in opts["scenarios"]:
            module = build_pipeline_module(cfg, num_stages=pp, seed=5)
            params = [p for p in module.parameters() if p.requires_grad]
            if sc["engine"] == "vanilla":
                config = dict(base, **({"bf16": {"enabled": True}} if sc.get("precision") == "bf16" else {}))
                if sc.get("clip"):
                    config["gradient_clipping"] = sc["clip"]
                engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params)
                it = data_iterator(corpus, pipeline=engine.grid.data_parallel_id, dp=dp, microbatches=m, micro_batch_size=MBS)

                def step():
                    engine.train_batch(it)
            else:
                config = dict(base, resilience={"schedule": sc.get("schedule", "1f1b"), "variant": sc.get("variant", "recycle"),
                                                "simulate_failed": sc.get("failed", []),
                                                "clipping": sc.get("clipping", "speculative"),
                                                # the rows compare schedules; the profile is its own row
                                                "cost_model": "unit"})
                if sc.get("profile"):  # no cost model: the engine profiles itself, then re-plans
                    config["resilience"].update(cost_model=None, profile_steps=sc["profile"])
                if sc.get("clip"):
                    config["gradient_clipping"] = sc["clip"]
                if sc.get("precision") == "bf16":
                    config["bf16"] = {"enabled": True}
                if sc.get("zero"):
                    config["zero_optimization"] = {"stage": sc["zero"]}

                def source(p, i, mb):
                    return micro_batch(corpus, pipeline=p, iteration=i, microbatch=mb, dp=dp, microbatches=m, micro_batch_size=MBS)

                engine, *_ = ds_resilience.initialize(model=module, config=config, model_parameters=params, batch_source=source)

                def step():
                    engine.train_batch()
            for _ in range(max(warmup, 2 * sc.get("profile", 0) + 1)):  # the timed steps run after the profile
                step()
            resilient = sc["engine"] != "vanilla" and getattr(engine, "alive", False)
            durations: dict = {}
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
                if resilient:  # every timed step's action timings (calibration), not just the last one's
                    for kind, values in engine.executor.stats.durations.items():
                        durations.setdefault(kind, []).extend(values)
            dist.barrier()
            elapsed = time.perf_counter() - t0
            rec = out.setdefault(sc["name"], {"times": [], "stage": engine.stage_id})
            rec["times"].append(elapsed / steps)
            if resilient and rnd == opts["rounds"] - 1:
                rec["durations"] = durations
                rec["schedule"] = engine.schedule.to_text()
                if engine.validator is not None:
                    v = engine.validator
                    rec["validation"] = {"speculated": v.speculated, "rolled back": v.rollbacks, "waited": v.waited,
                                         "ready": v.ready_steps}
                if sc.get("clip"):  # speculative against barrier: the same parameters after the same steps
                    rec["params"] = torch.cat([p.detach().double().flatten() for p in engine.module.parameters()])
            del engine
    # one agreement on the global norm: the barrier's scalar all-reduce over every rank, and the
    # speculative check's store publish + read (rank 0 hosts the store, as under the launcher)
    x = torch.zeros(1, dtype=torch.float64)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(x)
    out["allreduce_s"] = (time.perf_counter() - t0) / 50
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(50):
        store.set(f"bench/{rank}/{i}", "x")
        store.get(f"bench/{rank}/{i}")
    out["store_s"] = (time.perf_counter() - t0) / 50
    # link latency: small-message ping-pong between ranks 0 and 1 (both exist for any world >= 2)
    t = torch.zeros(8)
    dist.barrier()
    if rank in (0, 1):
        t0 = time.perf_counter()
        for _ in range(50):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        out["latency_s"] = (time.perf_counter() - t0) / 100
    dist.barrier()
    return out


def _calibrated_cost(results: list[dict], name: str, pp: int):
    """Per-stage t_F, t_B, t_W (medians over the stage's workers' actions) from the run ``name``
    itself; a fused backward (BW) is split evenly between t_B and t_W."""
    from ds_resilience.costs import CostModel

    per = {k: [[] for _ in range(pp)] for k in ("F", "B", "W", "BW", "OPT", "RD", "UNDO")}
    latency = statistics.median(r["latency_s"] for r in results if "latency_s" in r)
    for r in results:
        rec = r[name]
        for kind in per:
            per[kind][rec["stage"]].extend(rec.get("durations", {}).get(kind, []))
    med = {k: [statistics.median(v) if v else 0.0 for v in per[k]] for k in per}
    for s in range(pp):
        if med["BW"][s] and not med["B"][s]:
            med["B"][s] = med["W"][s] = med["BW"][s] / 2
    return CostModel(name="calibrated", t_f=med["F"], t_b=med["B"], t_w=med["W"], t_opt=med["OPT"], t_reduce=med["RD"],
                     t_undo=med["UNDO"], t_fused=med["BW"], p2p_latency=latency)


def _profiled_cost(results: list[dict], pp: int):
    """One model for every row, as ``ds-resilience profile`` measures it: F, B and W from the
    fault-free decoupled run, the fused backward from the fault-free 1F1B run, the reduce and the
    step from both."""
    from dataclasses import replace

    split, fused = _calibrated_cost(results, "decoupled", pp), _calibrated_cost(results, "1f1b", pp)
    return replace(split, name="profiled", t_fused=fused.t_fused,
                   t_opt=tuple((a + b) / 2 for a, b in zip(split.t_opt, fused.t_opt)),
                   t_reduce=tuple((a + b) / 2 for a, b in zip(split.t_reduce, fused.t_reduce)))


def _with_step_check(cost, results: list[dict], sc: dict, counts: dict | None, clean: str | None):
    """The calibrated model of a clipping row with its step check: the barrier (one scalar
    all-reduce, measured) or speculation (store round trips, measured; the fractions of steps that
    waited or rolled back, counted). Its OPT_STEP time comes from the same schedule's run without
    clipping (``clean``): the clipping run's own OPT timings include the waits being modelled."""
    from dataclasses import replace

    if clean is not None:
        cost = replace(cost, t_opt=_calibrated_cost(results, clean, len(cost.t_f)).t_opt)
    if sc.get("clipping") == "barrier":
        return replace(cost, step_check="barrier", t_sync=statistics.median(r["allreduce_s"] for r in results))
    total = sum(counts.values()) if counts else 0
    waits = counts["waited"] / total if total else 0.0
    rollbacks = counts["rolled back"] / total if total else 0.0
    t_undo = cost.t_undo if any(cost.t_undo) else cost.t_opt  # no rollback measured: a restore ~ a step
    return replace(cost, step_check="speculative", t_sync=statistics.median(r["store_s"] for r in results) / 2,
                   check_waits=waits, check_rollbacks=rollbacks, t_undo=t_undo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--world", type=int, default=4, choices=(2, 4),
                        help="4: PP=2 x DP=2 with the failure scenarios; 2: PP=2 x DP=1, fault-free only "
                             "(one process per core, so bubbles cost time as on dedicated devices)")
    parser.add_argument("--config-rows", action="store_true",
                        help="add clipping (speculative against barrier, with a failure: the staggered optimizer), "
                             "bf16 (vanilla bf16 as reference) and ZeRO-1 rows")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    scenarios = [
        {"name": "vanilla", "engine": "vanilla"},
        {"name": "1f1b", "engine": "resilient", "schedule": "1f1b"},
        {"name": "decoupled", "engine": "resilient", "schedule": "decoupled"},
        {"name": "decoupled-profiled", "engine": "resilient", "schedule": "decoupled", "profile": 1},
        {"name": "fail-adaptive", "engine": "resilient", "variant": "adaptive", "failed": ["1:1"]},
        {"name": "fail-decoupled", "engine": "resilient", "variant": "decoupled", "failed": ["1:1"]},
        {"name": "fail-recycle", "engine": "resilient", "variant": "recycle", "failed": ["1:1"]},
    ]
    if args.world == 2:
        scenarios = [sc for sc in scenarios if not sc.get("failed")]
    if args.config_rows:  # the DeepSpeed user's own configuration: clipping (DeepSpeed's default 1.0), bf16
        scenarios += [
            # the staggered optimizer (a failure re-routed by the recycle plan): the barrier every
            # step, against speculation validated after the step (same parameters, checked below)
            {"name": "clip-barrier", "engine": "resilient", "variant": "recycle", "failed": ["1:1"], "clip": 1.0,
             "clipping": "barrier"},
            {"name": "clip-speculative", "engine": "resilient", "variant": "recycle", "failed": ["1:1"], "clip": 1.0},
            # a limit the norm stays under (later in training, or a larger limit): speculation holds
            {"name": "clip100-barrier", "engine": "resilient", "variant": "recycle", "failed": ["1:1"], "clip": 100.0,
             "clipping": "barrier"},
            {"name": "clip100-speculative", "engine": "resilient", "variant": "recycle", "failed": ["1:1"],
             "clip": 100.0},
            {"name": "vanilla-clip", "engine": "vanilla", "clip": 1.0},  # DeepSpeed's default (first stage's norm)
            {"name": "vanilla-bf16", "engine": "vanilla", "precision": "bf16"},
            {"name": "bf16", "engine": "resilient", "precision": "bf16"},
            # ZeRO-1: the optimizer state sharded over the stage's replicas, the updated ranges gathered
            {"name": "zero1", "engine": "resilient", "zero": 1},
            {"name": "zero1-bf16", "engine": "resilient", "zero": 1, "precision": "bf16"},
        ]
    opts = {"pp": 2, "microbatches": args.microbatches, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "d_model": args.d_model, "layers": args.layers, "seq_len": args.seq_len, "scenarios": scenarios}
    t0 = time.perf_counter()
    results = run_workers(_program, args.world, args=(opts,), timeout_s=3000)
    print(f"(ran {len(scenarios)} scenarios x {args.rounds} rounds x {args.steps} steps in {time.perf_counter() - t0:.0f}s, "
          f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len}, PP=2 x DP={args.world // 2}, "
          f"{args.microbatches} micro-batches)")

    def it_time(name: str) -> float:
        per_round = [max(r[name]["times"][i] for r in results if name in r) for i in range(args.rounds)]
        return statistics.median(per_round)

    from ds_resilience.ir import Schedule
    from ds_resilience.ir import simulate
    from ds_resilience.planning.stage_mix import fused_in

    vanilla = it_time("vanilla")
    report = {"vanilla_s": vanilla}
    profiled = _profiled_cost(results, 2)
    report["profiled_cost"] = profiled.to_dict()
    print(f"\n{'scenario':<16} {'iteration s':>12} {'vs vanilla':>11} {'throughput ratio':>17} {'predicted s':>12} "
          f"{'measured/predicted':>19} {'profiled model: predicted s, measured/predicted':>49}")
    for sc in scenarios:
        name = sc["name"]
        t = it_time(name)
        row = {"iteration_s": t, "throughput_ratio": vanilla / t}
        pred = ""
        counts = next((r[name]["validation"] for r in results if "validation" in r.get(name, {})), None)
        if sc["engine"] != "vanilla":
            schedule = Schedule.from_text(next(r[name]["schedule"] for r in results if "schedule" in r.get(name, {})))
            cost = _calibrated_cost(results, name, 2)
            if sc.get("clip"):
                key = ("schedule", "variant", "failed", "precision", "zero")
                clean = next((c["name"] for c in scenarios if c["engine"] != "vanilla" and not c.get("clip")
                              and all(c.get(k) == sc.get(k) for k in key)), None)
                cost = _with_step_check(cost, results, sc, counts, clean)
            row["cost"] = cost.to_dict()
            sim = simulate(schedule, cost, repeat=4 if schedule.optimizer == "staggered" else 1)
            p = sim.iteration_time
            row["predicted_s"] = p
            row["measured_over_predicted"] = t / p
            pred = f"{p:12.4f} {t / p:19.2f}"
            if not sc.get("clip") and not sc.get("precision") and not sc.get("zero"):
                # the one profiled model for every fp32 row (the others run other kernels)
                q = simulate(schedule, profiled, repeat=4 if schedule.optimizer == "staggered" else 1).iteration_time
                row["profiled_predicted_s"] = q
                row["profiled_measured_over_predicted"] = t / q
                pred += f" {q:23.4f} {t / q:25.2f}"
        if sc.get("profile"):  # the stages the re-listed schedule runs fused
            row["fused_stages"] = fused_in(schedule)
            pred += f"   fused backward on stage(s) {row['fused_stages']}"
        if counts:
            row["validation"] = counts
            pred += f"   steps speculated/rolled back/waited {counts['speculated']}/{counts['rolled back']}/{counts['waited']}"
        report[name] = row
        print(f"{name:<16} {t:12.4f} {t / vanilla:11.2f} {vanilla / t:17.3f} {pred}")
    # the decoupled backward's price: B + W of the decoupled run against the fused BW of the 1F1B run
    split = _calibrated_cost(results, "decoupled", 2)
    fused = _calibrated_cost(results, "1f1b", 2)
    ratios = [(b + w) / f if f else float("nan") for b, w, f in zip(split.t_b, split.t_w, [x + y for x, y in zip(fused.t_b, fused.t_w)])]
    report["b_plus_w_over_fused"] = ratios
    print("\nB + W against the fused backward, per stage (medians of the runs' own actions): " + ", ".join(
        f"stage {s}: B {1e3 * b:.2f} ms + W {1e3 * w:.2f} ms = {r:.2f}x fused {1e3 * (fb + fw):.2f} ms"
        for s, (b, w, fb, fw, r) in enumerate(zip(split.t_b, split.t_w, fused.t_b, fused.t_w, ratios))))
    # post-validation: speculation must give exactly the barrier's (the global) clipped steps
    for spec, bar in (("clip-speculative", "clip-barrier"), ("clip100-speculative", "clip100-barrier")):
        by_stage_spec = {r[spec]["stage"]: r[spec]["params"] for r in results if "params" in r.get(spec, {})}
        by_stage_bar = {r[bar]["stage"]: r[bar]["params"] for r in results if "params" in r.get(bar, {})}
        if by_stage_spec and by_stage_bar:
            diff = max(float((by_stage_spec[s] - by_stage_bar[s]).abs().max()) for s in by_stage_spec)
            report[f"{spec}_vs_barrier_max_param_diff"] = diff
            print(f"{spec} against {bar} after the same steps: largest parameter difference {diff:.3g}")
    print(f"agreement messages: scalar all-reduce {1e3 * statistics.median(r['allreduce_s'] for r in results):.3f} ms, "
          f"store round trip {1e3 * statistics.median(r['store_s'] for r in results) / 2:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
