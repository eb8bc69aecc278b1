"""Launching a job of several nodes as DeepSpeed users do: ``ds-resilience run --hostfile H ...``.

On the launching machine, ``--hostfile`` (DeepSpeed's format, ``worker-0 slots=4``) with
``--include`` / ``--exclude`` / ``--num_nodes`` / ``--num_gpus`` selects the nodes and their slots
with DeepSpeed's own parser (``deepspeed.launcher.runner``); DeepSpeed's own multi-node runner for
``--launcher`` (pdsh, openmpi, slurm; ``deepspeed.launcher.multinode_runner``) builds the command
that reaches every node, with its exports (``.deepspeed_env``), ``--launcher_args``, ssh port and
venv script. What it starts on each node is not DeepSpeed's per-node launcher but one agent:
``python -u -m ds_resilience.cli run --nnodes K --node_rank k --num_gpus S ...`` with the
launcher's script and arguments. The node's rank comes from pdsh (``%n``), or from the scheduler's
environment (:func:`node_from_scheduler`: ``SLURM_NODEID`` under ``srun``, ``OMPI_COMM_WORLD_RANK``
under ``mpirun``), which is also how ``srun ds-resilience run ...`` in a batch script finds the node
count, its rank and the leader (the first host of ``SLURM_JOB_NODELIST``).

With ``--head`` the launching machine leads (the store and membership) and runs no worker; every
selected node runs a follower (``--follow``), so the loss of any training node, the first one
included, is a failure the job survives.

The job's secret goes to every agent as a file only its user can read (``--secret_file``; a new one
under ``~/.ds_resilience/secrets`` unless given): it must be visible at the same path on every node,
as the working directory must be for DeepSpeed's pdsh launch (a shared home or file system).

Only :func:`cluster_command` imports DeepSpeed; the rest is pure.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import ResilienceError
from ..job_secret import new_secret

__all__ = ["DEFAULT_MASTER_PORT", "LAUNCHERS", "NodeSpec", "cluster_command", "describe", "expand_nodelist",
           "node_from_scheduler", "write_secret_file"]

DEFAULT_MASTER_PORT = 29500  # DeepSpeed's (deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT)
LAUNCHERS = ("pdsh", "openmpi", "slurm")
_AGENT = ["-u", "-m", "ds_resilience.cli", "run"]


@dataclass(frozen=True)
class NodeSpec:
    """Where this agent stands in a job of several nodes, as a scheduler's environment says."""

    nnodes: int
    node_rank: int
    master_addr: str | None  # None: the scheduler does not name the leader
    source: str


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``"gpu[01-03,07],head"`` ->
    ``["gpu01", "gpu02", "gpu03", "gpu07", "head"]`` (zero padding kept)."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise ResilienceError(f"SLURM node list {nodelist!r}: bad range {part!r}")
                hosts += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            else:
                hosts.append(prefix + part + suffix)
    return hosts


