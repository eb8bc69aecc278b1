"""The DeepSpeed engine through a SIGKILL on one device: the survivors end with the fault-free run's weights.

    python benchmarks/gpu_engine_check.py [--device cpu|cuda] [--steps N] [--fault-step S] [--json PATH]

``examples/train_gpt.py`` PP=2 x DP=2 (4 worker processes) under :class:`ds_resilience.supervisor.agent.Agent`,
as ``tests/live/test_live.py``'s ``run_job`` runs it, twice: fault-free, then with rank 1 SIGKILLed
mid-backward at step ``--fault-step`` (default: half-way, after that many in-memory snapshots). The
config is the DeepSpeed user's: ``"optimizer": {"type": "Adam"}`` without ``torch_adam`` (DeepSpeed's
FusedAdam), ``"bf16"`` on (fp32 masters), the resilience section's in-memory snapshots on (every
step). Every survivor's fp32 masters must equal the fault-free run's stage to fp32 rounding
(rtol 1e-5, atol 1e-6, test_live's ``assert_masters_equal``) and its bf16 parameters be their
rounding; one verdict line (``gpu_engine_check: PASS`` / ``FAIL``) and the figures are printed, the
exit code is non-zero on any mismatch.

``--device cuda``: all 4 ranks on ``cuda:0``. The transport is gloo (``ds_resilience.init_distributed``),
which stages CUDA tensors through host memory, and the snapshots take the CUDA copy path (device
sub-buffers, copy and drain streams). The product has no setting for several ranks on one device:
DeepSpeed's engine and ``PipelineModule`` take ``cuda:LOCAL_RANK`` and the agent exports
``LOCAL_RANK = rank % nproc`` (0..3; and passes ``--local_rank=r``), which a one-GPU machine rejects
for ranks 1-3. So this script is the agent's worker script too (``--worker``): it sets
``LOCAL_RANK=0`` (and ``--local_rank=0``) in the worker before the example's unchanged ``main`` runs
(ds_resilience reads only ``LOCAL_WORLD_SIZE`` of the node layout, for the snapshots' placement),
and writes what the snapshots did next to the example's dump (``<dump>.rank<r>.snap.json``). The
CPU run does the same, so only ``torch.cuda.set_device(0)`` and the CUDA copy path are left to the GPU.

The DeepSpeed config is this script's own (:func:`ds_config`, written once, the two runs differing
in ``fault_injection`` only): a shared config file edited between the two runs would fail the check
for nothing. Snapshots: every step, 2 replicas, ``ranks_per_machine`` 2 (the 4 ranks as two
machines, so replication runs too). DeepSpeed's FusedAdam op is built (JIT) once before the runs,
timed apart (``fused_adam_build_s``); in a virtual environment the JIT ops go to its
``torch_extensions`` (``TORCH_EXTENSIONS_DIR`` unless set, as ``examples/main_job.sh``): another
DeepSpeed install sharing ``~/.cache/torch_extensions`` rebuilds them in turn, and a build killed
midway leaves a lock that hangs every later load.

``--device cpu`` hides any GPU (``CUDA_VISIBLE_DEVICES=``, ``DS_ACCELERATOR=cpu``): the same check on
the CPU (the test tier's ``tests/live/test_gpu_engine_check.py``), DeepSpeed's CPU FusedAdam.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULT_RANK = 1
SHARE_ENV = "DSR_CHECK_ONE_DEVICE"  # the workers' device: every rank on device 0 of it ("cuda" or "cpu")
# --device cpu: workers forked from a server that imported these once (as the tests' agents; DSR_PRELOAD
# overrides). --device cuda: a fresh interpreter each, so that no CUDA driver state is ever forked.
CPU_PRELOAD = "torch,torch.distributed,deepspeed,ds_resilience,ds_resilience.integrations.deepspeed"


def _snapshot_figures(engine) -> dict:
    """What this rank's in-memory checkpoint tier did (read after the example closed it)."""
    memory = getattr(getattr(engine, "tier", None), "memory", None)
    if memory is None:
        return {"enabled": False}
    pipeline = memory.store.pipeline
    stats = memory.replicator.stats if memory.replicator is not None else None
    return {
        "enabled": True,
        "captures": len(memory.captures),  # the last 64 at most
        "captured_steps": [c["step"] for c in memory.captures],
        "committed": memory.committed,
        "chunks_copied": pipeline.chunks_copied,
        # CUDA copy path: the copy and drain streams of each device the state lived on (none on CPU)
        "staging_devices": sorted(str(d) for d in getattr(pipeline, "_side", {})),
        "replicas_sent": None if stats is None else stats.versions_sent,
        "replicas_received": None if stats is None else stats.versions_received,
        "replication_errors": None if stats is None else list(stats.errors),
    }


