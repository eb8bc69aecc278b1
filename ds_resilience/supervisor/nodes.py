"""Several nodes: the agent of node 0 leads, one follower agent per other node launches its ranks.

The leader (:class:`~.agent.Agent` with ``nnodes > 1``) hosts the store and owns membership for
every rank, as on one node: it reads every worker's heartbeat from the store, declares crashes and
hangs, publishes epochs, and decides relaunches. A rank of another node is a :class:`RemoteProc`
for it: launching it posts a request in the store, its exit code is what that node's follower
reported, and killing it posts a kill order. The follower (:class:`NodeAgent`, ``ds-resilience
run --node_rank k``) only executes: it launches the requested ranks with the leader's launch
contract (``LOCAL_RANK = rank % nproc``, the node's ``GROUP_RANK``), reports their exits, kills on
order, and ends when the leader says the job is over (or its store is gone: then it kills its
workers and exits 1). A follower also beats (``alive/{node}``): a node lost whole (its follower
with its workers, whose exits nobody can report any more) is the silence of that beat, one event
that names every rank of the node at once (``Agent._check_nodes``), before any of their own
heartbeats' silences would name them one at a time. A follower started later with the same
``--node_rank`` (a replacement node) takes the lost node's place: it starts reading launch requests
where the leader marked the loss (``lost/{node}``), beats, and the leader relaunches the lost ranks
there to re-join.

Store keys (the leader's store, under ``dsr/nodes/``; spelled in :mod:`ds_resilience.store_keys`)::

    launches/{node}           counter of launch requests for that node
    launch/{node}/{i}         request i: JSON {rank, incarnation, local_rank, env}
    exit/{rank}/{incarnation} the exit code (text) of that process, set by its node's follower
    kill/{rank}/{incarnation} "1": SIGKILL that process
    done                      "{code}[ {root}]": the leader's exit code, and where the job's snapshots
                              are in host memory when they are to go: followers stop, and remove
                              that directory if it is the job's whose ranks they ran
    job                       JSON {script, args, nproc}: what the leader runs; a follower that was
                              given something else refuses to start
    alive/{node}              counter: the follower's beat (every ``beat_s``)
    lost/{node}               "{first} {beats}": a replacement of the lost node takes launch requests
                              from index ``first``; ``beats``, the count when the loss was declared

A restart of every worker from the snapshots keeps the store (``store_keys.attempt_prefix``): its
launch requests follow the earlier ones in the same queue, each naming its attempt
(``DSR_RESTART``); the exit and kill keys of a process are under its attempt's prefix (incarnation 0
comes back at every restart). A follower that reads a request of a newer attempt kills what it
still runs of the older ones first.

Every value but the counter is sealed with the job's secret (``job_secret.py``): the store has no
authentication, so an agent acts only on what the job's agents signed, and logs what it drops. A
request's environment may hold only the launch contract's variables (``launch.CONTRACT_KEYS``): the
rest of a worker's environment, and where its output goes, are the follower's own.
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
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist

from .. import store_keys as keys
from ..errors import ResilienceError
from ..launch import CONTRACT_KEYS
from ..runtime.attempt_scope import restart_of
from ..runtime.membership import attempt_view
from ..job_secret import SECRET_VAR, BadSignature, seal, unseal
from .spawn import WorkerProcess, preload_modules, start_worker

__all__ = ["LeaderEnd", "NodeAgent", "NodeBeats", "RemoteProc", "end_message", "read_end", "job_description", "post_launch", "refused_env", "signed_get", "signed_set"]


def _has(store: dist.Store, key: str) -> bool:
    return store.check([key])


def signed_set(store: dist.Store, secret: str, key: str, value: str) -> None:
    """Set ``key`` to ``value`` sealed with the job's secret."""
    store.set(key, seal(secret, key, value))


def signed_get(store: dist.Store, secret: str, key: str) -> str:
    """The value of ``key`` if the job's agents signed it (raises :class:`BadSignature` if not)."""
    return unseal(secret, key, store.get(key))


def end_message(code: int, release: str | os.PathLike[str] | None) -> str:
    """The leader's end (``done``): its exit code, and the snapshots' directory to remove on every
    node (``None``: they are kept, e.g. the only copy of the newest state)."""
    return f"{code}" if release is None else f"{code} {release}"


def read_end(text: str) -> tuple[int, str | None]:
    """(exit code, snapshots' directory or ``None``) of :func:`end_message`'s text."""
    code, _, release = text.partition(" ")
    return int(code), release or None


