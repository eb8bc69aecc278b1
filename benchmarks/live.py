"""Live-failure figures: random injections on the real engine under the agent.

    python benchmarks/live.py [--trials 20] [--steps 10] [--seed 0] [--config user|lab]
                              [--campaign] [--json FILE] [--keep DIR] [--timeout 240]

Each trial trains the example GPT (PP=2 x DP=2, 4 CPU processes, gloo) under the agent (heartbeat
interval 0.2 s, hang timeout 2 s) and injects failures; the survivors' final parameters are
compared with a fault-free run of the same configuration and steps.

``--config`` (default ``user``): the user's configuration, ``initialize(training_data=Dataset)``
(DeepSpeed's sampler and loader with its worker processes; 40 samples, so the steps run over
several epochs), DeepSpeed's default optimizer settings (Adam, ``gradient_clipping`` 1.0,
validated speculatively) and bf16 with fp32 masters. ``lab``: the earlier figures' setup (SGD with
momentum, fp32, ``batch_source``, no clipping).

Without ``--campaign`` each trial is one failure at a random rank, step, iteration point and kind
(sigkill, exit, or hang). With ``--campaign`` each trial draws a scenario (seeded), then its faults;
kinds are SIGKILL or SIGSTOP (``hang``: every thread stops, the agent detects the silence):

``single``       one fault at a random rank, iteration and action point;
``in_recovery``  a first fault, then a second rank in the other stage fails while the survivors
                 apply the first recovery plan (fault point ``in_recovery``);
``in_snapshot``  a fault while the rank's in-memory snapshot drains into host memory;
``in_rejoin``    a fault, the agent relaunches the rank 0.5 s later (steps paced so it can re-join),
                 and its stage peer (the donor) fails while it hands its state to the re-joining
                 worker (``in_rejoin``): the only holder of the stage's state is gone, which is beyond
                 re-routing; the agent restarts every worker from the in-memory snapshots
                 (``max_restarts`` 1) and training must still end where the fault-free run ends;
``two_stages``   two faults at random points, one in each stage, the second no earlier.

A trial survives when every planned fault fired, the agent exits 0, every expected worker (the
survivors; all four after a restart) finished every step, and its parameters and (bf16) fp32
master weights equal the fault-free run's (rtol 1e-5, atol 1e-6); the largest absolute differences
are reported per trial and overall. Reported too: detection latency (the agent's measure: exit
observed -> epoch published for crashes, last heartbeat -> epoch for hangs) and recovery latency
(epoch published -> survivors ready to replay, the slowest survivor), per scenario and kind.
A trial that exceeds ``--timeout`` is stopped (SIGTERM to the agent, which kills its workers) and
counts as failed. The logs of failed trials are kept under ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

os.environ.setdefault("DSR_SELF_PROFILE", "0")  # the campaign's jobs plan with unit costs, as in the tests
from test_live import POINTS, TRAINING_DATA, USER_CONFIG, run_job  # noqa: E402  (the tests' job runner)

SAMPLES = 2 * 4 * 2
DP = 2
SCENARIOS = ("single", "in_recovery", "in_snapshot", "in_rejoin", "two_stages")
CAMPAIGN_KINDS = ("sigkill", "hang")
RTOL, ATOL = 1e-5, 1e-6
REJOIN_PACE_S = 3.5  # a relaunched worker needs 10-20 s to start on the shared 2-core machine


def stage_of(rank: int) -> int:
    return rank // DP


def other_stage(rank: int) -> list[int]:
    s = 1 - stage_of(rank)
    return [s * DP + p for p in range(DP)]


def draw(rng: random.Random, scenario: str, steps: int) -> dict:
    """The faults (and job options) of one trial of ``scenario``."""
    kind = lambda: rng.choice(CAMPAIGN_KINDS)  # noqa: E731
    rank = rng.randrange(2 * DP)
    trial = {"scenario": scenario, "faults": [], "rejoin_after": None, "pace": 0.0, "max_restarts": 0,
             "dead": [], "fault_ranks": [rank]}
    if scenario == "single":
        trial["faults"] = [{"rank": rank, "step": rng.randint(1, steps - 2), "point": rng.choice(POINTS), "kind": kind()}]
        trial["dead"] = [rank]
    elif scenario == "in_recovery":
        step = rng.randint(1, steps - 3)
        second = rng.choice(other_stage(rank))
        k2 = kind()
        # the recovery resumes at the first fault's iteration, or one later if every survivor had
        # already stepped (staggered optimizer): armed at both, the first that is reached fires
        trial["faults"] = [{"rank": rank, "step": step, "point": rng.choice(POINTS), "kind": kind()}] + [
            {"rank": second, "step": s, "point": "in_recovery", "kind": k2} for s in (step, step + 1)]
        trial["dead"] = trial["fault_ranks"] = [rank, second]
    elif scenario == "in_snapshot":
        # the snapshot of step k is captured after iteration k-1's optimizer step
        trial["faults"] = [{"rank": rank, "step": rng.randint(2, steps - 1), "point": "in_snapshot", "kind": kind()}]
        trial["dead"] = [rank]
    elif scenario == "in_rejoin":
        donor = rank ^ 1  # its stage peer (DP = 2): the only holder of the stage's state
        k2 = kind()
        trial["faults"] = [{"rank": rank, "step": rng.randint(1, 2), "point": rng.choice(POINTS), "kind": kind()}] + [
            {"rank": donor, "step": s, "point": "in_rejoin", "kind": k2} for s in range(steps + 1)]
        trial.update(rejoin_after=0.5, pace=REJOIN_PACE_S, max_restarts=1, fault_ranks=[rank, donor], dead=[])
    elif scenario == "two_stages":
        second = rng.choice(other_stage(rank))
        k1 = rng.randint(1, steps - 3)
        k2 = rng.randint(k1, steps - 2)
        trial["faults"] = [{"rank": rank, "step": k1, "point": rng.choice(POINTS), "kind": kind()},
                           {"rank": second, "step": k2, "point": rng.choice(POINTS), "kind": kind()}]
        trial["dead"] = trial["fault_ranks"] = [rank, second]
    else:
        raise ValueError(scenario)
    return trial


def draw_lab(rng: random.Random, steps: int) -> dict:
    """The earlier benchmark's trial: one fault, any kind (sigkill, exit, hang), any point."""
    fault = {"rank": rng.randrange(4), "step": rng.randint(2, steps - 3), "point": rng.choice(POINTS),
             "kind": rng.choice(["sigkill", "exit", "hang"])}
    return {"scenario": "single", "faults": [fault], "rejoin_after": None, "pace": 0.0, "max_restarts": 0,
            "dead": [fault["rank"]], "fault_ranks": [fault["rank"]]}


