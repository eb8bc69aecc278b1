"""The agent, the membership protocol and fault injection, with real processes.

Process tests launch ``agent_workers/worker.py`` (the agent protocol without DeepSpeed) through a
real :class:`Agent`; faults are injected by the workers themselves through ``DSR_FAULTS`` and the
:class:`FaultInjector`. Each worker logs JSON lines (``rank{r}.{incarnation}.jsonl``) with
``time.time()`` stamps, the agent's records carry ``detected_at`` on the same clock, so detection
latencies are measured from the moment of the fault.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ds_resilience.config import FaultInjection
from ds_resilience.errors import ConfigError, ResilienceError
from ds_resilience.supervisor import agent as agent_mod
from ds_resilience.supervisor import cli as agent_cli
from ds_resilience.runtime import membership as mb
from ds_resilience.supervisor.agent import EXIT_STARTUP, EXIT_STOPPED, Agent, AgentError
from ds_resilience.supervisor.cli import main_run
from ds_resilience.runtime.faults import EXIT_CODE, FaultInjector, FaultPointError, faults_from_env

WORKERS = Path(__file__).parent / "agent_workers"
WORKER = WORKERS / "worker.py"
INTERVAL, TIMEOUT = 0.1, 1.0


def fault(rank: int, step: int, point: str = "before_forward", kind: str = "sigkill") -> dict[str, Any]:
    return {"rank": rank, "step": step, "point": point, "kind": kind}


def read_logs(out: Path) -> dict[str, list[dict[str, Any]]]:
    """``{"rank1.0": [events...]}`` from the workers' JSON-lines files."""
    return {p.stem: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            for p in sorted(out.glob("rank*.jsonl"))}


def worker_output(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))


def first(events: list[dict[str, Any]], ev: str) -> dict[str, Any]:
    return next(e for e in events if e["ev"] == ev)


def epochs_seen(events: list[dict[str, Any]]) -> list[int]:
    return [e["record"]["epoch"] for e in events if e["ev"] == "epoch"]


def run_agent(out: Path, n: int, faults: list[dict[str, Any]] = (), args: tuple[str, ...] = (),
              extra_env: dict[str, str] | None = None, **kw: Any) -> tuple[Agent, int, dict[str, list]]:
    messages: list[str] = []
    env = {"DSR_TEST_OUT": str(out), "DSR_FAULTS": json.dumps(list(faults)), **(extra_env or {})}
    kw.setdefault("stop_grace_s", 30.0)
    agent = Agent(WORKER, list(args), num_workers=n, env=env, heartbeat_interval_s=INTERVAL,
                  heartbeat_timeout_s=TIMEOUT, log_dir=out / "logs", echo=messages.append, **kw)
    code = agent.run()
    agent.messages = messages  # type: ignore[attr-defined]
    return agent, code, read_logs(out)


def dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# --- membership: records, store helpers, threads (one process) ----------------------------------
@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = mb.connect_store("127.0.0.1", master.port, 5.0)
    yield client


def _bare_coordinator(store):
    """A Coordinator's main-thread side without registration, heartbeat or watcher threads."""
    from ds_resilience.runtime.coordinator import Coordinator

    c = Coordinator.__new__(Coordinator)
    c.store, c.rank, c.store_timeout_s, c.applied, c.applying = store, 0, 5.0, 1, 0
    c._latched, c._disruptive, c._lock, c.on_epoch = None, 0, threading.Lock(), lambda record: None
    c._switch_seen, c._switch_checked = 0, 0.0
    c.joining, c._over_checked = False, 0.0
    return c


def _fault_target(tmp_path: Path, kind: str, rank: int) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**os.environ, "DSR_FAULTS": json.dumps([fault(2, 3, "mid_backward", kind)])}
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, str(WORKERS / "fault_target.py"), str(rank)], stdout=o, stderr=e,
                                env=env)
    return proc, out, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind,code", [("exit", EXIT_CODE), ("sigkill", -signal.SIGKILL)])
