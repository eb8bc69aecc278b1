"""Replicas re-placed after a failure (issue 43, item 6), on real gloo processes.

PP=2 x DP=2, one rank per machine, two copies of every snapshot, groups {0,1} {2,3}: rank 2's
replicas go to rank 3, its stage peer. Rank 3 is SIGKILLed after step 2; the survivors re-place
the replicas over the three machines left, so rank 2's newer snapshots reach another machine. Then
rank 2's machine is lost as well (its host memory wiped): stage 1 is left only with what other
machines hold, and the restart must restore the newest step (at most one behind), not step 2.
"""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch

from dist_harness import run_workers
from ds_resilience.checkpoint.restore_plan import LOCAL, PEER
import replacement_programs as prog

STEPS, DIE_AFTER, VICTIM = 6, 2, 3


def _same(a: dict, b: dict) -> None:
    assert a["lr"] == b["lr"]
    for x, y in zip(a["params"] + a["exp_avg"], b["params"] + b["exp_avg"]):
        assert torch.equal(x, y)


@pytest.mark.timeout(300)
def test_a_dead_targets_owner_replicates_elsewhere_and_a_second_loss_restores_the_newest_step(tmp_path):
    cfg = {"ranks_per_machine": 1, "replicas": 2, "host_dir": str(tmp_path / "shm"), "interleave": False,
           "chunk_mb": 0.05}
    job = f"t{uuid.uuid4().hex[:8]}"
    trained = run_workers(prog.train_through_a_target_failure, 4, args=(cfg, job, STEPS, VICTIM, DIE_AFTER),
                          timeout_s=180, allow_exit={VICTIM})
    assert trained[VICTIM] is None
    survivors = [r for r in range(4) if r != VICTIM]
    assert trained[2]["send_before"] == [3]  # rank 2's replicas went to the rank that died
    for r in survivors:
        t = trained[r]
        assert t["placements"] == 1 and t["replicated"] and not t["errors"], (r, t["errors"])
        assert t["send_to"] and VICTIM not in t["send_to"] and r not in t["send_to"], (r, t["send_to"])
        for src, held in t["held"].items():
            assert STEPS in held, (r, src, held)
    holder = trained[2]["send_to"][0]
    assert STEPS in trained[holder]["held"][2]  # rank 2's newest snapshot is on another machine now

    shutil.rmtree(tmp_path / "shm" / job / "machine2")  # rank 2's machine is lost: stage 1 has no memory of its own
    restored = run_workers(prog.restore_by_stage, 4, args=(cfg, job), timeout_s=180)
    plan_step = restored[0]["step"]
    assert plan_step in (STEPS - 1, STEPS)  # at most the iteration in flight lost (without re-placement: step 2)
    sources = restored[0]["sources"]
    assert sources[2] == (PEER, holder, 2) and sources[3] == (PEER, holder, 2), sources
    assert sources[0][0] == sources[1][0] == LOCAL
    for r in range(4):
        assert restored[r]["steps"] == plan_step
    if plan_step == STEPS:
        for r in range(4):
            _same(restored[r]["digest"], trained[r - r % 2]["digest"])  # ranks 2s and 2s + 1 train alike
