"""A forked worker's start: in a fork of the agent's fork server, become ``python -u script args``.

The agent (:mod:`ds_resilience.supervisor.spawn`, ``ds-resilience run --preload``) starts one fork
server that imports the preloaded modules once and forks every worker from it; :func:`run_script`
is the forked child's target, so this module runs inside the worker process, before the user's
script: it redirects the output, drops the multiprocessing state the server handed down, freezes
the preloaded objects, takes the worker's own environment, arguments and ``sys.path[0]``, stands in
the default group of a relaunched worker (:mod:`.rejoin_boot`) and runs the script as
``__main__``, exiting as the interpreter would.
"""

from __future__ import annotations

import os
import sys

__all__ = ["freeze_preloaded_objects", "run_script"]


def _forget_the_agents_multiprocessing() -> None:
    """A forked worker starts with multiprocessing as a fresh interpreter has it. The fork server
    hands each child the agent's descriptors (its 'alive' pipe, its resource tracker) and the
    agent's start method: kept, a worker would hold the server open after the agent died (so the
    worker's orphan check would never fire) and its data-loader workers would come from a fork
    server of its own that outlives it."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver  # type: ignore[attr-defined]
    tracker = resource_tracker._resource_tracker  # type: ignore[attr-defined]
    for holder, attr in ((server, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(holder, attr, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
            setattr(holder, attr, None)
    multiprocessing.set_start_method(None, force=True)  # the platform's default again


def freeze_preloaded_objects() -> None:
    """Move every object the fork server imported out of the garbage collector's reach
    (:func:`gc.freeze`): they live as long as the process, and a full collection would otherwise
    walk all of them (DeepSpeed's ~200k objects: ~0.1 s; with megatron.core ~0.4 s, each time
    training's garbage triggers one), and touching them copies the server's pages into the child."""
    import gc

    gc.freeze()


def run_script(script: str, args: list[str], env: dict[str, str], log: str | None) -> None:
    """In the forked child: become ``python -u script args`` with ``env`` and exit as it would."""
    import atexit
    import io
    import runpy
    import signal
    import threading
    import traceback

    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    # -u: unbuffered text streams on the (possibly new) descriptors 1 and 2
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    _forget_the_agents_multiprocessing()
    freeze_preloaded_objects()
    from .build_locks import guard_build_locks

    guard_build_locks()  # with torch preloaded: a load waits on no dead holder's lock
    os.environ.clear()
    os.environ.update(env)
    os.environ["DSR_AGENT_PID"] = str(os.getppid())  # the fork server: it dies with the agent
    script_dir = os.path.dirname(os.path.abspath(script))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [script_dir, *extra]
    sys.argv = [script, *args]
    if env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    code: int = 0
    try:
        from .attempt_scope import scope_rendezvous
        from .rejoin_boot import stand_in_if_rejoining

        stand_in_if_rejoining(env)
        scope_rendezvous(env)
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught error
        traceback.print_exc()
        code = 1
    try:  # what an interpreter does on its way out: join threads, run atexit handlers
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code & 0xFF)
