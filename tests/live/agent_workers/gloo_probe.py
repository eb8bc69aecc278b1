"""Child programs of ``tests/live/test_gloo_contract.py``: one gloo scenario per function.

Each runs in its own process (forked from a fork server that has imported torch), connects to the
TCPStore its parent hosts (the parent plays the agent), builds the default gloo process group with
a 60 s timeout through ``env://`` rendezvous in agent-store mode, and reports what happened as JSON
under ``res/{rank}`` in the store. Times are ``time.time()`` (one machine, one clock).
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run_child", "SCENARIOS", "PG_TIMEOUT_S", "CRASH_VICTIM"]

PG_TIMEOUT_S = 60.0
_STORE_TIMEOUT = timedelta(seconds=30)
_POISON_TAG = 9999


def _report(store: dist.Store, rank: int, result: dict[str, Any]) -> None:
    store.set(f"res/{rank}", json.dumps(result))


def _wait(store: dist.Store, key: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"key {key!r} not set within {timeout_s} s")
        time.sleep(0.005)


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; return {ok, t (end time), dt, error}."""
    start = time.time()
    try:
        value = fn()
        return {"ok": True, "t": time.time(), "dt": time.time() - start, "value": value}
    except Exception as exc:  # noqa: BLE001 - the error is the measurement
        return {"ok": False, "t": time.time(), "dt": time.time() - start, "error": f"{type(exc).__name__}: {exc}"}


def _recv(pg: Any, src: int, tag: int = 0) -> float:
    t = torch.zeros(4)
    pg.recv([t], src, tag).wait()
    return float(t.sum())


def _send(pg: Any, dst: int, value: float = 1.0, tag: int = 0) -> bool:
    pg.send([torch.full((4,), value)], dst, tag).wait()
    return True


def _new_group(store: dist.Store, name: str, rank: int, size: int) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, timedelta(seconds=PG_TIMEOUT_S))


CRASH_VICTIM = 1


def crash(rank: int, world: int, store: dist.Store, pg: Any) -> dict[str, Any]:
    """The survivors block in recv from rank ``CRASH_VICTIM``, which the parent SIGKILLs.

    Then they use the store and build new groups among themselves: a standalone gloo group (dense
    ranks) and a ``dist.new_group`` with local synchronisation (original global ranks).
    """
    store.set(f"posted/{rank}", str(time.time()))
    if rank == CRASH_VICTIM:
        time.sleep(120)  # killed long before
        return {}
    res: dict[str, Any] = {"recv": _attempt(lambda: _recv(pg, CRASH_VICTIM))}

    def store_ops() -> str:  # (d) the parent's store still serves after the death
        store.set(f"after/{rank}", "x")
        store.add("after/count", 1)
        return store.get(f"after/{rank}").decode()
    res["store"] = _attempt(store_ops)
    survivors = [r for r in range(world) if r != CRASH_VICTIM]
    me = survivors.index(rank)

    def standalone() -> dict[str, Any]:  # (c) a fresh ProcessGroupGloo on a new prefix
        g = _new_group(store, "gen1", me, len(survivors))
        t = torch.ones(2) * (rank + 1)
        g.allreduce([t]).wait()
        out: dict[str, Any] = {"allreduce": t.tolist()}
        if me == 0:
            out["send"] = _send(g, 1, 7.0)
        elif me == 1:
            out["recv"] = _recv(g, 0)
        return out
    res["standalone"] = _attempt(standalone)

    def new_group() -> dict[str, Any]:  # dist.new_group among survivors, global ranks kept
        g = dist.new_group(survivors, use_local_synchronization=True)
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t, group=g)
        out: dict[str, Any] = {"allreduce": t.tolist()}
        x = torch.full((4,), 3.0)
        if rank == survivors[0]:
            dist.send(x, dst=survivors[1], group=g)
        elif rank == survivors[1]:
            dist.recv(x.zero_(), src=survivors[0], group=g)
            out["recv"] = float(x.sum())
        return out
    res["new_group"] = _attempt(new_group)
    return res


