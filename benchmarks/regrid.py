"""Re-grid against restart from the in-memory snapshots, on the same job (issue 18).

    python benchmarks/regrid.py [--steps 10] [--fail-at 4] [--pp 3] [--workers 6] [--pace S] [--d-model 64] [--json FILE]
    python benchmarks/regrid.py --fit 64,256,512 [--json FILE]

The example GPT under ``ds-resilience run``'s agent, PP=3 x DP=2 (6 CPU processes on gloo), both
replicas of stage 1 SIGKILLed before the forward of step ``--fail-at``. Three runs of the same job:

* fault-free;
* ``"regrid": true``: the survivors re-form a 2 x 2 grid in their running processes;
* ``"regrid": false`` with ``checkpoint.max_restarts`` 1: the agent restarts all 6 workers from the
  in-memory snapshots (the tier before this one).

Figures, on one wall clock (the agent's events and each step's end as the workers log them):
the **pause**, from the agent's detection of the failure to the end of the first step completed
after it (the replayed step included), the median step time after the failure against the
fault-free run's, and the whole job's wall time. The re-grid's own log splits its pause into the
fetch of the lost stage's snapshot, the layer moves and the engine rebuild.

``--fit WIDTHS``: the re-grid run alone at each width of the example GPT (``--d-model``), then the
simulator's cost model of a re-grid (``ds_resilience/sim/regrid_cost.py``) fitted to them. The
bytes are the simulator's: one stage of the new grid, weights and Adam state (``regrid_bytes``, 12
bytes/param in this fp32 job), so the fitted rate carries the engine's traffic pattern (the
snapshot holder of the lost stage sends it to every new holder); the busiest worker's real traffic
(sent + received + fetched) is printed next to it. Per run: the slowest survivor's seconds moving
state (fetch + moves) and its whole re-grid; ``bytes_per_s`` is the least-squares slope of moving
seconds over bytes, ``rebuild_s`` the median of the rest (re-grid minus bytes / bytes_per_s). The
raw gloo loopback bandwidth between two processes is measured in the same run (what the simulator
scales to the traces' network). Then the simulator's pause for each run's model next to the live
re-grid, as a ratio, with the fitted and with the shipped constants. ``--from-json FILE`` prints
the fit again from a ``--fit --json`` file without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds_resilience.supervisor.agent import Agent  # noqa: E402

PACE = 0.0  # --pace: pad each step to this long
D_MODEL = 64  # --d-model: the example GPT's width


def run(tmp: Path, name: str, *, workers: int, pp: int, steps: int, faults=(), regrid=False, restarts=0) -> dict:
    base = json.loads((REPO / "configs" / "gpt_cpu_pp2_dp2.json").read_text())
    base["optimizer"] = {"type": "Adam", "params": {"lr": 0.002, "torch_adam": True}}
    base["resilience"] = {
        "schedule": "1f1b", "variant": "recycle", "regrid": regrid, "fault_injection": list(faults),
        "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "pg_timeout_s": 60.0},
        "checkpoint": {"persistent_dir": str(tmp / "ckpt"), "max_restarts": restarts},
    }
    cfg = tmp / f"{name}.json"
    cfg.write_text(json.dumps(base))
    dump = tmp / name
    agent = Agent(REPO / "examples" / "train_gpt.py",
                  ["--deepspeed_config", str(cfg), "--steps", str(steps), "--pp", str(pp), "--dump", str(dump),
                   "--min-step-seconds", str(PACE), "--d-model", str(D_MODEL)],
                  num_workers=workers, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, max_restarts=restarts,
                  log_dir=tmp / f"{name}-logs", env={"PYTHONPATH": str(REPO), "DSR_SELF_PROFILE": "0"},
                  echo=lambda msg: None, regrid=regrid)
    started = time.time()
    code = agent.run()
    wall = time.time() - started
    if code != 0:
        raise SystemExit(f"{name}: the agent exited with {code}; logs in {tmp / (name + '-logs')}")
    dumps = {r: torch.load(f, weights_only=False) for r in range(workers) if (f := Path(f"{dump}.rank{r}.pt")).exists()}
    crash = min((e.time for e in agent.events if e.kind == "crash"), default=None)
    ends = sorted(t for d in dumps.values() for _, t in d["step_ends"])
    out = {"wall_s": wall, "survivors": sorted(dumps)}
    per_rank = [d["step_ends"] for d in dumps.values()]
    if crash is None:
        gaps = [b[1] - a[1] for ends_r in per_rank for a, b in zip(ends_r, ends_r[1:])]
        out["step_s"] = statistics.median(gaps)
        return out
    out["pause_s"] = max(min(t for _, t in ends_r if t > crash) for ends_r in per_rank) - crash
    after = [b[1] - a[1] for ends_r in per_rank for a, b in zip(ends_r, ends_r[1:]) if a[1] > crash]
    out["step_s_after"] = statistics.median(after) if after else None
    regrids = [e for d in dumps.values() for e in d["recovery"] if e.get("kind") == "regrid"]
    if regrids:
        out["regrid"] = {k: statistics.median(e[k] for e in regrids) for k in ("fetch_s", "transfer_s", "rebuild_s", "regrid_s")}
        out["grid"] = regrids[0]["plan"]["grid"]
        out["from_step"], out["resume_step"] = regrids[0]["from_step"], regrids[0]["resume_step"]
        out["moved_bytes"] = sum(e["received_bytes"] for e in regrids)
        # the busiest receiver and the slowest survivor: what sets the pause (the fit's inputs)
        out["busiest_bytes"] = max(e["received_bytes"] + e.get("fetched_bytes", 0) for e in regrids)
        out["busiest_traffic"] = max(e["sent_bytes"] + e["received_bytes"] + e.get("fetched_bytes", 0) for e in regrids)
        out["max_move_s"] = max(e["fetch_s"] + e["transfer_s"] for e in regrids)
        out["max_regrid_s"] = max(e["regrid_s"] for e in regrids)
        out["max_rebuild_s"] = max(e["rebuild_s"] for e in regrids)
    del ends
    return out


def _probe(rank: int, path: str, nbytes: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    x = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(reps + 1):  # the first warms the pair up
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x[:1], 1)
        else:
            dist.recv(x, 0)
            dist.send(x[:1], 0)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"bytes": nbytes, "s": statistics.median(times[1:])}))
    dist.destroy_process_group()


def gloo_link_bytes_per_s(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Raw gloo send/recv between two CPU processes over loopback, bytes/s (median of ``reps``)."""
    import torch.multiprocessing as mp

    tmp = Path(tempfile.mkdtemp(prefix="dsr-link-"))
    try:
        mp.spawn(_probe, args=(str(tmp / "store"), nbytes, reps, str(tmp / "out.json")), nprocs=2, join=True)
        got = json.loads((tmp / "out.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return got["bytes"] / got["s"]


def example_params(d_model: int) -> int:
    """Parameters of the example GPT at width ``d_model``."""
    sys.path.insert(0, str(REPO / "examples"))
    import gpt_model

    cfg = gpt_model.GPTConfig(d_model=d_model)
    return sum(p.numel() for p in gpt_model.build_full_model(cfg, seed=0).parameters())


def fit(args, faults) -> int:
    global D_MODEL
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        for key in ("fail_at", "steps", "pace", "pp", "workers"):
            setattr(args, key, saved["args"][key])
        return report_fit(saved["raw"], saved["link_bytes_per_s"], args)
    widths = [int(w) for w in args.fit.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="dsr-regrid-fit-"))
    runs = []
    for width in widths:
        D_MODEL = width
        got = run(tmp, f"regrid-d{width}", faults=faults, regrid=True, workers=args.workers, pp=args.pp,
                  steps=args.steps)
        got["d_model"], got["params"] = width, example_params(width)
        runs.append(got)
    link = gloo_link_bytes_per_s()
    shutil.rmtree(tmp, ignore_errors=True)
    return report_fit(runs, link, args)


def report_fit(runs: list, link: float, args) -> int:
    from ds_resilience.sim import regrid_cost as rc

    widths = [r["d_model"] for r in runs]
    for r in runs:  # the simulator's bytes: one stage of the new grid, fp32 weights + Adam (12 bytes/param)
        r["stage_bytes"] = rc.regrid_bytes(r["params"], r["grid"]["pp"], bytes_per_param=12.0)
    xs = [r["stage_bytes"] for r in runs]
    ys = [r["max_move_s"] for r in runs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    bytes_per_s = 1.0 / slope
    rebuild_s = statistics.median(r["max_regrid_s"] - r["stage_bytes"] / bytes_per_s for r in runs)
    fitted = rc.RegridCost(rebuild_s=rebuild_s, bytes_per_s=bytes_per_s)
    dp = args.workers // args.pp
    print(f"PP={args.pp} x DP={dp}, the example GPT at widths {widths}, every replica of stage 1 SIGKILLed at step "
          f"{args.fail_at} ({args.steps} steps, each padded to {args.pace} s), the re-grid run alone; CPU processes, "
          f"gloo over loopback")
    print(f"{'d_model':>7} {'params':>10} {'grid':>6} {'stage MB':>9} {'busiest MB':>11} {'move s':>8} {'rebuild s':>10} "
          f"{'re-grid s':>10} {'sim s':>8} {'sim/live':>9} {'shipped s':>10} {'shipped/live':>13}")
    rows = []
    for r in runs:
        grid = r["grid"]
        predicted_bytes = r["stage_bytes"]
        sim = fitted.pause_s(predicted_bytes)
        shipped = rc.MEASURED.pause_s(predicted_bytes)
        live = r["max_regrid_s"]
        rows.append({"d_model": r["d_model"], "params": r["params"], "grid": grid,
                     "busiest_traffic": r.get("busiest_traffic"),
                     "predicted_bytes": predicted_bytes, "move_s": r["max_move_s"], "rebuild_s": r["max_rebuild_s"],
                     "regrid_s": live, "sim_s": sim, "shipped_s": shipped, "pause_s": r["pause_s"]})
        print(f"{r['d_model']:>7} {r['params']:>10,} {str(grid['dp']) + 'x' + str(grid['pp']):>6} "
              f"{predicted_bytes / 1e6:>9.2f} {r.get('busiest_traffic', math.nan) / 1e6:>11.2f} {r['max_move_s']:>8.3f} {r['max_rebuild_s']:>10.3f} {live:>10.3f} "
              f"{sim:>8.3f} {sim / live:>9.2f} {shipped:>10.3f} {shipped / live:>13.2f}")
    print(f"busiest MB: the busiest survivor's sent + received + fetched bytes (stage MB: the simulator's bytes)")
    print(f"fit: rebuild_s = {rebuild_s:.4f} s, bytes_per_s = {bytes_per_s:.4g} ({bytes_per_s / 1e6:.1f} MB/s); "
          f"raw gloo loopback {link / 1e9:.3f} GB/s (the transfer path reaches {bytes_per_s / link:.1%} of it)")
    cluster = fitted.scaled(link_bytes_per_s=rc.CLUSTER_LINK_BYTES_PER_S, measured_link_bytes_per_s=link)
    print(f"on the traces' cluster ({rc.CLUSTER_LINK_BYTES_PER_S * 8 / 1e9:.0f} Gbps): bytes_per_s = "
          f"{cluster.bytes_per_s:.4g}; shipped constants: MEASURED = {rc.MEASURED}, link "
          f"{rc.MEASURED_LINK_BYTES_PER_S:.4g}, CLUSTER = {rc.CLUSTER}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "rebuild_s": rebuild_s, "bytes_per_s": bytes_per_s,
                                               "link_bytes_per_s": link, "raw": runs,
                                               "args": {k: getattr(args, k) for k in ("fail_at", "steps", "pace", "pp", "workers")}},
                                              indent=1, default=str))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fail-at", type=int, default=4)
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--pace", type=float, default=0.0, help="pad each step to this many seconds")
    parser.add_argument("--d-model", type=int, default=64, help="the example GPT's width (default 64)")
    parser.add_argument("--fit", metavar="WIDTHS", help="comma-separated widths: fit the simulator's re-grid cost")
    parser.add_argument("--from-json", metavar="FILE", help="with --fit: print the fit of a saved --fit --json run")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    global PACE, D_MODEL
    PACE, D_MODEL = args.pace, args.d_model
    dp = args.workers // args.pp
    stage1 = [1 * dp + p for p in range(dp)]  # every replica of stage 1 (DeepSpeed's rank order)
    faults = [{"rank": r, "step": args.fail_at, "point": "before_forward", "kind": "sigkill"} for r in stage1]
    if args.fit:
        return fit(args, faults)
    tmp = Path(tempfile.mkdtemp(prefix="dsr-regrid-bench-"))  # kept when a run fails: its logs are there
    common = dict(workers=args.workers, pp=args.pp, steps=args.steps)
    base = run(tmp, "fault_free", **common)
    regrid = run(tmp, "regrid", faults=faults, regrid=True, **common)
    restart = run(tmp, "restart", faults=faults, restarts=1, **common)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"PP={args.pp} x DP={dp}, the example GPT, {args.steps} steps, every replica of stage 1 SIGKILLed at "
          f"step {args.fail_at}; 2-core CPU, gloo")
    print(f"{'run':<28} {'pause s':>8} {'step s after':>13} {'job wall s':>11}")
    print(f"{'fault-free':<28} {'-':>8} {base['step_s']:13.3f} {base['wall_s']:11.1f}")
    grid = regrid["grid"]
    print(f"{'re-grid (' + str(grid['dp']) + ' x ' + str(grid['pp']) + ', no restart)':<28} {regrid['pause_s']:8.2f} "
          f"{regrid['step_s_after']:13.3f} {regrid['wall_s']:11.1f}")
    print(f"{'restart from memory (6 x)':<28} {restart['pause_s']:8.2f} {restart['step_s_after']:13.3f} {restart['wall_s']:11.1f}")
    r = regrid["regrid"]
    print(f"re-grid pause / restart pause: {regrid['pause_s'] / restart['pause_s']:.3f} "
          f"({restart['pause_s'] / regrid['pause_s']:.1f}x shorter); the re-grid itself: fetch {r['fetch_s'] * 1e3:.0f} ms, "
          f"moves {r['transfer_s'] * 1e3:.0f} ms ({regrid['moved_bytes'] / 1e6:.2f} MB received), rebuild "
          f"{r['rebuild_s'] * 1e3:.0f} ms, {r['regrid_s'] * 1e3:.0f} ms in all (median over survivors); it resumed "
          f"from step {regrid['from_step']} (the survivors were at {regrid['resume_step']}: an older step when the "
          f"lost workers' newest snapshot was not committed yet)")
    from ds_resilience.sim import regrid_cost as rc

    params = example_params(args.d_model)
    sim = rc.MEASURED.pause_s(rc.regrid_bytes(params, grid["pp"], bytes_per_param=12.0))
    print(f"the simulator's re-grid for this model ({params:,} parameters, fp32 + Adam, onto {grid['pp']} stages; "
          f"MEASURED = {rc.MEASURED}): {sim:.3f} s against {regrid['max_regrid_s']:.3f} s live (slowest survivor): "
          f"sim / live {sim / regrid['max_regrid_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"fault_free": base, "regrid": regrid, "restart": restart}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
