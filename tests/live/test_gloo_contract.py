"""Contract tests: the torch 2.13 gloo behaviours the live-failure design relies on.

If a torch upgrade changes any of these, the recovery design (``../shared/research/runtime.md``
sections 0, 4 and 5) must be revisited, so they fail loudly here rather than as hangs elsewhere.

Setup, as in production: this (parent) process hosts the TCPStore and plays the agent; the workers
are real processes (forked from the shared fork server, which has imported torch) that join the
default gloo group through ``env://`` rendezvous in agent-store mode, with a process-group timeout
of 60 s, so a test that passes in a few seconds proves nothing waited for that timeout. Scenario
code is in ``agent_workers/gloo_probe.py``; each reports JSON with ``time.time()`` stamps.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from agent_workers import gloo_probe
from dist_harness import _context as forkserver_context

pytestmark = pytest.mark.timeout(60)

DEADLINE_S = 20.0


def _run(scenario: str, world: int, kill: int | None = None) -> dict[Any, Any]:
    """Run ``scenario`` on ``world`` ranks; SIGKILL rank ``kill`` once every rank has posted its op."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=DEADLINE_S))
    ctx = forkserver_context()
    procs = [ctx.Process(target=gloo_probe.run_child, args=(scenario, r, world, store.port), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[Any, Any] = {"store": store}
    deadline = time.monotonic() + DEADLINE_S

    def wait_key(key: str) -> None:
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise AssertionError(f"{scenario}: {key!r} not set within {DEADLINE_S} s")
            time.sleep(0.005)
    try:
        if kill is not None:
            for r in range(world):
                wait_key(f"posted/{r}")
            time.sleep(0.5)  # the survivors' recvs are pending by now
            out["t_kill"] = time.time()
            os.kill(procs[kill].pid, signal.SIGKILL)
        for r in range(world):
            if r != kill:
                wait_key(f"res/{r}")
                out[r] = json.loads(store.get(f"res/{r}"))
                assert "crashed" not in out[r], out[r]["crashed"]
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
    return out


@pytest.fixture(scope="module")
def crash_run() -> dict[Any, Any]:
    """Three ranks; the middle one is SIGKILLed while both others block in recv from it."""
    return _run("crash", 3, kill=gloo_probe.CRASH_VICTIM)


SURVIVORS = (0, 2)


def test_pending_recv_from_killed_peer_fails_fast(crash_run):
    """(a) A crash is seen in-band by a peer waiting on the dead rank, long before the 60 s timeout."""
    for r in SURVIVORS:
        recv = crash_run[r]["recv"]
        assert not recv["ok"]
        assert "connection closed by peer" in recv["error"].lower(), recv["error"]
        assert recv["t"] - crash_run["t_kill"] < 2.0, recv


def test_store_in_non_worker_process_keeps_serving(crash_run):
    """(d) The parent's store serves the survivors after a worker died (set/add/get, rendezvous)."""
    for r in SURVIVORS:
        assert crash_run[r]["store"]["ok"] and crash_run[r]["store"]["value"] == "x", crash_run[r]["store"]
    assert crash_run["store"].add("after/count", 0) == len(SURVIVORS)
    # env:// in agent-store mode (TORCHELASTIC_USE_AGENT_STORE=True) made the workers clients of
    # this store; torch 2.13 keeps the default group's keys under "default_pg/" with no
    # "/worker/attempt_N" prefix (the agent relies on neither colliding with its "dsr/" keys).
    keys = crash_run["store"].list_keys()
    assert any(k.startswith("default_pg/") for k in keys), keys
    assert not any("attempt" in k or k.startswith("dsr/") for k in keys), keys


def test_survivors_build_a_standalone_gloo_group(crash_run):
    """(c) ProcessGroupGloo(PrefixStore(new prefix, store), dense rank, n) works among survivors."""
    for r in SURVIVORS:
        res = crash_run[r]["standalone"]
        assert res["ok"], res
        assert res["value"]["allreduce"] == [4.0, 4.0]  # ranks 0 and 2 contribute 1 and 3
    assert crash_run[2]["standalone"]["value"]["recv"] == 28.0


def test_survivors_new_group_keeps_global_ranks(crash_run):
    """(c') dist.new_group(survivors, use_local_synchronization=True) works with global ranks."""
    for r in SURVIVORS:
        assert crash_run[r]["new_group"]["ok"], crash_run[r]["new_group"]
        assert crash_run[r]["new_group"]["value"]["allreduce"] == [4.0, 4.0]
    assert crash_run[2]["new_group"]["value"]["recv"] == 12.0  # dist.send(dst=2) reached global rank 2


def test_poison_releases_blocked_recvs_on_both_sides():
    """(b) Ranks 0 and 1 are alive and blocked in recv from each other; rank 0's other thread calls
    recv(src=1, tag=X).wait(1 ms). The poison raises, and both blocked recvs fail within ~1 s.

    Pinned as observed: the timeout closes *all* of rank 0's pairs in that group, not just (0, 1):
    rank 0's later send to bystander rank 2 fails, and rank 2's pending recv from rank 0 fails.
    """
    run = _run("poison", 3)
    r0, r1, r2 = run[0], run[1], run[2]
    assert not r0["poison"]["ok"] and "timed out" in r0["poison"]["error"].lower(), r0["poison"]
    t_poison = r0["poison_t"]
    assert not r0["blocked"]["ok"] and "pair closure" in r0["blocked"]["error"], r0["blocked"]
    assert not r1["blocked"]["ok"] and "connection closed by peer" in r1["blocked"]["error"].lower(), r1["blocked"]
    for res in (r0["blocked"], r1["blocked"]):
        assert res["t"] - t_poison < 1.5, (res, t_poison)
    assert not r0["send_peer_after"]["ok"], "the poisoned pair stays closed"
    assert not r0["send_bystander"]["ok"] and "pair closure" in r0["send_bystander"]["error"]
    assert not r2["recv_from_0"]["ok"] and r2["recv_from_0"]["t"] - t_poison < 1.5, r2


def test_p2p_wait_timeout_is_destructive():
    """(e) Work.wait(timeout) on a p2p recv that times out closes the pair for good: the next recv
    on it fails at once, and the peer's later send fails with 'Connection closed by peer'."""
    run = _run("p2p_timeout", 2)
    r0, r1 = run[0], run[1]
    assert not r0["timed_wait"]["ok"] and "timed out waiting 300ms" in r0["timed_wait"]["error"].lower()
    assert 0.25 < r0["timed_wait"]["dt"] < 2.0
    assert not r0["recv_again"]["ok"] and "pair closure" in r0["recv_again"]["error"]
    assert r0["recv_again"]["dt"] < 0.5
    assert not r0["send_after"]["ok"]
    assert not r1["send"]["ok"] and "connection closed by peer" in r1["send"]["error"].lower(), r1["send"]
    assert not r1["recv_after"]["ok"]


def test_gloo_abort_does_not_release_a_blocked_op_but_poison_does():
    """Why the design poisons: in torch 2.13 the gloo backend's abort() and shutdown() return at
    once and leave a blocked recv blocked (pytorch#130345); the poison still frees it afterwards."""
    r0 = _run("abort", 2)[0]
    assert r0["abort"]["ok"] and r0["abort"]["dt"] < 0.5, r0["abort"]
    assert r0["blocked_after_abort"], "abort() released the blocked recv: gloo can be aborted now"
    assert not r0["blocked"]["ok"] and r0["blocked"]["t"] - r0["poison_t"] < 1.5, r0