def test_fault_injector_kills_the_process_at_the_point(tmp_path, kind, code):
    proc, out, err = _fault_target(tmp_path, kind, rank=2)
    assert proc.wait(timeout=20) == code
    lines = out.read_text().splitlines()
    assert lines[-1] == "3 mid_backward" and len(lines) == 3 * 4 + 2  # nothing ran after the point
    assert f"[ds_resilience] injecting {kind} at step 3 mid_backward on rank 2" in err.read_text()


@pytest.mark.timeout(30)
def test_fault_injector_hang_stops_the_process_and_fires_once(tmp_path):
    proc, out, _ = _fault_target(tmp_path, "hang", rank=2)
    try:
        deadline = time.monotonic() + 20
        while True:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            assert time.monotonic() < deadline and proc.poll() is None, "the process never stopped"
            time.sleep(0.02)
        time.sleep(0.2)
        assert out.read_text().splitlines()[-1] == "3 mid_backward"
        os.kill(proc.pid, signal.SIGCONT)  # resumed, it goes on and never fires again
        assert proc.wait(timeout=20) == 0
        assert out.read_text().splitlines()[-1] == "survived ['3 mid_backward']"
    finally:
        proc.kill()


@pytest.mark.timeout(30)
def test_fault_injector_spares_other_ranks(tmp_path):
    proc, out, _ = _fault_target(tmp_path, "sigkill", rank=1)
    assert proc.wait(timeout=20) == 0
    assert out.read_text().splitlines()[-1] == "survived []"


# --- the agent with real workers ----------------------------------------------------------------
@pytest.mark.timeout(60)
def test_clean_run_publishes_epoch_1_and_exits_0(tmp_path):
    agent, code, logs = run_agent(tmp_path, 2, args=("--steps", "5"))
    assert code == 0, worker_output(tmp_path)
    assert [(r.epoch, r.kind, r.alive, r.failed) for r in agent.epochs] == [(1, "start", (0, 1), ())]
    assert mb.read_epoch(agent.store, 1, secret=agent.secret) == agent.epochs[0]
    assert mb.latest_epoch(agent.store, secret=agent.secret) == 1
    raw = agent.store.get(mb.epoch_key(1)).decode()  # sealed: HMAC-SHA256 of the job's secret, then the record
    assert raw.partition(":")[2] == agent.epochs[0].to_json() and len(raw.partition(":")[0]) == 64
    for r in (0, 1):
        events = logs[f"rank{r}.0"]
        assert epochs_seen(events) == [1] and first(events, "done")["steps"] == 5
        assert first(events, "start")["env"] == {
            "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
            "TORCHELASTIC_USE_AGENT_STORE": "True", "DSR_REJOIN": "0"}
        assert mb.read_worker(agent.store, r, secret=agent.secret).pid == first(events, "start")["pid"]
    assert sorted(e.rank for e in agent.events if e.kind == "exit") == [0, 1]
    assert any("exit code 0" in m for m in agent.messages)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,reason", [("sigkill", "killed by SIGKILL"), ("exit", "exit code 17")])
def test_crash_is_published_within_a_second(tmp_path, kind, reason):
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 3, "mid_backward", kind)], args=("--steps", "20"))
    assert code == 0, worker_output(tmp_path)  # the survivor finished its steps
    crash = agent.epochs[1]
    assert (crash.epoch, crash.kind, crash.failed, crash.alive) == (2, "crash", (1,), (0,))
    assert reason in crash.reason
    latency = crash.detected_at - first(logs["rank1.0"], "fault")["t"]
    print(f"crash ({kind}) detection latency: {latency * 1000:.1f} ms")
    assert 0 <= latency < 1.0
    assert epochs_seen(logs["rank0.0"]) == [1, 2]  # the survivor's watcher saw it
    seen_at = next(e["t"] for e in logs["rank0.0"] if e["ev"] == "epoch" and e["record"]["epoch"] == 2)
    assert seen_at - crash.detected_at < 0.5
    event = next(e for e in agent.events if e.kind == "crash")
    assert event.rank == 1 and event.epoch == 2 and event.latency_s < 0.5


