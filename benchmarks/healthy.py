"""The price of resilience while healthy (issue 45): vanilla DeepSpeed against ``ds_resilience.initialize``
on a user's model, in the same processes.

    python benchmarks/healthy.py [--steps 10] [--clips 0,1.0] [--ranks 2,4] [--modes plain,agent]
                                 [--width 1] [--small] [--json FILE]

The model is DeepSpeed's pipeline example as its users write it (``examples/deepspeed_pipe/train.py``:
its ``SyntheticImages`` and ``join_layers``) at torchvision's AlexNet widths, 57M parameters
(``benchmarks/healthy_worker.py``): a ``PipelineModule`` of two stages cut by parameters,
DeepSpeed's default optimizer config ``"type": "Adam"`` (FusedAdam), dropout, ``training_data``
passed to ``initialize``, ``gradient_clipping`` 0 and 1.0 (DeepSpeed's default), 4 images per
micro-batch and 8 micro-batches per pipeline. Each configuration is one launch of 2 or 4 ranks
(PP=2, DP=1 or 2), ``plain`` by ``torch.distributed.run`` and ``agent`` under ``ds-resilience run``
(heartbeats, in-memory snapshots, live recovery on); in it every rank trains ``--steps`` steps
with vanilla DeepSpeed, then as many with ``ds_resilience.initialize`` (which profiles itself in
its first 5 steps and re-plans with what it measured). The figure is the median iteration of
steps 6 to the end, the slowest rank's; the ratio is ds_resilience's throughput over vanilla's.
The table also gives each engine's longest step after the first (a stall for the re-plan after the
profile would show there), the step checks of clipping (summed over ranks: speculated, rolled back,
waited, or "ready": the last stage to publish its norm stepped exactly at once) and, under the
agent, the in-memory snapshots' interval in force at the end, the training thread's stall per
capture and the background copy's time (the largest over ranks).
``--small`` (AlexNet's widths / 8, 1 round) checks the benchmark runs, in a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from dist_harness import free_port  # noqa: E402

WORKER = REPO / "benchmarks" / "healthy_worker.py"


def launch(mode: str, ranks: int, clip: float, args, tmp: Path) -> dict:
    out = tmp / f"{mode}-{ranks}-{clip}.json"
    worker = [str(WORKER), "--steps", str(args.steps), "--clip", str(clip), "--width", str(args.width),
              "--out", str(out)]
    if mode == "plain":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), *worker]
    else:
        cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--num_workers", str(ranks),
               "--log_dir", str(tmp / f"{mode}-{ranks}-{clip}-logs"), *worker]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=args.timeout, env=env)
    if proc.returncode != 0 or not out.exists():
        logs = "".join(p.read_text()[-3000:] for p in sorted((tmp / f"{mode}-{ranks}-{clip}-logs").glob("*.log"))) \
            if mode == "agent" else ""
        raise SystemExit(f"{mode} {ranks} ranks clip {clip}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}\n{logs}")
    data = json.loads(out.read_text())
    data["wall_s"] = time.perf_counter() - started
    return data


def summarize(data: dict, first: int) -> dict:
    """Per engine: the slowest rank's median iteration over steps ``first``.. (1-based)."""
    row = {}
    for engine in ("vanilla", "resilient"):
        per_rank = [statistics.median(r[engine]["times"][first - 1:]) for r in data["ranks"]]
        row[engine] = max(per_rank)
    row["ratio"] = row["vanilla"] / row["resilient"]
    # the longest step after the first (the profile's end and the re-plan are at step 5): a re-plan
    # that stalled training shows here (it once stopped a 4-rank job for 12-24 s)
    row["longest"] = {e: max(max(r[e]["times"][1:]) for r in data["ranks"]) for e in ("vanilla", "resilient")}
    row["steps_s"] = {e: [max(r[e]["times"][i] for r in data["ranks"]) for i in range(len(data["ranks"][0][e]["times"]))]
                      for e in ("vanilla", "resilient")}
    res = [r["resilient"] for r in data["ranks"]]
    counts: dict[str, int] = {}
    for r in res:
        for k, v in (r.get("validation") or {}).items():
            counts[k] = counts.get(k, 0) + v
    row["validation"] = counts
    row["opt_step_s"] = {r["stage"]: r.get("opt_step_s") for r in res}
    snaps = [r["snapshot"] for r in res if r.get("snapshot")]
    if snaps:
        row["snapshot"] = {"interval": max(s["interval"] for s in snaps),
                           "stall_ms": max((s["stall_s"] or 0) for s in snaps) * 1e3,
                           "copy_ms": max((s["copy_s"] or 0) for s in snaps) * 1e3}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| ranks | agent | `gradient_clipping` | vanilla s/iter | ds_resilience s/iter | ds_resilience throughput / vanilla "
             "| longest step 2-N, vanilla / ds_resilience | steps speculated / rolled back / waited / ready "
             "| snapshot interval, stall, copy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r["validation"]
        checks = (f"{v.get('speculated', 0)} / {v.get('rolled back', 0)} / {v.get('waited', 0)} / {v.get('ready', 0)}"
                  if v else "-")
        snap = r.get("snapshot")
        snap_text = f"{snap['interval']}, {snap['stall_ms']:.0f} ms, {snap['copy_ms']:.0f} ms" if snap else "-"
        lines.append(f"| {r['ranks']} | {'yes' if r['mode'] == 'agent' else 'no'} | {r['clip']:g} | {r['vanilla']:.3f} "
                     f"| {r['resilient']:.3f} | **{r['ratio']:.2f}** | {r['longest']['vanilla']:.2f} / {r['longest']['resilient']:.2f} s "
                     f"| {checks} | {snap_text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--first", type=int, default=6, help="the first step timed (1-based)")
    parser.add_argument("--clips", default="0,1.0")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--modes", default="plain,agent")
    parser.add_argument("--width", type=int, default=1, help="divide AlexNet's widths by this")
    parser.add_argument("--small", action="store_true", help="widths / 8: a quick check that it runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="per launch, seconds")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.small:
        args.width = max(args.width, 8)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsr-healthy-") as tmp:
        for mode in args.modes.split(","):
            for ranks in (int(x) for x in args.ranks.split(",")):
                for clip in (float(x) for x in args.clips.split(",")):
                    data = launch(mode, ranks, clip, args, Path(tmp))
                    row = {"mode": mode, "ranks": ranks, "clip": clip, "wall_s": data["wall_s"],
                           **summarize(data, args.first)}
                    rows.append(row)
                    print(f"{mode} {ranks} ranks clip {clip:g}: vanilla {row['vanilla']:.3f} s/iter, ds_resilience "
                          f"{row['resilient']:.3f} s/iter, ratio {row['ratio']:.2f} (validation {row['validation']}, "
                          f"OPT {row['opt_step_s']}, snapshot {row.get('snapshot')}, launch {data['wall_s']:.0f} s)",
                          flush=True)
                    for e in ("vanilla", "resilient"):
                        print(f"  {e} steps (slowest rank): " + " ".join(f"{t:.2f}" for t in row["steps_s"][e]),
                              flush=True)
    print()
    print(f"AlexNet widths / {args.width}, {args.steps} steps, median of steps {args.first}-{args.steps}, "
          f"{os.cpu_count()} CPUs")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
