"""ZeRO-1 under the agent: a SIGKILLed shard holder, its shard rebuilt, a re-join re-sharded."""

from __future__ import annotations
import pytest
import torch
from conformance_programs import run_case
from dist_harness import run_workers
from test_conformance import assert_same_params
from test_zero1 import ZERO1  # noqa: F401


@pytest.mark.timeout(900)
def test_zero1_live_death_then_rejoin_reshards_and_equals_zero0(tmp_path):
    """Under the agent, PP=2 x DP=3 in the user's configuration (Adam, clipping 1.0, bf16) with
    ZeRO-1: rank 4 (stage 1) is SIGKILLed mid-backward. Its optimizer shard comes back from the
    in-memory snapshot tier and stage 1 re-shards over the two survivors; the agent relaunches it,
    it re-joins and the stage re-shards over three again. The fp32 masters end equal to a
    fault-free ZeRO-0 run's."""
    from test_live import USER_CONFIG, assert_masters_equal, logs, run_job

    steps = 36  # paced at 0.6 s a step: the relaunched process needs 10-20 s to start on a shared 2-core machine
    code, _, reference = run_job(tmp_path, world=6, name="ref", steps=steps, deepspeed=USER_CONFIG)
    assert code == 0, logs(tmp_path, "ref")
    fault = {"rank": 4, "step": 3, "point": "mid_backward", "kind": "sigkill"}
    code, events, dumps = run_job(tmp_path, world=6, faults=[fault], rejoin_after=0.5, steps=steps, pace=0.6,
                                  deepspeed=USER_CONFIG | ZERO1)
    assert code == 0, logs(tmp_path, "job")
    assert [(e.kind, e.rank) for e in events if e.kind in ("crash", "rejoin")] == [("crash", 4), ("rejoin", 4)]
    assert_masters_equal(dumps, reference, steps=steps)
    for rank in (3, 5):  # stage 1's survivors: pipelines 0 and 2
        reshards = [r for r in dumps[rank]["recovery"] if r["kind"] == "zero_reshard"]
        assert [(r["from"], r["to"]) for r in reshards] == [([0, 1, 2], [0, 2]), ([0, 2], [0, 1, 2])], reshards
        # the dead replica's shard was read from the snapshot tier (by the stage's lowest survivor)
        assert reshards[0]["from_snapshots"] == [4]
    joined = [r for r in dumps[4]["recovery"] if r["kind"] in ("joined", "zero_reshard")]
    assert [r["kind"] for r in joined] == ["zero_reshard", "joined"], dumps[4]["recovery"]
    assert joined[0]["resume_step"] == joined[1]["resume_step"] > 3 and joined[0]["to"] == [0, 1, 2]
    for d in dumps.values():
        assert d["zero"]["members"] == [0, 1, 2]
        assert abs(d["zero"]["shard"] - d["zero"]["total"] / 3) <= 1


@pytest.mark.timeout(600)
def test_zero1_live_death_leaves_one_replica_holding_the_whole_state(tmp_path):
    """PP=2 x DP=2, ZeRO-1, rank 1 (stage 0) SIGKILLed in its optimizer step: rank 0 rebuilds the
    dead half of the state from the snapshot tier and steps the whole stage alone, equal to ZeRO-0."""
    from test_live import USER_CONFIG, assert_masters_equal, logs, run_job

    code, _, reference = run_job(tmp_path, name="ref", deepspeed=USER_CONFIG)
    assert code == 0, logs(tmp_path, "ref")
    fault = {"rank": 1, "step": 4, "point": "in_optimizer", "kind": "sigkill"}
    code, events, dumps = run_job(tmp_path, faults=[fault], deepspeed=USER_CONFIG | ZERO1)
    assert code == 0, logs(tmp_path, "job")
    assert_masters_equal(dumps, reference, dead=[1])
    assert dumps[0]["zero"]["members"] == [0] and dumps[0]["zero"]["shard"] == dumps[0]["zero"]["total"]
    assert dumps[2]["zero"]["members"] == [0, 1]