@pytest.mark.timeout(60)
def test_hang_is_detected_by_heartbeat_and_the_process_killed(tmp_path):
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 3, "in_reduce", "hang")], args=("--steps", "40"))
    assert code == 0, worker_output(tmp_path)
    hang = agent.epochs[1]
    assert (hang.epoch, hang.kind, hang.failed, hang.alive) == (2, "hang", (1,), (0,))
    latency = hang.detected_at - first(logs["rank1.0"], "fault")["t"]
    print(f"hang detection latency: {latency:.3f} s (timeout {TIMEOUT} s, interval {INTERVAL} s)")
    assert TIMEOUT - INTERVAL - 0.1 <= latency < TIMEOUT + 1.0
    assert dead(first(logs["rank1.0"], "start")["pid"])
    event = next(e for e in agent.events if e.kind == "hang")
    assert TIMEOUT <= event.latency_s < TIMEOUT + 1.0
    assert 2 in epochs_seen(logs["rank0.0"])


@pytest.mark.timeout(60)
def test_two_failures_make_two_epochs(tmp_path):
    faults = [fault(1, 2, "before_forward", "sigkill"), fault(2, 14, "in_optimizer", "exit")]
    agent, code, logs = run_agent(tmp_path, 3, faults, args=("--steps", "30"))
    assert code == 0, worker_output(tmp_path)
    assert [(r.epoch, r.kind, r.failed, r.alive) for r in agent.epochs] == [
        (1, "start", (), (0, 1, 2)), (2, "crash", (1,), (0, 2)), (3, "crash", (1, 2), (0,))]
    assert epochs_seen(logs["rank0.0"]) == [1, 2, 3]


@pytest.mark.timeout(60)
def test_beyond_tolerance_stops_cleanly_with_exit_code_3(tmp_path):
    """2 stages x 2 pipelines (stage 1 = ranks 2, 3); losing both replicas of stage 1 stops the job."""
    faults = [fault(2, 2, "before_forward", "sigkill"), fault(3, 12, "mid_backward", "sigkill")]
    agent, code, logs = run_agent(tmp_path, 4, faults, args=("--steps", "1000", "--stages", "2"))
    assert code == EXIT_STOPPED == 3, worker_output(tmp_path)
    assert [(r.epoch, r.kind) for r in agent.epochs] == [(1, "start"), (2, "crash"), (3, "stop")]
    stop = agent.epochs[2]
    assert stop.stop and stop.failed == (2, 3) and stop.alive == (0, 1)
    assert "stage 1 lost every replica" in stop.reason and "stage 0" not in stop.reason
    for r in (0, 1):  # the survivors saw the stop, saved and exited 0
        assert (tmp_path / f"saved.{r}").exists()
        assert mb.read_status(agent.store, r) == "saved"
    assert sorted(e.rank for e in agent.events if e.kind == "exit") == [0, 1]
    assert "stage 1 lost every replica" in agent.messages[-1] and "exit code 3" in agent.messages[-1]


@pytest.mark.timeout(60)
def test_failure_before_registration_stops_with_exit_code_1(tmp_path):
    agent, code, logs = run_agent(tmp_path, 2, extra_env={"DSR_TEST_DIE_EARLY": "1"}, args=("--steps", "1000"))
    assert code == EXIT_STARTUP == 1, worker_output(tmp_path)
    assert agent.epochs[-1].stop and "rank 1 failed before it registered" in agent.epochs[-1].reason
    assert (tmp_path / "saved.0").exists()