def poison(rank: int, world: int, store: dist.Store, pg: Any) -> dict[str, Any]:
    """Ranks 0 and 1 block in recv from each other (both alive); rank 0 poisons the pair."""
    res: dict[str, Any] = {}
    if rank in (0, 1):
        peer = 1 - rank
        box: dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(blocked=_attempt(lambda: _recv(pg, peer))), daemon=True)
        th.start()
        store.set(f"posted/{rank}", str(time.time()))
        if rank == 0:
            _wait(store, "posted/1")
            time.sleep(0.5)  # both recvs are really pending
            t0 = time.time()
            store.set("poison_t", str(t0))
            res["poison"] = _attempt(lambda: pg.recv([torch.zeros(1)], 1, _POISON_TAG)
                                     .wait(timeout=timedelta(milliseconds=1)))
        th.join(timeout=15)
        res["blocked"] = box.get("blocked", {"ok": False, "t": time.time(), "error": "still blocked after 15 s"})
        res["poison_t"] = float(store.get("poison_t"))
        # the poisoned pair stays closed; pairs to other ranks are untouched
        if rank == 0:
            res["send_peer_after"] = _attempt(lambda: _send(pg, 1))
            res["send_bystander"] = _attempt(lambda: _send(pg, 2, 5.0, tag=1))
    elif rank == 2:
        res["recv_from_0"] = _attempt(lambda: _recv(pg, 0, tag=1))
    return res


def p2p_timeout(rank: int, world: int, store: dist.Store, pg: Any) -> dict[str, Any]:
    """Rank 0 times out a recv from rank 1 with Work.wait(timeout); then rank 1 sends."""
    res: dict[str, Any] = {}
    if rank == 0:
        t = torch.zeros(4)
        work = pg.recv([t], 1, 0)
        res["timed_wait"] = _attempt(lambda: work.wait(timeout=timedelta(milliseconds=300)))
        store.set("timed_out", "1")
        res["recv_again"] = _attempt(lambda: _recv(pg, 1))
        res["send_after"] = _attempt(lambda: _send(pg, 1, tag=2))
    else:
        _wait(store, "timed_out")
        time.sleep(0.2)
        res["send"] = _attempt(lambda: _send(pg, 0))
        res["recv_after"] = _attempt(lambda: _recv(pg, 0, tag=2))
    return res


def abort(rank: int, world: int, store: dist.Store, pg: Any) -> dict[str, Any]:
    """Rank 0 blocks in recv from rank 1 (alive, silent) and calls the gloo backend's abort() and
    shutdown() from another thread; then, 1.5 s later, poisons the pair."""
    res: dict[str, Any] = {}
    if rank == 0:
        box: dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(blocked=_attempt(lambda: _recv(pg, 1))), daemon=True)
        th.start()
        time.sleep(0.3)
        backend = pg._get_backend(torch.device("cpu"))
        res["abort"] = _attempt(lambda: (backend.abort(), backend.shutdown()) and None)
        th.join(timeout=1.5)
        res["blocked_after_abort"] = th.is_alive()
        res["poison_t"] = time.time()
        res["poison"] = _attempt(lambda: pg.recv([torch.zeros(1)], 1, _POISON_TAG)
                                 .wait(timeout=timedelta(milliseconds=1)))
        th.join(timeout=10)
        res["blocked"] = box.get("blocked", {"ok": False, "t": time.time(), "error": "still blocked"})
        store.set("done", "1")
    else:
        _wait(store, "done", 30.0)
    return res


SCENARIOS: dict[str, Callable[[int, int, dist.Store, Any], dict[str, Any]]] = {
    "crash": crash, "poison": poison, "p2p_timeout": p2p_timeout, "abort": abort,
}


def run_child(scenario: str, rank: int, world: int, port: int) -> None:
    """Entry point of one child: env:// rendezvous against the parent's store, then the scenario."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_STORE_TIMEOUT)
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=PG_TIMEOUT_S))
        pg = dist.distributed_c10d._get_default_group()
        result = SCENARIOS[scenario](rank, world, store, pg)
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"crashed": traceback.format_exc()}
    _report(store, rank, result)
    os._exit(0)  # skip gloo/PG teardown: a dead peer could block it