def job_description(script: str, script_args: Sequence[str], nproc: int) -> str:
    """What every node of the job must run, as the leader publishes it (``job``): the script's
    file name (its directory may differ between nodes), its arguments, workers per node."""
    return json.dumps({"script": os.path.basename(str(script)), "args": list(script_args), "nproc": nproc})


def post_launch(store: dist.Store, secret: str, node: int, *, rank: int, incarnation: int, local_rank: int,
                env: Mapping[str, str]) -> None:
    """Ask ``node``'s follower to launch ``rank`` (leader side), with the launch contract's
    variables of ``env`` (the only ones a follower takes). The request is written before the
    counter moves, so a follower never reads a missing request."""
    i = store.add(keys.node_launches(node), 0)
    contract = {k: str(v) for k, v in env.items() if k in CONTRACT_KEYS}
    request = {"rank": rank, "incarnation": incarnation, "local_rank": local_rank, "env": contract}
    signed_set(store, secret, keys.node_launch(node, i), json.dumps(request))
    store.add(keys.node_launches(node), 1)


class LeaderEnd:
    """The leader's exit code as a launcher learns it: a client of the leader's store, from a thread
    of its own, waits for the signed end (``done``), which the leader writes just before its store
    goes. A launcher's own exit code is the nodes' (pdsh: the largest), 137 when a node was lost
    although the job finished; this is the job's. ``code`` stays ``None`` if the store could not be
    reached or the end was not seen."""

    def __init__(self, addr: str, port: int, secret: str, connect_timeout_s: float = 300.0) -> None:
        self.addr, self.port, self.secret, self.connect_timeout_s = addr, port, secret, connect_timeout_s
        self.code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="dsr-leader-end")

    def start(self) -> "LeaderEnd":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Stop watching (the launcher's nodes are done); the leader's code, if seen."""
        self._stop.set()
        self._thread.join(timeout_s)
        return self.code

    def _watch(self) -> None:
        deadline = time.monotonic() + self.connect_timeout_s
        store = None
        while store is None and not self._stop.is_set() and time.monotonic() < deadline:
            try:
                store = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=5))
            except (RuntimeError, ValueError):  # not up yet
                self._stop.wait(0.5)
        while store is not None and not self._stop.is_set():
            try:  # returns when the end is set, raises at once when the store goes
                store.wait([keys.NODES_DONE], timedelta(hours=1))
            except dist.DistStoreError:  # an hour without an end: wait on
                continue
            except RuntimeError:
                return  # the store is gone without an end: unknown
            try:
                self.code = read_end(signed_get(store, self.secret, keys.NODES_DONE))[0]
            except (BadSignature, RuntimeError, ValueError):
                pass
            return


class NodeBeats:
    """The leader's view of its followers' beats (``alive/{node}``): which node fell silent for
    longer than ``timeout_s`` (lost whole), and which lost one beats again (a replacement agent).
    A node that never beat is not judged here: its workers' heartbeats and start-up are."""

    def __init__(self, store: dist.Store, nodes: Sequence[int], timeout_s: float, now: float) -> None:
        self.store, self.timeout_s = store, timeout_s
        self.value = {node: 0 for node in nodes}
        self.changed = {node: now for node in self.value}
        self.seen: set[int] = set()
        self.lost: set[int] = set()

    def forgive(self, now: float) -> None:
        """The leader itself stalled: no node is blamed for the silence it did not watch."""
        for node in self.changed:
            self.changed[node] = now

    def check(self, now: float) -> tuple[list[tuple[int, float, int]], list[int]]:
        """([(node, silence, last beat count) lost since the last check], [nodes lost before that
        beat again])."""
        lost, back = [], []
        for node in self.value:
            value = self.store.add(keys.node_alive(node), 0)
            if value != self.value[node]:
                self.value[node], self.changed[node] = value, now
                self.seen.add(node)
                if node in self.lost:
                    self.lost.discard(node)
                    back.append(node)
            elif node in self.seen and node not in self.lost and now - self.changed[node] > self.timeout_s:
                self.lost.add(node)
                lost.append((node, now - self.changed[node], value))
        return lost, back


class RemoteProc:
    """A worker on another node as the leader sees it: ``poll``, ``kill``, ``wait`` and ``pid`` of a
    :class:`subprocess.Popen`, through the store (an exit report not signed by the job's agents is
    ignored, and told once through ``echo``)."""

    def __init__(self, store: dist.Store, secret: str, node: int, rank: int, incarnation: int,
                 echo: Callable[[str], None] | None = None) -> None:
        self.store, self.secret, self.node, self.rank, self.incarnation = store, secret, node, rank, incarnation
        self.pid = f"node {node}"
        self.returncode: int | None = None
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._forged = False

    def poll(self) -> int | None:
        if self.returncode is None:
            key = keys.node_exit(self.rank, self.incarnation)
            try:
                if _has(self.store, key):
                    self.returncode = int(signed_get(self.store, self.secret, key))
            except BadSignature as exc:
                if not self._forged:
                    self._forged = True
                    self._echo(f"[ds_resilience agent] ignored an exit report of rank {self.rank}: {exc}")
                return None
            except (RuntimeError, ValueError):
                return None
        return self.returncode

    def lost(self) -> None:
        """Its node was lost whole: nobody will report its exit; it is taken as killed."""
        if self.returncode is None:
            self.returncode = -signal.SIGKILL

    def kill(self) -> None:
        try:
            signed_set(self.store, self.secret, keys.node_kill(self.rank, self.incarnation), "1")
        except RuntimeError:  # the store is going away with the leader: the follower kills on its own
            pass

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank {self.rank} on node {self.node}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class NodeAgent:
    """The follower agent of node ``node_rank`` (see the module docstring).

    Args:
        script, script_args: the training script and its arguments (``--local_rank=r`` is added
            unless ``local_rank_arg`` is false).
        node_rank: this node's index, >= 1.
        master_addr, master_port: the leader's store.
        secret: the job's secret (``job_secret.load_secret``): requests not signed with it are refused.
        connect_timeout_s: how long to wait for the leader's store.
        log_dir: worker ``r``'s output to ``log_dir/rank{r}.{incarnation}.log`` (else this agent's own
            output).
        tick_s: polling interval.
        echo: where messages go (default: stderr).
        preload: modules a fork server imports once for every worker (see ``supervisor/spawn.py``;
            ``None``: ``DSR_PRELOAD``).
        beat_s: how often this agent beats in the store (the leader takes its silence for the
            loss of the whole node; give it the job's heartbeat interval).
        nproc: the workers per node it was told to run (``--num_gpus``): checked, with the script
            and its arguments, against the leader's (``None``: not checked).
        under_head: the leader is a head node that runs no worker (``--follow``): node 0 is a
            follower too.
    """

    def __init__(self, script: str, script_args: Sequence[str] = (), *, node_rank: int, master_addr: str,
                 master_port: int, secret: str, connect_timeout_s: float = 300.0, log_dir: str | os.PathLike[str] | None = None,
                 tick_s: float = 0.05, echo: Callable[[str], None] | None = None, local_rank_arg: bool = True,
                 preload: Sequence[str] | None = None, beat_s: float = 0.5, nproc: int | None = None,
                 under_head: bool = False) -> None:
        if node_rank < 0 or (node_rank == 0 and not under_head):
            raise ResilienceError(f"a follower's node_rank must be >= 1, got {node_rank} (node 0 runs the leader, "
                                  f"unless the leader is a head node: --follow)")
        if not master_port:
            raise ResilienceError("a follower needs the leader's --master_port (not 0)")
        if not secret:
            raise ResilienceError("a follower needs the job's secret ($DSR_JOB_SECRET or --secret_file, the leader's)")
        self.secret = secret
        self.script, self.script_args = script, tuple(script_args)
        self.local_rank_arg = local_rank_arg
        self.node, self.addr, self.port = node_rank, master_addr, master_port
        self.connect_timeout_s, self.tick_s = connect_timeout_s, tick_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.preload = preload_modules(preload)
        # (attempt, rank, incarnation) -> process; attempt: the restarts before it (DSR_RESTART)
        self.children: dict[tuple[int, int, int], WorkerProcess] = {}
        self._refused: set[str] = set()  # keys whose unsigned value was told once
        self.reported: set[tuple[int, int, int]] = set()
        self.attempt = 0  # the newest attempt a request named
        self._job_ids: set[str] = set()  # of the requests it ran: the snapshots' directory it may remove
        self._views: dict[int, dist.Store] = {}
        self.next_request = 0
        self.beat_s = beat_s
        self.nproc = nproc

    def run(self) -> int:
        """Launch on request until the leader is done; returns its exit code (1 if it vanished)."""
        try:
            store = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timedelta(seconds=self.connect_timeout_s))
        except RuntimeError as exc:
            raise ResilienceError(f"node {self.node}: cannot reach the leader's store at {self.addr}:{self.port}: "
                                  f"{exc}") from exc
        self._echo(f"[ds_resilience node {self.node}] connected to {self.addr}:{self.port}")
        code, release = 1, None
        stop_beating = threading.Event()
        try:
            self._check_job(store)
            self._take_over(store)
            # the beat comes from a thread of its own: a launch (a fork server importing torch) may
            # hold this loop for seconds, and this agent is no less alive for it
            beater = threading.Thread(target=self._beat, args=(store.clone(), stop_beating), daemon=True,
                                      name=f"dsr-node-{self.node}-beat")
            beater.start()
            while True:
                self._launch_requested(store)
                self._report_exits(store)
                self._kill_ordered(store)
                if _has(store, keys.NODES_DONE) and (done := self._verified(store, keys.NODES_DONE, "an end")):
                    code, release = read_end(done)
                    break
                time.sleep(self.tick_s)
        except RuntimeError as exc:  # the store is gone: the leader (and the job) ended
            self._echo(f"[ds_resilience node {self.node}] lost the leader's store ({exc}); stopping")
        finally:
            stop_beating.set()
            for proc in self.children.values():
                if proc.poll() is None:
                    proc.kill()
            for proc in self.children.values():
                try:
                    proc.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    pass
        self._release(release)
        self._echo(f"[ds_resilience node {self.node}] exit code {code}")
        return code

    def _release(self, root: str | None) -> None:
        """Remove the job's snapshots from this node's host memory, as the leader said: only a
        directory named for the job id of the ranks this agent ran (a signed end names it)."""
        if root is None:
            return
        if Path(root).name not in self._job_ids:
            self._echo(f"[ds_resilience node {self.node}] kept {root}: not the directory of a job this node ran")
            return
        if Path(root).exists():
            shutil.rmtree(root, ignore_errors=True)
            self._echo(f"[ds_resilience node {self.node}] removed the job's snapshots from host memory ({root})")

    def _beat(self, store: dist.Store, stop: threading.Event) -> None:
        """This node's beat (``alive/{node}``) every ``beat_s`` until ``stop``."""
        while not stop.is_set():
            try:
                store.add(keys.node_alive(self.node), 1)
            except RuntimeError:  # the store is gone: the main loop sees it too
                return
            stop.wait(self.beat_s)

    def _check_job(self, store: dist.Store) -> None:
        """Refuse to run anything but the leader's script, arguments and workers per node."""
        deadline = time.monotonic() + self.connect_timeout_s
        while not _has(store, keys.NODES_JOB):
            if time.monotonic() > deadline:
                raise ResilienceError(f"node {self.node}: the leader did not say what the job runs within "
                                      f"{self.connect_timeout_s:.0f} s")
            time.sleep(self.tick_s)
        raw = self._verified(store, keys.NODES_JOB, "the job's description")
        if raw is None:
            raise ResilienceError(f"node {self.node}: the job's description in the store is not signed with this "
                                  f"agent's secret (another job's store, or another secret)")
        leader = json.loads(raw)
        mine = json.loads(job_description(self.script, self.script_args, self.nproc or leader["nproc"]))
        diff = [f"{k}: the leader's {leader[k]!r}, this node's {mine[k]!r}" for k in ("script", "args", "nproc")
                if leader[k] != mine[k]]
        if diff:
            raise ResilienceError(f"node {self.node} was started with another job than the leader's ("
                                  + "; ".join(diff) + "): every node runs the leader's script, arguments and "
                                  "workers per node")

    def _take_over(self, store: dist.Store) -> None:
        """Whether this agent replaces a lost node, and where its launch requests start.

        A node that beat before (``alive`` > 0) had an agent. If that one still beats, this one is
        refused. Otherwise it waits, silent, until the leader has declared the node lost: the mark
        names the beat count it saw last (this one's reading: that loss is the current one) and the
        first launch request posted after it; those before were for the dead workers."""
        beats = store.add(keys.node_alive(self.node), 0)
        if not beats:
            return  # the node's first agent
        time.sleep(3 * self.beat_s)
        if store.add(keys.node_alive(self.node), 0) != beats:
            raise ResilienceError(f"node {self.node} already has an agent that beats in the leader's store: a second "
                                  f"one is refused (give a replacement node the --node_rank of a lost node)")
        key = keys.node_lost(self.node)
        self._echo(f"[ds_resilience node {self.node}] node {self.node} had an agent before this one: waiting for the "
                   f"leader to declare it lost")
        while True:
            mark = self._verified(store, key, "a lost-node mark") if _has(store, key) else None
            if mark is not None and int(mark.split()[1]) == beats:
                break
            if _has(store, keys.NODES_DONE):
                return  # the job ended first
            time.sleep(self.tick_s)
        self.next_request = int(mark.split()[0])
        self._echo(f"[ds_resilience node {self.node}] replaces node {self.node}, which the leader declared lost: its "
                   f"ranks are relaunched here to re-join (launch requests from {self.next_request} on)")

    def _verified(self, store: dist.Store, key: str, what: str) -> str | None:
        """The value of ``key`` if the job's agents signed it; else ``None``, told once."""
        try:
            return signed_get(store, self.secret, key)
        except BadSignature as exc:
            if key not in self._refused:
                self._refused.add(key)
                self._echo(f"[ds_resilience node {self.node}] refused {what} not signed with the job's secret "
                           f"({exc}); someone else writes to the store at {self.addr}:{self.port}")
            return None

    def _launch_requested(self, store: dist.Store) -> None:
        count = store.add(keys.node_launches(self.node), 0)
        while self.next_request < count:
            i = self.next_request
            self.next_request += 1
            raw = self._verified(store, keys.node_launch(self.node, i), f"launch request {i}")
            if raw is None:
                continue
            request = json.loads(raw)
            why = refused_env(request.get("env", {}))
            if why:
                self._echo(f"[ds_resilience node {self.node}] refused launch request {i}: {why}")
                continue
            attempt = restart_of({"DSR_AGENT": "1", **request["env"]})
            if attempt > self.attempt:
                self._new_attempt(attempt)
            self._launch(request, attempt)

    def _new_attempt(self, attempt: int) -> None:
        """The leader restarted every worker (attempt ``attempt``): what still runs of the attempts
        before it is killed (the leader's kill orders for them may not have been read yet)."""
        self.attempt = attempt
        old = [proc for (a, _, _), proc in self.children.items() if a < attempt and proc.poll() is None]
        for proc in old:
            proc.kill()
        for proc in old:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        self._echo(f"[ds_resilience node {self.node}] restart {attempt}: every worker restarts from the snapshots"
                   + (f" ({len(old)} of the earlier attempt's killed)" if old else ""))

    def _launch(self, request: dict[str, Any], attempt: int) -> None:
        rank, incarnation = int(request["rank"]), int(request["incarnation"])
        if request["env"].get("DSR_JOB_ID"):
            self._job_ids.add(request["env"]["DSR_JOB_ID"])
        env = {**os.environ, "OMP_NUM_THREADS": "1", **request["env"],
               "DSR_AGENT_PID": str(os.getpid()),  # orphan check: this agent is the parent here
               SECRET_VAR: self.secret}  # the membership records' seal: this agent's, never a request's
        suffix = f".restart{attempt}" if attempt else ""  # as the leader names its own ranks' logs
        log = str(self.log_dir / f"rank{rank}.{incarnation}{suffix}.log") if self.log_dir is not None else None
        extra = [f"--local_rank={int(request['local_rank'])}"] if self.local_rank_arg else []
        proc = start_worker(self.script, [*self.script_args, *extra], env=env, log=log, preload=self.preload)
        self.children[attempt, rank, incarnation] = proc
        self._echo(f"[ds_resilience node {self.node}] launched rank {rank} (incarnation {incarnation}, pid {proc.pid}"
                   + (f", restart {attempt}" if attempt else "") + ")")

    def _view(self, store: dist.Store, attempt: int) -> dist.Store:
        """``store`` as attempt ``attempt`` sees it (its processes' exit and kill keys)."""
        if attempt not in self._views:
            self._views[attempt] = attempt_view(store, attempt)
        return self._views[attempt]

    def _report_exits(self, store: dist.Store) -> None:
        for key, proc in self.children.items():
            if key not in self.reported and (code := proc.poll()) is not None:
                attempt, rank, incarnation = key
                signed_set(self._view(store, attempt), self.secret, keys.node_exit(rank, incarnation), str(code))
                self.reported.add(key)

    def _kill_ordered(self, store: dist.Store) -> None:
        for (attempt, rank, incarnation), proc in self.children.items():
            view, order = self._view(store, attempt), keys.node_kill(rank, incarnation)
            if proc.poll() is None and _has(view, order) and self._verified(view, order, "a kill order"):
                proc.kill()


def refused_env(env: Any) -> str | None:
    """Why a launch request's environment is refused (``None``: it is not): only the launch
    contract's variables (``launch.CONTRACT_KEYS``), as strings without NUL."""
    if not isinstance(env, dict):
        return f"its environment is a {type(env).__name__}, not a mapping"
    other = sorted(str(k) for k in env if k not in CONTRACT_KEYS)
    if other:
        return f"it sets {', '.join(other)}; a request may set only the launch contract ({', '.join(sorted(CONTRACT_KEYS))})"
    bad = sorted(k for k, v in env.items() if not isinstance(v, str) or "\0" in v)
    return f"malformed values of {', '.join(bad)}" if bad else None
