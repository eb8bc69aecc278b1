"""Live-failure figures: random injections on the real engine under the agent.

    python benchmarks/live.py [--trials 20] [--steps 12] [--seed 0] [--json FILE]

Each trial trains the example GPT (PP=2 x DP=2, 4 CPU processes, gloo, SGD) under the agent and
injects one failure at a random rank, step, point and kind (sigkill, exit, or hang: SIGSTOP,
detected by a missed heartbeat, interval 0.2 s, timeout 2 s). A trial survives when the agent exits
0, every survivor finished every step, and its parameters equal the fault-free reference's
(rtol 1e-5, atol 1e-6). Reported: survived / tried, detection latency per kind (the agent's own
measure: exit observed -> epoch published for crashes; last heartbeat -> epoch for hangs), recovery
latency (epoch published -> survivors ready to replay), and samples/s before, during and after.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_live import POINTS, run_job  # noqa: E402  (the tests' job runner)

SAMPLES = 2 * 4 * 2


def _equal(dumps, reference) -> bool:
    import torch

    ref = {}
    for d in reference.values():
        ref.setdefault(d["stage"], d["params"])
    return all(
        torch.allclose(t, ref[d["stage"]][n], rtol=1e-5, atol=1e-6) for d in dumps.values() for n, t in d["params"].items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    import test_live

    test_live.STEPS = args.steps
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="dsr-live-"))
    t0 = time.perf_counter()
    code, _, reference = run_job(tmp, name="ref", steps=args.steps)
    assert code == 0, "reference run failed"
    ref_times = reference[0]["times_s"][1:]
    rows = []
    for i in range(args.trials):
        fault = {"rank": rng.randrange(4), "step": rng.randint(2, args.steps - 3), "point": rng.choice(POINTS),
                 "kind": rng.choice(["sigkill", "exit", "hang"])}
        code, events, dumps = run_job(tmp, faults=[fault], name=f"t{i}", steps=args.steps)
        detected = [e for e in events if e.kind in ("crash", "hang")]
        ok = code == 0 and len(dumps) == 3 and all(d["steps"] == args.steps for d in dumps.values()) and _equal(dumps, reference)
        rec = [r["recovery_s"] for d in dumps.values() for r in d["recovery"] if r.get("recovery_s") is not None]
        r0 = dumps.get(min(dumps)) if dumps else None
        row = {"fault": fault, "survived": ok, "exit_code": code,
               "detection_s": detected[0].latency_s if detected else None,
               "detected_as": detected[0].kind if detected else None,
               "recovery_s": max(rec) if rec else None}
        if r0 is not None:
            t, k = r0["times_s"], fault["step"]
            row["before"] = SAMPLES * (k - 1) / sum(t[1:k]) if k > 1 else None
            row["during"] = SAMPLES / t[k] if len(t) > k else None
            row["after"] = SAMPLES * len(t[k + 1:]) / sum(t[k + 1:]) if len(t) > k + 1 else None
        rows.append(row)
        print(f"trial {i:2d} {fault['kind']:>7} rank {fault['rank']} step {fault['step']:2d} {fault['point']:<14} "
              f"{'survived' if ok else 'FAILED':<8} detection {row['detection_s'] or 0:.3f}s "
              f"recovery {row['recovery_s'] or 0:.3f}s", flush=True)
    survived = sum(r["survived"] for r in rows)

    def med(vals):
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\n{survived}/{len(rows)} injections survived with parameters equal to the fault-free run "
          f"({time.perf_counter() - t0:.0f}s)")
    for kind in ("sigkill", "exit", "hang"):
        ds = [r["detection_s"] for r in rows if r["fault"]["kind"] == kind]
        if ds:
            print(f"  detection {kind:<7}: median {med(ds) * 1e3:8.1f} ms, max {max(d or 0 for d in ds) * 1e3:8.1f} ms (n={len(ds)})")
    rs = [r["recovery_s"] for r in rows]
    print(f"  recovery (epoch -> ready): median {med(rs) * 1e3:.1f} ms, max {max(r or 0 for r in rs) * 1e3:.1f} ms")
    print(f"  samples/s: fault-free {SAMPLES * len(ref_times) / sum(ref_times):.1f}; failed runs: before "
          f"{med([r.get('before') for r in rows]):.1f}, during (the step with the failure) {med([r.get('during') for r in rows]):.1f}, "
          f"after {med([r.get('after') for r in rows]):.1f} (medians)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
