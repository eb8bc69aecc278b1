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
profiled by the engine in its first iterations), rank 1 slowed from iteration 10 for 40 iterations;
the detector finds it and the job switches to the weighted plan at an iteration boundary; a twin
job with the switch off gives the un-adapted time (see :func:`live_rows`). Per speed: the measured
iteration time (median seconds) before the fault (healthy), with the slow worker un-adapted and
adapted, against the plan's predictions (the profile's seconds), and ``toward plan``: how far the
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
    parser.add_argument("--live", action="store_true", help="also measure the live switch (four jobs, about 3 min)")
    parser.add_argument("--live-repeat", type=int, default=1, help="pairs of live jobs per speed (medians after)")
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
        rows.extend(live_rows(args.live_costs, args.live_repeat))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


LIVE_STEPS, LIVE_FAULT_STEP, LIVE_FAULT_STEPS, LIVE_MICROBATCHES = 54, 10, 40, 8


def live_rows(costs: str = "profile", repeat: int = 1) -> list[dict]:
    """The live switch measured (see the module docstring). Per speed two jobs back to back, the
    same fault: one that only reports the straggler (``straggler_replan`` false: the un-adapted
    time, over the fault's iterations from the 3rd) and one that switches (the adapted time, from
    the 3rd iteration after the switch to the fault's end); healthy: both jobs' iterations before
    the fault. Paired jobs rather than one job's phases: on a shared machine the load drifts within
    a minute, and the un-adapted phase before the switch is short. ``costs``: the engine's own
    profile, or ``unit`` costs (the test suite's); ``repeat``: pairs per speed (then a line of
    medians per speed)."""
    import statistics
    import tempfile

    sys.path.insert(0, str(REPO / "tests" / "live"))
    from test_stragglers_live import DETECTOR, step_seconds, switch_phases  # the live test's detector and phases
    from test_live import run_job

    def median(secs: dict, lo: int, hi: int) -> float | None:
        values = [secs[s] for s in range(lo, hi) if s in secs]
        return statistics.median(values) if values else None

    rows = []
    end = LIVE_FAULT_STEP + LIVE_FAULT_STEPS
    print(f"\nlive: example GPT, 2x2x{LIVE_MICROBATCHES}, 4 CPU ranks under the agent, rank 1 (p1s0) slowed from "
          f"iteration {LIVE_FAULT_STEP} for {LIVE_FAULT_STEPS}; {costs} costs; measured: median iteration seconds; "
          f"planned: the cost model's unit")
    print(f"{'speed':>5} {'found at':>8} {'loads':>9} {'healthy':>8} {'un-adapted':>10} {'adapted':>8} "
          f"{'| planned':>9} {'un-adapted':>10} {'bound':>7} {'fault-free':>10} {'toward plan':>11}")
    fmt = lambda v, w=8: f"{v:>{w}.3f}" if isinstance(v, float) else f"{'-':>{w}}"  # noqa: E731
    for speed in [v for _ in range(repeat) for v in (0.5, 0.75)]:
        # slow above 1 + margin: 0.75x is a 1.33x pace, under the test's 0.6 margin
        detector = {**DETECTOR, "straggler_margin": 0.6 if speed <= 0.5 else 0.2}
        fault = {"rank": 1, "step": LIVE_FAULT_STEP, "point": "before_forward", "kind": "slow", "speed": speed,
                 "steps": LIVE_FAULT_STEPS}
        jobs = {}
        for replan in (False, True):
            with tempfile.TemporaryDirectory(prefix="dsr-slow-bench-") as tmp:
                code, _, dumps = run_job(Path(tmp), faults=[fault], steps=LIVE_STEPS,
                                         deepspeed={"gradient_accumulation_steps": LIVE_MICROBATCHES},
                                         resilience={"detector": {**detector, "straggler_replan": replan},
                                                     "profile_steps": 2 if costs == "profile" else 0})
            jobs[replan] = dumps.get(0) if code == 0 else None
        if jobs[False] is None or jobs[True] is None:
            print(f"{speed:>5}: a job failed")
            continue
        ph = switch_phases(jobs[True], LIVE_FAULT_STEP, end)
        if ph.get("switched_at") is None:
            print(f"{speed:>5}: never switched (not found slow)")
            continue
        off, on = step_seconds(jobs[False]), step_seconds(jobs[True])
        healthy = statistics.median([v for secs in (off, on) for s, v in secs.items() if 3 <= s < LIVE_FAULT_STEP])
        unadapted = median(off, LIVE_FAULT_STEP + 2, end)
        adapted = median(on, ph["switched_at"] + 3, end)
        ratio = ph["predicted"] / ph["predicted_unadapted"]
        gain = unadapted * (1 - ratio) if unadapted else 0.0
        fraction = (unadapted - adapted) / gain if gain > 0 and adapted else None
        row = {"live": True, "costs": costs, "speed": speed, "measured_healthy": healthy,
               "measured_unadapted": unadapted, "measured_adapted": adapted, "measured_fraction": fraction,
               "unadapted_in_job": ph["unadapted"], **ph}
        rows.append(row)
        loads = ph["loads"]
        print(f"{speed:>5} {ph['switched_at']:>8} {loads[1]:>4}/{loads[0]:<4} {fmt(healthy)} {fmt(unadapted, 10)} "
              f"{fmt(adapted)} | {fmt(ph['predicted'], 7)} {fmt(ph['predicted_unadapted'], 10)} "
              f"{fmt(ph['bound'], 7)} {fmt(ph['predicted_healthy'], 10)} "
              + (f"{fraction:>11.0%}" if fraction is not None else f"{'-':>11}"))
    if repeat > 1:
        for speed in (0.5, 0.75):
            mine = [r for r in rows if r["speed"] == speed]
            if not mine:
                continue
            med = lambda key: statistics.median(r[key] for r in mine if r.get(key) is not None)  # noqa: E731
            fractions = sorted(r["measured_fraction"] for r in mine if r.get("measured_fraction") is not None)
            print(f"{speed:>5} median of {len(mine)}: healthy {med('measured_healthy'):.3f}, un-adapted "
                  f"{med('measured_unadapted'):.3f}, adapted {med('measured_adapted'):.3f}; planned "
                  f"{med('predicted'):.3f} against {med('predicted_unadapted'):.3f} un-adapted; toward plan "
                  + (f"{statistics.median(fractions):.0%} (each: {', '.join(f'{f:.0%}' for f in fractions)})"
                     if fractions else "-"))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
