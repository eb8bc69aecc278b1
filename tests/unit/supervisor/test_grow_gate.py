"""The agent's gate before a grow-back epoch (issue 46, part 2): it publishes the ``grows`` re-join
only when every rank the re-grid left out registered, every survivor finished applying every
epoch (a grow published mid-re-grid would interrupt it: the race fresh-clone CI run 6 hit), and
growing pays on the figures the re-formed grid's lead posts; when it does not pay the relaunched
workers are stopped and nobody is relaunched until the next re-grid. In one process, on a
``HashStore``, with stand-in children."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ds_resilience import store_keys as keys
from ds_resilience.epochs import EpochRecord, MembershipError
from ds_resilience.runtime import membership as mb
from ds_resilience.supervisor.agent import Agent


class _Proc:
    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout=None) -> int:
        return -9


def _agent(tmp_path, *, grow_back=True):
    script = tmp_path / "train.py"
    script.write_text("")
    agent = Agent(script, num_workers=6, regrid=True, grow_back=grow_back, rejoin_after_s=0.0, echo=lambda m: None)
    agent.store = dist.HashStore()
    agent._workers = {r: SimpleNamespace(rank=r, state="running", proc=_Proc(), pidfd=None, incarnation=0,
                                         registered_at=None, launched_at=0.0, admitted=False) for r in range(6)}
    for r in (2, 3):  # both replicas of stage 1 died; the survivors re-grid; 2 and 3 are relaunched
        agent._workers[r].state, agent._workers[r].incarnation = "joining", 1
    agent._failed = {2, 3}
    agent.epochs = [EpochRecord(epoch=1, failed=(), alive=tuple(range(6))),
                    EpochRecord(epoch=2, failed=(2, 3), alive=(0, 1, 4, 5), kind="crash")]
    for record in agent.epochs:
        mb.publish_epoch(agent.store, record, secret=agent.secret)
    agent._regridded = True
    return agent


def _figures(store, *, small_s=1.0, full_s=0.7, pause_s=0.3, left=None):
    store.set(keys.GROW_FIGURES, json.dumps({"grid": 1, "step": 5, "small_s": small_s, "full_s": full_s,
                                             "pause_s": pause_s, "iterations_left": left}))


def _applied(store, ranks, epoch):
    for r in ranks:
        mb.mark_applied(store, r, epoch)


def test_the_grow_waits_for_every_survivors_regrid_then_for_the_figures(tmp_path):
    agent = _agent(tmp_path)
    joiners = [agent._workers[2], agent._workers[3]]
    _figures(agent.store)
    _applied(agent.store, (0, 1, 4), 2)  # rank 5 is still inside its re-grid (epoch 2 not applied)
    assert not agent._grow_ready(joiners)
    _applied(agent.store, (5,), 2)
    assert agent._grow_ready(joiners)
    assert [e.kind for e in agent.events] == ["grow"] and "growing back pays" in agent.events[0].detail
    agent.store.delete_key(keys.GROW_FIGURES)
    assert not agent._grow_ready(joiners)  # no figures yet: the lead has not trained an iteration on the small grid


def test_the_grow_waits_for_every_rank_left_out(tmp_path):
    agent = _agent(tmp_path)
    _figures(agent.store)
    _applied(agent.store, (0, 1, 4, 5), 2)
    agent._rejoin_due[3] = 1e12  # rank 3's relaunch is still due
    agent._workers[3].state = "failed"
    assert not agent._grow_ready([agent._workers[2]]) and agent._grow_declined is None
    del agent._rejoin_due[3]  # it gave up: the first grid cannot be re-formed
    assert not agent._grow_ready([agent._workers[2]])
    assert "ranks [3] are not coming back" in agent._grow_declined


@pytest.mark.parametrize("figures", [dict(small_s=1.0, full_s=1.2),  # the first grid would be slower
                                     dict(small_s=1.0, full_s=0.9, pause_s=5.0, left=10)])  # saves 1 s, pauses 5 s
def test_a_grow_that_does_not_pay_stops_the_relaunched_workers_and_the_relaunches(tmp_path, figures):
    agent = _agent(tmp_path)
    _figures(agent.store, **figures)
    _applied(agent.store, (0, 1, 4, 5), 2)
    joiners = [agent._workers[2], agent._workers[3]]
    assert not agent._grow_ready(joiners)
    assert "does not pay" in agent._grow_declined
    assert all(w.proc.killed and w.state == "failed" for w in joiners)
    assert [e.kind for e in agent.events][:1] == ["grow_declined"]
    assert not agent._growing_back()  # no relaunch until the next re-grid
    agent._regridded = False
    agent._no_more_rejoins("epoch 9: a second re-grid")
    assert agent._growing_back()


def test_the_published_grow_is_a_rejoin_that_says_it_grows(tmp_path):
    agent = _agent(tmp_path)
    _figures(agent.store)
    _applied(agent.store, (0, 1, 4, 5), 2)
    for r in (2, 3):
        mb.register_worker(agent.store, mb.WorkerInfo(rank=r, pipeline=r % 2, stage=r // 2, pid=1, incarnation=1,
                                                      dp=2, pp=3), secret=agent.secret)
    agent.store.set(mb.REGRIDDED_KEY, "epoch 2: 4 survivors of 2 x 3")
    agent._rejoins()
    record = agent.epochs[-1]
    assert record.kind == "rejoin" and record.grows and record.joining == (2, 3), record
    assert not agent._regridded  # the first grid again: a later lost stage re-grids anew
    assert agent._regrid_raw == b"epoch 2: 4 survivors of 2 x 3"  # that re-grid's word is not acted on again
    assert EpochRecord.from_json(record.to_json()) == record


def test_grows_goes_with_a_rejoin_only():
    with pytest.raises(MembershipError, match="grows=True only goes with kind 'rejoin'"):
        EpochRecord(epoch=3, failed=(2,), alive=(0, 1), kind="crash", grows=True)
    with pytest.raises(MembershipError, match="grows must be true or false"):
        EpochRecord(epoch=3, failed=(), alive=(0, 1), joining=(1,), kind="rejoin", grows=1)
    old = json.loads(EpochRecord(epoch=3, failed=(), alive=(0, 1), joining=(1,), kind="rejoin").to_json())
    old.pop("grows")  # a record from an agent older than the field
    assert EpochRecord.from_json(json.dumps(old)).grows is False


def test_the_iterations_left_come_from_the_schedulers_total_when_it_has_one():
    from ds_resilience.integrations.ds_grow import iterations_left

    engine = SimpleNamespace(global_steps=30, lr_scheduler=SimpleNamespace(total_num_steps=100))  # WarmupDecayLR's
    assert iterations_left(engine) == 70
    engine.global_steps = 120
    assert iterations_left(engine) == 0
    assert iterations_left(SimpleNamespace(global_steps=3, lr_scheduler=None)) is None  # unknown: taken as many
    assert iterations_left(SimpleNamespace(global_steps=3, lr_scheduler=SimpleNamespace(total_num_steps=True))) is None


def test_figures_that_cannot_be_read_decline_the_grow():
    from ds_resilience.supervisor.grow_gate import grow_verdict

    store = dist.HashStore()
    store.set(keys.GROW_FIGURES, json.dumps({"small_s": "fast", "full_s": 1.0, "pause_s": 0.1}))
    verdict = grow_verdict(store, left_out={2}, back={2}, coming=lambda r: False, survivors=[], newest_epoch=0)
    assert verdict.action == "decline" and "figures are unreadable" in verdict.detail
    store.set(keys.GROW_FIGURES, json.dumps({"small_s": 1.0, "full_s": 0.5, "pause_s": -1.0}))  # a negative pause
    assert grow_verdict(store, left_out={2}, back={2}, coming=lambda r: False, survivors=[],
                        newest_epoch=0).action == "decline"