def node_from_scheduler(env: Mapping[str, str] | None = None) -> NodeSpec | None:
    """This agent's place from SLURM (``srun``: ``SLURM_NNODES``, ``SLURM_NODEID``,
    ``SLURM_JOB_NODELIST``) or Open MPI (``mpirun``, one process per node:
    ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``); ``None`` outside them or on one node."""
    env = os.environ if env is None else env
    if "SLURM_NODEID" in env and "SLURM_NNODES" in env and "SLURM_STEP_ID" in env:  # inside srun
        nnodes, rank = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        hosts = expand_nodelist(nodelist) if nodelist else []
        if int(env.get("SLURM_NTASKS", nnodes)) != nnodes:
            raise ResilienceError(f"srun started {env.get('SLURM_NTASKS')} tasks on {nnodes} nodes: ds-resilience run "
                                  f"is one agent per node (srun --ntasks-per-node=1 ds-resilience run ...)")
        spec = NodeSpec(nnodes, rank, hosts[0] if hosts else None, "SLURM")
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        if env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1") != "1":
            raise ResilienceError("mpirun started several ds-resilience run processes on one node: it is one agent "
                                  "per node (mpirun --map-by ppr:1:node)")
        spec = NodeSpec(int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"]), None, "Open MPI")
    else:
        return None
    return spec if spec.nnodes > 1 else None


def write_secret_file(directory: Path | None = None) -> Path:
    """A new job secret in a file of mode 600 (``~/.ds_resilience/secrets`` by default)."""
    directory = Path(directory) if directory is not None else Path.home() / ".ds_resilience" / "secrets"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"job-{os.getpid()}-{secrets.token_hex(4)}.secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new_secret() + "\n")
    return path


def _resources(args: argparse.Namespace) -> dict[str, list[int]]:
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile, parse_inclusion_exclusion

    if not os.path.isfile(args.hostfile):
        raise ResilienceError(f"--hostfile {args.hostfile!r}: no such file (lines like 'worker-0 slots=4')")
    if (args.include or args.exclude) and (args.num_nodes > 0 or args.num_gpus_given):
        raise ResilienceError("--num_nodes / --num_gpus cannot be combined with --include / --exclude "
                              "(as with deepspeed)")
    try:
        pool = fetch_hostfile(args.hostfile)
        active = parse_inclusion_exclusion(pool, args.include, args.exclude)
    except ValueError as exc:
        raise ResilienceError(f"--hostfile {args.hostfile}: {exc}") from exc
    active = apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus if args.num_gpus_given else -1)
    counts = {host: len(slots) for host, slots in active.items()}
    if not counts:
        raise ResilienceError(f"--hostfile {args.hostfile} with the filters given selects no node")
    if len(set(counts.values())) > 1:
        raise ResilienceError(f"every node runs the same number of workers (a pipeline grid): the selection gives "
                              f"{counts}")
    if any(list(slots) != list(range(len(slots))) for slots in active.values()):
        raise ResilienceError(f"the selection names particular slots ({dict(active)}): a node's workers are its first "
                              f"N slots (select whole hosts, or --num_gpus N)")
    return dict(active)


def _agent_args(args: argparse.Namespace, nnodes: int, nproc: int, master_addr: str, secret_file: str,
                node_rank: str | None) -> list[str]:
    out = ["--nnodes", str(nnodes), *(["--node_rank", node_rank] if node_rank is not None else []),
           *(["--follow"] if getattr(args, "head", False) else []),
           "--num_gpus", str(nproc), "--master_addr", master_addr, "--master_port", str(args.master_port),
           "--secret_file", secret_file]
    for flag in ("heartbeat_interval", "heartbeat_timeout", "rejoin_after", "job_id", "log_dir", "preload"):
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{flag}", str(value)]
    out += ["--stop_grace", str(args.stop_grace), "--term_grace_s", str(args.term_grace_s)]
    if args.no_local_rank:
        out.append("--no_local_rank")
    return out


def _ds_args(args: argparse.Namespace, user_script: str, user_args: list[str], master_addr: str) -> argparse.Namespace:
    """The namespace DeepSpeed's runners read (deepspeed.launcher.runner.parse_args's fields)."""
    return argparse.Namespace(
        hostfile=args.hostfile, include=args.include, exclude=args.exclude, num_nodes=args.num_nodes,
        num_gpus=args.num_gpus if args.num_gpus_given else -1, master_addr=master_addr,
        master_port=args.master_port, launcher=args.launcher, launcher_args=args.launcher_args or "", module=False,
        no_python=False, no_local_rank=False, save_pid=False, enable_each_rank_log="None", ssh_port=args.ssh_port,
        venv_script=None, user_script=user_script, user_args=user_args, slurm_comment="", bind_cores_to_rank=False,
        bind_core_list=None, detect_nvlink_pairs=False)


