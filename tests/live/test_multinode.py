"""Several nodes: node 0's agent (or a head's) leads (store, membership), the other nodes' followers
launch their ranks on request (supervisor/nodes.py). Two nodes on loopback for the follower's
protocol and the hostfile launch (the example GPT with PP=2 x DP=2, 2 ranks per node); three nodes
emulated in namespaces (netns_nodes.py: each its own address on a bridge and its own /dev/shm; root
only) for a node lost whole, its replacement, and a head launched through DeepSpeed's pdsh runner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_live import (REPO, SCRIPT, STEPS, TRAINING_DATA, USER_CONFIG, _config, assert_equal_to_reference,  # noqa: F401
                       assert_masters_equal, reference4)


def _free_port() -> int:
    from dist_harness import free_port

    return free_port()  # below the ephemeral range: see there


def _run_two_nodes(tmp: Path, cfg: Path, dump: Path, *, timeout_s: float = 400.0):
    port = _free_port()
    common = ["--nnodes", "2", "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
              "--heartbeat_interval", "0.2", "--heartbeat_timeout", "4.0"]
    script = [str(SCRIPT), "--deepspeed_config", str(cfg), "--steps", str(STEPS), "--dump", str(dump)]
    from ds_resilience.job_secret import SECRET_VAR, new_secret

    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **{k: v for k, v in __import__("os").environ.items()
                                                                if k not in ("PYTHONPATH",)},
           SECRET_VAR: new_secret()}  # the agents of both nodes share it
    cli = [sys.executable, "-m", "ds_resilience.cli", "run"]
    with open(tmp / "leader.log", "wb") as lo, open(tmp / "follower.log", "wb") as fo:
        leader = subprocess.Popen([*cli, *common, "--node_rank", "0", "--log_dir", str(tmp / "logs"), *script],
                                  env=env, stdout=lo, stderr=subprocess.STDOUT, cwd=REPO)
        follower = subprocess.Popen([*cli, *common, "--node_rank", "1", "--log_dir", str(tmp / "logs1"), *script],
                                    env=env, stdout=fo, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            codes = (leader.wait(timeout=timeout_s), follower.wait(timeout=60))
        finally:
            for p in (leader, follower):
                if p.poll() is None:
                    p.kill()
    text = (tmp / "leader.log").read_text(errors="replace") + "\n--- follower\n" + (tmp / "follower.log").read_text(errors="replace")
    dumps = {}
    for r in range(4):
        f = Path(f"{dump}.rank{r}.pt")
        if f.exists():
            dumps[r] = torch.load(f, weights_only=False)
    return codes, text, dumps


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault,seen", [
    # a hang: the leader sees the silence, the follower of node 1 kills the process on its order
    ({"rank": 3, "step": 3, "point": "mid_backward", "kind": "hang"}, "rank 3 hung"),
    # a crash: the follower reports the exit code, the leader publishes the failure
    ({"rank": 2, "step": 4, "point": "before_forward", "kind": "sigkill"}, "rank 2 crashed (killed by SIGKILL)"),
], ids=["hang", "crash"])
def test_a_failure_on_another_node_is_handled_through_its_follower(tmp_path, reference4, fault, seen):
    cfg = _config(tmp_path, dp=2, faults=[fault])
    codes, text, dumps = _run_two_nodes(tmp_path, cfg, tmp_path / "job")
    assert codes == (0, 0), text
    assert seen in text and f"[ds_resilience node 1] launched rank {fault['rank']}" in text, text
    assert_equal_to_reference(dumps, reference4, dead=[fault["rank"]])
    # LOCAL_RANK is the rank's place on its node: ranks 0, 1 on node 0 and 2, 3 on node 1
    assert {r: d["local_rank"] for r, d in dumps.items()} == {r: r % 2 for r in dumps}


def test_node_arguments_are_checked(tmp_path):
    from ds_resilience.supervisor.agent import Agent, AgentError
    from ds_resilience.supervisor.cli import main_run

    with pytest.raises(AgentError, match="nnodes > 1 the store needs a fixed --master_port"):
        Agent(SCRIPT, num_workers=2, nnodes=2)
    with pytest.raises(AgentError, match="needs a secret shared by its agents"):
        Agent(SCRIPT, num_workers=2, nnodes=2, master_port=1234)
    assert main_run(["--nnodes", "2", "--node_rank", "2", "--master_port", "1234", str(SCRIPT)]) == 2


@pytest.mark.timeout(120)
def test_a_follower_launches_only_what_the_jobs_agents_signed(tmp_path):
    """A rogue client on the store's port (it has no authentication) asks node 1's follower for
    workers: unsigned with ``LD_PRELOAD``, signed with another job's secret, and signed with the
    job's but setting ``LD_PRELOAD``. Each is refused and logged; the leader's signed request
    launches its worker; the follower's exit report is signed; a signed end stops it."""
    import json
    import os
    import time

    import torch.distributed as dist

    from ds_resilience import store_keys as keys
    from ds_resilience.job_secret import SECRET_VAR, new_secret, seal, unseal
    from ds_resilience.supervisor.nodes import job_description

    secret = new_secret()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys\n"
                      "name = 'rank%s.preload=%s' % (os.environ['RANK'], os.environ.get('LD_PRELOAD'))\n"
                      "open(os.path.join(sys.argv[1], name), 'w').close()\n")
    out = tmp_path / "out"
    out.mkdir()
    # what the leader runs (the follower checks its own command against it)
    store.set(keys.NODES_JOB, seal(secret, keys.NODES_JOB, job_description(str(worker), [str(out)], 2)))
    env = {**os.environ, SECRET_VAR: secret, "PYTHONPATH": str(REPO)}
    follower = subprocess.Popen([sys.executable, "-m", "ds_resilience.cli", "run", "--nnodes", "2", "--node_rank", "1",
                                 "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(store.port),
                                 "--no_local_rank", "--preload", "",
                                 str(worker), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def request(i: int, body: dict, sign_with: str | None) -> None:
        key = keys.node_launch(1, i)
        value = json.dumps(body)
        store.set(key, seal(sign_with, key, value) if sign_with else value)
        store.add(keys.node_launches(1), 1)

    evil = {"rank": 9, "incarnation": 0, "local_rank": 0, "env": {"RANK": "9", "LD_PRELOAD": "/tmp/evil.so"}}
    try:
        request(0, evil, None)
        request(1, evil, new_secret())
        request(2, evil, secret)
        request(3, {"rank": 2, "incarnation": 0, "local_rank": 0, "env": {"RANK": "2", "DSR_AGENT": "0"}}, secret)
        exit_key = keys.node_exit(2, 0)
        deadline = time.monotonic() + 60
        while not store.check([exit_key]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert unseal(secret, exit_key, store.get(exit_key)) == "0"  # the follower's report is signed
        store.set(keys.NODES_DONE, "0")  # an unsigned end is not obeyed
        time.sleep(1.0)
        assert follower.poll() is None
        store.set(keys.NODES_DONE, seal(secret, keys.NODES_DONE, "0"))
        text = follower.communicate(timeout=30)[0]
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, text
    assert sorted(p.name for p in out.iterdir()) == ["rank2.preload=None"], text  # only the signed worker ran
    assert "refused launch request 0 not signed with the job's secret" in text, text
    assert "refused launch request 1 not signed with the job's secret" in text, text
    assert "refused launch request 2: it sets LD_PRELOAD; a request may set only the launch contract" in text, text
    assert "refused an end not signed" in text, text


@pytest.mark.timeout(120)
def test_a_follower_started_with_another_job_than_the_leaders_refuses_to_run(tmp_path):
    """Every node runs the leader's script, arguments and workers per node: a follower given other
    arguments, or another --num_gpus, says which and exits 2 without launching anything."""
    import os

    import torch.distributed as dist

    from ds_resilience import store_keys as keys
    from ds_resilience.job_secret import SECRET_VAR, new_secret, seal
    from ds_resilience.supervisor.nodes import job_description

    secret = new_secret()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(keys.NODES_JOB, seal(secret, keys.NODES_JOB, job_description(str(SCRIPT), ["--steps", "8"], 2)))
    env = {**os.environ, SECRET_VAR: secret, "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "ds_resilience.cli", "run", "--nnodes", "2", "--node_rank", "1", "--master_addr",
            "127.0.0.1", "--master_port", str(store.port)]
    for extra, said in ((["--num_gpus", "2", str(SCRIPT), "--steps", "9"], "args: the leader's ['--steps', '8'], "
                                                                           "this node's ['--steps', '9']"),
                        (["--num_gpus", "3", str(SCRIPT), "--steps", "8"], "nproc: the leader's 2, this node's 3")):
        done = subprocess.run([*base, *extra], env=env, capture_output=True, text=True, timeout=90)
        assert done.returncode == 2, done.stderr
        assert "was started with another job than the leader's" in done.stderr and said in done.stderr, done.stderr
        assert "launched rank" not in done.stderr


def test_the_store_listens_only_on_the_address_of_master_addr():
    from ds_resilience.supervisor.agent import _listen

    sock = _listen("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()  # another address of the machine
    finally:
        sock.close()


@pytest.mark.timeout(600)
def test_a_hostfile_job_starts_one_agent_per_node_through_pdsh_and_survives_a_crash(tmp_path, reference4):
    """``ds-resilience run --hostfile`` as a DeepSpeed user launches: DeepSpeed's pdsh runner
    starts one agent per host of the hostfile (pdsh here runs each host's command on this machine,
    tests/live/cluster_bin/pdsh), node 0's leads, node 1's launches ranks 2 and 3, and a crash of
    rank 2 is recovered: the run ends equal to the fault-free one."""
    import os
    import re

    fault = {"rank": 2, "step": 4, "point": "mid_backward", "kind": "sigkill"}
    cfg = _config(tmp_path, dp=2, faults=[fault])
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    dump = tmp_path / "job"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(__file__).parent / 'cluster_bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DSR_JOB_SECRET", None)  # the launcher makes the job's secret
    done = subprocess.run([sys.executable, "-m", "ds_resilience.cli", "run", "--hostfile", str(hostfile),
                           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "--heartbeat_interval", "0.2",
                           "--heartbeat_timeout", "4.0", "--log_dir", str(tmp_path / "logs"), str(SCRIPT),
                           "--deepspeed_config", str(cfg), "--steps", str(STEPS), "--dump", str(dump)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    launch = next(line for line in out.splitlines() if line.startswith("[ds_resilience launcher] pdsh"))
    assert "-w node-a,node-b" in launch and "--node_rank %n" in launch and "--nnodes 2" in launch, launch
    secret_file = re.search(r"--secret_file (\S+)", launch).group(1)
    assert os.stat(secret_file).st_mode & 0o777 == 0o600
    assert re.search(r"^node-b: \[ds_resilience node 1\] launched rank 2 \(incarnation 0", out, re.M), out
    assert re.search(r"^node-a: .*rank 2 crashed \(killed by SIGKILL\)", out, re.M), out
    dumps = {r: torch.load(Path(f"{dump}.rank{r}.pt"), weights_only=False) for r in range(4)
             if Path(f"{dump}.rank{r}.pt").exists()}
    assert_equal_to_reference(dumps, reference4, dead=[2])


NODE_STEPS = 40  # paced at 0.5 s a step: time for a node to die, be declared lost, and be replaced


@pytest.fixture(scope="module")
def reference6(tmp_path_factory):
    """The fault-free run of PP=2 x DP=3 on one node (6 ranks), NODE_STEPS steps, in the user's
    configuration: DeepSpeed's ``"Adam"``, clipping 1.0, bf16 with fp32 masters, ``training_data``."""
    from test_live import logs, run_job

    tmp = tmp_path_factory.mktemp("ref6")
    code, _, dumps = run_job(tmp, world=6, name="ref", steps=NODE_STEPS, extra=TRAINING_DATA, deepspeed=USER_CONFIG)
    assert code == 0, logs(tmp, "ref")
    return dumps


HOSTS = ["node-a", "node-b", "node-c"]


def _hostfile(tmp: Path) -> Path:
    """A hostfile of the three emulated nodes, 2 slots each."""
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in HOSTS))
    return hostfile


def _pdsh_env(nodes) -> dict:
    """The launcher's environment: the stand-in pdsh first on PATH, mapping HOSTS to ``nodes``; no
    job secret (the launcher makes one)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **nodes.pdsh_env(HOSTS),
           "PATH": f"{Path(__file__).parent / 'cluster_bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("DSR_JOB_SECRET", None)
    return env


def _wait_for_step(log: Path, step: int, procs, text, timeout_s: float = 240.0) -> None:
    import re
    import time

    deadline = time.monotonic() + timeout_s
    while not (log.exists() and re.search(rf"^step +{step} loss", log.read_text(errors="replace"), re.M)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), text()
        time.sleep(0.1)


def _dumps(dump: Path, world: int) -> dict:
    return {r: torch.load(Path(f"{dump}.rank{r}.pt"), weights_only=False) for r in range(world)
            if Path(f"{dump}.rank{r}.pt").exists()}


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="nodes are emulated in network and mount namespaces: needs root")
def test_a_node_lost_whole_is_one_event_and_a_replacement_node_takes_its_ranks_back(tmp_path, reference6):
    """Three nodes emulated in namespaces (each its own address and /dev/shm), 2 ranks each,
    PP=2 x DP=3 (stage 0: ranks 0-2, stage 1: ranks 3-5), launched with ``--hostfile`` through
    DeepSpeed's pdsh runner; node 0's agent leads. Node 2 (its follower agent and ranks 4 and 5,
    two of stage 1's three replicas) is lost whole while rank 4 is mid-backward (stopped there):
    every process in it SIGKILLed, its host memory gone. Nobody is left to report its ranks'
    exits: the leader names both at once from the follower's silence (one epoch), and the
    survivors re-route their micro-batches through rank 3. A replacement agent started by hand on a
    fresh node 2 (an empty /dev/shm) with --node_rank 2 and the launcher's secret file waits,
    silent, for the loss to be declared, then launches the relaunched ranks, which re-join from
    their peers: the run ends with the fault-free run's masters."""
    import re
    import shlex
    import time

    from netns_nodes import NetnsNodes, wrap_command

    fault = {"rank": 4, "step": 3, "point": "mid_backward", "kind": "hang"}  # stopped: the node dies mid-backward
    cfg = _config(tmp_path, dp=3, faults=[fault], resilience={"max_failures": 2},  # a node holds 2 ranks
                  deepspeed=USER_CONFIG)
    hostfile = _hostfile(tmp_path)
    dump = tmp_path / "job"
    port = _free_port()
    # 1 s a step: the relaunched ranks' fresh interpreters import torch and DeepSpeed, load FusedAdam
    # and fetch bf16 masters and Adam moments from their peers before training ends (20 s under CI's load)
    script = [str(SCRIPT), "--deepspeed_config", str(cfg), "--steps", str(NODE_STEPS), "--dump", str(dump),
              "--min-step-seconds", "1.0", *TRAINING_DATA]
    timing = ["--heartbeat_interval", "0.2", "--heartbeat_timeout", "4.0", "--rejoin_after", "0.5"]
    logs = {"launcher": tmp_path / "launcher.log", "replacement": tmp_path / "replacement.log"}

    def text() -> str:
        return "\n".join(f"--- {n}\n" + f.read_text(errors="replace") for n, f in logs.items() if f.exists())

    def stopped(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (FileNotFoundError, ProcessLookupError):
            return False

    procs: list[subprocess.Popen] = []
    with NetnsNodes(3) as nodes:
        env = _pdsh_env(nodes)
        try:
            with open(logs["launcher"], "wb") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ds_resilience.cli", "run", "--hostfile", str(hostfile), "--master_addr",
                     nodes.addr(0), "--master_port", str(port), *timing, "--log_dir", str(tmp_path / "logs"), *script],
                    env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
            deadline = time.monotonic() + 240
            while not any(stopped(pid) for pid in nodes.pids(2)):  # rank 4 stopped itself mid-backward
                assert time.monotonic() < deadline and procs[0].poll() is None, text()
                time.sleep(0.05)
            nodes.kill(2)  # the node: its agent, its fork server, its workers, its /dev/shm
            launch = next(x for x in text().splitlines() if x.startswith("[ds_resilience launcher] pdsh"))
            secret_file = re.search(r"--secret_file (\S+)", launch).group(1)
            cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--nnodes", "3", "--node_rank", "2", "--num_gpus",
                   "2", "--master_addr", nodes.addr(0), "--master_port", str(port), "--secret_file", secret_file,
                   *timing, "--log_dir", str(tmp_path / "logs-replacement"), *script]
            with open(logs["replacement"], "wb") as out:  # a fresh node in its place: an empty /dev/shm
                procs.append(subprocess.Popen(
                    wrap_command(nodes.netns[2], nodes.ifname[2], f"cd {REPO} && {shlex.join(cmd)}"),
                    env={k: v for k, v in env.items() if k != "PDSH_NETNS"}, stdout=out, stderr=subprocess.STDOUT,
                    cwd=REPO, start_new_session=True))
            assert procs[0].wait(timeout=400) == 0, text()
            assert procs[1].wait(timeout=60) == 0, text()
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    out = text()
    assert "-w node-a,node-b,node-c" in out and f"[ds_resilience node 1] connected to {nodes.addr(0)}:" in out, out
    assert re.search(r"node 2 lost whole \(its agent silent for [\d.]+ s\): ranks 4, 5 at once", out), out
    epochs = {int(m.group(2)) for m in re.finditer(r"^node-a: \s*[\d.]+s\s+node\s+([45])\s+(\d+)", out, re.M)}
    assert len(epochs) == 1, out  # both ranks failed in one epoch
    assert "rank 4 hung" not in out and "rank 5 hung" not in out, out  # not found one at a time
    assert "waiting for the leader to declare it lost" in out and "replaces node 2" in out, out
    assert "node 2 beats again" in out, out
    assert re.search(r"launched rank 4 \(incarnation 1", out) and re.search(r"launched rank 5 \(incarnation 1", out), out
    dumps = _dumps(dump, 6)
    for r in (4, 5):
        assert r in dumps and any(x["kind"] == "joined" for x in dumps[r]["recovery"]), out
    assert_masters_equal(dumps, reference6, steps=NODE_STEPS)


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="nodes are emulated in network and mount namespaces: needs root")
def test_with_a_head_node_the_loss_of_node_0_is_survived(tmp_path, reference6):
    """Three nodes emulated in namespaces (tests/live/netns_nodes.py: each its own network namespace
    and address on a bridge, its own /dev/shm), reached by ``ds-resilience run --hostfile --head``
    through DeepSpeed's pdsh runner; this machine is the head (store, membership) and runs no
    worker; every node runs a follower (``--follow``), node 0 included. Node 0 (ranks 0 and 1, two
    of stage 0's three replicas) is lost whole at step 3: every process in it SIGKILLed, its host
    memory gone. The leader, not on it, declares both ranks lost in one event, the survivors
    re-place the snapshot replicas over the two nodes left, and the other four ranks finish the run
    equal to the fault-free one. Without a head, node 0's loss takes the store."""
    import re

    from netns_nodes import NetnsNodes

    cfg = _config(tmp_path, dp=3, resilience={"max_failures": 2}, deepspeed=USER_CONFIG)
    hostfile = _hostfile(tmp_path)
    dump = tmp_path / "job"
    with NetnsNodes(3) as nodes:
        env = _pdsh_env(nodes)
        with open(tmp_path / "launcher.log", "wb") as out:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "ds_resilience.cli", "run", "--hostfile", str(hostfile), "--head",
                 "--master_addr", nodes.head_addr, "--master_port", str(_free_port()), "--heartbeat_interval", "0.2",
                 "--heartbeat_timeout", "4.0", "--log_dir", str(tmp_path / "logs"), str(SCRIPT), "--deepspeed_config",
                 str(cfg), "--steps", str(NODE_STEPS), "--dump", str(dump), "--min-step-seconds", "0.5", *TRAINING_DATA],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def text() -> str:
            return (tmp_path / "launcher.log").read_text(errors="replace")

        try:
            _wait_for_step(tmp_path / "logs" / "rank0.0.log", 3, [launcher], text)
            assert nodes.pids(0), "node 0 runs nothing"
            nodes.kill(0)  # node 0 is lost: its agent, its workers, its /dev/shm
            assert launcher.wait(timeout=400) == 0, text()
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    out = text()
    assert "--follow" in out and "--node_rank %n" in out and f"--master_addr {nodes.head_addr}" in out, out
    assert all(f"[ds_resilience node {k}] connected to {nodes.head_addr}:" in out for k in range(3)), out
    assert re.search(r"^node-a: \[ds_resilience node 0\] launched rank 0 ", out, re.M), out
    assert re.search(r"node 0 lost whole \(its agent silent for [\d.]+ s\): ranks 0, 1 at once", out), out
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("rank*.log"))
    assert "not built" not in logs, logs  # every survivor's replicas were re-placed
    for k in (1, 2):  # the job ended with its checkpoint-free run complete: each node's snapshots go
        assert f"[ds_resilience node {k}] removed the job's snapshots from host memory" in out, out
    assert_masters_equal(_dumps(dump, 6), reference6, dead=[0, 1], steps=NODE_STEPS)


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="nodes are emulated in network and mount namespaces: needs root")
def test_a_stage_lost_whole_restarts_every_node_from_its_own_memory(tmp_path, reference6):
    """Three nodes emulated in namespaces, launched with ``--hostfile`` through DeepSpeed's pdsh
    runner (node 0's agent leads: store and membership). Stage 1 (ranks 3, 4, 5, on nodes 1 and 2)
    loses every replica in one iteration's gradient reduce: beyond tolerance. The leader restarts
    every worker from the in-memory snapshots and keeps its store (same address and port: the
    followers stay connected; the restart's keys, torch's rendezvous included, under
    ``dsr/attempt/1/``). The followers launch the restart's ranks, each restores the newest step held
    for every rank from its own node's memory, and the run ends equal to the fault-free one."""
    import re

    from netns_nodes import NetnsNodes

    faults = [{"rank": r, "step": 3, "point": "in_reduce", "kind": "sigkill"} for r in (3, 4, 5)]
    cfg = _config(tmp_path, dp=3, faults=faults, resilience={"max_failures": 2},
                  checkpoint={"ranks_per_machine": 2, "replicas": 2, "stall_budget": 1.0, "max_restarts": 1,
                              "persistent_dir": None}, deepspeed=USER_CONFIG)
    hostfile = _hostfile(tmp_path)
    dump = tmp_path / "job"
    with NetnsNodes(3) as nodes:
        env = _pdsh_env(nodes)
        with open(tmp_path / "launcher.log", "wb") as out:
            launcher = subprocess.Popen(
                [sys.executable, "-m", "ds_resilience.cli", "run", "--hostfile", str(hostfile),
                 "--master_addr", nodes.addr(0), "--master_port", str(_free_port()), "--heartbeat_interval", "0.2",
                 "--heartbeat_timeout", "4.0", "--stop_grace", "60", "--log_dir", str(tmp_path / "logs"), str(SCRIPT),
                 "--deepspeed_config", str(cfg), "--steps", str(NODE_STEPS), "--dump", str(dump),
                 "--min-step-seconds", "0.25", *TRAINING_DATA],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = launcher.wait(timeout=500)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
    out = (tmp_path / "launcher.log").read_text(errors="replace")
    assert code == 0, out
    assert re.search(r"stage 1 lost every replica", out), out
    port = re.search(rf"store at {re.escape(nodes.addr(0))}:(\d+); launching", out).group(1)
    assert f"store at {nodes.addr(0)}:{port} (attempt 1's keys under dsr/attempt/1/); restart 1" in out, out
    for k in (1, 2):  # the followers took the restart's requests on the store they had
        assert f"[ds_resilience node {k}] restart 1: every worker restarts from the snapshots" in out, out
        assert out.count(f"[ds_resilience node {k}] connected to") == 1, out
    assert re.search(r"^node-c: \[ds_resilience node 2\] launched rank 5 \(incarnation 0, pid \d+, restart 1\)", out, re.M), out
    for k in (1, 2):  # the followers' nodes held the snapshots the restart read: released at the end
        assert f"[ds_resilience node {k}] removed the job's snapshots from host memory" in out, out
    dumps = _dumps(dump, 6)
    for r in range(6):
        restored = [x for x in dumps[r]["recovery"] if x["kind"] == "restored"]
        assert restored and restored[0]["sources"][str(r)] == "local", (r, dumps[r]["recovery"])
    assert_masters_equal(dumps, reference6, steps=NODE_STEPS)