def worker(argv: list[str]) -> int:
    """The agent's worker: the example's main, every rank on device 0 when asked."""
    shared = os.environ.get(SHARE_ENV)
    if shared:
        os.environ["LOCAL_RANK"] = "0"  # DeepSpeed's engine and PipelineModule: cuda:LOCAL_RANK
        argv = ["--local_rank=0" if a.startswith("--local_rank=") else a for a in argv]
        if shared == "cuda":
            import torch

            torch.cuda.set_device(0)
    sys.path.insert(0, str(REPO / "examples"))
    import train_gpt

    import ds_resilience

    engines = []
    initialize = ds_resilience.initialize

    def keep(*args, **kwargs):
        out = initialize(*args, **kwargs)
        engines.append(out[0])
        return out

    ds_resilience.initialize = keep
    code = train_gpt.main(argv)
    dump = argv[argv.index("--dump") + 1] if "--dump" in argv else None
    if dump and engines:
        figures = _snapshot_figures(engines[-1])
        figures["local_rank"] = os.environ.get("LOCAL_RANK")
        Path(f"{dump}.rank{os.environ['RANK']}.snap.json").write_text(json.dumps(figures))
    return code


def ds_config(tmp: Path) -> dict:
    """The DeepSpeed user's config of the example GPT (PP=2 x DP=2), bf16, FusedAdam, snapshots on."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "steps_per_print": 1000000,
        "gradient_clipping": 1.0,  # DeepSpeed users' usual value: by the global norm over both stages
        # no torch_adam: DeepSpeed's FusedAdam (its CUDA op on a GPU, its CPU op on the CPU)
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "fp16": {"enabled": False},
        "bf16": {"enabled": True},  # bf16 parameters, fp32 masters
        "zero_optimization": {"stage": 0},
        "wall_clock_breakdown": False,
        "resilience": {
            "schedule": "1f1b",
            "variant": "recycle",
            "cost_model": "unit",
            "planner": {"solver": "heuristic"},
            "fault_injection": [],
            # pg_timeout 120 s: group set-up waits for the slowest worker's start on a loaded machine
            "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0, "pg_timeout_s": 120.0},
            # in-memory snapshots every step (stall budget 1: none skipped under load), replicated between
            # the two pretend machines; persistent ones rare
            "checkpoint": {"enabled": True, "interval": 1, "stall_budget": 1.0, "replicas": 2, "ranks_per_machine": 2,
                           "persistent_dir": str(tmp / "ckpt")},
        },
    }


def worker_env(device: str) -> dict:
    env = {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           SHARE_ENV: device}
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    else:
        env["DS_ACCELERATOR"] = "cuda"
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    return env


def build_fused_adam(device: str) -> tuple[float, str | None]:
    """DeepSpeed's FusedAdam op built (JIT, cached) once, as the workers load it; (seconds, error or None)."""
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('FusedAdamBuilder').load()")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **worker_env(device)},
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    return seconds, None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]


def run_job(tmp: Path, name: str, *, device: str, steps: int, cfg: dict, faults: list[dict]) -> dict:
    import torch

    from ds_resilience.supervisor.agent import Agent

    cfg = json.loads(json.dumps(cfg))
    cfg["resilience"]["fault_injection"] = faults
    config = tmp / f"{name}.json"
    config.write_text(json.dumps(cfg, indent=1))
    dump = tmp / name
    agent = Agent(
        Path(__file__).resolve(),
        ["--worker", "--deepspeed_config", str(config), "--steps", str(steps), "--dump", str(dump)],
        num_workers=4, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, log_dir=tmp / f"{name}-logs",
        env=worker_env(device), echo=lambda msg: print(f"  [{name}] {msg}", file=sys.stderr, flush=True),
        preload=() if device == "cuda" else os.environ.get("DSR_PRELOAD", CPU_PRELOAD),
    )
    t0 = time.perf_counter()
    code = agent.run()
    wall = time.perf_counter() - t0
    dumps, devices, snaps = {}, set(), {}
    for r in range(4):
        f = Path(f"{dump}.rank{r}.pt")
        if f.exists():
            d = torch.load(f, weights_only=False, map_location=None if device == "cuda" else "cpu")
            devices |= {str(t.device) for t in d["params"].values()} | {str(t.device) for t in d["masters"].values()}
            d["params"] = {k: v.cpu() for k, v in d["params"].items()}
            d["masters"] = {k: v.cpu() for k, v in d["masters"].items()}
            dumps[r] = d
        s = Path(f"{dump}.rank{r}.snap.json")
        if s.exists():
            snaps[r] = json.loads(s.read_text())
    return {"code": code, "events": agent.events, "dumps": dumps, "wall_s": wall, "devices": sorted(devices),
            "snapshots": snaps, "logs": tmp / f"{name}-logs"}


