"""Nothing lost on an interrupt: SIGTERM (a scheduler's preemption or time limit) to ``ds-resilience
run``, or to one worker as every process of a SLURM job step receives it, stops the job gracefully:
every stage saves the newest step they all committed, in DeepSpeed's layout under
``<persistent_dir>/<job id>``, the agent exits 128+15 naming the checkpoint and removes the
snapshots, and the same command started again (same ``--job_id``) resumes from that checkpoint and
ends where an uninterrupted run ends. In the user's configuration: DeepSpeed's default Adam
(FusedAdam), clipping 1.0, bf16, ``training_data``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ds_resilience.job_secret import SECRET_VAR, new_secret
from ds_resilience.launch import DEFAULT_HOST_DIR
from ds_resilience.runtime import membership
from test_live import REPO, SCRIPT, TRAINING_DATA, USER_CONFIG, _config, assert_masters_equal, logs, run_job  # noqa: E402

STEPS = 8


def _free_port() -> int:
    from dist_harness import free_port

    return free_port()  # below the ephemeral range: see there


SECRET = new_secret()  # the agents' (one node's agent makes its own unless given one): the test reads their records

def _cli(tmp: Path, cfg: Path, job_id: str, name: str, port: int = 0, *, session: bool = False) -> subprocess.Popen:
    """The README's way: ``ds-resilience run`` with the user's config, paced steps (``session``: in a
    process group of its own, which a machine crash kills whole)."""
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--num_workers", "4", "--job_id", job_id,
           "--master_port", str(port),
           "--heartbeat_interval", "0.2", "--heartbeat_timeout", "4", "--log_dir", str(tmp / f"{name}-logs"),
           str(SCRIPT), "--deepspeed_config", str(cfg), "--steps", str(STEPS), "--dump", str(tmp / name),
           "--min-step-seconds", "0.5", *TRAINING_DATA]
    return subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", SECRET_VAR: SECRET},
                            start_new_session=session)


def _dumps(tmp: Path, name: str) -> dict[int, dict]:
    return {r: torch.load(f, weights_only=False) for r in range(4) if (f := tmp / f"{name}.rank{r}.pt").exists()}


def _wait_for_step(tmp: Path, name: str, step: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until rank 0 printed ``step`` (the example prints ``step   N loss ...`` after each)."""
    deadline = time.monotonic() + timeout_s
    log = tmp / f"{name}-logs" / "rank0.0.log"
    while time.monotonic() < deadline:
        if log.exists() and re.search(rf"^step +{step} loss", log.read_text(), re.M):
            return
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"rank 0 did not reach step {step}\n" + logs(tmp, name))


