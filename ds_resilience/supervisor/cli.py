"""``ds-resilience run``: the agent's command line (its argument parser and entry point).

:func:`main_run` reads the script's resilience settings (DeepSpeed's ``--deepspeed_config`` or
Megatron's ``--resilience-config``) for the detector's timing (the agent learns the rest, the restart
budget, the re-grid and the host-memory directory, from the workers' registrations, however the
script was given its config), then runs the
leader :class:`~.agent.Agent` (node 0) or a follower :class:`~.nodes.NodeAgent` (``--node_rank``
k > 0) and returns its exit code. :func:`build_parser` imports nothing heavy (no torch): the
package's CLI reference is rendered from it; the agent (torch) is imported when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..config import load_resilience_config, load_resilience_file
from ..errors import ResilienceError
from .cluster import DEFAULT_MASTER_PORT, node_from_scheduler
from ..job_secret import load_secret
from .spawn import PRELOAD_VAR, preload_modules

__all__ = ["build_parser", "main_run"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ds-resilience run`` (imports nothing heavy: no torch)."""
    p = argparse.ArgumentParser(prog="ds-resilience run", description=(
        "Launch a DeepSpeed training script under the ds_resilience agent: crashes and hangs are "
        "detected and published to the workers, which keep training (arguments as for `deepspeed`)."))
    p.add_argument("--num_gpus", "--num_workers", dest="num_gpus", type=int, default=-1,
                   help="worker processes (default: all visible GPUs, or 1 without GPUs)")
    p.add_argument("-H", "--hostfile", default=None,
                   help="launch on the nodes of this hostfile (DeepSpeed's format: 'worker-0 slots=4'), one agent per "
                        "node, through DeepSpeed's multi-node runner for --launcher")
    p.add_argument("-i", "--include", default="", help="nodes and slots of the hostfile to use, as with deepspeed "
                                                       "('worker-0@worker-1:0,1')")
    p.add_argument("-e", "--exclude", default="", help="nodes and slots of the hostfile not to use, as with deepspeed")
    p.add_argument("--num_nodes", type=int, default=-1, help="use the first N nodes of the hostfile")
    p.add_argument("--launcher", default="pdsh", help="how the hostfile's nodes are reached: pdsh (default), openmpi, "
                                                      "slurm")
    p.add_argument("--launcher_args", default="", help="extra arguments for pdsh / mpirun / srun")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port for pdsh")
    p.add_argument("--nnodes", type=int, default=None,
                   help="nodes of the job (node 0's agent leads; default: srun's or mpirun's node count, else 1)")
    p.add_argument("--node_rank", type=int, default=None,
                   help="this node (0: the leader, which hosts the store; default: the scheduler's, else 0)")
    p.add_argument("--head", action="store_true",
                   help="lead from this machine without running workers here (a head node): the store and membership "
                        "survive the loss of any training node, whose agents run with --follow; with --hostfile, "
                        "this launching machine is the head")
    p.add_argument("--follow", action="store_true",
                   help="this agent follows a head node's leader (node ranks 0..K-1 all run workers)")
    p.add_argument("--master_addr", default=None,
                   help="address of the agent's store, node 0's (default: the hostfile's or the SLURM job's first "
                        "node, else 127.0.0.1)")
    p.add_argument("--master_port", type=int, default=None,
                   help=f"port of the agent's store (default: {DEFAULT_MASTER_PORT} across nodes, as deepspeed; a "
                        f"free port on one node)")
    p.add_argument("--heartbeat_interval", type=float, default=None, metavar="S",
                   help="seconds between worker heartbeats (default: resilience.detector, else 0.5)")
    p.add_argument("--heartbeat_timeout", type=float, default=None, metavar="S",
                   help="silence after which a worker is killed as hung (default: resilience.detector, else 5)")
    p.add_argument("--rejoin_after", type=float, default=None, metavar="S",
                   help="relaunch a failed worker S seconds after its failure (default: never); after a re-grid "
                        "(resilience.regrid) the relaunched workers grow the grid back to its first shape "
                        "(resilience.grow_back, default true)")
    p.add_argument("--stop_grace", type=float, default=300.0, metavar="S",
                   help="time survivors get to save a checkpoint and exit after a stop")
    p.add_argument("--term_grace_s", type=float, default=30.0, metavar="S",
                   help="on SIGTERM / SIGINT the workers save a checkpoint and stop; after S seconds what is left is "
                        "killed (a second signal kills at once)")
    p.add_argument("--job_id", default=None,
                   help="names the job: its snapshots in host memory and the checkpoints its stops write "
                        "(under resilience.checkpoint.persistent_dir); a job started again with the same id resumes "
                        "from its newest one (default: the scheduler's job id, e.g. SLURM_JOB_ID, else a new id)")
    p.add_argument("--secret_file", default=None, metavar="FILE",
                   help="the job's secret (mode 600), shared by the agents of every node: they act only on messages "
                        "signed with it (default: $DSR_JOB_SECRET; needed with --nnodes > 1)")
    p.add_argument("--log_dir", default=None, help="write each worker's output to LOG_DIR/rank{r}.{n}.log")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script (as DeepSpeed's launcher: Megatron-LM scripts "
                        "read LOCAL_RANK from the environment and reject the flag)")
    p.add_argument("--preload", default=None, metavar="MODULES",
                   help="comma-separated modules to import once in a fork server; workers (and relaunches) are forked "
                        f"from it instead of importing them each (default: ${PRELOAD_VAR}, else none). Only modules "
                        "that start no thread and touch no GPU at import, e.g. "
                        "torch,deepspeed,ds_resilience.integrations.warm (the last one also does what each "
                        "worker's engine construction would import and probe)")
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _script_resilience(script_args: Sequence[str]):
    """The script's resilience settings (``None``: none given): DeepSpeed's ``--deepspeed_config``
    or Megatron's ``--resilience-config`` (a DeepSpeed config, or the section alone)."""
    readers = {"--deepspeed_config": load_resilience_config, "--resilience-config": load_resilience_file}
    for i, arg in enumerate(script_args):
        for flag, read in readers.items():
            if arg == flag and i + 1 < len(script_args):
                return read(script_args[i + 1])
            if arg.startswith(flag + "="):
                return read(arg.split("=", 1)[1])
    return None


