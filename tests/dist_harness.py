"""Run a function in N real processes on gloo over loopback, bounded by a timeout.

Workers are forked from a fork server that has imported torch and deepspeed once (``DSR_PRELOAD``), so a 4-process
job starts in well under a second instead of ~15 s of imports. Each worker gets the usual
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one CPU thread, and returns a
picklable result. A job that does not finish in time is killed and fails the test: a hang is a
failure, never a frozen CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["free_port", "run_workers", "WorkerFailure"]

_CTX = None


class WorkerFailure(AssertionError):
    """A worker raised, died, or the job timed out."""


_PORTS = range(20000, 32000)  # below Linux's ephemeral range (32768-60999)


def free_port() -> int:
    """A port for a store a test's process will host: free now, and drawn below the ephemeral range.
    A port the kernel hands out for a bind to port 0 comes from that range, where every outgoing
    connection of the suite's jobs (gloo pairs, store clients) also takes its port: between this
    check and the store's bind one of them could take it (fresh-clone run P: "Address already in
    use", and a rank connected to another job's store)."""
    import random

    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def _context():
    global _CTX
    if _CTX is None:
        from ds_resilience.supervisor.spawn import fork_context, preload_modules

        # the agent's list (conftest sets DSR_PRELOAD), and DeepSpeed's Muon optimizer: vanilla DeepSpeed
        # engines with ZeRO (the reference runs) import it to check their optimizer, about 6 s of a core
        # per rank under load (integrations/warm.py); one fork server per process serves them all
        preload = preload_modules() or ("torch", "torch.distributed", "deepspeed", "ds_resilience",
                                        "ds_resilience.integrations.warm")
        _CTX = fork_context((*preload, "deepspeed.runtime.zero.muon.muon_optimizer"))
    return _CTX


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, env: dict[str, str], args: tuple, queue,
           dump_after: float) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(dump_after, exit=False)  # a hang shows where each rank waits
    from ds_resilience.runtime.fork_boot import freeze_preloaded_objects

    freeze_preloaded_objects()  # the server's imports: out of the collector's way, as for the agent's workers
    from ds_resilience.runtime.build_locks import guard_build_locks

    guard_build_locks()  # a rank's op load gives up on a lock whose holder died, as the agent's workers' do
    # the platform's start method again (fork), as in a fresh interpreter and in the agent's forked
    # workers (runtime/fork_boot.py): a DataLoader's worker processes would otherwise each be
    # started by a fork server of their own, 2 s apiece, and a loader closed while they start
    # waits up to 5 s per worker
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, world, *args)
        # plain pickle: by value (multiprocessing's reducers would pass tensors as shared-memory
        # handles that die with this process)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    allow_exit: set[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results by rank.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of processes.
        timeout_s: the whole job's deadline.
        env: extra environment variables for every worker.
        allow_exit: ranks allowed to die without a result (killed on purpose).

    Raises:
        WorkerFailure: a worker raised (its traceback is in the message), died, or the job timed out.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, dict(env or {}), args, queue, max(5.0, timeout_s - 15)),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    expected = set(range(world_size)) - set(allow_exit)
    try:
        while not expected <= set(results):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailure(f"job timed out after {timeout_s:.0f}s; results from ranks {sorted(results)}")
            try:
                rank, status, payload = queue.get(timeout=min(1.0, remaining))
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r in expected]
                if dead:
                    # give the queue a moment: a result may still be in flight
                    time.sleep(0.5)
                    if queue.empty():
                        raise WorkerFailure(f"ranks {dead} ended without a result (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"{rank}: {payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise WorkerFailure("worker failed:\n" + "\n".join(errors))
    return [results.get(r) for r in range(world_size)]