@pytest.mark.timeout(60)
def test_rejoin_relaunches_the_rank_and_publishes_a_rejoin_epoch(tmp_path):
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 2, "before_forward", "sigkill")],
                                  args=("--steps", "10", "--until_epoch", "3"), rejoin_after_s=0.3)
    assert code == 0, worker_output(tmp_path)
    assert [(r.epoch, r.kind, r.failed, r.alive, r.joining) for r in agent.epochs] == [
        (1, "start", (), (0, 1), ()), (2, "crash", (1,), (0,), ()), (3, "rejoin", (), (0, 1), (1,))]
    start = first(logs["rank1.1"], "start")
    assert start["rejoin"] and start["incarnation"] == 1 and start["env"]["DSR_REJOIN"] == "1"
    assert "fault" not in [e["ev"] for e in logs["rank1.1"]]  # a relaunched rank does not re-fire
    assert first(logs["rank1.1"], "done")["steps"] == 10
    assert epochs_seen(logs["rank0.0"]) == [1, 2, 3]
    relaunch = next(e for e in agent.events if e.kind == "relaunch")
    crash = next(e for e in agent.events if e.kind == "crash")
    assert relaunch.time - crash.time >= 0.3 - 0.05
    assert mb.read_worker(agent.store, 1, secret=agent.secret).incarnation == 1
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "relaunch", "register", "rejoin", "exit"]
    register, rejoin = (next(e for e in agent.events if e.kind == k) for k in ("register", "rejoin"))
    assert register.epoch == rejoin.epoch == 3 and rejoin.latency_s >= register.latency_s
    exit_ = [e for e in agent.events if e.rank == 1][-1]
    assert "admitted" in rejoin.detail and exit_.detail == "exit code 0"


@pytest.mark.timeout(60)
def test_relaunches_that_die_before_rejoining_are_retried_then_given_up(tmp_path):
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 2, "before_forward", "sigkill")], args=("--steps", "40"),
                                  extra_env={"DSR_TEST_DIE_IF_REJOIN": "1"}, rejoin_after_s=0.1, max_join_attempts=2)
    assert code == 0, worker_output(tmp_path)
    assert [r.kind for r in agent.epochs] == ["start", "crash"]  # membership never changed back
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "relaunch", "exit", "relaunch", "exit", "giveup"]


@pytest.mark.timeout(60)
def test_a_relaunch_due_after_training_ended_is_dropped(tmp_path):
    """Rank 0 finishes its 6 steps before rank 1's relaunch is due: the relaunch is dropped, the
    job exits 0 (a late joiner would wait for a donor that has left)."""
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 1, "before_forward", "sigkill")], args=("--steps", "6"),
                                  rejoin_after_s=5.0)
    assert code == 0, worker_output(tmp_path)
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "cancel"]
    assert "rank1.1" not in logs and first(logs["rank0.0"], "done")["steps"] == 6


@pytest.mark.timeout(60)
def test_a_relaunched_worker_still_starting_when_training_ends_is_stopped(tmp_path):
    """The relaunch happens, but rank 0 finishes while the new rank 1 is still starting (it never
    registers): it is stopped, not retried, and the job exits 0."""
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 1, "before_forward", "sigkill")],
                                  args=("--steps", "20", "--step_s", "0.1"), rejoin_after_s=0.1,
                                  extra_env={"DSR_TEST_START_DELAY_IF_REJOIN": "30"})
    assert code == 0, worker_output(tmp_path)
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "relaunch", "cancel"]
    assert [r.kind for r in agent.epochs] == ["start", "crash"]
    assert first(logs["rank0.0"], "done")["steps"] == 20


