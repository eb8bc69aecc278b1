"""How the agent starts a worker (ds_resilience/supervisor/spawn.py): a fresh interpreter, or a fork of
the pre-imported server. Both must look the same to the script and to the agent: arguments,
environment, ``__main__``, ``sys.path[0]``, output file, exit code (a negative code for a signal),
``atexit`` handlers, non-daemon threads joined, and a forked worker that does not keep the fork
server (and so itself) alive after its agent is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ds_resilience.supervisor.spawn import preload_modules, start_worker

PRELOADED = ("json", "torch")  # a fork server of its own list would clash with the suite's: use DSR_PRELOAD's
SCRIPT = '''
import atexit, json, os, sys, threading, time
out = os.environ["SPAWN_OUT"]
mode = sys.argv[1]
info = {"argv": sys.argv, "name": __name__, "path0": sys.path[0], "env": os.environ.get("SPAWN_MARK"),
        "leak": os.environ.get("SPAWN_NOT_PASSED"), "pid": os.getpid()}
import multiprocessing
info["start_method"] = multiprocessing.get_start_method()
with open(out + ".json", "w") as f:
    json.dump(info, f)
print("hello from", mode, flush=True)
atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
def late():
    time.sleep(0.3)
    open(out + ".thread", "w").write("joined")
threading.Thread(target=late).start()
if mode == "exit7":
    sys.exit(7)
if mode == "raise":
    raise RuntimeError("boom in the script")
if mode == "sleep":
    time.sleep(60)
'''


def _modules():
    return preload_modules() or PRELOADED


@pytest.fixture(params=["fresh", "forked"])
def how(request):
    return () if request.param == "fresh" else _modules()


def _start(tmp_path: Path, mode: str, preload):
    script = tmp_path / "scripts" / "job.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    out = tmp_path / mode
    env = {"PATH": os.environ.get("PATH", ""), "SPAWN_OUT": str(out), "SPAWN_MARK": "mine",
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    os.environ["SPAWN_NOT_PASSED"] = "agent's own"
    try:
        proc = start_worker(str(script), [mode, "--local_rank=0"], env=env, log=tmp_path / "logs" / f"{mode}.log",
                            preload=preload)
    finally:
        del os.environ["SPAWN_NOT_PASSED"]
    return proc, out, script


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, code", [("ok", 0), ("exit7", 7), ("raise", 1)])
def test_a_worker_sees_what_a_fresh_interpreter_sees_and_exits_as_it_would(tmp_path, how, mode, code):
    proc, out, script = _start(tmp_path, mode, how)
    assert proc.wait(timeout=90) == code and proc.returncode == code and proc.poll() == code
    info = json.loads(Path(f"{out}.json").read_text())
    assert info["argv"] == [str(script), mode, "--local_rank=0"]
    assert info["name"] == "__main__" and info["path0"] == str(script.parent)
    assert info["env"] == "mine" and info["leak"] is None  # exactly the environment it was given
    assert info["start_method"] == "fork"  # the platform's default, not the agent's fork server
    assert Path(f"{out}.atexit").read_text() == "ran"
    assert Path(f"{out}.thread").read_text() == "joined"
    log = (tmp_path / "logs" / f"{mode}.log").read_text()
    assert f"hello from {mode}" in log
    if mode == "raise":
        assert "RuntimeError: boom in the script" in log


@pytest.mark.timeout(120)
def test_a_killed_worker_reports_the_signal_and_wait_times_out_while_it_runs(tmp_path, how):
    proc, out, _ = _start(tmp_path, "sleep", how)
    deadline = time.monotonic() + 60
    while not Path(f"{out}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_forked_worker_does_not_keep_its_dead_agents_fork_server_alive(tmp_path):
    """The agent is a process of its own here; it forks a sleeping worker, then is SIGKILLed: the
    fork server must exit (so the worker's parent changes and its orphan check fires)."""
    code = f'''
import os, sys, time
from ds_resilience.supervisor.spawn import start_worker
p = start_worker(sys.argv[1], ["sleep"], env={{**os.environ, "SPAWN_OUT": sys.argv[2]}}, log=sys.argv[2] + ".log",
                 preload={list(_modules())!r})
print("PID", p.pid, flush=True)
time.sleep(120)
'''
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    agent = subprocess.Popen([sys.executable, "-c", code, str(script), str(tmp_path / "w")], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    pid = int(next(line for line in agent.stdout if line.startswith("PID")).split()[1])
    server = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the worker's parent
    agent.kill()
    agent.wait(timeout=10)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{server}/stat").read_text() if Path(f"/proc/{server}").exists() else ""
        if stat and stat.rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    try:
        alive = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        alive = False
    os.kill(pid, signal.SIGKILL)
    assert not alive, "the fork server outlived its agent: its worker keeps it open"


def test_the_preload_list_comes_from_the_argument_or_the_environment():
    assert preload_modules("torch, deepspeed,,") == ("torch", "deepspeed")
    assert preload_modules(None, {"DSR_PRELOAD": "a,b"}) == ("a", "b")
    assert preload_modules(None, {}) == ()
    assert preload_modules("", {"DSR_PRELOAD": "a"}) == ()  # an explicit empty list turns it off


def test_a_dead_forked_worker_is_seen_before_its_parent_reaps_it():
    """A forked worker's parent is the fork server, which reaps it and only then reports its exit
    (seconds late on a loaded machine: the agent then took a SIGKILLed worker for hung). Until the
    reap the worker is a zombie, and ``/proc`` holds its status: ``-N`` for signal N, else the code."""
    from ds_resilience.supervisor.spawn import zombie_status

    children = {}
    for name, how in (("sigkill", lambda: os.kill(os.getpid(), signal.SIGKILL)), ("exit3", lambda: os._exit(3)),
                      ("exit0", lambda: os._exit(0))):
        pid = os.fork()
        if pid == 0:
            how()
        children[name] = pid
    running = os.fork()
    if running == 0:
        time.sleep(30)
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(zombie_status(p) is None for p in children.values()):
            time.sleep(0.01)
        assert {n: zombie_status(p) for n, p in children.items()} == {"sigkill": -9, "exit3": 3, "exit0": 0}
        assert zombie_status(running) is None
    finally:
        os.kill(running, signal.SIGKILL)
        for pid in [*children.values(), running]:
            os.waitpid(pid, 0)
    assert zombie_status(running) is None  # reaped: gone from /proc


def test_a_forked_worker_reaped_but_not_yet_reported_is_waited_for_not_taken_for_running():
    """CI run 11: the fork server had reaped a SIGKILLed worker (gone from ``/proc``) but not yet
    reported it, so ``poll()`` said running and the agent took the silent heartbeat for a hang.
    Now ``poll()`` waits (bounded) for the report of a worker that no longer exists."""
    from ds_resilience.supervisor.spawn import _ForkedProc

    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)  # reaped, as the fork server does before it reports

    class Reporting:  # the fork server's report arrives during the wait
        def __init__(self):
            self.pid, self.exitcode, self.joined = pid, None, []

        def is_alive(self):
            return self.exitcode is None

        def join(self, timeout=None):
            self.joined.append(timeout)
            self.exitcode = -9

    late = Reporting()
    assert _ForkedProc(late).poll() == -9
    assert late.joined and late.joined[0] > 0
    running = Reporting()
    running.pid = os.getpid()  # alive: no wait, still running
    assert _ForkedProc(running).poll() is None and running.joined == []


BATON_SCRIPT = '''
import os, sys
if "torch" in sys.modules:  # a forked worker of a server that preloaded torch
    from torch.utils import file_baton
    open(os.environ["SPAWN_OUT"], "w").write(file_baton.FileBaton.wait.__name__)
else:
    open(os.environ["SPAWN_OUT"], "w").write("torch not imported")
'''


@pytest.mark.timeout(120)
def test_a_build_lock_left_by_a_killed_worker_is_removed_before_the_next_starts(tmp_path, how, capfd):
    """A worker SIGKILLed while it held DeepSpeed's JIT op build lock would hang every later load:
    start_worker removes it; a forked worker (torch preloaded) also gives up on one whose holder dies."""
    ext = tmp_path / "ext"
    (ext / "fused_adam").mkdir(parents=True)
    lock = ext / "fused_adam" / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nos.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
                               "print('held', flush=True)\ntime.sleep(60)", str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(10)
    assert lock.exists()
    script = tmp_path / "baton.py"
    script.write_text(BATON_SCRIPT)
    out = tmp_path / "baton.out"
    env = {"PATH": os.environ.get("PATH", ""), "SPAWN_OUT": str(out), "TORCH_EXTENSIONS_DIR": str(ext),
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    proc = start_worker(str(script), [], env=env, log=tmp_path / "baton.log", preload=how)
    assert not lock.exists()
    assert "died holding it" in capfd.readouterr().err
    assert proc.wait(timeout=90) == 0
    assert out.read_text() == ("_stale_aware_wait" if "torch" in how else "torch not imported")
