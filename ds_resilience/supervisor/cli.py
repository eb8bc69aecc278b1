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
from .job_secret import load_secret
from .spawn import PRELOAD_VAR, preload_modules

__all__ = ["build_parser", "main_run"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``ds-resilience run`` (imports nothing heavy: no torch)."""
    p = argparse.ArgumentParser(prog="ds-resilience run", description=(
        "Launch a DeepSpeed training script under the ds_resilience agent: crashes and hangs are "
        "detected and published to the workers, which keep training (arguments as for `deepspeed`)."))
    p.add_argument("--num_gpus", "--num_workers", dest="num_gpus", type=int, default=-1,
                   help="worker processes (default: all visible GPUs, or 1 without GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job (node 0's agent leads)")
    p.add_argument("--node_rank", type=int, default=0, help="this node (0: the leader, which hosts the store)")
    p.add_argument("--master_addr", default="127.0.0.1", help="address of the agent's store (node 0's)")
    p.add_argument("--master_port", type=int, default=0, help="port of the agent's store (0: a free port)")
    p.add_argument("--heartbeat_interval", type=float, default=None, metavar="S",
                   help="seconds between worker heartbeats (default: resilience.detector, else 0.5)")
    p.add_argument("--heartbeat_timeout", type=float, default=None, metavar="S",
                   help="silence after which a worker is killed as hung (default: resilience.detector, else 5)")
    p.add_argument("--rejoin_after", type=float, default=None, metavar="S",
                   help="relaunch a failed worker S seconds after its failure (default: never)")
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
    from .agent import Agent, AgentError  # torch: imported once the agent is to run
    from .nodes import NodeAgent

    try:
        num = args.num_gpus
        if num < 0:
            from ..accelerator import device_count

            num = device_count() or 1  # one process per accelerator (one on a CPU machine)
        interval, timeout, store_timeout = args.heartbeat_interval, args.heartbeat_timeout, None
        max_restarts = 0
        resilience = _script_resilience(args.script_args)
        if resilience is not None:
            detector = resilience.detector
            if resilience.checkpoint.enabled:
                max_restarts = resilience.checkpoint.max_restarts
            interval = detector.heartbeat_interval_s if interval is None else interval
            timeout = detector.heartbeat_timeout_s if timeout is None else timeout
            store_timeout = detector.store_timeout_s
        preload = preload_modules(args.preload) if args.preload is not None else None
        secret = load_secret(args.secret_file)
        if args.node_rank:
            if not 0 < args.node_rank < args.nnodes:
                raise AgentError(f"--node_rank {args.node_rank} is out of range for --nnodes {args.nnodes}")
            return NodeAgent(args.script, args.script_args, node_rank=args.node_rank, master_addr=args.master_addr,
                             master_port=args.master_port, secret=secret, log_dir=args.log_dir,
                             local_rank_arg=not args.no_local_rank, preload=preload).run()
        if max_restarts and args.nnodes > 1:
            print("ds-resilience run: a restart from the snapshots is not supported across nodes yet: beyond "
                  "tolerance the job stops after its survivors save", file=sys.stderr)
        agent = Agent(args.script, args.script_args, num_workers=num, nnodes=args.nnodes, master_addr=args.master_addr,
                      master_port=args.master_port, heartbeat_interval_s=interval,
                      heartbeat_timeout_s=timeout, rejoin_after_s=args.rejoin_after,
                      stop_grace_s=args.stop_grace, store_timeout_s=store_timeout, log_dir=args.log_dir,
                      max_restarts=None, host_dir=None, regrid=None, local_rank_arg=not args.no_local_rank,
                      preload=preload, job_id=args.job_id, term_grace_s=args.term_grace_s, secret=secret)
        return agent.run()
    except ResilienceError as exc:
        print(f"ds-resilience run: error: {exc}", file=sys.stderr)
        return 2