@pytest.mark.timeout(60)
def test_a_relaunched_worker_registered_but_not_admitted_when_training_ends_exits_0(tmp_path):
    """The relaunched rank 1 registers (the agent publishes its re-join epoch) but the survivor
    runs its last step without admitting it: the agent says training is over and the joiner's
    wait for its peers gives up at once and exits 0 (before, it waited out the store timeout,
    30 s here, and exited 1: a crash at the end of a finished job)."""
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 1, "before_forward", "sigkill")],
                                  args=("--steps", "30", "--step_s", "0.1"), rejoin_after_s=0.1,
                                  extra_env={"DSR_TEST_JOINER_WAITS": "1"})
    assert code == 0, worker_output(tmp_path)
    assert [r.kind for r in agent.epochs] == ["start", "crash", "rejoin"]
    # registered (the re-join epoch was published) but never admitted: no rejoin in the event table
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "relaunch", "register", "exit"]
    assert "never admitted" in [e for e in agent.events if e.rank == 1][-1].detail
    assert mb.admitted(agent.store, 1) is None
    assert first(logs["rank1.1"], "joining")["joining"]
    over = first(logs["rank1.1"], "training_over")
    done = first(logs["rank0.0"], "done")
    assert "rank 0 finished training" in over["why"] and done["steps"] == 30
    assert over["t"] - done["t"] < 5.0  # released by the agent's word, not by the store timeout
    assert mb.training_over(agent.store) == "rank 0 finished training"


@pytest.mark.timeout(60)
def test_after_the_survivors_regrid_no_rank_is_relaunched_and_a_starting_relaunch_is_stopped(tmp_path):
    """A relaunched worker would join the first grid, which a re-grid replaced (measured with
    DeepSpeed: each relaunch died with "re-joining rank 3 has no surviving peer in stage 1" and was
    relaunched again). Rank 1 dies at step 1 and is relaunched (slowly starting); rank 0 announces
    a re-grid at step 5: the relaunch is stopped and not retried, and the job exits 0."""
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 1, "before_forward", "sigkill")],
                                  args=("--steps", "30", "--step_s", "0.1"), rejoin_after_s=0.1, regrid=True,
                                  extra_env={"DSR_TEST_START_DELAY_IF_REJOIN": "30", "DSR_TEST_REGRID_AT_STEP": "5"})
    assert code == 0, worker_output(tmp_path)
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash", "relaunch", "cancel"]
    cancel = next(e for e in agent.events if e.kind == "cancel")
    assert "re-form the grid" in cancel.detail and cancel.time >= first(logs["rank0.0"], "regrid")["t"]
    assert [r.kind for r in agent.epochs] == ["start", "crash"]
    assert first(logs["rank0.0"], "done")["steps"] == 30


@pytest.mark.timeout(60)
def test_a_stage_lost_under_regrid_schedules_no_relaunch(tmp_path):
    """One replica per stage (2 stages of 1): rank 1's death loses stage 1; under ``regrid`` the
    survivors re-form the grid, so the agent relaunches nobody, although ``rejoin_after_s`` is set."""
    agent, code, logs = run_agent(tmp_path, 2, [fault(1, 2, "before_forward", "sigkill")],
                                  args=("--steps", "20", "--stages", "2"), rejoin_after_s=0.1, regrid=True)
    assert code == 0, worker_output(tmp_path)
    assert [e.kind for e in agent.events if e.rank == 1] == ["crash"]
    assert any("the survivors re-form the grid" in m for m in agent.messages)
    assert "rank1.1" not in logs and first(logs["rank0.0"], "done")["steps"] == 20


# --- the CLI and the agent's own death -----------------------------------------------------------
def _free_port() -> int:
    from dist_harness import free_port

    return free_port()  # below the ephemeral range: see there


