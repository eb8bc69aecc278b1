"""The agent: launches and watches the workers of one node, hosts the store, publishes membership.

Never inside a worker (a dead worker would take the store down with it). The agent

* hosts a :class:`torch.distributed.TCPStore` and launches ``N`` workers the way the ``deepspeed``
  launcher does (``python -u script args --local_rank=r``, with ``RANK``/``WORLD_SIZE``/
  ``MASTER_ADDR``/...), plus ``TORCHELASTIC_USE_AGENT_STORE=True`` so that torch's ``env://``
  rendezvous connects to this store as a client (torch 2.13 then keeps the default group's keys
  under ``default_pg/``, with no per-attempt prefix), ``DSR_AGENT=1`` and ``DSR_INCARNATION``;
* detects crashes by exit status (woken through pidfds) and hangs by heartbeats that stop changing
  for ``heartbeat_timeout_s`` (measured on its own clock; it SIGKILLs the silent worker);
* publishes each change as an :class:`~.membership.EpochRecord`; when a stage has lost every
  replica it publishes a ``stop`` epoch, waits for the survivors to save and exit, and exits 3;
* optionally relaunches a failed rank after ``rejoin_after_s`` (``DSR_REJOIN=1``) and publishes a
  ``rejoin`` epoch once the new process has registered; after the survivors re-formed the grid only
  with ``grow_back`` (the relaunched ranks and the survivors then re-form the first grid:
  ``integrations/ds_grow.py``); without it the ranks left out stay out.

* on SIGTERM or SIGINT (a scheduler's preemption or time limit, Ctrl-C), or when a worker that
  received one asks for it, publishes an ``interrupt`` epoch: every worker saves its stage (the
  newest step all stages committed, in the front end's checkpoint layout, under
  ``job_checkpoint_dir``) and exits; after ``term_grace_s`` what is left is killed. A second
  signal kills at once. The snapshots in host memory are removed only once a stop's checkpoint is
  complete; a job started again under the same named job id (``job_id``, or the scheduler's)
  resumes from it.

Exit codes: 0 all live workers finished, 1 a worker failed before registering (a start-up error),
3 stopped beyond tolerance, 128+n interrupted by signal n. Children are killed on every way out.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch.distributed as dist

from .. import store_keys as keys
from ..config import DetectorConfig
from ..errors import ResilienceError
from ..job_secret import SECRET_VAR, new_secret
from ..launch import DEFAULT_HOST_DIR, LaunchEnv, snapshot_root
from ..planning.recovery import lost_stages
from ..epochs import STOP_KINDS, MembershipError, SlowRequest
from ..runtime import membership as mb
from .events import AgentEvent, event_table
from .grow_gate import grow_verdict
from .host_memory import claim, disown, owner_alive, reclaim_orphans
from .nodes import NodeBeats, RemoteProc, end_message, job_description, post_launch, signed_set
from .spawn import WorkerProcess, preload_modules, start_worker

__all__ = ["Agent", "AgentEvent", "AgentError", "EXIT_OK", "EXIT_STARTUP", "EXIT_STOPPED", "SCHEDULER_JOB_VARS",
           "named_job_id"]

EXIT_OK, EXIT_STARTUP, EXIT_STOPPED = 0, 1, 3
SCHEDULER_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "COBALT_JOBID")
"""Where a scheduler names the job: a requeued job keeps its id, so it finds its checkpoints."""


def named_job_id(explicit: str | None, env: Mapping[str, str]) -> str | None:
    """The job id a later run can name again: ``explicit`` (``--job_id``), else ``DSR_JOB_ID``, else
    the scheduler's; ``None`` when nothing names the job."""
    for value in (explicit, env.get("DSR_JOB_ID"), *(env.get(var) for var in SCHEDULER_JOB_VARS)):
        if value:
            if "/" in value or value in (".", ".."):
                raise AgentError(f"job id {value!r} must not contain '/' (it names a directory)")
            return value
    return None


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr`` only (not every interface), for the store to serve on: only
    the network of ``--master_addr`` reaches it. Port 0: a free one."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock

class AgentError(ResilienceError, ValueError):
    """The agent was given invalid arguments."""


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Failure(NamedTuple):
    rank: int
    kind: str  # crash | hang | node (lost with its node)
    reason: str
    since: float  # monotonic: exit observed (crash) or last heartbeat change (hang)


_LIVE = ("running", "joining")


@dataclass(kw_only=True)
class _Child:
    rank: int
    proc: WorkerProcess
    incarnation: int
    pidfd: int | None
    state: str = "running"  # running | joining | done | failed
    hb_value: int = 0
    hb_seen: bool = False
    hb_changed: float = 0.0  # monotonic
    failed_at: float = 0.0  # monotonic, when declared failed
    launched_at: float = 0.0
    admitted: bool = False  # a relaunched worker the survivors admitted (its rejoin event recorded)
    registered_at: float | None = None  # monotonic: a relaunched worker's registration was seen