def _exports(runner, env: Mapping[str, str]) -> None:
    """What DeepSpeed's launcher exports to every node (``deepspeed.launcher.runner.main``): the
    variables of its prefixes (``PYTHON*``, ``UCX*``, the accelerator's), and ``.deepspeed_env``
    in the home and working directories."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner as ds_runner

    excluded = [v for key, names in getattr(ds_runner, "EXCLUDE_ENVS", {}).items() if key in env for v in names]
    prefixes = [*ds_runner.EXPORT_ENVS, *get_accelerator().export_envs()]
    for var, value in env.items():
        if any(var.startswith(p) for p in prefixes) and var not in excluded:
            runner.add_export(var, value)
    for where in ds_runner.DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(where, ds_runner.DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    if "=" in line:
                        key, value = line.split("=", 1)
                        runner.add_export(key, value)


def cluster_command(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(the command that starts one agent per node of ``--hostfile``, its environment), built by
    DeepSpeed's multi-node runner for ``--launcher``."""
    from deepspeed.launcher import multinode_runner as mnr
    from deepspeed.launcher.runner import encode_world_info

    env = dict(os.environ if env is None else env)
    if args.launcher not in LAUNCHERS:
        raise ResilienceError(f"--launcher {args.launcher!r}: one of {', '.join(LAUNCHERS)}")
    active = _resources(args)
    hosts = list(active)
    nnodes, nproc = len(hosts), len(next(iter(active.values())))
    head = bool(getattr(args, "head", False))
    master_addr = args.master_addr or (socket.gethostname() if head else hosts[0])
    secret_file = args.secret_file or str(write_secret_file())
    # what the launching machine's own agent needs when it is the head
    args.nnodes, args.num_gpus, args.secret_file, args.bind_addr = nnodes, nproc, secret_file, master_addr
    world_info = encode_world_info(active)
    if args.launcher == "pdsh":
        agent = _agent_args(args, nnodes, nproc, master_addr, secret_file, "%n")
        runner = mnr.PDSHRunner(_ds_args(args, args.script, list(args.script_args), master_addr), world_info)
        _exports(runner, env)
        cmd, _kill, env = runner.get_cmd(env, active)
        # DeepSpeed's per-node launcher and its own arguments make way for one agent per node
        at = cmd.index("deepspeed.launcher.launch")  # preceded by python -u -m
        end = cmd.index(runner.user_script, at)
        cmd = [*cmd[:at - 3], sys.executable, *_AGENT, *agent, *cmd[end:]]
        return cmd, env
    agent = _agent_args(args, nnodes, nproc, master_addr, secret_file, None)  # the rank: the scheduler's
    one_per_node = {host: [0] for host in hosts}
    if args.launcher == "slurm":
        ds = _ds_args(args, "ds_resilience.cli", ["run", *agent, args.script, *args.script_args], master_addr)
        ds.num_gpus, ds.launcher_args = -1, f"{ds.launcher_args} --ntasks-per-node=1".strip()
        runner = mnr.SlurmRunner(ds, world_info, one_per_node)
        _exports(runner, env)
        cmd = runner.get_cmd(env, one_per_node)
        at = cmd.index("ds_resilience.cli")
        return [*cmd[:at], "-m", *cmd[at:]], env
    if args.include or args.exclude or args.num_nodes > 0:
        raise ResilienceError("--launcher openmpi starts an agent on every host of the hostfile: --include, "
                              "--exclude and --num_nodes are not supported with it (as with deepspeed)")
    ds = _ds_args(args, "ds_resilience.cli", ["run", *agent, args.script, *args.script_args], master_addr)
    ds.num_nodes = ds.num_gpus = -1
    ds.module = True
    ds.launcher_args = f"{ds.launcher_args} --map-by ppr:1:node".strip()
    runner = mnr.OpenMPIRunner(ds, world_info, {host: 1 for host in hosts})  # its pool: host -> processes
    _exports(runner, env)
    return runner.get_cmd(env, one_per_node), env


def describe(cmd: Sequence[str]) -> str:
    """The command as a shell would take it (for the launcher's message)."""
    return " ".join(shlex.quote(c) for c in cmd)
