"""``ds-resilience demo``: train the example GPT, kill a worker mid-run, keep training, compare.

Runs ``examples/train_gpt.py`` on CPU with PP=2 x DP=2 under the agent three times: once fault-free
(the reference), once with one worker SIGKILLed in the middle of a backward pass, and once where
that worker's whole stage is lost (its data-parallel peer's machine goes too, host memory and all).
The second run keeps training (the dead worker's micro-batches are re-routed to its data-parallel
peer) while a progress bar shows the steps; the summary gives the steps done, the detection and
recovery times, samples/s before, during and after the failure, and the largest parameter difference
against the reference. In the third run re-routing cannot cover the stage: the agent restarts every
worker from the in-memory snapshots (one machine per rank, two replicas), and training again ends
where the reference ends. Needs a source checkout (``examples/`` and ``configs/`` next to the package).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_demo"]

REPO = Path(__file__).resolve().parents[1]
_STEP = re.compile(r"^step\s+(\d+) loss ([\d.]+) samples/s\s+([\d.]+)")


def _job(out: Path, name: str, *, steps: int, faults: list[dict[str, Any]], echo,
         checkpoint: dict[str, Any] | None = None, max_restarts: int = 0):
    """Start the agent on a thread; returns (thread, agent, log dir, dump prefix, result holder)."""
    from .supervisor.agent import Agent

    base = json.loads((REPO / "configs" / "gpt_cpu_pp2_dp2.json").read_text())
    base["resilience"] = {
        "schedule": "1f1b",
        "variant": "recycle",
        "fault_injection": faults,
        "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "pg_timeout_s": 60.0},
        "checkpoint": checkpoint or {},
    }
    cfg = out / f"{name}.json"
    cfg.write_text(json.dumps(base, indent=1))
    dump = out / name
    logs = out / f"{name}-logs"
    agent = Agent(
        REPO / "examples" / "train_gpt.py",
        ["--deepspeed_config", str(cfg), "--steps", str(steps), "--dump", str(dump)],
        num_workers=4,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=2.0,
        log_dir=logs,
        max_restarts=max_restarts,
        env={"PYTHONPATH": str(REPO)},
        echo=echo,
    )
    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", agent.run()), daemon=True)
    thread.start()
    return thread, agent, logs, dump, result


def _follow(thread, logs: Path, steps: int, draw: bool) -> None:
    """Draw a progress bar from rank 0's log while the job runs."""
    seen = 0
    while thread.is_alive() or seen == 0:
        found = sorted(logs.glob("rank0.0*.log"), key=lambda f: f.stat().st_mtime) if logs.exists() else []
        log = found[-1] if found else logs / "rank0.0.log"  # after a restart: rank0.0.restart1.log
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()
            for line in lines:
                m = _STEP.match(line)
                if m and int(m.group(1)) + 1 > seen:
                    seen = int(m.group(1)) + 1
                    text = f"step {seen:3d}/{steps} loss {float(m.group(2)):.4f} {float(m.group(3)):7.1f} samples/s"
                    if draw and sys.stdout.isatty():
                        bar = "#" * (30 * seen // steps)
                        print(f"\r  [{bar:<30}] {text}", end="", flush=True)
                    elif draw and (seen % 5 == 0 or seen == steps):
                        print(f"  {text}", flush=True)
        if not thread.is_alive():
            break
        time.sleep(0.1)
    if draw and sys.stdout.isatty():
        print(flush=True)


def _wait(thread, result) -> int:
    thread.join()
    return result.get("code", 1)


def _dumps(dump: Path) -> dict[int, dict]:
    import torch

    out = {}
    for r in range(4):
        f = Path(f"{dump}.rank{r}.pt")
        if f.exists():
            out[r] = torch.load(f, weights_only=True)  # plain tensors and values: nothing to unpickle
    return out


def run_demo(*, steps: int = 30, kill_rank: int = 3, kill_step: int = 12, point: str = "mid_backward",
             out: str | os.PathLike[str] = "out/demo", restart: bool = True) -> int:
    """Run the demo; returns 0 when the faulty runs finished every step and match the reference."""
    if not (REPO / "examples" / "train_gpt.py").exists():
        print("ds-resilience demo: needs a source checkout (examples/ and configs/ beside the package)", file=sys.stderr)
        return 2
    outdir = Path(out).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    quiet = lambda msg: None  # noqa: E731
    print(f"ds_resilience demo: example GPT on CPU, PP=2 x DP=2 (4 processes, gloo), {steps} steps")
    runs = 3 if restart else 2
    print(f"1/{runs} fault-free reference run ...", flush=True)
    thread, _, logs, ref_dump, result = _job(outdir, "reference", steps=steps, faults=[], echo=quiet)
    _follow(thread, logs, steps, draw=True)
    if _wait(thread, result) != 0:
        print(f"reference run failed; logs in {logs}", file=sys.stderr)
        return 1
    fault = {"rank": kill_rank, "step": kill_step, "point": point, "kind": "sigkill"}
    print(f"2/{runs} the same run, worker rank {kill_rank} SIGKILLed at step {kill_step} ({point}) ...", flush=True)
    def echo(msg: str) -> None:
        if "epoch" in msg and "(start)" not in msg:
            print(f"{chr(10) if sys.stdout.isatty() else ''}  {msg.strip()}", flush=True)

    thread, agent, logs, dump, result = _job(outdir, "faulty", steps=steps, faults=[fault], echo=echo)
    _follow(thread, logs, steps, draw=True)
    code = _wait(thread, result)
    ref, got = _dumps(ref_dump), _dumps(dump)
    if code != 0 or not got:
        print(f"faulty run ended with code {code}; logs in {logs}", file=sys.stderr)
        return 1
    ok = _summary(steps, kill_step, fault, agent.events, ref, got, outdir)
    if restart:
        ok = max(ok, _restart_run(outdir, steps, kill_rank, kill_step, point, ref, echo))
    return ok


def _restart_run(outdir: Path, steps: int, kill_rank: int, kill_step: int, point: str, ref, echo) -> int:
    """Run 3: the killed worker's data-parallel peer loses its machine a few steps later."""
    peer = kill_rank ^ 1  # PP=2 x DP=2: ranks 2s and 2s+1 are stage s
    lose_step = min(kill_step + 4, steps - 2)
    faults = [{"rank": kill_rank, "step": kill_step, "point": point, "kind": "sigkill"},
              {"rank": peer, "step": lose_step, "point": "before_forward", "kind": "lose_machine"}]
    print(f"\n3/3 rank {kill_rank} SIGKILLed at step {kill_step}, then rank {peer}'s machine (host memory included) "
          f"lost at step {lose_step}: stage {kill_rank // 2} has no replica left ...", flush=True)
    thread, agent, logs, dump, result = _job(
        outdir, "restart", steps=steps, faults=faults, echo=echo, max_restarts=1,
        checkpoint={"ranks_per_machine": 1, "replicas": 2})
    _follow(thread, logs, steps, draw=True)
    code = _wait(thread, result)
    got = _dumps(dump)
    restored = [r for d in got.values() for r in d["recovery"] if r["kind"] == "restored"]
    if code != 0 or len(got) != 4 or not restored:
        print(f"restart run ended with code {code}; logs in {logs}", file=sys.stderr)
        return 1
    ref_params = {d["stage"]: d["params"] for d in ref.values()}
    worst = max(float((t - ref_params[d["stage"]][n]).abs().max()) for d in got.values() for n, t in d["params"].items())
    first = restored[0]
    where = ", ".join(f"rank {r}: {s}" for r, s in sorted(first["sources"].items()))
    print("\nrestart summary")
    print(f"  restarts                       {sum(e.kind == 'restart' for e in agent.events)}")
    print(f"  restored step                  {first['resume_step']} (the machine was lost at step {lose_step})")
    print(f"  snapshot sources               {where}")
    print(f"  restore time (slowest rank)    {max(r['total_s'] for r in restored) * 1e3:.1f} ms")
    print(f"  steps done                     {min(d['steps'] for d in got.values())}/{steps}")
    print(f"  largest parameter difference   {worst:.3e} against the fault-free reference")
    ok = all(d["steps"] == steps for d in got.values()) and worst < 1e-4
    print("OK: the lost stage came back from the in-memory snapshots and training matches the fault-free run"
          if ok else "MISMATCH")
    return 0 if ok else 1


def _rate(times: list[float], lo: int, hi: int, samples: int) -> float:
    part = times[lo:hi]
    return samples * len(part) / sum(part) if part else float("nan")


def _summary(steps, kill_step, fault, events, ref, got, outdir: Path) -> int:
    samples = 2 * 4 * 2  # micro-batch 2 x 4 micro-batches x 2 pipelines
    r0, ref0 = got[min(got)], ref[min(ref)]
    crash = [e for e in events if e.kind == "crash"]
    recovery = max(r["recovery_s"] for d in got.values() for r in d["recovery"] if r.get("recovery_s") is not None)
    ref_params = {}
    for d in ref.values():
        ref_params.setdefault(d["stage"], d["params"])
    worst = 0.0
    for d in got.values():
        for name, t in d["params"].items():
            worst = max(worst, float((t - ref_params[d["stage"]][name]).abs().max()))
    t = r0["times_s"]
    rows = {
        "steps_done": r0["steps"],
        "failed_rank": fault["rank"],
        "detection_s": crash[0].latency_s if crash else None,
        "recovery_s": recovery,
        "samples_per_s_before": _rate(t, 1, kill_step, samples),
        "samples_per_s_during": _rate(t, kill_step, kill_step + 1, samples),
        "samples_per_s_after": _rate(t, kill_step + 1, len(t), samples),
        "reference_samples_per_s": _rate(ref0["times_s"], 1, len(ref0["times_s"]), samples),
        "max_param_diff_vs_reference": worst,
        "final_loss": r0["losses"][-1],
        "reference_final_loss": ref0["losses"][-1],
    }
    (outdir / "summary.json").write_text(json.dumps(rows, indent=1))
    print("\nsummary")
    print(f"  steps done                     {rows['steps_done']}/{steps} (rank {fault['rank']} died at step {kill_step})")
    print(f"  detection (exit -> new epoch)  {rows['detection_s'] * 1e3:.1f} ms" if rows["detection_s"] is not None else "")
    print(f"  recovery (epoch -> ready)      {rows['recovery_s'] * 1e3:.1f} ms")
    print(f"  samples/s before / during / after   {rows['samples_per_s_before']:.1f} / "
          f"{rows['samples_per_s_during']:.1f} / {rows['samples_per_s_after']:.1f}  "
          f"(fault-free reference {rows['reference_samples_per_s']:.1f})")
    print(f"  final loss                     {rows['final_loss']:.6f} (reference {rows['reference_final_loss']:.6f})")
    print(f"  largest parameter difference   {worst:.3e} against the fault-free reference")
    print(f"  (details in {outdir})")
    ok = rows["steps_done"] == steps and worst < 1e-4
    print("OK: training survived the failure and matches the fault-free run" if ok else "MISMATCH")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-resilience demo", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-rank", type=int, default=3, choices=range(4))
    parser.add_argument("--kill-step", type=int, default=12)
    parser.add_argument("--point", default="mid_backward", choices=("before_forward", "mid_backward", "in_reduce", "in_optimizer"))
    parser.add_argument("--out", default="out/demo")
    parser.add_argument("--no-restart", action="store_true", help="skip run 3 (a whole stage lost, restart from memory)")
    args = parser.parse_args(argv)
    if not 1 <= args.kill_step < args.steps - 1:
        parser.error(f"--kill-step must be in 1..{args.steps - 2}")
    return run_demo(steps=args.steps, kill_rank=args.kill_rank, kill_step=args.kill_step, point=args.point, out=args.out,
                    restart=not args.no_restart)
