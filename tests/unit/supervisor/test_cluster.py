"""`ds-resilience run --hostfile`: one agent per node through DeepSpeed's runners, and an agent's
place from SLURM's or Open MPI's environment."""

from __future__ import annotations

import sys

import pytest

from ds_resilience.errors import ResilienceError
from ds_resilience.supervisor.cli import build_parser
from ds_resilience.supervisor.cluster import cluster_command, expand_nodelist, node_from_scheduler


def test_slurm_node_lists_expand_as_scontrol_does():
    assert expand_nodelist("gpu[01-03,07],head") == ["gpu01", "gpu02", "gpu03", "gpu07", "head"]
    assert expand_nodelist("node7") == ["node7"]
    assert expand_nodelist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    with pytest.raises(ResilienceError, match="bad range"):
        expand_nodelist("n[5-2]")


def test_an_agent_finds_its_node_in_srun_or_mpirun():
    srun = {"SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3",
            "SLURM_JOB_NODELIST": "gpu[4-6]"}
    spec = node_from_scheduler(srun)
    assert (spec.nnodes, spec.node_rank, spec.master_addr, spec.source) == (3, 2, "gpu4", "SLURM")
    with pytest.raises(ResilienceError, match="--ntasks-per-node=1"):
        node_from_scheduler({**srun, "SLURM_NTASKS": "6"})
    assert node_from_scheduler({**srun, "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_NODEID": "0"}) is None
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    spec = node_from_scheduler(mpi)
    assert (spec.nnodes, spec.node_rank, spec.master_addr) == (2, 1, None)
    with pytest.raises(ResilienceError, match="ppr:1:node"):
        node_from_scheduler({**mpi, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert node_from_scheduler({}) is None  # a batch script's salloc shell is not an srun step
    assert node_from_scheduler({k: v for k, v in srun.items() if k != "SLURM_STEP_ID"}) is None


def _args(tmp_path, *extra, hosts=("worker-0 slots=2", "worker-1 slots=2", "worker-2 slots=2")):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the cluster\n" + "\n".join(hosts) + "\n")
    secret = tmp_path / "job.secret"
    secret.write_text("x" * 64)
    args = build_parser().parse_args(["--hostfile", str(hostfile), "--secret_file", str(secret), *extra,
                                      "train.py", "--deepspeed_config", "ds config.json"])
    args.num_gpus_given = args.num_gpus >= 0
    args.master_port = 29500 if args.master_port is None else args.master_port
    return args, secret


def _agent_part(cmd):
    at = cmd.index("ds_resilience.cli")
    return cmd[at - 2:]


def test_pdsh_starts_one_agent_per_node_with_the_node_rank_pdsh_substitutes(tmp_path):
    args, secret = _args(tmp_path, "--heartbeat_timeout", "4")
    cmd, env = cluster_command(args, env={"PYTHONPATH": "/src", "HOME": str(tmp_path)})
    assert cmd[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1,worker-2"]
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    assert "export PYTHONPATH=/src; " in cmd  # DeepSpeed's exports reach every node
    agent = _agent_part(cmd)
    assert agent[:5] == ["-u", "-m", "ds_resilience.cli", "run", "--nnodes"]
    flags = dict(zip(agent[4::2], agent[5::2]))
    assert flags["--nnodes"] == "3" and flags["--node_rank"] == "%n" and flags["--num_gpus"] == "2"
    assert flags["--master_addr"] == "worker-0" and flags["--master_port"] == "29500"
    assert flags["--secret_file"] == str(secret) and flags["--heartbeat_timeout"] == "4.0"
    assert cmd[-3:] == ["train.py", "--deepspeed_config", '"ds config.json"']  # quoted for pdsh's shell
    assert "deepspeed.launcher.launch" not in cmd


def test_the_selection_is_deepspeeds(tmp_path):
    args, _ = _args(tmp_path, "--include", "worker-1@worker-2", "--master_addr", "10.0.0.1")
    cmd, _ = cluster_command(args, env={})
    agent = _agent_part(cmd)
    assert "worker-1,worker-2" in cmd and agent[agent.index("--nnodes") + 1] == "2"
    assert agent[agent.index("--master_addr") + 1] == "10.0.0.1"
    args, _ = _args(tmp_path, "--num_nodes", "2", "--num_gpus", "1")
    agent = _agent_part(cluster_command(args, env={})[0])
    assert agent[agent.index("--nnodes") + 1] == "2" and agent[agent.index("--num_gpus") + 1] == "1"


def test_slurm_and_openmpi_start_one_agent_per_node_and_leave_the_rank_to_the_scheduler(tmp_path):
    args, _ = _args(tmp_path, "--launcher", "slurm")
    cmd, _ = cluster_command(args, env={})
    assert cmd[:3] == ["srun", "-n", "3"] and "--ntasks-per-node=1" in cmd
    assert cmd[cmd.index("ds_resilience.cli") - 2:cmd.index("ds_resilience.cli")] == ["-u", "-m"]
    assert "--node_rank" not in cmd and cmd[-1] == "ds config.json"
    args, _ = _args(tmp_path, "--launcher", "openmpi")
    cmd, _ = cluster_command(args, env={})
    assert cmd[:3] == ["mpirun", "-n", "3"] and "ppr:1:node" in cmd and "--node_rank" not in cmd
    assert cmd[cmd.index("ds_resilience.cli") - 3:cmd.index("ds_resilience.cli")] == [sys.executable, "-u", "-m"]


@pytest.mark.parametrize("extra, hosts, message", [
    (("--launcher", "ssh"), None, "one of pdsh, openmpi, slurm"),
    ((), ("a slots=2", "b slots=4"), "the same number of workers"),
    (("--include", "worker-0:1"), None, "names particular slots"),
    (("--include", "worker-0", "--num_gpus", "1"), None, "cannot be combined"),
    (("--launcher", "openmpi", "--num_nodes", "2"), None, "not supported with it"),
    ((), ("a slots=2", "a slots=2"), "multiple entries for a"),
])
def test_a_bad_selection_is_named(tmp_path, extra, hosts, message):
    args, _ = _args(tmp_path, *extra, **({"hosts": hosts} if hosts else {}))
    with pytest.raises(ResilienceError, match=message):
        cluster_command(args, env={})


def test_a_missing_hostfile_is_named(tmp_path):
    args, _ = _args(tmp_path)
    args.hostfile = str(tmp_path / "nope")
    with pytest.raises(ResilienceError, match="no such file"):
        cluster_command(args, env={})
