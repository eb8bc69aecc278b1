"""The DeepSpeed engine through a SIGKILL on one device: the survivors end with the fault-free run's weights.

    python benchmarks/gpu_engine_check.py [--device cpu|cuda] [--steps N] [--fault-step S] [--json PATH]

``examples/train_gpt.py`` PP=2 x DP=2 (4 worker processes) under :class:`ds_resilience.runtime.agent.Agent`,
as ``tests/live/test_live.py``'s ``run_job`` runs it, twice: fault-free, then with rank 1 SIGKILLed
mid-backward at step ``--fault-step`` (default: half-way, after that many in-memory snapshots). The
config is the DeepSpeed user's: ``"optimizer": {"type": "Adam"}`` without ``torch_adam`` (DeepSpeed's
FusedAdam), ``"bf16"`` on (fp32 masters), the resilience section's in-memory snapshots on (every
step). Every survivor's fp32 masters must equal the fault-free run's stage to fp32 rounding
(rtol 1e-5, atol 1e-6, test_live's ``assert_masters_equal``) and its bf16 parameters be their
rounding; one verdict line (``gpu_engine_check: PASS`` / ``FAIL``) and the figures are printed, the
exit code is non-zero on any mismatch.

``--device cuda``: all 4 ranks on ``cuda:0``. The transport is gloo (``ds_resilience.init_distributed``),
which stages CUDA tensors through host memory, and the snapshots take the CUDA copy path. The
product has no setting for several ranks on one device: DeepSpeed's engine calls
``set_device(LOCAL_RANK)`` and the agent exports ``LOCAL_RANK = rank % nproc`` (0..3), which a
one-GPU machine rejects for ranks 1-3. So this script is the agent's worker script too
(``--worker``): it sets ``LOCAL_RANK=0`` in the worker's own environment (nothing in ds_resilience
reads it after launch) and runs the example's ``main`` unchanged.

``--device cpu`` hides any GPU (``CUDA_VISIBLE_DEVICES=``, ``DS_ACCELERATOR=cpu``): the same check on
the CPU (the test tier's ``tests/live/test_gpu_engine_check.py``), DeepSpeed's CPU FusedAdam.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
FAULT_RANK = 1
SHARE_ENV = "DSR_CHECK_ONE_DEVICE"  # set for the workers of --device cuda


def worker(argv: list[str]) -> int:
    """The agent's worker: the example's main, every rank on device 0 when asked."""
    if os.environ.get(SHARE_ENV) == "1":
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine: set_device(LOCAL_RANK), device cuda:LOCAL_RANK
        import torch

        torch.cuda.set_device(0)
    sys.path.insert(0, str(REPO / "examples"))
    import train_gpt

    return train_gpt.main(argv)


def config(tmp: Path, name: str, faults: list[dict]) -> Path:
    base = json.loads((REPO / "configs" / "gpt_cpu_pp2_dp2.json").read_text())
    base["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}  # no torch_adam: DeepSpeed's FusedAdam
    base["bf16"] = {"enabled": True}
    base["resilience"] = {
        "schedule": "1f1b",
        "variant": "recycle",
        "cost_model": "unit",
        "planner": {"solver": "heuristic"},
        "fault_injection": faults,
        "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "pg_timeout_s": 60.0},
        # in-memory snapshots every step (stall budget 1: none skipped under load), persistent ones rare
        "checkpoint": {"enabled": True, "interval": 1, "stall_budget": 1.0, "persistent_dir": str(tmp / "ckpt")},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(base))
    return path


def run_job(tmp: Path, name: str, *, device: str, steps: int, faults: list[dict]) -> dict:
    import torch

    from ds_resilience.runtime.agent import Agent

    env = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    else:
        env.update({SHARE_ENV: "1", "DS_ACCELERATOR": "cuda"})
    dump = tmp / name
    agent = Agent(
        Path(__file__).resolve(),
        ["--worker", "--deepspeed_config", str(config(tmp, name, faults)), "--steps", str(steps), "--dump", str(dump)],
        num_workers=4, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, log_dir=tmp / f"{name}-logs",
        env=env, echo=lambda msg: print(f"  [{name}] {msg}", file=sys.stderr, flush=True),
    )
    t0 = time.perf_counter()
    code = agent.run()
    wall = time.perf_counter() - t0
    dumps, devices = {}, set()
    for r in range(4):
        f = Path(f"{dump}.rank{r}.pt")
        if f.exists():
            d = torch.load(f, weights_only=False, map_location=None if device == "cuda" else "cpu")
            devices |= {str(t.device) for t in d["params"].values()} | {str(t.device) for t in d["masters"].values()}
            d["params"] = {k: v.cpu() for k, v in d["params"].items()}
            d["masters"] = {k: v.cpu() for k, v in d["masters"].items()}
            dumps[r] = d
    return {"code": code, "events": agent.events, "dumps": dumps, "wall_s": wall, "devices": sorted(devices),
            "logs": tmp / f"{name}-logs"}


def compare(dumps: dict, reference: dict, *, steps: int, dead: tuple[int, ...]) -> tuple[list[str], float]:
    """test_live's assert_masters_equal as a list of problems (empty: equal) and the largest master difference."""
    import torch

    problems, worst = [], 0.0
    ref = {}
    for d in reference.values():
        ref.setdefault(d["stage"], d["masters"])
    if set(dumps) != set(range(len(reference))) - set(dead):
        problems.append(f"survivors {sorted(dumps)}, expected {sorted(set(range(len(reference))) - set(dead))}")
    for rank, d in sorted(dumps.items()):
        if d["steps"] != steps:
            problems.append(f"rank {rank} stopped at step {d['steps']}")
        if not d["masters"] or d["masters"].keys() != ref.get(d["stage"], {}).keys():
            problems.append(f"rank {rank}: no fp32 masters, or not the reference stage's")
            continue
        for name, t in d["masters"].items():
            r, p = ref[d["stage"]][name], d["params"][name]
            if t.dtype != torch.float32 or p.dtype != torch.bfloat16:
                problems.append(f"rank {rank} {name}: master {t.dtype}, parameter {p.dtype}")
                continue
            diff = float((t - r).abs().max()) if t.numel() else 0.0
            worst = max(worst, diff)
            if not torch.allclose(t, r, rtol=1e-5, atol=1e-6):
                problems.append(f"rank {rank} {name}: master differs by {diff:.3e}")
            if not torch.equal(p, t.to(torch.bfloat16)):
                problems.append(f"rank {rank} {name}: bf16 parameter is not its master rounded")
    return problems, worst