def _worker_pid(port: int, rank: int) -> int:
    """The pid ``rank`` registered with the agent (its store at ``port``)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    info = membership.read_worker(store, rank, secret=SECRET)  # the registrations are sealed
    assert info is not None, f"rank {rank} is not registered"
    return info.pid


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref_stop")
    code, _, dumps = run_job(tmp, name="ref", extra=TRAINING_DATA, deepspeed=USER_CONFIG)
    assert code == 0, logs(tmp, "ref")
    return dumps


@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["agent", "worker"])
def test_sigterm_saves_every_stage_and_the_same_command_resumes_to_the_uninterrupted_state(tmp_path, uninterrupted,
                                                                                          target):
    job_id = f"stop-{target}-{os.getpid()}"
    cfg = _config(tmp_path, dp=2, deepspeed=USER_CONFIG)
    port = _free_port()
    proc = _cli(tmp_path, cfg, job_id, "first", port)
    _wait_for_step(tmp_path, "first", 3, proc)
    if target == "agent":
        proc.send_signal(signal.SIGTERM)
    else:  # one worker receives it (a SLURM job step signals every process): it asks the agent to stop
        os.kill(_worker_pid(port, 2), signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    saved = re.search(r"checkpoint saved to (\S+)", err)
    assert saved, err[-4000:] + logs(tmp_path, "first")
    job_dir = tmp_path / "ckpt" / job_id
    tag = (job_dir / "latest").read_text().strip()
    assert Path(saved.group(1)) == job_dir / tag
    step = int(tag.removeprefix("global_step"))
    assert 3 <= step < STEPS, tag
    # DeepSpeed's layout, every stage: the layer files and each stage's model states with the optimizer
    files = sorted(p.name for p in (job_dir / tag).iterdir())
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "manifest.json"} <= set(files), files
    states = torch.load(job_dir / tag / "mp_rank_01_model_states.pt", weights_only=False)
    assert states["global_steps"] == step and states["optimizer"] is not None
    # every worker stopped cleanly at that step (no traceback, exit 0), and said why
    for r, d in _dumps(tmp_path, "first").items():
        assert d["steps"] == step and "stopped gracefully" in d["stopped"], (r, d["steps"], d["stopped"])
    assert "Traceback" not in logs(tmp_path, "first", tail=100000)
    # the snapshots in host memory are gone once the checkpoint is complete
    assert not (Path(DEFAULT_HOST_DIR) / job_id).exists()

    again = _cli(tmp_path, cfg, job_id, "again")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-4000:] + logs(tmp_path, "again")
    dumps = _dumps(tmp_path, "again")
    for d in dumps.values():
        assert {"kind": "resume", "checkpoint_dir": str(job_dir / tag), "resume_step": step} in d["recovery"]
        assert d["losses"] and len(d["losses"]) == STEPS - step  # it trained only the steps left
    assert_masters_equal(dumps, uninterrupted)


def _newest_held_for_all(root: Path, ranks: int) -> int | None:
    """The newest step of which every rank has a committed snapshot (a manifest) under ``root``
    (``<root>[/machine<m>]/rank<r>/v<step>/MANIFEST.json``), or ``None``."""
    steps = {r: {int(v.name[1:]) for v in root.glob(f"**/rank{r}/v*") if (v / "MANIFEST.json").exists()}
             for r in range(ranks)}
    common = set.intersection(*steps.values()) if steps else set()
    return max(common) if common else None


@pytest.mark.timeout(600)
@pytest.mark.parametrize("lost", ["agent", "machine"])
def test_after_a_sigkill_the_next_run_of_the_job_resumes_from_the_snapshots_it_left(tmp_path, uninterrupted, lost):
    """Nothing can be saved when the agent is SIGKILLed (``agent``: its workers exit when they see
    it gone) or the machine crashes (``machine``: every process killed at once and host memory
    wiped, during the disk tier's writes of every step). The snapshots are what is committed: the
    next run of the same named job resumes from the newest step they hold for every rank, in host
    memory (the next agent keeps its job's directory) or on disk, and ends where an uninterrupted
    run ends; the host memory is freed when it exits."""
    job_id = f"killed-{lost}-{os.getpid()}"
    root = Path(DEFAULT_HOST_DIR) / job_id
    checkpoint = {"persistent_interval": 1} if lost == "machine" else None
    cfg = _config(tmp_path, dp=2, deepspeed=USER_CONFIG, checkpoint=checkpoint)
    port = _free_port()
    proc = _cli(tmp_path, cfg, job_id, "first", port, session=True)
    _wait_for_step(tmp_path, "first", 3, proc)
    pids = [_worker_pid(port, r) for r in range(4)]
    if lost == "agent":
        proc.kill()
    else:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    if lost == "machine":
        shutil.rmtree(root, ignore_errors=True)  # host memory goes with the machine
        held = _newest_held_for_all(tmp_path / "ckpt" / "snapshots" / job_id, 4)
    else:
        held = _newest_held_for_all(root, 4)
    assert held is not None and held > 0, held
    assert not (tmp_path / "ckpt" / job_id / "latest").exists()  # no stop checkpoint: nothing was saved

    again = _cli(tmp_path, cfg, job_id, "again")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-4000:] + logs(tmp_path, "again")
    if lost == "agent":
        assert "snapshots it left" in err and "kept for this run to resume from" in err, err[-3000:]
    dumps = _dumps(tmp_path, "again")
    for d in dumps.values():
        restored = [e for e in d["recovery"] if e.get("kind") == "restored"]
        assert [e["resume_step"] for e in restored] == [held], d["recovery"]
        assert len(d["losses"]) == STEPS - held  # it trained only the steps left
    assert_masters_equal(dumps, uninterrupted)
    assert not root.exists()  # freed by the agent of the run that resumed
