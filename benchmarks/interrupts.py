"""Interrupt campaign: random SIGTERM / SIGINT / SIGKILL to a job under ``ds-resilience run``, then
the same command again; what was kept, what was lost, what was left behind.

    python benchmarks/interrupts.py [--trials 30] [--steps 10] [--seed 0] [--json FILE] [--keep DIR]

Each trial runs the example GPT (PP=2 x DP=2, 4 CPU processes, gloo) in the user's configuration
(DeepSpeed's default Adam, clipping 1.0, bf16, ``training_data``) under ``ds-resilience run
--job_id J`` (workers forked from a preloaded server), paced at 0.3 s a step, and when rank 0 has
printed a random step k (1..steps-2) sends one of:

``sigterm``        SIGTERM to the agent (a scheduler's preemption or time limit);
``sigint``         SIGINT to the agent (Ctrl-C);
``sigterm_worker`` SIGTERM to one random worker (as every process of a SLURM job step receives it);
``sigkill_agent``  SIGKILL to the agent (nothing can be saved: the workers see their parent change
                   and exit; the snapshots stay in host memory, and the next agent of the job keeps
                   them for its workers to resume from);
``crash_in_write`` a machine crash in the middle of a disk write: with the disk tier writing every
                   step, once a version directory without its manifest exists (a write in flight),
                   every process of the job is SIGKILLed and its host memory wiped.

Then the same command runs again (same job id) to the end. A trial passes when:

* graceful kinds: the agent exits 128+signal, the stop's checkpoint holds a step >= k - 1 (rank 0
  printed k; a stage behind it has committed k - 1 at least: no committed step is lost), and the
  second run resumes from exactly that step;
* ``sigkill_agent`` and ``crash_in_write``: no stop checkpoint was written; the committed steps are
  the snapshots' (in host memory, or on disk after the crash), and the second run resumes from the
  newest step they hold for every rank (read from their manifests after the kill), so no committed
  step is lost; the torn write never counts;
* always: the second run exits 0 after the last step, its fp32 master weights equal an
  uninterrupted run's (rtol 1e-5, atol 1e-6), and after it nothing of the job is left in host
  memory (``/dev/shm/ds_resilience/J``).

Prints a table per kind and a JSON summary (``--json``). Takes about 40 s a trial on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

from ds_resilience.job_secret import SECRET_VAR, new_secret

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_gpt.py"
PRELOAD = "torch,torch.distributed,deepspeed,ds_resilience,ds_resilience.integrations.deepspeed," \
          "ds_resilience.integrations.warm"
KINDS = ("sigterm", "sigint", "sigterm_worker", "sigkill_agent", "crash_in_write")
KILLED = ("sigkill_agent", "crash_in_write")  # nothing saved at the stop: the snapshots are what is kept
DATA = ["--training-data", "--dataset-size", "40"]


def _config(tmp: Path, disk_every_step: bool = False) -> Path:
    base = json.loads((REPO / "configs" / "gpt_cpu_pp2_dp2.json").read_text())
    user = json.loads((REPO / "configs" / "default_resilience.json").read_text())
    base.update({k: v for k, v in user.items() if k in ("optimizer", "gradient_clipping", "bf16")})
    base["resilience"] = {"schedule": "1f1b", "variant": "recycle",
                          "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 4.0, "pg_timeout_s": 60.0},
                          "checkpoint": {"persistent_dir": str(tmp / "ckpt"),
                                         **({"persistent_interval": 1} if disk_every_step else {})}}
    path = tmp / "ds.json"
    path.write_text(json.dumps(base))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SECRET = new_secret()  # given to the agents, so that their sealed records can be read here

def _start(tmp: Path, cfg: Path, job: str, name: str, steps: int, port: int, pace: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--num_workers", "4", "--job_id", job,
           "--master_port", str(port), "--preload", PRELOAD, "--log_dir", str(tmp / f"{name}-logs"),
           str(SCRIPT), "--deepspeed_config", str(cfg), "--steps", str(steps), "--dump", str(tmp / name),
           "--min-step-seconds", str(pace), *DATA]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", SECRET_VAR: SECRET,
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))}
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: what a machine crash kills


def _printed(tmp: Path, name: str) -> int:
    log = tmp / f"{name}-logs" / "rank0.0.log"
    found = re.findall(r"^step +(\d+) loss", log.read_text(), re.M) if log.exists() else []
    return int(found[-1]) + 1 if found else 0  # the example prints the 0-based step it finished


def _worker_pid(port: int, rank: int) -> int:
    import torch.distributed as dist

    from ds_resilience.runtime import membership

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    return membership.read_worker(store, rank, secret=SECRET).pid  # the registrations are sealed


def _newest_held_for_all(root: Path, ranks: int = 4) -> int | None:
    """The newest step every rank has a committed snapshot of (a manifest) under ``root``."""
    steps = [{int(v.name[1:]) for v in root.glob(f"**/rank{r}/v*") if (v / "MANIFEST.json").exists()}
             for r in range(ranks)]
    common = set.intersection(*steps)
    return max(common) if common else None


def _write_in_flight(disk: Path, timeout_s: float = 5.0) -> bool:
    """Wait until a snapshot version directory on disk has no manifest yet (a write in flight)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for v in disk.glob("rank*/v*"):
            if not (v / "MANIFEST.json").exists():
                return True
        time.sleep(0.0005)
    return False


