"""How the agent starts a worker process: a fresh interpreter, or a fork of a pre-imported one.

By default a worker is ``python -u script args`` (:class:`subprocess.Popen`), as DeepSpeed's
launcher starts it. Every worker then imports torch, DeepSpeed and this package itself: about 3 s
on an idle core, 8-12 s per process when four start at once on two cores, and again for every
relaunched worker before it can re-join.

With ``preload`` (``ds-resilience run --preload MODULES``, or ``DSR_PRELOAD=mod,mod`` in the
agent's environment) the agent starts one fork server that imports those modules once, and each
worker is a fork of it that runs the script as ``__main__`` (:func:`runpy.run_path`) with the
worker's own environment, arguments, ``sys.path[0]`` and output file: a real process with its own
pid, killed and reaped like any other, that starts in a fraction of a second. Only modules that
neither start threads nor touch a GPU at import may be preloaded (torch, deepspeed, megatron.core
qualify; the script's own code runs after the fork). A forked worker's parent is the fork server,
which exits when the agent does, so the worker's orphan check (``DSR_AGENT_PID``) names the server.
The fork server and this module are the agent's; what runs in the forked child before the script
(the worker's side) is :mod:`ds_resilience.runtime.fork_boot`.

Both kinds of process answer ``pid``, ``poll()``, ``kill()``, ``wait(timeout)`` and ``returncode``
as :class:`subprocess.Popen` does (a negative return code is the signal that killed it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from ..runtime.build_locks import clear_stale_locks, extensions_root
from ..runtime.fork_boot import run_script
from ..runtime.rejoin_boot import needs_boot

__all__ = ["PRELOAD_VAR", "WorkerProcess", "fork_context", "preload_modules", "start_worker"]

PRELOAD_VAR = "DSR_PRELOAD"


class WorkerProcess(Protocol):
    pid: Any
    returncode: int | None

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def preload_modules(preload: Sequence[str] | str | None = None, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The modules to pre-import: ``preload`` when given, else ``DSR_PRELOAD`` (comma-separated)."""
    if preload is None:
        preload = (env if env is not None else os.environ).get(PRELOAD_VAR, "")
    if isinstance(preload, str):
        preload = preload.split(",")
    return tuple(m.strip() for m in preload if m.strip())


def fork_context(modules: Sequence[str]):
    """The process's forkserver context, its server preloading ``modules`` (the list of whoever
    starts it first: use one list per process, e.g. ``DSR_PRELOAD``)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["ds_resilience.supervisor.spawn_server", *modules])  # it dies with its starter
    return ctx


def zombie_status(pid: int) -> int | None:
    """The exit status of ``pid`` if it has exited and awaits its parent's ``wait`` (a zombie), as
    :attr:`subprocess.Popen.returncode` gives it (``-N``: killed by signal N); ``None`` while it runs
    (or where ``/proc`` does not say: Linux >= 3.5 keeps the status in ``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3, exit_code field 52
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


_REPORT_WAIT_S = 10.0
"""How long :meth:`_ForkedProc.poll` waits for the fork server's report on a worker it has reaped."""


class _ForkedProc:
    """A worker forked from the fork server, with :class:`subprocess.Popen`'s process methods."""

    def __init__(self, process: Any) -> None:
        self._p = process
        self.pid = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            if not self._p.is_alive():
                self.returncode = self._p.exitcode
            else:  # the fork server (its parent) reaps it and only then reports: seconds late under load
                self.returncode = zombie_status(self.pid)
                if self.returncode is None and not os.path.exists(f"/proc/{self.pid}"):
                    # reaped, not reported yet: it has exited, its status is on the way (a bounded
                    # wait, else the agent would take the silent heartbeat of a dead worker for a hang)
                    self._p.join(_REPORT_WAIT_S)
                    if not self._p.is_alive():
                        self.returncode = self._p.exitcode
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                self._p.kill()
            except (OSError, ValueError):  # gone meanwhile
                pass

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
        return self.returncode  # type: ignore[return-value]


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def start_worker(script: str, args: Sequence[str], *, env: Mapping[str, str], log: str | os.PathLike[str] | None,
                 preload: Sequence[str] = ()) -> WorkerProcess:
    """Start ``python -u script args`` with exactly ``env``, output to ``log`` (else inherited):
    a fresh interpreter, or (``preload`` non-empty) a fork of the fork server that imported them.
    A JIT op build lock left by a worker killed while holding it is removed first
    (:func:`~ds_resilience.runtime.build_locks.clear_stale_locks`): the new worker would wait on it forever."""
    clear_stale_locks(extensions_root(env), echo=_say)
    if preload:
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
        ctx = fork_context(preload)
        process = ctx.Process(target=run_script, args=(str(script), list(args), dict(env),
                                                       None if log is None else str(log)),
                              name=f"worker {Path(script).name}")
        process.start()
        return _ForkedProc(process)
    out: Any = None
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    try:
        boot = ["-m", "ds_resilience.runtime.rejoin_boot"] if needs_boot(env) else []
        return subprocess.Popen([sys.executable, "-u", *boot, str(script), *args], env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out is not None:
            out.close()