def tail(logs: Path, n: int = 1500) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-n:]}" for f in sorted(logs.glob("*.log")))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each run (default 12)")
    ap.add_argument("--fault-step", type=int, default=None, help="the step rank 1 is SIGKILLed in (default steps // 2)")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    ap.add_argument("--keep", metavar="DIR", help="keep configs, dumps and worker logs here (default: a temporary dir)")
    args = ap.parse_args(argv)
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step
    if not 2 <= fault_step <= args.steps - 2:
        ap.error(f"--fault-step {fault_step}: needs snapshots before it and steps after it (2 <= S <= steps - 2)")

    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("gpu_engine_check: FAIL no CUDA device visible", flush=True)
            return 2
        device_name = f"cuda:0 {torch.cuda.get_device_name(0)}"
    else:
        device_name = "cpu"
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpu_engine_check-"))
    tmp.mkdir(parents=True, exist_ok=True)
    fault = {"rank": FAULT_RANK, "step": fault_step, "point": "mid_backward", "kind": "sigkill"}
    ref = run_job(tmp, "ref", device=args.device, steps=args.steps, faults=[])
    job = run_job(tmp, "kill", device=args.device, steps=args.steps, faults=[fault]) if ref["code"] == 0 else None

    problems: list[str] = []
    worst = float("nan")
    figures = {"device": device_name, "steps": args.steps, "fault": fault, "ref_wall_s": round(ref["wall_s"], 2)}
    if ref["code"] != 0:
        problems.append(f"fault-free run exited {ref['code']}")
        print(tail(ref["logs"]), file=sys.stderr)
    else:
        figures["kill_wall_s"] = round(job["wall_s"], 2)
        crashes = [e for e in job["events"] if e.kind == "crash"]
        if job["code"] != 0:
            problems.append(f"SIGKILL run exited {job['code']}")
        if [e.rank for e in crashes] != [FAULT_RANK]:
            problems.append(f"crash events for ranks {[e.rank for e in crashes]}, expected [{FAULT_RANK}]")
        if crashes:
            figures["detect_to_publish_s"] = crashes[0].latency_s  # the agent: exit observable -> epoch published
        recs = [r for d in job["dumps"].values() for r in d["recovery"] if r.get("recovery_s") is not None]
        if recs:
            figures["recovery_s"] = round(max(r["recovery_s"] for r in recs), 3)  # detection -> survivors resumed
            figures["resume_step"] = sorted({r.get("resume_step") for r in recs})
        else:
            problems.append("no survivor logged a recovery")
        if crashes:  # the first step a survivor finished after the kill, as wall time from the crash event
            after = [t for d in job["dumps"].values() for _, t in d.get("step_ends", []) if t > crashes[0].time]
            if after:
                figures["crash_to_next_step_s"] = round(min(after) - crashes[0].time, 3)
        for name, run in (("ref", ref), ("kill", job)):
            want = "cuda:0" if args.device == "cuda" else "cpu"
            if run["devices"] != [want]:
                problems.append(f"{name} run's tensors on {run['devices']}, expected [{want!r}]")
        figures["tensor_devices"] = job["devices"]
        more, worst = compare(job["dumps"], ref["dumps"], steps=args.steps, dead=(FAULT_RANK,))
        problems += more
        figures["max_master_diff"] = worst
        if problems:
            print(tail(job["logs"]), file=sys.stderr)
    ok = not problems
    verdict = "PASS" if ok else "FAIL"
    print(f"gpu_engine_check: {verdict} device={device_name} PP=2xDP=2 bf16 FusedAdam in-memory snapshots, "
          f"rank {FAULT_RANK} SIGKILLed mid_backward at step {fault_step}/{args.steps}: "
          + ("survivors' fp32 masters equal the fault-free run's" if ok else "; ".join(problems[:8])), flush=True)
    for key, value in figures.items():
        print(f"  {key}: {value}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"verdict": verdict, "problems": problems, **figures}, indent=1, default=str))
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