def check_snapshots(name: str, run: dict, *, device: str, fault_step: int, dead: bool) -> list[str]:
    """Every rank that finished took snapshots (before the fault step too), through the device's path."""
    problems = []
    for rank in sorted(run["dumps"]):
        snap = run["snapshots"].get(rank)
        if not snap or not snap.get("enabled"):
            problems.append(f"{name} rank {rank}: no in-memory checkpoint tier")
            continue
        if snap["local_rank"] != "0":
            problems.append(f"{name} rank {rank}: LOCAL_RANK {snap['local_rank']}, expected 0 (all ranks on device 0)")
        if not any(s < fault_step for s in snap["captured_steps"]) or snap["committed"] is None:
            problems.append(f"{name} rank {rank}: snapshots of steps {snap['captured_steps']}, committed "
                            f"{snap['committed']}: none before step {fault_step}")
        want = ["cuda:0"] if device == "cuda" else []
        if snap["staging_devices"] != want:
            problems.append(f"{name} rank {rank}: snapshots staged through {snap['staging_devices']}, expected {want}")
        # a replica in flight between a survivor and the killed rank when it died is lost, in either
        # direction (each side keeps its older ones): the killed rank's own, or one sent to it
        errors = [e for e in snap["replication_errors"] or []
                  if not (dead and (e.startswith(f"recv rank{FAULT_RANK}@")
                                    or (e.startswith("send ") and f"with rank {FAULT_RANK}:" in e)))]
        if errors:
            problems.append(f"{name} rank {rank}: replication errors {errors[:2]}")
    return problems


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
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if torch sees a GPU")
    ap.add_argument("--steps", type=int, default=12, help="training steps of each run (default 12)")
    ap.add_argument("--fault-step", type=int, default=None, help="the step rank 1 is SIGKILLed in (default steps // 2)")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    ap.add_argument("--keep", metavar="DIR", help="keep configs, dumps and worker logs here (default: a temporary dir)")
    args = ap.parse_args(argv)
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step
    if not 2 <= fault_step <= args.steps - 2:
        ap.error(f"--fault-step {fault_step}: needs snapshots before it and steps after it (2 <= S <= steps - 2)")

    if args.device == "cpu":  # before torch and deepspeed are imported (here and in the workers' fork server)
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    if "TORCH_EXTENSIONS_DIR" not in os.environ and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu":  # the children's environment: the fork server, the op build, the workers
            os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
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
    figures = {"device": device_name, "steps": args.steps, "fault": fault}
    problems: list[str] = []
    worst = float("nan")
    build_s, error = build_fused_adam(args.device)
    figures["fused_adam_build_s"] = round(build_s, 2)
    if error is not None:
        problems.append(f"DeepSpeed's FusedAdam op did not build or load on {args.device}")
        print(error, file=sys.stderr)
    cfg = ds_config(tmp)
    ref = run_job(tmp, "ref", device=args.device, steps=args.steps, cfg=cfg, faults=[]) if not problems else None
    job = run_job(tmp, "kill", device=args.device, steps=args.steps, cfg=cfg, faults=[fault]) if ref and ref["code"] == 0 else None

    if ref is None:
        pass
    elif ref["code"] != 0:
        figures["ref_wall_s"] = round(ref["wall_s"], 2)
        problems.append(f"fault-free run exited {ref['code']}")
        print(tail(ref["logs"]), file=sys.stderr)
    else:
        figures["ref_wall_s"] = round(ref["wall_s"], 2)
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
        for name, run in (("ref", ref), ("kill", job)):
            problems += check_snapshots(name, run, device=args.device, fault_step=fault_step, dead=name == "kill")
        snaps = job["snapshots"].values()
        figures["snapshots_per_survivor"] = sorted({s.get("captures") for s in snaps})
        figures["snapshot_staging"] = sorted({d for s in snaps for d in s.get("staging_devices", [])}) or ["host copy"]
        figures["replicas_sent_per_survivor"] = sorted({s.get("replicas_sent") for s in snaps}, key=str)
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