def _cli_agent(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, list[int]]:
    """`ds-resilience run` in a subprocess with 2 long-running workers; returns it and their pids."""
    code = "import sys; from ds_resilience.supervisor.cli import main_run; sys.exit(main_run(sys.argv[1:]))"
    env = {**os.environ, "DSR_TEST_OUT": str(tmp_path), **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", code, "--num_gpus", "2", "--master_port", str(_free_port()),
                             "--heartbeat_interval", "0.1", "--heartbeat_timeout", "2", *extra, str(WORKER), "--steps",
                             "2000"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        logs = read_logs(tmp_path)
        if all(f"rank{r}.0" in logs and epochs_seen(logs[f"rank{r}.0"]) for r in (0, 1)):
            return proc, [first(logs[f"rank{r}.0"], "start")["pid"] for r in (0, 1)]
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("workers did not start")


@pytest.mark.timeout(60)
def test_sigterm_to_the_agent_stops_gracefully_then_kills_what_is_left_after_the_grace(tmp_path):
    """SIGTERM publishes an interrupt epoch (the engines save and exit: tests/live/test_graceful_stop.py);
    workers that do not stop are killed after --term_grace_s."""
    proc, pids = _cli_agent(tmp_path, "--term_grace_s", "1", env={"DSR_TEST_IGNORE_INTERRUPT": "1"})
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM
    assert all(dead(pid) for pid in pids)
    err = proc.stderr.read().decode()
    assert "epoch 2 (interrupt): interrupted by SIGTERM" in err, err
    assert "2 worker(s) did not exit within 1 s and were killed" in err and "no checkpoint was saved" in err, err


@pytest.mark.timeout(60)
def test_workers_that_stop_on_the_interrupt_exit_on_their_own(tmp_path):
    proc, pids = _cli_agent(tmp_path, "--term_grace_s", "300")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM  # not the 300 s grace: they exited
    assert all(dead(pid) for pid in pids)
    logs = read_logs(tmp_path)
    for r in (0, 1):
        assert any(e["ev"] == "saved" for e in logs[f"rank{r}.0"]), logs[f"rank{r}.0"][-3:]
    assert "did not exit" not in proc.stderr.read().decode()


@pytest.mark.timeout(60)
def test_a_second_sigterm_kills_at_once(tmp_path):
    proc, pids = _cli_agent(tmp_path, "--term_grace_s", "300", env={"DSR_TEST_IGNORE_INTERRUPT": "1"})
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the interrupt epoch is out; the workers ignore it
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 128 + signal.SIGTERM  # long before the 300 s grace
    assert all(dead(pid) for pid in pids)
    assert "interrupted by SIGTERM again; workers killed" in proc.stderr.read().decode()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("named", [False, True])
def test_workers_exit_when_the_agent_is_sigkilled_and_the_next_agent_reclaims_its_host_memory(tmp_path, named):
    """A SIGKILLed agent cannot clean up. Its workers exit; its host memory is reclaimed by the next
    agent of the machine if the job cannot be started again (an id of its own), or, for a named
    job, kept by another job's agent and taken by the job's own next agent (whose workers resume
    from it, tests/live/test_graceful_stop.py), which removes it when it exits."""
    from ds_resilience.launch import DEFAULT_HOST_DIR

    job = f"killed-agent-{os.getpid()}"
    proc, pids = _cli_agent(tmp_path, *(("--job_id", job) if named else ()), env={"DSR_JOB_ID": ""})
    if named:
        root = Path(DEFAULT_HOST_DIR) / job
    else:  # an id of its own, which nobody can start again: found by its agent's record
        root = next(d for d in Path(DEFAULT_HOST_DIR).iterdir() if (d / "agent.json").exists()
                    and json.loads((d / "agent.json").read_text())["pid"] == proc.pid)
    (root / "rank0").mkdir(parents=True, exist_ok=True)  # what its workers' snapshots would hold
    (root / "rank0" / "snapshot").write_bytes(b"x" * 4096)
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not all(dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(dead(pid) for pid in pids), "orphaned workers outlived their agent"
    assert (root / "rank0" / "snapshot").exists()  # nobody cleaned up after the SIGKILL
    out = tmp_path / "next"
    out.mkdir()
    proc, _ = _cli_agent(out, "--term_grace_s", "0", env={"DSR_JOB_ID": ""})  # another job's agent
    try:
        assert root.exists() == named
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    said = proc.stderr.read().decode()
    if named:  # kept: the job's own next agent takes it
        assert f"removed {root}" not in said, said
    else:  # reclaimed by the machine's next agent: this one, which says so, or another test's agent
        # that started meanwhile (the live tier runs two files at once: seen with test_rejoin_live.py)
        assert not root.exists(), said
    if named:
        again = tmp_path / "again"
        again.mkdir()
        proc, _ = _cli_agent(again, "--job_id", job, "--term_grace_s", "0")
        try:
            assert (root / "rank0" / "snapshot").exists()  # kept for this run's workers
            assert json.loads((root / "agent.json").read_text())["pid"] == proc.pid  # and taken by its agent
        finally:
            proc.send_signal(signal.SIGTERM)  # stopped again without a checkpoint: still the only copy
            proc.wait(timeout=20)
        assert "kept for this run to resume from" in proc.stderr.read().decode()
        shutil.rmtree(root)  # (a run that ends removes it: tests/live/test_graceful_stop.py)


def test_main_run_reads_the_detector_section_and_flags_override(tmp_path, monkeypatch):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 4, "resilience": {"detector": {
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "store_timeout_s": 12.0}}}))
    seen: list[Agent] = []
    monkeypatch.setattr(agent_mod.Agent, "run", lambda self: seen.append(self) or 0)
    assert main_run(["--num_gpus", "3", str(WORKER), "--deepspeed_config", str(cfg), "--x", "1"]) == 0
    a = seen[-1]
    assert (a.num_workers, a.heartbeat_interval_s, a.heartbeat_timeout_s, a.store_timeout_s) == (3, 0.2, 3.0, 12.0)
    assert a.script_args == ("--deepspeed_config", str(cfg), "--x", "1") and a.rejoin_after_s is None
    assert main_run(["--num_gpus", "2", "--heartbeat_timeout", "9", "--rejoin_after", "1.5", str(WORKER),
                     f"--deepspeed_config={cfg}"]) == 0
    assert (seen[-1].heartbeat_interval_s, seen[-1].heartbeat_timeout_s, seen[-1].rejoin_after_s) == (0.2, 9.0, 1.5)
    assert main_run(["--num_gpus", "2", str(WORKER)]) == 0
    assert (seen[-1].heartbeat_interval_s, seen[-1].heartbeat_timeout_s) == (0.5, 5.0)
    assert main_run(["--num_gpus", "2", "--heartbeat_interval", "2", "--heartbeat_timeout", "1", str(WORKER)]) == 2
    assert main_run(["--num_gpus", "2", str(tmp_path / "missing.py")]) == 2


