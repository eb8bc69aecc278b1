"""A slow worker planned as a partial failure: what the planner predicts (planning/stragglers.py).

    python benchmarks/stragglers.py [--json FILE]

For each grid (D pipelines x P stages, M micro-batches), cost model (unit costs, and the example
GPT's profiled costs, configs/costs_gpt_example.json) and variant, one worker of the middle stage
at 0.5x and at 0.75x of its speed: the fault-free iteration time, the fault-free schedule run with
the slow worker (un-adapted: every synchronous pipeline system runs at its pace), the weighted plan
(adapted), the work bound with the slow worker, and how far the plan goes from the un-adapted time
toward the bound. Times are the timeline replay's (the simulator is the judge), in the cost model's
unit; ratios to the fault-free time. What the engine measures live is not here yet: nothing
switches to these plans during training (issue 45, part 2, open).
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
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