def compare(dumps: dict, reference: dict) -> tuple[bool, float, float | None, list[str]]:
    """(equal within tolerance, largest |param diff|, largest |master diff| or None, problems)."""
    import torch

    ref_params, ref_masters = {}, {}
    for d in reference.values():
        ref_params.setdefault(d["stage"], d["params"])
        ref_masters.setdefault(d["stage"], d.get("masters") or {})
    ok, problems = True, []
    dp_max, dm_max = 0.0, None
    for rank, d in sorted(dumps.items()):
        for name, t in d["params"].items():
            r = ref_params[d["stage"]][name]
            dp_max = max(dp_max, float((t.float() - r.float()).abs().max()))
            if not torch.allclose(t.float(), r.float(), rtol=RTOL, atol=ATOL):
                ok = False
                problems.append(f"rank {rank} param {name}: {float((t.float() - r.float()).abs().max()):.3e}")
        masters = d.get("masters") or {}
        if masters.keys() != ref_masters[d["stage"]].keys():
            ok = False
            problems.append(f"rank {rank}: master keys differ from the reference's")
            continue
        for name, t in masters.items():
            r = ref_masters[d["stage"]][name]
            diff = float((t - r).abs().max())
            dm_max = diff if dm_max is None else max(dm_max, diff)
            if not torch.allclose(t, r, rtol=RTOL, atol=ATOL):
                ok = False
                problems.append(f"rank {rank} master {name}: {diff:.3e}")
            if not torch.equal(d["params"][name], t.to(d["params"][name].dtype)):
                ok = False
                problems.append(f"rank {rank} param {name} is not its master rounded")
    return ok, dp_max, dm_max, problems