def test_agent_reports_a_taken_port(tmp_path):
    taken = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = Agent(WORKER, num_workers=1, master_port=taken.port, echo=lambda m: None)
    with pytest.raises(AgentError, match="cannot host the store"):
        agent.run()


def test_the_agent_reads_a_megatron_scripts_resilience_config(tmp_path):
    """`ds-resilience run ... pretrain_gpt.py --resilience-config F`: the agent takes its restart
    budget and heartbeat settings from F (the section alone, or a DeepSpeed config holding it), as
    it does from DeepSpeed's --deepspeed_config; without either it keeps its defaults."""
    alone = tmp_path / "section.json"
    alone.write_text(json.dumps({"checkpoint": {"max_restarts": 0}, "detector": {"heartbeat_interval_s": 0.2}}))
    wrapped = tmp_path / "ds.json"
    wrapped.write_text(json.dumps({"train_batch_size": 8, "resilience": {"checkpoint": {"max_restarts": 2}}}))
    read = agent_cli._script_resilience
    assert read(["--num-layers", "4", "--resilience-config", str(alone)]).checkpoint.max_restarts == 0
    assert read([f"--resilience-config={alone}"]).detector.heartbeat_interval_s == 0.2
    assert read(["--resilience-config", str(wrapped)]).checkpoint.max_restarts == 2
    assert read(["--deepspeed_config", str(wrapped)]).checkpoint.max_restarts == 2
    assert read(["--resilience"]) is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"checkpoint": {"max_restarts": -1}}))
    with pytest.raises(ConfigError, match="max_restarts"):
        read(["--resilience-config", str(bad)])


