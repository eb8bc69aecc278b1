"""Two nodes on loopback: node 0's agent leads (store, membership), node 1's follower launches its
ranks on request (supervisor/nodes.py). Two `ds-resilience run` processes, the example GPT with
PP=2 x DP=2 (2 ranks per node), and failures on node 1 that only the leader can see."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_live import REPO, SCRIPT, STEPS, _config, assert_equal_to_reference, reference4  # noqa: F401


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_nodes(tmp: Path, cfg: Path, dump: Path, *, timeout_s: float = 400.0):
    port = _free_port()
    common = ["--nnodes", "2", "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
              "--heartbeat_interval", "0.2", "--heartbeat_timeout", "4.0"]
    script = [str(SCRIPT), "--deepspeed_config", str(cfg), "--steps", str(STEPS), "--dump", str(dump)]
    from ds_resilience.supervisor.job_secret import SECRET_VAR, new_secret

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
    from ds_resilience.supervisor.job_secret import SECRET_VAR, new_secret, seal, unseal

    secret = new_secret()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    worker = tmp_path / "worker.py"
    worker.write_text("import os, sys\n"
                      "name = 'rank%s.preload=%s' % (os.environ['RANK'], os.environ.get('LD_PRELOAD'))\n"
                      "open(os.path.join(sys.argv[1], name), 'w').close()\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, SECRET_VAR: secret, "PYTHONPATH": str(REPO)}
    follower = subprocess.Popen([sys.executable, "-m", "ds_resilience.cli", "run", "--nnodes", "2", "--node_rank", "1",
                                 "--num_gpus", "2", "--master_port", str(store.port), "--no_local_rank", "--preload", "",
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
