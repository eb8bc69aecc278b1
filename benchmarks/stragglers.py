"""A slow worker planned as a partial failure: what the planner predicts (planning/stragglers.py).

    python benchmarks/stragglers.py [--json FILE] [--live]

For each grid (D pipelines x P stages, M micro-batches), cost model (unit costs, and the example
GPT's profiled costs, configs/costs_gpt_example.json) and variant, one worker of the middle stage
at 0.5x and at 0.75x of its speed: the fault-free iteration time, the fault-free schedule run with
the slow worker (un-adapted: every synchronous pipeline system runs at its pace), the weighted plan
(adapted), the work bound with the slow worker, and how far the plan goes from the un-adapted time
toward the bound. Times are the timeline replay's (the simulator is the judge), in the cost model's
unit; ratios to the fault-free time.

``--live`` also measures the live switch (issue 45 part 2): for each speed, one job of the example
GPT under ``ds-resilience run``'s agent (4 CPU ranks, PP=2 x DP=2, 8 micro-batches, the costs
profiled by the engine in its first iterations), rank 1 slowed from iteration 4 for 30 iterations;
the detector finds it, the job switches to the weighted plan at an iteration boundary and back when
the fault ends. Per speed: the measured iteration time (median seconds) before the fault
(healthy), with the slow worker before the switch (un-adapted), after it (adapted) and after the
return, against the plan's predictions (the profile's seconds), and ``toward plan``: how far the
measured time went from the un-adapted one toward the plan's prediction (the predicted ratio
applied to the measured un-adapted time; 1 = all the way).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_resilience.costs import CostModel  # noqa: E402
from ds_resilience.planning.stragglers import plan_slow  # noqa: E402
from ds_resilience.topology import Worker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GRIDS = ((2, 2, 8), (2, 4, 8), (4, 4, 8), (4, 4, 16), (8, 4, 16))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--live", action="store_true", help="also measure the live switch (two jobs, about 1 min)")
    parser.add_argument("--live-costs", choices=("profile", "unit"), default="profile",
                        help="the live jobs plan with the engine's own profile (default) or unit costs")
    args = parser.parse_args(argv)
    costs = {"unit": CostModel.unit(), "gpt-example": CostModel.load(REPO / "configs" / "costs_gpt_example.json")}
    rows = []
    print(f"{'grid':>10} {'costs':>11} {'variant':>9} {'speed':>5} {'loads':>9} {'healthy':>8} {'un-adapted':>10} "
          f"{'planned':>8} {'bound':>8} {'won back':>8} {'plan s':>6}")
    for dp, pp, m in GRIDS:
        for name, cost in costs.items():
            try:
                cost.check_stages(pp)
            except Exception:  # noqa: BLE001 - a profile of another depth
                continue
            for variant in ("decoupled", "recycle"):
                for speed in (0.5, 0.75):
                    slow = Worker(pipeline=1, stage=pp // 2)
                    t0 = time.perf_counter()
                    try:
                        p = plan_slow(dp, pp, m, {slow: speed}, cost=cost, variant=variant)
                    except Exception as exc:  # noqa: BLE001 - a cost model that does not fit this grid
                        print(f"{dp}x{pp}x{m:<3} {name:>11} {variant:>9} {speed:>5}: {exc}")
                        continue
                    seconds = time.perf_counter() - t0
                    idx = pp // 2 * dp + 1
                    peer = idx - 1
                    row = {"dp": dp, "pp": pp, "m": m, "costs": name, "variant": variant, "speed": speed,
                           "slow_load": p.loads[idx], "peer_load": p.loads[peer], "healthy": p.healthy_time,
                           "unadapted": p.unadapted_time, "planned": p.iteration_time, "bound": p.bound,
                           "recovered": p.recovered, "plan_s": seconds}
                    rows.append(row)
                    h = p.healthy_time
                    print(f"{dp}x{pp}x{m:<4} {name:>11} {variant:>9} {speed:>5} {p.loads[idx]:>4}/{p.loads[peer]:<4} "
                          f"{1.0:>8.2f} {p.unadapted_time / h:>9.2f}x {p.iteration_time / h:>7.2f}x "
                          f"{p.bound / h:>7.2f}x {p.recovered:>8.0%} {seconds:>6.2f}")
    if args.live:
        rows.extend(live_rows(args.live_costs))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


LIVE_STEPS, LIVE_FAULT_STEP, LIVE_FAULT_STEPS, LIVE_MICROBATCHES = 64, 10, 40, 8


def live_rows(costs: str = "profile") -> list[dict]:
    """The live switch measured (see the module docstring): one job per speed; ``costs``: the
    engine's own profile, or ``unit`` costs (the test suite's)."""
    import tempfile

    sys.path.insert(0, str(REPO / "tests" / "live"))
    from test_stragglers_live import DETECTOR, switch_phases  # the live test's detector and phases
    from test_live import run_job

    rows = []
    print(f"\nlive: example GPT, 2x2x{LIVE_MICROBATCHES}, 4 CPU ranks under the agent, rank 1 (p1s0) slowed from "
          f"iteration {LIVE_FAULT_STEP} for {LIVE_FAULT_STEPS}; {costs} costs; iteration seconds (median; planned "
          f"in the cost model's unit)")
    print(f"{'speed':>5} {'found at':>8} {'loads':>9} {'healthy':>8} {'un-adapted':>10} {'adapted':>8} {'after':>7} "
          f"{'| planned':>9} {'un-adapted':>10} {'bound':>7} {'fault-free':>10} {'toward plan':>11}")
    for speed in (0.5, 0.75):
        # slow above 1 + margin: 0.75x is a 1.33x pace, under the test's 0.6 margin
        detector = {**DETECTOR, "straggler_margin": 0.6 if speed <= 0.5 else 0.2}
        fault = {"rank": 1, "step": LIVE_FAULT_STEP, "point": "before_forward", "kind": "slow", "speed": speed,
                 "steps": LIVE_FAULT_STEPS}
        with tempfile.TemporaryDirectory(prefix="dsr-slow-bench-") as tmp:
            code, _, dumps = run_job(Path(tmp), faults=[fault], steps=LIVE_STEPS,
                                     deepspeed={"gradient_accumulation_steps": LIVE_MICROBATCHES},
                                     resilience={"detector": detector, "profile_steps": 2 if costs == "profile" else 0})
        if code != 0 or 0 not in dumps:
            print(f"{speed:>5}: the job failed (exit code {code})")
            continue
        ph = switch_phases(dumps[0], LIVE_FAULT_STEP, LIVE_FAULT_STEP + LIVE_FAULT_STEPS)
        row = {"live": True, "costs": costs, "speed": speed, **ph}
        rows.append(row)
        if ph.get("switched_at") is None:
            print(f"{speed:>5}: never switched (not found slow)")
            continue
        fmt = lambda v, w=8: f"{v:>{w}.3f}" if isinstance(v, float) else f"{'-':>{w}}"  # noqa: E731
        loads = ph["loads"]
        print(f"{speed:>5} {ph['switched_at']:>8} {loads[1]:>4}/{loads[0]:<4} {fmt(ph['healthy'])} "
              f"{fmt(ph['unadapted'], 10)} {fmt(ph['adapted'])} {fmt(ph['after'], 7)} | {fmt(ph['predicted'], 7)} "
              f"{fmt(ph['predicted_unadapted'], 10)} {fmt(ph['bound'], 7)} {fmt(ph['predicted_healthy'], 10)} "
              + (f"{ph['fraction']:>11.0%}" if ph.get("fraction") is not None else f"{'-':>11}"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