def test_after_a_regrid_the_agent_judges_failures_on_the_newest_grids_registrations(tmp_path):
    """The ranks lost before a re-grid keep their old registrations; only the newest grid's count."""
    script = tmp_path / "train.py"
    script.write_text("")
    agent = Agent(script, num_workers=6, regrid=True)
    agent.store = dist.HashStore()
    old = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 2), 5: (1, 2)}  # rank -> (pipeline, stage), 2 x 3
    for rank, (p, s) in old.items():
        mb.register_worker(agent.store, mb.WorkerInfo(rank=rank, pipeline=p, stage=s, pid=1, dp=2, pp=3),
                           secret=agent.secret)
    agent._failed = {2, 3}
    assert "stage 1 lost every replica" in agent._beyond_tolerance()[1]
    new = {0: (0, 0), 1: (1, 0), 4: (0, 1), 5: (1, 1)}  # the survivors re-formed 2 x 2
    for rank, (p, s) in new.items():
        mb.register_worker(agent.store, mb.WorkerInfo(rank=rank, pipeline=p, stage=s, pid=1, dp=2, pp=2, grid=1),
                           secret=agent.secret)
    assert agent._beyond_tolerance()[1] == ""  # stage 1 of the new grid is ranks 4 and 5
    agent._failed = {2, 3, 4}
    assert agent._beyond_tolerance()[1] == ""
    agent._failed = {2, 3, 4, 5}
    assert "stage 1 lost every replica" in agent._beyond_tolerance()[1]


@pytest.mark.timeout(90)
def test_membership_records_not_signed_by_the_agent_are_ignored(tmp_path):
    """The store has no authentication: a rogue client on its port writes a stop epoch 2 that names
    rank 1 failed, points ``latest`` at it, and overwrites rank 1's registration. The records are
    sealed with the job's secret (the agent makes one for a one-node job and gives it to its
    workers in their environment): the workers ignore the forged epoch, log it once, and train to
    the end; the agent reads the forged registration as absent; the job ends normally."""
    from datetime import timedelta

    from ds_resilience import store_keys as keys

    forged: list[str] = []

    def rogue(agent: Agent) -> None:
        deadline = time.monotonic() + 30
        while agent.store is None or not agent.store.check([keys.worker(1)]):
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        client = dist.TCPStore("127.0.0.1", agent.port, is_master=False, timeout=timedelta(seconds=10))
        record = mb.EpochRecord(epoch=2, failed=(1,), alive=(0,), stop=True, reason="forged", kind="stop",
                                detected_at=time.time())
        client.set(keys.epoch(2), record.to_json())
        client.set(keys.LATEST_EPOCH, "2")
        client.set(keys.worker(1), mb.WorkerInfo(rank=1, pipeline=0, stage=0, pid=1).to_json())
        forged.append("done")

    messages: list[str] = []
    agent = Agent(WORKER, ["--steps", "60"], num_workers=2, env={"DSR_TEST_OUT": str(tmp_path), "DSR_FAULTS": "[]"},
                  heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=TIMEOUT, log_dir=tmp_path / "logs",
                  echo=messages.append, stop_grace_s=30.0)
    thread = threading.Thread(target=rogue, args=(agent,), daemon=True)
    thread.start()
    code = agent.run()
    thread.join(5)
    logs = read_logs(tmp_path)
    assert forged and code == 0, worker_output(tmp_path)
    for r in (0, 1):
        assert epochs_seen(logs[f"rank{r}.0"]) == [1], logs  # the forged stop epoch was never applied
        assert first(logs[f"rank{r}.0"], "done")["steps"] == 60
        assert not (tmp_path / f"saved.{r}").exists()
    out = worker_output(tmp_path)
    assert out.count("ignored a membership record not signed with the job's secret (dsr/epoch/2") == 2, out
    assert mb.read_worker(agent.store, 1, secret=agent.secret) is None  # the forged registration reads as absent
    assert mb.latest_epoch(agent.store, secret=agent.secret) == 1  # the forged pointer gives way to epoch 1
    assert [e.kind for e in agent.events if e.kind in ("crash", "hang", "stop")] == []
