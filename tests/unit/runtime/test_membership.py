"""Membership in one process: epoch records, store waits, the epoch watcher, heartbeats, the launch
contract, the fault injector's bookkeeping and the agent's argument checks (the agent's runs are in
tests/live/test_agent.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from ds_resilience.config import FaultInjection
from ds_resilience.errors import ConfigError, ResilienceError
from ds_resilience.runtime import membership as mb
from ds_resilience.runtime.faults import FaultInjector, FaultPointError, faults_from_env
from ds_resilience.supervisor.agent import Agent, AgentError
from test_agent import WORKER, _bare_coordinator, fault, store  # noqa: F401


def test_epoch_record_round_trip_and_invariants():
    rec = mb.EpochRecord(epoch=2, failed=(3, 1), alive=(0, 2), reason="r", detected_at=1.5, kind="crash")
    assert rec.failed == (1, 3)
    assert mb.EpochRecord.from_json(rec.to_json()) == rec
    for bad in (dict(epoch=0, failed=(), alive=(0,)), dict(epoch=1, failed=(0,), alive=(0,)),
                dict(epoch=1, failed=(), alive=(0,), joining=(1,)), dict(epoch=1, failed=(), alive=(), kind="x"),
                dict(epoch=1, failed=(), alive=(), stop=True, kind="crash"), dict(epoch=1, failed=(-1,), alive=())):
        with pytest.raises(mb.MembershipError):
            mb.EpochRecord(**bad)
    with pytest.raises(ResilienceError):
        mb.EpochRecord.from_json('{"epoch": 1, "bogus": 2}')


def test_publish_read_latest_wait(store):
    assert mb.latest_epoch(store) == 0 and mb.read_epoch(store, 1) is None
    assert mb.wait_epoch(store, 1, 0.05) is None
    rec = mb.EpochRecord(epoch=1, failed=(), alive=(0, 1))
    mb.publish_epoch(store, rec)
    assert mb.latest_epoch(store) == 1 and mb.read_epoch(store, 1) == rec == mb.wait_epoch(store, 1, 1.0)
    with pytest.raises(mb.MembershipError, match="expected 2"):
        mb.publish_epoch(store, mb.EpochRecord(epoch=3, failed=(), alive=(0,)))
    mb.register_worker(store, mb.WorkerInfo(rank=1, pipeline=1, stage=0, pid=42, incarnation=2))
    assert mb.read_worker(store, 1) == mb.WorkerInfo(rank=1, pipeline=1, stage=0, pid=42, incarnation=2)
    assert mb.read_worker(store, 0) is None and mb.read_status(store, 0) is None
    mb.set_status(store, 0, "saved")
    assert mb.read_status(store, 0) == "saved"


def test_epoch_watcher_sees_epochs_in_order_and_survives_callback_errors(store):
    seen: list[int] = []

    def on_epoch(rec: mb.EpochRecord) -> None:
        seen.append(rec.epoch)
        if rec.epoch == 2:
            raise RuntimeError("a buggy callback must not kill the watcher")

    mb.publish_epoch(store, mb.EpochRecord(epoch=1, failed=(), alive=(0, 1, 2)))
    watcher = mb.EpochWatcher(store, on_epoch)  # after = latest = 1
    watcher.start()
    for g in range(2, 7):  # published faster than the watcher polls
        mb.publish_epoch(store, mb.EpochRecord(epoch=g, failed=(), alive=(0, 1, 2), kind="rejoin"))
    deadline = time.monotonic() + 5
    while len(seen) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    assert not watcher.is_alive()
    assert seen == [2, 3, 4, 5, 6]


def _rejoin(epoch: int) -> mb.EpochRecord:
    return mb.EpochRecord(epoch=epoch, failed=(), alive=(0, 1), joining=(1,), stop=False, reason="r", detected_at=0.0,
                          kind="rejoin")


def _crash(epoch: int) -> mb.EpochRecord:
    return mb.EpochRecord(epoch=epoch, failed=(1,), alive=(0,), joining=(), stop=False, reason="c", detected_at=0.0,
                          kind="crash")


def test_a_rejoin_epoch_does_not_interrupt_a_store_wait_but_a_failure_does(store):
    """A re-join is applied at the next iteration boundary and poisons nothing, so a store wait in
    the iteration must go on (giving up would leave peers blocked in a collective this worker
    walked out of); a crash after it, or alone, interrupts the wait."""
    from ds_resilience.runtime.coordinator import Reconfigure

    c = _bare_coordinator(store)
    rejoin = _rejoin(2)
    c._latch(rejoin)
    assert c.pending() is rejoin and c.interrupting() is None
    threading.Timer(0.3, lambda: store.set("k/late", "v")).start()
    assert c.wait_key("k/late") == b"v"  # waited through the latched re-join
    with pytest.raises(Reconfigure):
        c.check()  # the iteration boundary applies it
    crash = _crash(3)
    c._latch(crash)
    with pytest.raises(Reconfigure) as err:
        c.wait_key("k/never")
    assert err.value.record is crash
    c.applied = 3
    c._latch(mb.EpochRecord(epoch=4, failed=(), alive=(0, 1), joining=(1,), stop=False, reason="r",
                            detected_at=0.0, kind="rejoin"))
    c.begin(c.pending())  # applying the re-join itself: a newer failure still interrupts its waits
    c._latch(mb.EpochRecord(epoch=5, failed=(1,), alive=(0,), joining=(), stop=False, reason="c",
                            detected_at=0.0, kind="crash"))
    assert c.interrupting().epoch == 5


def test_a_rejoin_a_peer_started_applying_interrupts_a_store_wait(store):
    """Ranks reach their iteration boundaries at different times: once one rank applies the
    re-join (announce_switch), a peer still inside the iteration must give up its store waits for
    it (the switched rank will never post what they wait for), and only for that epoch."""
    from ds_resilience.runtime.coordinator import Reconfigure

    c, peer = _bare_coordinator(store), _bare_coordinator(store)
    rejoin = _rejoin(2)
    c._latch(rejoin)
    assert c.interrupting() is None
    threading.Timer(0.3, lambda: peer.announce_switch(rejoin)).start()
    started = time.monotonic()
    with pytest.raises(Reconfigure) as err:
        c.wait_key("k/never-posted")
    assert err.value.record is rejoin and time.monotonic() - started < 3.0
    c.begin(rejoin)  # applying it: its own waits are not interrupted by its own switch
    assert c.interrupting() is None
    c.mark_applied(rejoin)
    later = mb.EpochRecord(epoch=3, failed=(), alive=(0, 1), joining=(1,), stop=False, reason="r", detected_at=0.0,
                           kind="rejoin")
    c._latch(later)
    assert c.interrupting() is None  # the switch of epoch 2 says nothing about epoch 3


def test_a_boundary_that_is_not_a_training_iteration_leaves_a_rejoin_but_not_a_failure(store):
    """Stop 48's CI: a relaunched worker registered as training ended; rank 0 passed its last
    boundary (``close_snapshots``) before the re-join epoch came and exited, ranks 1 and 2 applied
    it at theirs and waited 30 s for rank 0's agreement. CI run I: the survivors applied a re-join
    at a ``save_checkpoint`` and waited for the joiner in the save's barrier, the joiner for them
    in its first iteration. Outside a training iteration's start a re-join is left; a failure or a
    stop is still applied."""
    from ds_resilience.runtime.coordinator import Reconfigure

    c = _bare_coordinator(store)
    rejoin = _rejoin(2)
    c._latch(rejoin)
    c.check(rejoin=False)  # left: nothing raised
    assert c.pending() is rejoin
    with pytest.raises(Reconfigure):
        c.check()  # the start of a training iteration applies it
    crash = _crash(3)
    c._latch(crash)
    with pytest.raises(Reconfigure) as err:
        c.check(rejoin=False)
    assert err.value.record is crash


def test_heartbeat_bumps_counter_and_marks_a_deliberate_stop(store):
    hb = mb.Heartbeat(store, 3, 0.02)
    hb.start()
    time.sleep(0.3)
    assert mb.read_heartbeat(store, 3) >= 5
    assert not store.check([mb.hb_stopped_key(3)])
    hb.stop()
    assert not hb.is_alive() and store.check([mb.hb_stopped_key(3)])
    value = mb.read_heartbeat(store, 3)
    time.sleep(0.1)
    assert mb.read_heartbeat(store, 3) == value


def test_agent_env(monkeypatch):
    assert mb.agent_env({}) is None
    monkeypatch.delenv("DSR_AGENT", raising=False)
    assert mb.agent_store_from_env() is None
    env = {"DSR_AGENT": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "RANK": "2", "WORLD_SIZE": "4",
           "DSR_INCARNATION": "1", "DSR_REJOIN": "1", "DSR_HEARTBEAT_INTERVAL_S": "0.25", "DSR_AGENT_PID": "7"}
    assert mb.agent_env(env) == mb.AgentEnv(host="127.0.0.1", port=1234, rank=2, world_size=4, incarnation=1,
                                            rejoin=True, heartbeat_interval_s=0.25, agent_pid=7)
    with pytest.raises(mb.MembershipError, match="incomplete"):
        mb.agent_env({"DSR_AGENT": "1", "MASTER_ADDR": "x"})


# --- fault injection ----------------------------------------------------------------------------
def test_fault_injector_fires_once_at_its_rank_step_point():
    calls: list[tuple[int, int]] = []
    faults = [FaultInjection(rank=1, step=2, point="in_reduce", kind="hang"),
              FaultInjection(rank=0, step=2, point="in_reduce", kind="exit")]
    inj = FaultInjector(faults, 1, env={}, kill=lambda pid, sig: calls.append((pid, sig)))
    for step in range(4):
        for point in ("before_forward", "mid_backward", "in_reduce", "in_optimizer"):
            inj.maybe_fire(point, step)
            inj.maybe_fire(point, step)  # the same point again: already fired
    assert calls == [(os.getpid(), signal.SIGSTOP)]
    assert inj.fired == [faults[0]] and inj.pending == ()
    with pytest.raises(FaultPointError, match="allowed"):
        inj.maybe_fire("in_forward", 0)


def test_fault_injector_env_override_and_relaunch_disarm():
    env = {"DSR_FAULTS": json.dumps([fault(0, 1, "mid_backward", "exit")])}
    inj = FaultInjector([FaultInjection(rank=0, step=5, point="in_reduce", kind="exit")], 0, env=env)
    assert [(f.step, f.point) for f in inj.pending] == [(1, "mid_backward")]
    assert not FaultInjector((), 0, env={**env, "DSR_INCARNATION": "1"}).armed
    assert faults_from_env({}) is None
    with pytest.raises(ConfigError, match=r"DSR_FAULTS\[0\]\.kind"):
        faults_from_env({"DSR_FAULTS": json.dumps([fault(0, 1, kind="explode")])})
    with pytest.raises(ConfigError, match="DSR_FAULTS"):
        faults_from_env({"DSR_FAULTS": "[{"})


def test_a_delay_fault_sleeps_its_seconds_then_returns_and_needs_them(monkeypatch):
    """``delay`` (a straggler): the main thread sleeps the fault's seconds and goes on, once; the
    kind needs ``seconds`` and no other kind takes them."""
    from ds_resilience.runtime import faults as faults_module

    slept: list[float] = []
    monkeypatch.setattr(faults_module.time, "sleep", slept.append)
    inj = FaultInjector([FaultInjection(rank=0, step=3, point="in_replan", kind="delay", seconds=25.0)], 0, env={},
                        kill=lambda pid, sig: pytest.fail("a delay sends no signal"))
    inj.maybe_fire("in_replan", 2)
    assert slept == []
    inj.maybe_fire("in_replan", 3)
    inj.maybe_fire("in_replan", 3)
    assert slept == [25.0] and inj.pending == ()
    with pytest.raises(ConfigError, match="seconds.*required by kind 'delay'"):
        FaultInjection(rank=0, step=3, point="in_replan", kind="delay")
    with pytest.raises(ConfigError, match="kind 'sigkill'"):
        faults_from_env({"DSR_FAULTS": json.dumps([{**fault(0, 1, kind="sigkill"), "seconds": 2}])})


def test_only_a_joining_coordinator_gives_up_its_waits_when_training_is_over(store):
    """The survivors' waits ignore the key (they finished or are finishing by themselves); a
    re-joining worker's waits end with TrainingOver, its other waits are untouched until then."""
    from ds_resilience.runtime.coordinator import TrainingOver

    survivor, joiner = _bare_coordinator(store), _bare_coordinator(store)
    joiner.joining = True
    store.set("k/posted", "v")
    assert joiner.wait_key("k/posted") == b"v"
    threading.Timer(0.3, lambda: store.set(mb.TRAINING_OVER_KEY, "rank 0 finished training")).start()
    started = time.monotonic()
    with pytest.raises(TrainingOver, match="rank 0 finished training"):
        joiner.wait_key("k/never", timeout_s=20.0)
    assert time.monotonic() - started < 3.0
    with pytest.raises(ResilienceError, match="timed out"):
        survivor.wait_key("k/never", timeout_s=0.3)
    joiner.rank, joiner.incarnation = 1, 2
    joiner.admitted()  # a donor's state arrived: the survivors train on with it
    assert not joiner.joining and mb.admitted(store, 1) == 2
    with pytest.raises(ResilienceError, match="timed out"):
        joiner.wait_key("k/never", timeout_s=0.3)