def fired(tmp: Path, name: str) -> dict[int, str]:
    """rank -> the fault that fired in it (from the workers' logs)."""
    out = {}
    for f in sorted((tmp / f"{name}-logs").glob("rank*.log")):
        for m in re.finditer(r"injecting (\w+) at step (\d+) (\w+) on rank (\d+)", f.read_text(errors="replace")):
            out[int(m.group(4))] = f"{m.group(1)}@{m.group(2)}:{m.group(3)}"
    return out


def verify_imports() -> str:
    """The workers import this checkout's ds_resilience (run_job passes PYTHONPATH=REPO)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", "import ds_resilience; print(ds_resilience.__file__)"], env=env,
                         capture_output=True, text=True, check=True, cwd="/").stdout.strip()
    if not Path(out).resolve().is_relative_to(REPO):
        raise SystemExit(f"workers would import ds_resilience from {out}, not from {REPO}")
    return out


class TrialTimeout:
    """SIGTERM to this process after ``seconds``: the agent's handler kills its workers and returns."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds
        self.expired = False

    def __enter__(self):
        self.expired = False

        def alarm(signum, frame):
            self.expired = True
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc):
        signal.alarm(0)
        return False


def run_trial(tmp: Path, i: int, trial: dict, steps: int, config: dict, reference: dict, timeout_s: int) -> dict:
    name = f"t{i}"
    started = time.perf_counter()
    with TrialTimeout(timeout_s) as guard:
        code, events, dumps = run_job(tmp, faults=trial["faults"], name=name, steps=steps, pace=trial["pace"],
                                      rejoin_after=trial["rejoin_after"], max_restarts=trial["max_restarts"],
                                      **config)
    wall = time.perf_counter() - started
    hit = fired(tmp, name)
    expected = set(range(2 * DP)) - set(trial["dead"])
    problems = []
    if guard.expired:
        problems.append(f"timed out after {timeout_s} s")
    if code != 0:
        problems.append(f"agent exit code {code}")
    missing = [r for r in trial["fault_ranks"] if r not in hit]
    if missing:
        problems.append(f"faults of ranks {missing} did not fire")
    if set(dumps) != expected:
        problems.append(f"dumps from ranks {sorted(dumps)}, expected {sorted(expected)}")
    unfinished = {r: d["steps"] for r, d in dumps.items() if d["steps"] != steps or d.get("stopped")}
    if unfinished:
        problems.append(f"ranks stopped early: {unfinished}")
    equal, dp_max, dm_max, diffs = compare(dumps, reference) if dumps else (False, None, None, ["no dumps"])
    problems += diffs[:6]
    detected = [e for e in events if e.kind in ("crash", "hang") and e.latency_s is not None]
    recoveries: dict[int, float] = {}
    for d in dumps.values():
        for r in d["recovery"]:
            if r.get("recovery_s") is not None and r.get("kind") not in ("joined", "restored"):
                recoveries[r["epoch"]] = max(recoveries.get(r["epoch"], 0.0), r["recovery_s"])
    restored = [r for d in dumps.values() for r in d["recovery"] if r.get("kind") == "restored"]
    throughput = {}
    if trial["scenario"] == "single" and dumps:  # samples/s before, during (the step with the failure) and after
        t, k = dumps[min(dumps)]["times_s"], trial["faults"][0]["step"]
        throughput = {"before": SAMPLES * (k - 1) / sum(t[1:k]) if k > 1 else None,
                      "during": SAMPLES / t[k] if len(t) > k else None,
                      "after": SAMPLES * len(t[k + 1:]) / sum(t[k + 1:]) if len(t) > k + 1 else None}
    return {
        "trial": i, "scenario": trial["scenario"], "faults": trial["faults"], "fired": {str(k): v for k, v in hit.items()},
        "survived": not problems, "problems": problems, "exit_code": code, "wall_s": wall,
        "max_param_diff": dp_max, "max_master_diff": dm_max,
        "detections": [{"kind": e.kind, "rank": e.rank, "latency_s": e.latency_s} for e in detected],
        "recovery_s": [recoveries[k] for k in sorted(recoveries)],
        "restarts": [e.kind for e in events].count("restart"), "rejoins": [e.kind for e in events].count("rejoin"),
        "restored": [{"resume_step": r["resume_step"], "source": r["source"], "recovery_s": r["recovery_s"]}
                     for r in restored],
        "samples_per_s": throughput, "events": [asdict(e) for e in events],
    }


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", choices=("user", "lab"), default="user",
                        help="user: training_data + Adam + clipping 1.0 + bf16 (default); lab: SGD, fp32, batch_source")
    parser.add_argument("--campaign", action="store_true", help="draw a scenario per trial (see above)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="with --campaign: the scenarios to draw from")
    parser.add_argument("--timeout", type=int, default=240, help="seconds one trial may take")
    parser.add_argument("--keep", metavar="DIR", help="copy failed trials' logs here")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="report the trials of earlier --json files together (campaigns run side by side with "
                             "different seeds) and run nothing; with --json, write the merged result there")
    args = parser.parse_args()
    if args.merge:
        merge(args)
        return
    import test_live

    test_live.STEPS = args.steps
    scenarios = [s for s in args.scenarios.split(",") if s]
    if any(s not in SCENARIOS for s in scenarios):
        parser.error(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    config = {"extra": TRAINING_DATA, "deepspeed": USER_CONFIG} if args.config == "user" else {}
    signal.signal(signal.SIGTERM, lambda *a: None)  # a trial's timeout that lands outside the agent's run
    print(f"workers import {verify_imports()}", flush=True)
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="dsr-live-"))
    t0 = time.perf_counter()
    code, _, reference = run_job(tmp, name="ref", steps=args.steps, **config)
    assert code == 0 and len(reference) == 4, "reference run failed"
    ref_times = reference[0]["times_s"][1:]
    print(f"config {args.config}, {args.steps} steps, seed {args.seed}; fault-free reference in "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    for i in range(args.trials):
        trial = draw(rng, rng.choice(scenarios), args.steps) if args.campaign else draw_lab(rng, args.steps)
        row = run_trial(tmp, i, trial, args.steps, config, reference, args.timeout)
        rows.append(row)
        det = ",".join(f"{d['latency_s']:.3f}" for d in row["detections"])
        rec = ",".join(f"{r:.3f}" for r in row["recovery_s"])
        faults = "fired " + ", ".join(f"r{r} {v}" for r, v in sorted(row["fired"].items()))
        print(f"trial {i:3d} {row['scenario']:<11} {'survived' if row['survived'] else 'FAILED':<8} "
              f"{row['wall_s']:5.1f}s param {row['max_param_diff'] or 0:.1e} master {row['max_master_diff'] or 0:.1e} "
              f"det {det} rec {rec} | {faults}"
              + ("" if row["survived"] else f" | {'; '.join(row['problems'])}"), flush=True)
        if not row["survived"] and args.keep:
            dest = Path(args.keep) / f"t{i}"
            shutil.copytree(tmp / f"t{i}-logs", dest, dirs_exist_ok=True)
            (dest / "trial.json").write_text(json.dumps(row, indent=1, default=str))
        for p in (tmp / f"t{i}", tmp / "ckpt"):  # the trial's dumps and disk snapshots
            shutil.rmtree(p, ignore_errors=True)
        for f in tmp.glob(f"t{i}.rank*.pt"):
            f.unlink()
        if args.json:  # after every trial: a long campaign's partial results survive an interruption
            write_json(args, rows, reference, ref_times, time.perf_counter() - t0)
    summary = report(rows, ref_times, time.perf_counter() - t0)
    if args.json:
        write_json(args, rows, reference, ref_times, time.perf_counter() - t0, summary)
    shutil.rmtree(tmp, ignore_errors=True)


def merge(args) -> None:
    """One report over several campaigns' JSON files (each keeps its own seed's trials)."""
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    rows, ref_times, wall = [], [], 0.0
    for f, run in zip(args.merge, runs):
        print(f"{f}: config {run['config']}, {run['steps']} steps, seed {run['seed']}, {run['trials']} trials, "
              f"{run['wall_s']:.0f}s")
        rows += [{**r, "trial": f"{run['seed']}.{r['trial']}"} for r in run["rows"]]
        wall = max(wall, run["wall_s"])
    # the fault-free rate of each run, as per-step times for report()
    rate = statistics.mean(run["fault_free_samples_per_s"] for run in runs)
    ref_times = [SAMPLES / rate]
    summary = report(rows, ref_times, wall)
    if args.json:
        Path(args.json).write_text(json.dumps({"merged": args.merge, "trials": len(rows), "summary": summary,
                                               "rows": rows}, indent=1, default=str))


def write_json(args, rows, reference, ref_times, wall, summary=None) -> None:
    out = {"config": args.config, "campaign": args.campaign, "steps": args.steps, "seed": args.seed,
           "trials": len(rows), "wall_s": wall, "summary": summary, "rows": rows,
           "fault_free_samples_per_s": SAMPLES * len(ref_times) / sum(ref_times)}
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def report(rows, ref_times, wall) -> dict:
    survived = sum(r["survived"] for r in rows)
    print(f"\n{survived}/{len(rows)} trials survived with parameters (and fp32 masters) equal to the fault-free run "
          f"({wall:.0f}s)")
    summary = {"survived": survived, "tried": len(rows), "scenarios": {}}
    print(f"  {'scenario':<12} {'survived/tried':>14}  {'max param diff':>14}  {'max master diff':>15}  "
          f"{'detection med':>13}  {'recovery med':>12}")
    for s in SCENARIOS + ("all",):
        rs = [r for r in rows if s in ("all", r["scenario"])]
        if not rs:
            continue
        pd = max((r["max_param_diff"] for r in rs if r["max_param_diff"] is not None), default=None)
        md = max((r["max_master_diff"] for r in rs if r["max_master_diff"] is not None), default=None)
        det = med([d["latency_s"] for r in rs for d in r["detections"] if d["kind"] == "crash"])
        rec = med([x for r in rs for x in r["recovery_s"]])
        ok = sum(r["survived"] for r in rs)
        summary["scenarios"][s] = {"survived": ok, "tried": len(rs), "max_param_diff": pd, "max_master_diff": md,
                                   "crash_detection_median_s": det, "recovery_median_s": rec}
        print(f"  {s:<12} {f'{ok}/{len(rs)}':>14}  {pd if pd is not None else float('nan'):14.3e}  "
              f"{md if md is not None else float('nan'):15.3e}  {det * 1e3:10.1f} ms  {rec * 1e3:9.1f} ms")
    for kind in ("crash", "hang"):
        ds = [d["latency_s"] for r in rows for d in r["detections"] if d["kind"] == kind]
        if ds:
            print(f"  detection {kind:<5}: median {med(ds) * 1e3:8.1f} ms, max {max(ds) * 1e3:8.1f} ms (n={len(ds)})")
            summary[f"detection_{kind}"] = {"median_s": med(ds), "max_s": max(ds), "n": len(ds)}
    rs = [x for r in rows for x in r["recovery_s"]]
    if rs:
        print(f"  recovery (epoch -> ready, slowest survivor): median {med(rs) * 1e3:.1f} ms, max {max(rs) * 1e3:.1f} ms "
              f"(n={len(rs)})")
        summary["recovery"] = {"median_s": med(rs), "max_s": max(rs), "n": len(rs)}
    restored = [x["recovery_s"] for r in rows for x in r["restored"]]
    if restored:
        print(f"  restart restore (every worker): median {med(restored) * 1e3:.1f} ms (n={len(restored)})")
        summary["restore"] = {"median_s": med(restored), "n": len(restored)}
    tp = [r["samples_per_s"] for r in rows if r["samples_per_s"]]
    line = f"  samples/s: fault-free {SAMPLES * len(ref_times) / sum(ref_times):.1f}"
    if tp:
        summary["samples_per_s"] = {k: med([x.get(k) for x in tp]) for k in ("before", "during", "after")}
        line += ("; single-failure runs: before {before:.1f}, during (the step with the failure) {during:.1f}, "
                 "after {after:.1f} (medians)").format(**summary["samples_per_s"])
    print(line)
    by_kind: dict[str, int] = {}
    by_point: dict[str, int] = {}
    for r in rows:
        for v in r["fired"].values():  # "kind@step:point"
            kind, point = v.split("@")[0], v.split(":")[1]
            by_kind[kind] = by_kind.get(kind, 0) + 1
            by_point[point] = by_point.get(point, 0) + 1
    if by_kind:
        order = lambda d: ", ".join(f"{k} {n}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))
        print(f"  faults fired: {sum(by_kind.values())} ({order(by_kind)}); at {order(by_point)}")
        summary["fired"] = {"by_kind": by_kind, "by_point": by_point}
    failed = [r for r in rows if not r["survived"]]
    for r in failed:
        print(f"  FAILED trial {r['trial']} ({r['scenario']}): {'; '.join(r['problems'])}")
    return summary


if __name__ == "__main__":
    main()