def main_run(argv: Sequence[str]) -> int:
    """``ds-resilience run [options] script.py [script args...]``; returns the agent's exit code."""
    args = build_parser().parse_args(list(argv))
    if args.hostfile is not None and args.node_rank is None:
        return _launch_cluster(args)
    from .agent import AgentError  # torch: imported once the agent is to run
    from .nodes import NodeAgent

    try:
        _place(args)
        num = args.num_gpus
        if num < 0:
            from ..accelerator import device_count

            num = device_count() or 1  # one process per accelerator (one on a CPU machine)
        interval, _, _, max_restarts = _detector(args)
        if args.node_rank or args.follow:
            if not (0 if args.follow else 1) <= args.node_rank < args.nnodes:
                raise AgentError(f"--node_rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
            return NodeAgent(args.script, args.script_args, node_rank=args.node_rank, master_addr=args.master_addr,
                             master_port=args.master_port, secret=load_secret(args.secret_file),
                             log_dir=args.log_dir, local_rank_arg=not args.no_local_rank, preload=_preload(args),
                             beat_s=interval or 0.5, nproc=num, under_head=args.follow).run()
        return _leader(args, num_workers=num, master_addr=args.master_addr, head=args.head).run()
    except ResilienceError as exc:
        print(f"ds-resilience run: error: {exc}", file=sys.stderr)
        return 2


def _preload(args: argparse.Namespace) -> tuple[str, ...] | None:
    return preload_modules(args.preload) if args.preload is not None else None


def _detector(args: argparse.Namespace) -> tuple[float | None, float | None, float | None, int]:
    """(heartbeat interval, heartbeat timeout, store timeout, restarts): the command line's, else
    the script's resilience settings (``None``: the agent's defaults)."""
    interval, timeout, store_timeout, max_restarts = args.heartbeat_interval, args.heartbeat_timeout, None, 0
    resilience = _script_resilience(args.script_args)
    if resilience is not None:
        detector = resilience.detector
        if resilience.checkpoint.enabled:
            max_restarts = resilience.checkpoint.max_restarts
        interval = detector.heartbeat_interval_s if interval is None else interval
        timeout = detector.heartbeat_timeout_s if timeout is None else timeout
        store_timeout = detector.store_timeout_s
    return interval, timeout, store_timeout, max_restarts


def _leader(args: argparse.Namespace, *, num_workers: int, master_addr: str, head: bool):
    """The leading agent (node 0's, or a head's) as the command line describes it."""
    from .agent import Agent

    interval, timeout, store_timeout, _ = _detector(args)
    return Agent(args.script, args.script_args, num_workers=num_workers, nnodes=args.nnodes, master_addr=master_addr,
                 master_port=args.master_port, heartbeat_interval_s=interval, heartbeat_timeout_s=timeout,
                 rejoin_after_s=args.rejoin_after, stop_grace_s=args.stop_grace, store_timeout_s=store_timeout,
                 log_dir=args.log_dir, max_restarts=None, host_dir=None, regrid=None,
                 local_rank_arg=not args.no_local_rank, preload=_preload(args), job_id=args.job_id,
                 term_grace_s=args.term_grace_s, secret=load_secret(args.secret_file), head=head)


def _place(args: argparse.Namespace) -> None:
    """This agent's node count, rank and leader: given, else the scheduler's (srun, mpirun), else
    one node; the store's port: DeepSpeed's default across nodes, a free one on one node."""
    spec = node_from_scheduler() if args.nnodes is None or args.node_rank is None else None
    if spec is not None:
        args.nnodes = spec.nnodes if args.nnodes is None else args.nnodes
        args.node_rank = spec.node_rank if args.node_rank is None else args.node_rank
        args.master_addr = args.master_addr or spec.master_addr
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    multi = args.nnodes > 1 or args.head or args.follow
    if multi and args.master_addr is None:
        raise ResilienceError("a job of several nodes needs --master_addr (the leader's address: node 0's, or the "
                              "head's)")
    args.master_addr = args.master_addr or "127.0.0.1"
    if args.master_port is None:
        args.master_port = DEFAULT_MASTER_PORT if multi else 0


def _launch_cluster(args: argparse.Namespace) -> int:
    """``--hostfile``: start one agent per node through DeepSpeed's runner, wait for them, and
    return the launcher's exit code (a signal to this process goes to the launcher)."""
    import signal
    import subprocess

    from .cluster import cluster_command, describe

    try:
        args.num_gpus_given = args.num_gpus >= 0
        args.master_port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
        cmd, env = cluster_command(args)
    except ResilienceError as exc:
        print(f"ds-resilience run: error: {exc}", file=sys.stderr)
        return 2
    print(f"[ds_resilience launcher] {describe(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env)
    if args.head:  # this machine leads: the nodes' agents follow it
        try:
            return _leader(args, num_workers=args.num_gpus, master_addr=args.bind_addr, head=True).run()
        except ResilienceError as exc:
            print(f"ds-resilience run: error: {exc}", file=sys.stderr)
            proc.kill()
            return 2
        finally:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    from ..job_secret import load_secret
    from .nodes import LeaderEnd

    leader = LeaderEnd(args.bind_addr, args.master_port, load_secret(args.secret_file)).start()
    forward = {signum: signal.signal(signum, lambda n, f: proc.send_signal(n))
               for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for signum, old in forward.items():
            signal.signal(signum, old)
    job = leader.stop()
    if job is None:
        return code
    if job != code:  # pdsh returns the largest of the nodes' codes: 137 for a node lost, even if the job finished
        print(f"[ds_resilience launcher] the job's exit code is {job} (its leader's); {args.launcher} returned {code} "
              f"(a node's: one lost or killed)", file=sys.stderr, flush=True)
    return job