def test_agent_rejects_bad_arguments(tmp_path):
    with pytest.raises(AgentError, match="num_workers"):
        Agent(WORKER, num_workers=0)
    with pytest.raises(AgentError, match="heartbeat"):
        Agent(WORKER, num_workers=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)
    with pytest.raises(AgentError, match="not found"):
        Agent(tmp_path / "nope.py", num_workers=1)


def _slow(epoch: int, speeds=((1, 0.5),)) -> mb.EpochRecord:
    return mb.EpochRecord(epoch=epoch, failed=(), alive=(0, 1, 2, 3), reason="r", kind="slow", speeds=speeds)


def test_a_slow_epoch_carries_its_speeds_through_json_and_checks_them():
    from ds_resilience.epochs import SWITCH_KINDS, SlowRequest

    rec = _slow(2, {3: 0.75, 1: 0.5})
    assert rec.speeds == ((1, 0.5), (3, 0.75)) and "slow" in SWITCH_KINDS
    assert mb.EpochRecord.from_json(rec.to_json()) == rec  # pairs come back as JSON lists
    assert _slow(3, ()).speeds == ()  # none slow any more
    assert mb.EpochRecord.from_json(mb.EpochRecord(epoch=1, failed=(), alive=(0,)).to_json()).speeds == ()
    for bad in (dict(kind="crash", speeds=((1, 0.5),)), dict(speeds=((7, 0.5),)), dict(speeds=((1, 1.0),)),
                dict(speeds=((1, 0.0),)), dict(speeds=((1, 0.5), (1, 0.6))), dict(speeds=((1, "x"),)),
                dict(speeds=((-1, 0.5),)), dict(speeds=5)):
        with pytest.raises(mb.MembershipError):
            mb.EpochRecord(**{"epoch": 2, "failed": (), "alive": (0, 1, 2, 3), "kind": "slow", **bad})
    req = SlowRequest(seq=3, speeds={2: 0.4}, reason="rank 2 slow")
    assert SlowRequest.from_json(req.to_json()) == req and req.speeds == ((2, 0.4),)
    for bad_json in ('{"seq": 0}', '{"seq": 1, "speeds": [[1, 2.0]]}', '{"seq": 1, "bogus": 1}', "not json"):
        with pytest.raises(mb.MembershipError):
            SlowRequest.from_json(bad_json)