def _masters(tmp: Path, name: str) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for r in range(4):
        f = tmp / f"{name}.rank{r}.pt"
        if f.exists():
            d = torch.load(f, weights_only=False)
            out.setdefault(d["stage"], d["masters"])
    return out


def _same(a, b) -> tuple[bool, float]:
    worst = 0.0
    ok = set(a) == set(b)
    for stage in a:
        for name, t in a[stage].items():
            r = b.get(stage, {}).get(name)
            if r is None:
                return False, float("inf")
            worst = max(worst, float((t - r).abs().max()))
            ok = ok and torch.allclose(t, r, rtol=1e-5, atol=1e-6)
    return ok, worst


def trial(tmp: Path, cfg: Path, kind: str, at: int, steps: int, reference, pace: float, timeout: float) -> dict:
    from ds_resilience.launch import DEFAULT_HOST_DIR

    job = f"campaign-{tmp.name}"
    shm = Path(DEFAULT_HOST_DIR) / job
    port = _free_port()
    out = {"kind": kind, "at": at}
    proc = _start(tmp, cfg, job, "first", steps, port, pace)
    deadline = time.monotonic() + timeout
    while _printed(tmp, "first") < at and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    printed = _printed(tmp, "first")
    t0 = time.monotonic()
    if kind == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif kind == "sigint":
        proc.send_signal(signal.SIGINT)
    elif kind == "sigterm_worker":
        os.kill(_worker_pid(port, random.randrange(4)), signal.SIGTERM)
    elif kind == "crash_in_write":
        workers = [_worker_pid(port, r) for r in range(4)]
        out["in_write"] = _write_in_flight(tmp / "ckpt" / "snapshots" / job)
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        workers = [_worker_pid(port, r) for r in range(4)]
        proc.kill()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    out.update(printed=printed, first_code=proc.returncode, stop_s=time.monotonic() - t0)
    if kind in KILLED:  # the workers exit when they see their agent gone; then their snapshots are final
        end = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.monotonic() < end:
            time.sleep(0.05)
    if kind == "crash_in_write":
        shutil.rmtree(shm, ignore_errors=True)  # host memory goes with the machine
        out["held"] = _newest_held_for_all(tmp / "ckpt" / "snapshots" / job)
    elif kind == "sigkill_agent":
        out["held"] = _newest_held_for_all(shm)
    latest = tmp / "ckpt" / job / "latest"
    out["saved_step"] = int(latest.read_text().removeprefix("global_step")) if latest.exists() else None
    out["shm_left_after_first"] = shm.exists()
    again = _start(tmp, cfg, job, "again", steps, _free_port(), 0.0)
    _, err2 = again.communicate(timeout=timeout)
    out["second_code"] = again.returncode
    resumed = None
    source = "restored" if kind in KILLED else "resume"  # from the snapshots / from the stop's checkpoint
    for r in range(4):
        f = tmp / f"again.rank{r}.pt"
        if f.exists():
            resumed = next((e["resume_step"] for e in torch.load(f, weights_only=False)["recovery"]
                            if e.get("kind") == source), None)
            break
    out["resumed_from"] = resumed
    out["equal"], out["max_abs_diff"] = _same(_masters(tmp, "again"), reference)
    out["shm_left"] = shm.exists()
    graceful = kind not in KILLED
    want_code = 128 + (signal.SIGINT if kind == "sigint" else signal.SIGTERM)
    kept = out["saved_step"] if graceful else out.get("held")
    checks = {
        "exit": (out["first_code"] == want_code) if graceful else True,
        "kept": (out["saved_step"] is not None and out["saved_step"] >= printed - 1) if graceful
        else (out["saved_step"] is None and kept is not None),
        "resumed": resumed == kept,
        "finished": out["second_code"] == 0,
        "equal": out["equal"],
        "no_files": not out["shm_left"],
    }
    out["checks"] = checks
    out["passed"] = all(checks.values())
    if not out["passed"]:
        out["stderr"] = (err or "")[-2000:] + "\n---\n" + (err2 or "")[-2000:]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="keep the failed trials' directories here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    root = Path(tempfile.mkdtemp(prefix="interrupts-"))
    cfg = _config(root)
    print(f"reference: {args.steps} uninterrupted steps ...", flush=True)
    ref = _start(root, cfg, f"campaign-ref-{os.getpid()}", "ref", args.steps, _free_port(), 0.0)
    _, err = ref.communicate(timeout=args.timeout)
    if ref.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{err[-3000:]}")
    reference = _masters(root, "ref")
    results = []
    for i in range(args.trials):
        kind, at = KINDS[i % len(KINDS)], rng.randint(1, args.steps - 2)
        tmp = root / f"t{i:02d}"
        tmp.mkdir()
        tcfg = _config(tmp, disk_every_step=kind == "crash_in_write")
        r = trial(tmp, tcfg, kind, at, args.steps, reference, args.pace, args.timeout)
        results.append(r)
        kept = r["saved_step"] if kind not in KILLED else f"{r.get('held')} (snapshots)"
        print(f"[{i + 1:2d}/{args.trials}] {kind:15s} at step {at}: printed {r['printed']}, kept "
              f"{kept}, resumed {r['resumed_from']}, stop {r['stop_s']:.1f}s"
              + (f", kill during a write: {r['in_write']}" if "in_write" in r else "") + ", "
              f"{'PASS' if r['passed'] else 'FAIL ' + str({k: v for k, v in r['checks'].items() if not v})}",
              flush=True)
        if r["passed"]:
            shutil.rmtree(tmp, ignore_errors=True)
        elif args.keep:
            shutil.copytree(tmp, Path(args.keep) / tmp.name, dirs_exist_ok=True)
    print("\n| kind | trials | passed | committed step kept | resumed there | equal to uninterrupted | "
          "host memory left | stop (s, median) |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        rs = [r for r in results if r["kind"] == kind]
        if not rs:
            continue
        stops = sorted(r["stop_s"] for r in rs)
        print(f"| {kind} | {len(rs)} | {sum(r['passed'] for r in rs)} | {sum(r['checks']['kept'] for r in rs)} | "
              f"{sum(r['checks']['resumed'] for r in rs)} | {sum(r['equal'] for r in rs)} | "
              f"{sum(r['shm_left'] for r in rs)} | {stops[len(stops) // 2]:.1f} |")
    crashes = [r for r in results if r["kind"] == "crash_in_write"]
    if crashes:
        print(f"\ncrash_in_write: the kill came while a disk write was in flight in "
              f"{sum(bool(r.get('in_write')) for r in crashes)} of {len(crashes)} trials")
    worst = max((r["max_abs_diff"] for r in results), default=0.0)
    print(f"\n{sum(r['passed'] for r in results)}/{len(results)} trials passed; largest master difference "
          f"{worst:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"trials": results, "steps": args.steps, "seed": args.seed}, indent=1))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