def _signal_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Agent:
    """Launch ``num_workers`` copies of ``script`` and watch them (see the module docstring).

    Args:
        script: the training script; ``script_args`` follow it, then ``--local_rank=r`` (unless
            ``local_rank_arg`` is false: Megatron-LM's parser rejects it and reads ``LOCAL_RANK``).
        num_workers: worker processes per node (ranks ``0..N-1`` on one node; node k holds ranks
            ``k*N .. k*N+N-1``).
        nnodes: nodes; with more than one, this agent is node 0's and leads: the other nodes run
            a follower (:class:`~.nodes.NodeAgent`) that launches their ranks when asked
            (``supervisor/nodes.py``). ``master_port`` must then be given.
        head: this agent runs no worker: it leads from a head node (the launching machine, or one
            outside the training nodes), and the ``nnodes`` training nodes 0..K-1 all run
            followers (``ds-resilience run --follow``), so the store and membership survive the
            loss of any training node.
        master_addr, master_port: where the store listens (port 0: a free port).
        heartbeat_interval_s, heartbeat_timeout_s: the workers' beat interval (exported to them in
            their :class:`~ds_resilience.launch.LaunchEnv`; they beat at it) and the silence after
            which one is killed as hung (default: ``resilience.detector``'s defaults).
        rejoin_after_s: relaunch a failed rank that many seconds after its failure (None: never).
        stop_grace_s: how long survivors may take to save a checkpoint and exit after a stop.
        exit_grace_s: how long a worker that stopped its heartbeat on purpose (it is exiting) may
            stay silent beyond the heartbeat timeout before it counts as hung.
        max_join_attempts: relaunches of one rank that may die before re-joining before giving up.
        max_restarts: when a failure is beyond tolerance, restart every worker from the in-memory
            snapshots up to this many times (0: stop with exit code 3 instead; ``None``: what the
            workers register from their config, ``resilience.checkpoint.max_restarts``).
        host_dir: the host-memory directory of the snapshots; the agent owns ``host_dir/<job id>``
            (workers write it, it outlives them) and removes it when it exits (after a stop, only
            once the stop's checkpoint is complete). ``None``: what the workers register, else
            ``/dev/shm/ds_resilience``.
        keep_snapshots: leave the snapshots in host memory when the agent exits (for inspection).
        regrid: the workers re-form a smaller grid when a stage loses every replica
            (``resilience.regrid``): such a failure is then published as any other, not as a stop
            (``None``: what the workers register).
        grow_back: after such a re-grid, keep relaunching the ranks it left out (``rejoin_after_s``):
            once every one of them registered, the survivors finished their re-grid and growing
            pays (``planning/grow_back.decide_grow`` on the figures the re-formed grid's lead
            posts), their ``rejoin`` epoch (``grows``) has the survivors and them re-form the first
            grid (``integrations/ds_grow.py``). ``None``: what the workers register
            (``resilience.grow_back``, default true); ``False``: the ranks left out stay out.
        job_id: names the job (its snapshots' directory, its stop checkpoints); default
            ``DSR_JOB_ID``, else the scheduler's job id (``SLURM_JOB_ID``, ...), else a new one. A
            named job resumes from its newest stop checkpoint when started again.
        term_grace_s: after SIGTERM / SIGINT, how long the workers get to save and exit before
            they are killed (torchrun's default, 30 s).
        env: extra environment for the workers (overrides the agent's own, not the protocol's).
        log_dir: when set, worker ``r``'s output goes to ``log_dir/rank{r}.{incarnation}.log``
            (``.restart{n}.log`` after the n-th restart).
        echo: where the agent's messages go (default: stderr).
        preload: modules to import once in a fork server that every worker is forked from
            (``supervisor/spawn.py``); ``None``: ``DSR_PRELOAD``, else none (a fresh interpreter each).
    """

    def __init__(self, script: str | os.PathLike[str], script_args: Sequence[str] = (), *, num_workers: int,
                 master_addr: str = "127.0.0.1", master_port: int = 0, heartbeat_interval_s: float | None = None,
                 heartbeat_timeout_s: float | None = None, rejoin_after_s: float | None = None,
                 stop_grace_s: float = 300.0, exit_grace_s: float = 30.0, max_join_attempts: int = 3,
                 store_timeout_s: float | None = None,
                 max_restarts: int = 0, host_dir: str | os.PathLike[str] | None = None, keep_snapshots: bool = False,
                 env: Mapping[str, str] | None = None, log_dir: str | os.PathLike[str] | None = None,
                 echo: Callable[[str], None] | None = None, nnodes: int = 1, local_rank_arg: bool = True,
                 regrid: bool | None = False, grow_back: bool | None = None, preload: Sequence[str] | None = None,
                 job_id: str | None = None, term_grace_s: float = 30.0, secret: str | None = None,
                 head: bool = False) -> None:
        if num_workers < 1:
            raise AgentError(f"num_workers must be >= 1, got {num_workers}")
        if nnodes < 1:
            raise AgentError(f"nnodes must be >= 1, got {nnodes}")
        self.head = head  # no worker here: every training node runs a follower
        multi = nnodes > 1 or head
        if multi and not master_port:
            raise AgentError("with nnodes > 1 the store needs a fixed --master_port (the other nodes connect to it)")
        if multi and not secret:
            raise AgentError("a job of several nodes needs a secret shared by its agents (the store has no "
                             "authentication): set $DSR_JOB_SECRET on every node (e.g. export DSR_JOB_SECRET=$(python "
                             "-c 'import secrets; print(secrets.token_hex(32))')), or give --secret_file FILE (mode 600)")
        # seals the agents' messages and the membership records; one node makes its own (its workers
        # take it from their environment)
        self.secret = secret or new_secret()
        defaults = DetectorConfig()  # the one place the detector's defaults live
        heartbeat_interval_s = defaults.heartbeat_interval_s if heartbeat_interval_s is None else heartbeat_interval_s
        heartbeat_timeout_s = defaults.heartbeat_timeout_s if heartbeat_timeout_s is None else heartbeat_timeout_s
        store_timeout_s = defaults.store_timeout_s if store_timeout_s is None else store_timeout_s
        if not heartbeat_interval_s > 0 or not heartbeat_timeout_s > heartbeat_interval_s:
            raise AgentError(f"need 0 < heartbeat_interval_s ({heartbeat_interval_s}) < heartbeat_timeout_s "
                             f"({heartbeat_timeout_s})")
        if rejoin_after_s is not None and rejoin_after_s < 0:
            raise AgentError(f"rejoin_after_s must be >= 0 or None, got {rejoin_after_s}")
        if not Path(script).is_file():
            raise AgentError(f"training script {str(script)!r} not found")
        self.script, self.script_args = str(script), tuple(script_args)
        self.local_rank_arg = local_rank_arg
        self.nproc, self.nnodes = num_workers, nnodes
        self.num_workers = num_workers * nnodes  # the world
        self.master_addr, self.port = master_addr, master_port
        self.heartbeat_interval_s, self.heartbeat_timeout_s = heartbeat_interval_s, heartbeat_timeout_s
        self.rejoin_after_s, self.stop_grace_s, self.store_timeout_s = rejoin_after_s, stop_grace_s, store_timeout_s
        self.exit_grace_s, self.max_join_attempts = exit_grace_s, max_join_attempts
        self.join_batch_s = max(30.0, heartbeat_timeout_s)  # how long a registered joiner waits for the others
        if max_restarts is not None and max_restarts < 0:
            raise AgentError(f"max_restarts must be >= 0, got {max_restarts}")
        if not term_grace_s >= 0:
            raise AgentError(f"term_grace_s must be >= 0, got {term_grace_s}")
        self.env = dict(env or {})
        # None: learnt from the workers' registrations (their config, however it was given)
        self._given = {"max_restarts": max_restarts, "regrid": regrid, "host_dir": host_dir, "grow_back": grow_back}
        self.max_restarts, self.restarts = max_restarts or 0, 0
        self.regrid = bool(regrid)
        self.grow_back = bool(grow_back)
        self.preload = preload_modules(preload)
        named = named_job_id(job_id, {**os.environ, **self.env})
        self.resume = named is not None  # a named job resumes from its stop checkpoints
        self.job_id = named or f"job-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.term_grace_s = term_grace_s
        self._signal: int | None = None  # a SIGTERM / SIGINT not acted on yet
        self._interrupted: mb.EpochRecord | None = None  # the interrupt epoch, once published
        self.checkpoint_dir: str | None = None  # where a stop's checkpoint was saved (complete)
        self.host_dir = host_dir
        self._claimed: Path | None = None  # the job's directory in host memory this agent recorded itself in
        self.keep_snapshots = keep_snapshots
        self._restart_pending = False
        self._export_pending = False  # a stop beyond tolerance restarts once more to save every stage
        self._exporting = ""  # that restart's reason, while it runs
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.tick_s = min(heartbeat_interval_s / 2, 0.05)
        self._base: dist.TCPStore | None = None  # the store this agent hosts, kept across restarts
        self.store: dist.Store | None = None  # the current attempt's view of it (membership.attempt_view)
        self.events: list[AgentEvent] = []
        self.epochs: list[mb.EpochRecord] = []
        self.exit_code: int | None = None
        self.message = ""
        self._workers: dict[int, _Child] = {}
        self._failed: set[int] = set()
        self._rejoin_due: dict[int, float] = {}  # rank -> monotonic time of its relaunch
        self._join_attempts: dict[int, int] = {}  # rank -> relaunches that died before re-joining
        self._finished = False  # a member exited 0: training is over, nobody re-joins any more
        self._regridded = False  # the survivors re-form(ed) the grid without some ranks (until they grow it back)
        self._regrid_raw: bytes | None = None  # the survivors' newest re-grid word (dsr/regridded) acted on
        self._grow_declined: str | None = None  # growing back did not pay: why (no relaunch until the next re-grid)
        self._slow_seq = 0  # the newest slow-worker request acted on (SlowRequest.seq), this attempt
        self._slow_raw: bytes | None = None  # the request last read (each is read once)
        self._t0 = time.time()
        self._nodes: NodeBeats | None = None  # the followers' beats (several nodes), from the first launch

    # --- public ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Launch, watch, and return the exit code (children are always killed on the way out).

        The store stays up afterwards (records can still be read) until the agent is collected.

        Raises:
            AgentError: the store cannot be hosted at ``master_addr:master_port``.
        """
        handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            # the snapshots a dead agent left in host memory go, but a named job keeps its own: its
            # workers resume from them; this agent records itself as the owner
            own = snapshot_root(self.host_dir, self.job_id)
            if self.resume and owner_alive(own) is False:
                self._echo(f"[ds_resilience agent] job {self.job_id}: the agent of its earlier run is gone; the "
                           f"snapshots it left in {own} are kept for this run to resume from")
            reclaim_orphans(self.host_dir or DEFAULT_HOST_DIR, keep=own if self.resume else None)
            self._claimed = own
            claim(self._claimed, self.job_id, named=self.resume)
            self._start_attempt()
            self.exit_code = self._monitor()
        except _Interrupted as exc:
            self.message = (f"interrupted by {signal.Signals(exc.signum).name}"
                            + ("" if self._interrupted is None else " again") + "; workers killed")
            self.exit_code = 128 + exc.signum
        finally:
            for signum, old in handlers.items():
                signal.signal(signum, old)
            self._kill_all()
            release = self._snapshots_to_release()
            if self._multi and self._base is not None:
                try:  # the followers stop (kill whatever they still run, and release their node's snapshots)
                    signed_set(self._base, self.secret, keys.NODES_DONE,
                               end_message(self.exit_code if self.exit_code is not None else 1, release))
                    time.sleep(2 * self.tick_s + 0.5)  # let them read it before the store goes
                except RuntimeError:
                    pass
            if release is not None:
                shutil.rmtree(release, ignore_errors=True)
        self._summary()
        return self.exit_code

    def _snapshots_to_release(self) -> Path | None:
        """Where the job's snapshots are in host memory (on every node) if they are to be removed;
        ``None`` when asked to keep them or a stop's checkpoint is missing (they are then the only
        copy of the newest state)."""
        if self.store is not None:
            self._learn_settings()  # where the workers put them
        root = snapshot_root(self.host_dir, self.job_id)
        claimed = self._claimed if self._claimed is not None and self._claimed != root else None
        if claimed is not None:  # the host_dir the workers registered is another one
            shutil.rmtree(claimed, ignore_errors=True)
        if self.keep_snapshots:
            disown(root)
            return None
        stopped = self._interrupted is not None or self.exit_code == EXIT_STOPPED
        if stopped and self.checkpoint_dir is None and not self._restart_pending:
            # the only copy of the newest state: kept, and reclaimed by the next agent that starts
            self.message += f"; no complete checkpoint was written: the snapshots stay in {root}"
            return None
        return root

    def _start_attempt(self) -> None:
        """Launch every rank (the first attempt, or a restart). The first hosts the store; a restart
        keeps it (same address and port: the other nodes' followers stay connected) and sees it under
        its attempt's prefix (``store_keys.attempt_prefix``), as its workers do."""
        if self._base is None:
            try:
                listener = _listen(self.master_addr, self.port)
                port = listener.getsockname()[1]
                fd = listener.detach()  # the store owns the socket from now on (and closes it)
                self._base = dist.TCPStore(self.master_addr, port, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=self.store_timeout_s), master_listen_fd=fd)
            except (RuntimeError, OSError) as exc:  # port taken, bad address
                raise AgentError(f"cannot host the store on {self.master_addr}:{self.port}: {exc}") from exc
            self.port = self._base.port
        self.store = mb.attempt_view(self._base, self.restarts)
        self._slow_seq, self._slow_raw = 0, None  # a restart's workers number their requests afresh (its own keys)
        what = f"restart {self.restarts} from the in-memory snapshots" if self.restarts else "launching"
        self._echo(f"[ds_resilience agent] store at {self.master_addr}:{self.port}"
                   + (f" (attempt {self.restarts}'s keys under {keys.attempt_prefix(self.restarts)}/)" if self.restarts
                      else "") + f"; {what}: {self.num_workers} workers of {self.script}")
        self._publish("start", f"{what}: {self.num_workers} workers")  # before any worker looks
        if self._multi:
            if not self.restarts:
                signed_set(self._base, self.secret, keys.NODES_JOB,
                           job_description(self.script, self.script_args, self.nproc))
            followers = range(0 if self.head else 1, self.nnodes)  # node 0 is this agent's own, unless a head
            self._nodes = NodeBeats(self._base, followers, 0.75 * self.heartbeat_timeout_s, time.monotonic())
        for rank in range(self.num_workers):
            self._launch(rank, 0)

    def _restart(self, export: bool = False) -> None:
        """Every worker is gone after a stop with restart: start them all again, same job id.
        ``export``: a stop beyond tolerance with no restart left, restarted once so that every stage
        (the lost ones from their snapshots) is saved, then stopped (exit code 3)."""
        self._kill_all()
        self.restarts += 1
        self._exporting = self.message.split(";")[0] if export else ""
        self._event("restart", detail=(
            "to save every stage: all workers restore the newest snapshot held for every rank, then stop" if export
            else f"attempt {self.restarts} of {self.max_restarts}: all workers restore the newest snapshot held for "
                 f"every rank"))
        self._workers, self._failed, self.epochs = {}, set(), []
        self._rejoin_due.clear()
        self._join_attempts.clear()
        self._restart_pending = self._export_pending = False
        self._finished = self._regridded = False
        self._grow_declined, self._regrid_raw = None, None
        self.exit_code, self.message = None, ""
        self._start_attempt()

    def _can_export(self) -> bool:
        """Whether a restart can restore every stage to save it: snapshots on, and a front end that
        saves on an interrupt (its registration says so)."""
        if self._exporting:
            return False
        settings = self._registered_settings()
        return settings is not None and bool(settings.get("snapshots")) and bool(settings.get("export_restart"))

    def _registered_settings(self) -> dict[str, Any] | None:
        """The config settings the first worker that registered any reports (every worker runs the
        same config), or ``None`` before one did."""
        for rank in range(self.num_workers):
            info = mb.read_worker(self.store, rank, secret=self.secret)
            if info is not None and info.settings:
                return info.settings
        return None

    def _all_registered(self) -> bool:
        return all(mb.read_worker(self.store, r, secret=self.secret) is not None for r in range(self.num_workers))

    # --- launching ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        """The first SIGTERM / SIGINT is a graceful stop (``_monitor`` publishes it); a second one,
        or one before the workers run, kills at once."""
        if self.store is None or self._signal is not None or self._interrupted is not None:
            raise _Interrupted(signum)
        self._signal = signum

    def _interrupt(self, reason: str, signum: int | None, under_way: float | None, *,
                   exit_code: int | None = None) -> float:
        """Publish the graceful stop (or, with a stop ``under_way``, let that one save within the
        grace, and restart nothing); returns the deadline. The exit code is ``128 + signum``, or
        ``exit_code`` (the export after a stop beyond tolerance)."""
        self._restart_pending = self._export_pending = False
        self._rejoin_due.clear()
        for w in self._workers.values():
            if w.state == "joining":  # it would wait for donors that are leaving
                w.proc.kill()
        self.exit_code = exit_code if signum is None else 128 + signum
        deadline = time.monotonic() + self.term_grace_s
        if under_way is not None:
            self._interrupted = next(r for r in reversed(self.epochs) if r.stop)
            self.message += f"; {reason}"
            self._event("interrupt", epoch=self._interrupted.epoch, detail=f"{reason} while stopping")
            return min(under_way, deadline)
        self.message = reason
        self._interrupted = self._publish("interrupt", reason)
        return deadline

    def _stop_requested(self) -> tuple[str, int] | None:
        """A SIGTERM / SIGINT to the agent, or to a worker (its ``STOP_REQUEST``): (reason, signal)."""
        if self._signal is not None:
            return f"interrupted by {signal.Signals(self._signal).name}", self._signal
        if self.store.check([keys.STOP_REQUEST]):
            reason = self.store.get(keys.STOP_REQUEST).decode(errors="replace")
            signum = signal.SIGINT if "SIGINT" in reason else signal.SIGTERM
            return f"interrupted: {reason}", signum
        return None

    def _launch(self, rank: int, incarnation: int) -> _Child:
        node, local = self._node_of(rank), rank % self.nproc
        contract = LaunchEnv(host=self.master_addr, port=self.port, rank=rank, world_size=self.num_workers,
                             incarnation=incarnation, rejoin=incarnation > 0,
                             heartbeat_interval_s=self.heartbeat_interval_s, agent_pid=os.getpid(), local_rank=local,
                             local_world_size=self.nproc, restart=self.restarts, job_id=self.job_id,
                             heartbeat_timeout_s=self.heartbeat_timeout_s, resume=self.resume)
        protocol = {**contract.to_environ(), "GROUP_RANK": str(node), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        suffix = f".restart{self.restarts}" if self.restarts else ""
        log = self.log_dir / f"rank{rank}.{incarnation}{suffix}.log" if self.log_dir is not None else None
        if node != 0 or self.head:  # another node's follower launches it
            post_launch(self._base, self.secret, node, rank=rank, incarnation=incarnation, local_rank=local,
                        env=protocol)
            return self._track(rank, incarnation, RemoteProc(self.store, self.secret, node, rank, incarnation,
                                                             echo=self._echo), None)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env, **protocol, SECRET_VAR: self.secret}
        proc = start_worker(self.script, [*self.script_args, *([f"--local_rank={local}"] if self.local_rank_arg else [])],
                            env=env, log=log, preload=self.preload)
        try:
            pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        return self._track(rank, incarnation, proc, pidfd)

    def _track(self, rank: int, incarnation: int, proc: Any, pidfd: int | None) -> _Child:
        now = time.monotonic()
        hb = mb.read_heartbeat(self.store, rank)  # a relaunch must beat past its predecessor's count
        self.store.delete_key(mb.hb_stopped_key(rank))
        worker = _Child(rank=rank, proc=proc, incarnation=incarnation, pidfd=pidfd,
                         state="joining" if incarnation else "running", hb_value=hb, hb_changed=now,
                         launched_at=now)
        self._workers[rank] = worker
        return worker

    # --- the loop -------------------------------------------------------------------------------
    def _monitor(self) -> int:
        stop_deadline: float | None = None
        last_tick = time.monotonic()
        while True:
            woke = time.monotonic()
            if woke - last_tick > self.heartbeat_timeout_s / 2:  # the agent itself stalled: no blame
                for w in self._workers.values():
                    w.hb_changed = woke
                if self._nodes is not None:
                    self._nodes.forgive(woke)
            last_tick = woke
            if self._interrupted is None and (asked := self._stop_requested()) is not None:
                stop_deadline = self._interrupt(*asked, under_way=stop_deadline)
            elif self._exporting and self._interrupted is None and stop_deadline is None and self._all_registered():
                # the export restart's workers restored the snapshots: every stage saves, then stops
                stop_deadline = self._interrupt(f"{self._exporting}; every stage restored from the in-memory "
                                                f"snapshots is saved", None, None, exit_code=EXIT_STOPPED)
            failures = (self._reap(woke, stopping=stop_deadline is not None) + self._check_nodes(woke)
                        + self._check_heartbeats())
            if failures and stop_deadline is None:
                stop_deadline = self._on_failures(failures)
            elif failures:  # while stopping, a failure changes nothing but is still recorded
                self._failed.update(f.rank for f in failures)
                for f in failures:
                    self._event(f.kind, f.rank, latency_s=time.monotonic() - f.since,
                                detail=f.reason + " (while stopping)")
            if stop_deadline is None and self.regrid and self.store.check([mb.REGRID_FAILED_KEY]):
                stop_deadline = self._regrid_failed()
            if stop_deadline is None and self.regrid and self.store.check([mb.REGRIDDED_KEY]):
                raw = self.store.get(mb.REGRIDDED_KEY)
                if raw != self._regrid_raw:  # each re-grid the survivors announce, once (the agent may know it already)
                    self._regrid_raw = raw
                    self._no_more_rejoins(raw.decode(errors="replace"))
            if stop_deadline is None:
                self._rejoins()
                self._slow_requests()
            live = [w for w in self._workers.values() if w.state in _LIVE]
            if stop_deadline is None and not live:
                self.message = "all live workers finished" + (f" ({len(self._failed)} failed)" if self._failed else "")
                return EXIT_OK
            if stop_deadline is not None and (not live or time.monotonic() > stop_deadline):
                self._saved()
                if self._restart_pending or self._export_pending:
                    self._restart(export=self._export_pending)
                    stop_deadline = None
                    continue
                if live:
                    grace = self.term_grace_s if self._interrupted is not None else self.stop_grace_s
                    self.message += f"; {len(live)} worker(s) did not exit within {grace:.0f} s and were killed"
                return self.exit_code if self.exit_code is not None else EXIT_STOPPED
            fds = [w.pidfd for w in live if w.pidfd is not None]
            if fds:
                select.select(fds, [], [], self.tick_s)  # wakes at once when a worker exits
            else:
                time.sleep(self.tick_s)

    def _reap(self, observed: float, stopping: bool) -> list[_Failure]:
        """Exited workers; failures of members are returned, the rest recorded."""
        failures = []
        for w in self._workers.values():
            if w.state not in _LIVE or (code := w.proc.poll()) is None:
                continue
            self._close(w)
            if code == 0:
                member = w.state == "running"
                w.state = "done"
                late = w.incarnation > 0 and not self._check_admitted(w)
                self._event("exit", w.rank, detail="exit code 0" + (
                    "; never admitted: training ended before the survivors took this relaunched worker in"
                    if late else ""))
                if member and not stopping:
                    self._training_over(w.rank)
            elif w.state == "joining" or stopping:
                self._event("exit", w.rank, detail=f"{w.state} worker {_signal_text(code)}")
                if w.state == "joining" and not stopping:
                    self._join_failed(w)
                w.state = "failed"
            else:
                w.state, w.failed_at = "failed", observed
                failures.append(_Failure(w.rank, "crash", f"rank {w.rank} crashed ({_signal_text(code)})", observed))
        return failures

    def _check_heartbeats(self) -> list[_Failure]:
        failures = []
        now = time.monotonic()
        for w in self._workers.values():
            if w.state not in _LIVE:
                continue
            value = mb.read_heartbeat(self.store, w.rank)
            if value != w.hb_value:
                w.hb_value, w.hb_seen, w.hb_changed = value, True, now
                continue
            silence = now - w.hb_changed
            if not w.hb_seen or silence <= self.heartbeat_timeout_s:
                continue
            exiting = self.store.check([mb.hb_stopped_key(w.rank)])  # it stopped beating on purpose
            if exiting and silence <= self.heartbeat_timeout_s + self.exit_grace_s:
                continue
            w.proc.kill()  # SIGKILL works on a stopped process too
            try:
                w.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self._echo(f"[ds_resilience agent] rank {w.rank} (pid {w.proc.pid}) survives SIGKILL")
            self._close(w)
            reason = f"rank {w.rank} hung (no heartbeat for {silence:.2f} s); killed"
            if w.state == "joining":
                self._event("killed", w.rank, latency_s=silence, detail="joining worker " + reason)
                self._join_failed(w)
                w.state = "failed"
                continue
            w.state, w.failed_at = "failed", now
            failures.append(_Failure(w.rank, "hang", reason, now - silence))
        return failures

    @property
    def _multi(self) -> bool:
        return self.nnodes > 1 or self.head

    def _node_of(self, rank: int) -> int:
        """The node that runs ``rank``: node k holds ranks ``k*N .. k*N+N-1`` (node 0 is this
        agent's own, unless it is a head)."""
        return rank // self.nproc

    def _check_nodes(self, now: float) -> list[_Failure]:
        """A follower node fallen silent is lost whole, one event: every live rank of it fails at
        once (nobody is left there to report their exits, and their own heartbeats would name them
        one at a time); their relaunches wait for a replacement node, whose launch requests start
        where the loss is marked. A lost node that beats again is back."""
        if self._nodes is None:
            return []
        lost, back = self._nodes.check(now)
        failures = []
        for node, silence, beats in lost:
            first = self._base.add(keys.node_launches(node), 0)
            signed_set(self._base, self.secret, keys.node_lost(node), f"{first} {beats}")
            ranks = []
            for w in self._workers.values():
                if self._node_of(w.rank) != node or w.state not in _LIVE:
                    continue
                w.proc.lost()
                w.proc.kill()  # a node only stalled, not dead: its follower kills them when it wakes
                self._close(w)
                if w.state == "joining":
                    self._event("exit", w.rank, detail=f"joining worker lost with node {node}")
                    self._join_failed(w)
                    w.state = "failed"
                    continue
                w.state, w.failed_at = "failed", now
                ranks.append(w.rank)
                failures.append(_Failure(w.rank, "node", f"rank {w.rank} lost with node {node}", now - silence))
            detail = (f"node {node} lost whole (its agent silent for {silence:.2f} s): ranks "
                      f"{', '.join(map(str, ranks)) or 'none running'} at once")
            self._event("nodelost", None, latency_s=silence, detail=detail)
            self._echo(f"[ds_resilience agent] {detail}")
        for node in back:
            detail = f"node {node} beats again (a replacement agent): its lost ranks are relaunched there to re-join"
            self._event("nodeback", None, detail=detail)
            self._echo(f"[ds_resilience agent] {detail}")
        return failures

    def _training_over(self, rank: int) -> None:
        """A member finished training: relaunches still due are dropped and relaunched workers
        that have not registered yet are stopped (there is no step left for them to join; they
        would wait for a donor that is leaving). One that registered but was not admitted (the
        survivors ran their last step before its re-join epoch) reads ``TRAINING_OVER_KEY`` and
        exits 0 by itself. Not a failure: the job still exits 0."""
        if self._finished:
            return
        self._finished = True
        self.store.set(mb.TRAINING_OVER_KEY, f"rank {rank} finished training")
        self._cancel_rejoins(f"rank {rank} finished training")

    def _no_more_rejoins(self, why: str) -> None:
        """The survivors re-form the grid (``why``): a relaunched worker cannot join the first grid,
        which is gone, so without ``grow_back`` relaunches still due are dropped, relaunched workers
        that have not registered yet are stopped, and no rank is relaunched any more: the ranks left
        out of the new grid stay out. With ``grow_back`` the relaunches go on: once every rank left
        out registered, they grow the grid back (:meth:`_grow_ready`)."""
        if self._regridded:
            return
        self._regridded = True
        self._grow_declined = None
        if self.grow_back:
            self._echo(f"[ds_resilience agent] the survivors re-form the grid ({why}); relaunched ranks will grow it back")
            return
        self._cancel_rejoins(f"the survivors re-form the grid ({why}); a relaunched worker cannot join it")

    def _cancel_rejoins(self, why: str) -> None:
        for r in sorted(self._rejoin_due):
            self._event("cancel", r, detail=f"relaunch dropped: {why}")
        self._rejoin_due.clear()
        for w in self._workers.values():
            if w.state == "joining":
                w.proc.kill()
                try:
                    w.proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    pass
                self._close(w)
                w.state = "failed"
                self._event("cancel", w.rank, detail=f"relaunched worker stopped before it re-joined: {why}")

    def _join_failed(self, w: _Child) -> None:
        """A relaunched worker died before it re-joined: try again, a few times."""
        if self._finished or (self._regridded and not self._growing_back()):
            return
        self._join_attempts[w.rank] = self._join_attempts.get(w.rank, 0) + 1
        if self._join_attempts[w.rank] < self.max_join_attempts:
            self._rejoin_due[w.rank] = time.monotonic() + (self.rejoin_after_s or 0.0)
        else:
            self._event("giveup", w.rank, detail=f"{self.max_join_attempts} relaunches failed; not retrying")

    def _learn_settings(self) -> None:
        """The config values the agent was not given (``None``), from the workers' registrations:
        the config the workers run with, however the script was given it."""
        if all(v is not None for v in self._given.values()):
            return
        settings = self._registered_settings()
        if settings is None:
            return
        if self._given["max_restarts"] is None:
            self.max_restarts = int(settings.get("max_restarts") or 0)
        if self._given["regrid"] is None:
            self.regrid = bool(settings.get("regrid"))
        if self._given["grow_back"] is None:
            self.grow_back = bool(settings.get("grow_back"))
        if self._given["host_dir"] is None and settings.get("host_dir"):
            self.host_dir = settings["host_dir"]

    def _on_failures(self, failures: list[_Failure]) -> float | None:
        """Publish the epoch for a batch of failures; return a stop deadline when beyond tolerance."""
        self._learn_settings()
        self._failed.update(f.rank for f in failures)
        reason = "; ".join(f.reason for f in failures)
        code, lost = self._beyond_tolerance()
        if lost and self.regrid and code == EXIT_STOPPED and len(self._failed) < self.num_workers:
            self._echo(f"[ds_resilience agent] {lost}: the survivors re-form the grid")
            self._no_more_rejoins(lost)
            lost = ""
        if lost:
            self._restart_pending = code == EXIT_STOPPED and self.restarts < self.max_restarts
            # no restart left: one more, to export every stage, the lost ones from their snapshots
            self._export_pending = code == EXIT_STOPPED and not self._restart_pending and self._can_export()
            then = ("restarting all workers from the in-memory snapshots" if self._restart_pending else
                    "restarting all workers from the in-memory snapshots to save every stage, then stopping"
                    if self._export_pending else
                    "stopping after a checkpoint" if code == EXIT_STOPPED else "stopping all workers")
            self.message = f"beyond tolerance: {lost}. {reason}; {then}"
            self.exit_code = code
            self._record_failures(failures, self._publish("stop", self.message,
                                                          restart=self._restart_pending or self._export_pending))
            for w in self._workers.values():
                if w.state == "joining":
                    w.proc.kill()
            self._rejoin_due.clear()
            grace = self.stop_grace_s if code == EXIT_STOPPED else min(self.stop_grace_s, 10.0)
            return time.monotonic() + grace
        kind = "crash" if any(f.kind in ("crash", "node") for f in failures) else "hang"
        self._record_failures(failures, self._publish(kind, reason))
        if self.rejoin_after_s is not None and not self._finished and (not self._regridded or self._growing_back()):
            for f in failures:
                w = self._workers[f.rank]
                if w.incarnation > 0 and not self._check_admitted(w):  # registered, failed before it re-joined
                    self._join_failed(w)
                else:
                    self._rejoin_due[f.rank] = w.failed_at + self.rejoin_after_s
        return None

    def _regrid_failed(self) -> float:
        """A survivor could not re-form the grid: stop, with a restart of every worker from the
        in-memory snapshots when one is left (the tier below); returns the stop deadline."""
        why = self.store.get(mb.REGRID_FAILED_KEY).decode(errors="replace")
        self._restart_pending = self.restarts < self.max_restarts
        then = "restarting all workers from the in-memory snapshots" if self._restart_pending else "stopping"
        self.message = f"the survivors could not re-form the grid ({why}); {then}"
        self.exit_code = EXIT_STOPPED
        self._publish("stop", self.message, restart=self._restart_pending)
        return time.monotonic() + self.stop_grace_s

    def _record_failures(self, failures: list[_Failure], record: mb.EpochRecord) -> None:
        published = time.monotonic()
        for f in failures:
            self._event(f.kind, f.rank, epoch=record.epoch, latency_s=published - f.since, detail=f.reason)

    def _beyond_tolerance(self) -> tuple[int, str]:
        """(exit code, what is lost); "" when every stage keeps a replica.

        Decided by ``planning.recovery.lost_stages``, the function the workers' recovery plans use,
        on the stages the workers registered. A failed rank that never registered is a start-up
        failure (its stage is unknown). After the survivors re-formed the grid, only the
        registrations of the newest grid count (the ranks lost before it hold no position in it)."""
        stage_of: dict[int, int] = {}
        pipeline_of: dict[int, int] = {}  # a replica is (pipeline, stage): a tensor-parallel group's ranks share it
        infos = {}
        for rank in range(self.num_workers):
            info = mb.read_worker(self.store, rank, secret=self.secret)
            if info is None:
                if rank in self._failed:
                    return EXIT_STARTUP, f"rank {rank} failed before it registered (its stage is unknown)"
                continue
            infos[rank] = info
        newest = max((info.grid for info in infos.values()), default=0)
        for rank, info in infos.items():
            if info.grid != newest:
                continue
            stage_of[rank], pipeline_of[rank] = info.stage, info.pipeline
            if info.heartbeat_interval_s is not None and abs(info.heartbeat_interval_s - self.heartbeat_interval_s) > 1e-9:
                self._echo(f"[ds_resilience agent] rank {rank} beats every {info.heartbeat_interval_s} s, "
                           f"the agent expects {self.heartbeat_interval_s} s")
        lost = lost_stages(stage_of, self._failed, {r: (pipeline_of[r], stage_of[r]) for r in stage_of})
        return EXIT_STOPPED, "; ".join(f"stage {s} lost every replica (" + ", ".join(
            f"rank {r} of pipeline {pipeline_of[r]}" for r in sorted(stage_of) if stage_of[r] == s) + ")" for s in lost)

    def _rejoins(self) -> None:
        now = time.monotonic()
        for rank, due in list(self._rejoin_due.items()):
            if now >= due and not (self._nodes is not None and self._node_of(rank) in self._nodes.lost):
                del self._rejoin_due[rank]
                w = self._launch(rank, self._workers[rank].incarnation + 1)
                self._event("relaunch", rank, detail=f"incarnation {w.incarnation}, pid {w.proc.pid}")
        registered, unregistered = [], []
        for w in self._workers.values():
            info = mb.read_worker(self.store, w.rank, secret=self.secret) if w.state == "joining" else None
            if info is not None and info.incarnation == w.incarnation:
                if w.registered_at is None:
                    w.registered_at = now
                registered.append(w)
            elif w.state == "joining":
                unregistered.append(w)
            elif w.state == "running" and w.incarnation > 0:
                self._check_admitted(w)
        # ranks relaunched together (a replaced node's) join in one epoch: a worker's join would be
        # interrupted by a second re-join epoch; a laggard is waited for a bounded time
        first = min((w.registered_at for w in registered), default=None)
        if first is None or (unregistered and now - first < self.join_batch_s):
            return
        grows = self._regridded
        if grows and not self._grow_ready(registered):
            return
        for w in registered:
            w.state = "running"
            self._failed.discard(w.rank)
        ranks = tuple(sorted(w.rank for w in registered))
        record = self._publish("rejoin", ", ".join(f"rank {w.rank} re-joins (incarnation {w.incarnation})"
                                                   for w in sorted(registered, key=lambda w: w.rank))
                               + (": the grid grows back to its first shape" if grows else ""),
                               joining=ranks, grows=grows)
        if grows:  # the first grid again: a later lost stage re-grids anew, this one's word is acted on
            self._regridded = False
            self._regrid_raw = self.store.get(mb.REGRIDDED_KEY) if self.store.check([mb.REGRIDDED_KEY]) else None
        for w in registered:
            self._event("register", w.rank, epoch=record.epoch, latency_s=now - w.launched_at,
                        detail=f"incarnation {w.incarnation} registered; epoch {record.epoch} asks the "
                               f"survivors to take it in")

    def _growing_back(self) -> bool:
        """After a re-grid: whether the ranks it left out are relaunched to grow the grid back."""
        return self.grow_back and self._grow_declined is None

    def _grow_ready(self, registered: list[_Child]) -> bool:
        """Whether the relaunched ``registered`` workers grow the re-formed grid back now
        (``grow_gate.grow_verdict``); when growing does not pay (or cannot be done) the relaunched
        workers are stopped and nobody is relaunched until the next re-grid."""
        back = {w.rank for w in registered}
        verdict = grow_verdict(
            self.store, left_out=self._failed, back=back,
            coming=lambda r: r in self._rejoin_due or self._workers[r].state == "joining",
            survivors=[w.rank for w in self._workers.values() if w.state == "running" and w.rank not in back],
            newest_epoch=self.epochs[-1].epoch if self.epochs else 0)
        if verdict.action == "decline":
            self._decline_grow(verdict.detail)
        elif verdict.action == "grow":
            self._event("grow", None, detail=verdict.detail)
            self._echo(f"[ds_resilience agent] {verdict.detail}")
        return verdict.action == "grow"

    def _decline_grow(self, why: str) -> None:
        self._grow_declined = why
        self._event("grow_declined", None, detail=why)
        self._echo(f"[ds_resilience agent] {why}; the re-formed grid trains on")
        self._cancel_rejoins(why)

    def _slow_requests(self) -> None:
        """The reporting rank found a worker slow, or recovered (``runtime/stragglers.py``): publish
        a ``slow`` epoch with the workers slow now (none: back to the failed set's schedule). The
        workers apply it at their next iteration boundary; nothing is killed. Acted on once per
        request; a rank that failed since is left out (its failure epoch has the last word)."""
        if self._finished or not self.store.check([keys.SLOW_REQUEST]):
            return
        raw = self.store.get(keys.SLOW_REQUEST)
        if raw == self._slow_raw:
            return
        self._slow_raw = raw
        try:
            request = SlowRequest.from_json(raw)
        except MembershipError as exc:
            self._echo(f"[ds_resilience agent] ignored a malformed slow-worker request: {exc}")
            return
        if request.seq <= self._slow_seq:
            return
        self._slow_seq = request.seq
        speeds = tuple((r, s) for r, s in request.speeds if r < self.num_workers and r not in self._failed)
        what = ", ".join(f"rank {r} at {s:.2f}x" for r, s in speeds) or "no worker slow any more"
        record = self._publish("slow", f"{what}" + (f" ({request.reason})" if request.reason else ""), speeds=speeds)
        self._event("slow", None, epoch=record.epoch, detail=what)

    def _check_admitted(self, w: _Child) -> bool:
        """Whether the survivors admitted relaunched worker ``w`` (its own word in the store);
        records its rejoin event the first time it is seen."""
        if not w.admitted and mb.admitted(self.store, w.rank) == w.incarnation:
            w.admitted = True
            self._join_attempts.pop(w.rank, None)  # it re-joined: a later failure starts a new count
            epoch = next((r.epoch for r in reversed(self.epochs) if w.rank in r.joining), None)
            self._event("rejoin", w.rank, epoch=epoch, latency_s=time.monotonic() - w.launched_at,
                        detail=f"incarnation {w.incarnation} admitted: it trains with the survivors")
        return w.admitted

    def _saved(self) -> None:
        """Where the stop's checkpoint went, once its leader wrote the manifest (every stage saved)."""
        stop = self._interrupted or next((r for r in reversed(self.epochs) if r.stop), None)
        if stop is None or self.checkpoint_dir is not None:
            return
        if self.store.check([keys.saved_manifest(stop.epoch)]):
            self.checkpoint_dir = self.store.get(keys.saved_manifest(stop.epoch)).decode(errors="replace")
            self.message += f"; checkpoint saved to {self.checkpoint_dir}"
            self._event("saved", epoch=stop.epoch, detail=self.checkpoint_dir)
        elif self._interrupted is not None:
            self.message += "; no checkpoint was saved"

    # --- helpers --------------------------------------------------------------------------------
    def _publish(self, kind: str, reason: str, joining: tuple[int, ...] = (), restart: bool = False,
                 speeds: tuple[tuple[int, float], ...] = (), grows: bool = False) -> mb.EpochRecord:
        alive = tuple(r for r in range(self.num_workers) if r not in self._failed)
        record = mb.EpochRecord(epoch=len(self.epochs) + 1, failed=tuple(self._failed), alive=alive,
                                joining=joining, stop=kind in STOP_KINDS, reason=reason, detected_at=time.time(),
                                kind=kind, restart=restart, speeds=speeds, grows=grows)
        mb.publish_epoch(self.store, record, secret=self.secret)
        self.epochs.append(record)
        self._echo(f"[ds_resilience agent] epoch {record.epoch} ({kind}): {reason}; alive {list(alive)}")
        if kind == "start":
            self._event("start", epoch=record.epoch, detail=reason)
        elif kind in STOP_KINDS:
            self._event(kind, epoch=record.epoch, detail=reason)
        return record

    def _event(self, kind: str, rank: int | None = None, **fields: Any) -> None:
        self.events.append(AgentEvent(time=time.time(), kind=kind, rank=rank, **fields))

    @staticmethod
    def _close(w: _Child) -> None:
        if w.pidfd is not None:
            os.close(w.pidfd)
            w.pidfd = None

    def _kill_all(self) -> None:
        for w in self._workers.values():
            if w.proc.poll() is None:
                w.proc.kill()
        for w in self._workers.values():
            try:
                w.proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self._echo(f"[ds_resilience agent] rank {w.rank} (pid {w.proc.pid}) did not die")
            self._close(w)

    def _summary(self) -> None:
        self._echo(event_table(self.events, self._t0, self.exit_code, self.message))