def test_a_slow_epoch_is_a_switch_applied_at_a_training_iteration_boundary(store):
    """Like a re-join: a store wait in the iteration goes on, a save's boundary leaves it, the
    next training iteration's start applies it; once a peer started applying it, waits give up."""
    from ds_resilience.runtime.coordinator import Reconfigure

    c, peer = _bare_coordinator(store), _bare_coordinator(store)
    slow = _slow(2)
    c._latch(slow)
    assert c.pending() is slow and c.interrupting() is None
    threading.Timer(0.2, lambda: store.set("k/slow-late", "v")).start()
    assert c.wait_key("k/slow-late") == b"v"
    c.check(rejoin=False)  # a save's boundary: left
    with pytest.raises(Reconfigure):
        c.check()
    peer.announce_switch(slow)
    with pytest.raises(Reconfigure) as err:
        c.wait_key("k/never-posted-slow")
    assert err.value.record is slow


def test_the_reporting_ranks_request_becomes_the_agents_slow_epoch_once(store):
    """runtime/stragglers.request_switch posts the slow workers; the agent publishes one sealed
    ``slow`` epoch per request (a failed rank left out), and none for a request it has acted on."""
    from ds_resilience.runtime.stragglers import request_switch

    agent = Agent(WORKER, num_workers=4, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, echo=lambda m: None)
    agent.store = store
    agent._publish("start", "launching")
    agent._slow_requests()
    assert len(agent.epochs) == 1  # no request yet
    first = request_switch(store, {1: 0.4567}, "rank 1 slow at iteration 9")
    assert first.seq == 1 and first.speeds == ((1, 0.46),)
    agent._slow_requests()
    agent._slow_requests()  # the same request: nothing more
    rec = mb.read_epoch(store, 2, secret=agent.secret)
    assert len(agent.epochs) == 2 and rec.kind == "slow" and rec.speeds == ((1, 0.46),) and not rec.stop
    assert "rank 1 at 0.46x" in rec.reason and [e.kind for e in agent.events][-1] == "slow"
    agent._failed.add(3)
    assert request_switch(store, {1: 0.5, 3: 0.5}).seq == 2
    agent._slow_requests()
    assert mb.read_epoch(store, 3, secret=agent.secret).speeds == ((1, 0.5),)
    request_switch(store, {})  # recovered: none slow
    agent._slow_requests()
    back = mb.read_epoch(store, 4, secret=agent.secret)
    assert back.kind == "slow" and back.speeds == () and "no worker slow" in back.reason
    store.set("dsr/slow_request", "garbage")
    agent._slow_requests()
    assert len(agent.epochs) == 4
