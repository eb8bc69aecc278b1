"""Re-grid against restart from the in-memory snapshots, on the same job (issue 18).

    python benchmarks/regrid.py [--steps 10] [--fail-at 4] [--pp 3] [--workers 6] [--pace S] [--json FILE]

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
"""

from __future__ import annotations

import argparse
import json
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
                   "--min-step-seconds", str(PACE)],
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
    del ends
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fail-at", type=int, default=4)
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--pace", type=float, default=0.0, help="pad each step to this many seconds")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    global PACE
    PACE = args.pace
    dp = args.workers // args.pp
    stage1 = [1 * dp + p for p in range(dp)]  # every replica of stage 1 (DeepSpeed's rank order)
    faults = [{"rank": r, "step": args.fail_at, "point": "before_forward", "kind": "sigkill"} for r in stage1]
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
    if args.json:
        Path(args.json).write_text(json.dumps({"fault_free": base, "regrid": regrid, "restart": restart}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
