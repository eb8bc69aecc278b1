"""Re-joins under the agent: a SIGKILLed worker relaunched (``rejoin_after``) joins the survivors at
an iteration boundary and training stays exact, also when the re-join reaches ranks in different
iterations and around the re-plan after the self-profile.

Split from ``test_live.py`` (whose helpers these use) so the two files run on two pytest-xdist
workers at once: these jobs are paced, and spend most of their time waiting.
"""

from __future__ import annotations

import pytest

from test_live import TRAINING_DATA, USER_CONFIG, assert_equal_to_reference, assert_masters_equal, logs, run_job  # noqa: E402


@pytest.mark.timeout(600)
def test_rejoin_returns_to_fault_free_and_stays_exact(tmp_path):
    steps = 40  # paced at 0.4 s a step: the relaunched process needs a few seconds to start
    code, _, reference = run_job(tmp_path, name="ref", steps=steps)
    assert code == 0, logs(tmp_path, "ref")
    fault = {"rank": 1, "step": 2, "point": "mid_backward", "kind": "sigkill"}
    code, events, dumps = run_job(tmp_path, faults=[fault], rejoin_after=0.5, steps=steps, pace=0.4)
    assert code == 0, logs(tmp_path, "job")
    assert any(e.kind == "rejoin" for e in events), [e.kind for e in events]
    assert 1 in dumps, "the re-joined worker finished and dumped its state\n" + logs(tmp_path, "job")
    joined = [r for r in dumps[1]["recovery"] if r["kind"] == "joined"]
    assert joined and 2 < joined[0]["resume_step"] < steps, dumps[1]["recovery"]
    # back to fault-free: after the re-join every worker runs its own pipeline's work only
    assert_equal_to_reference(dumps, reference, steps=steps)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting", ["lab", "user"])
def test_a_rejoin_reaching_ranks_in_different_iterations_is_applied_by_all_of_them(tmp_path, setting):
    """Ranks meet a re-join at different points: survivor rank 3 runs 0.35 s behind its peers (a
    straggler's phase, paced at 0.5 s a step), so when the re-join lands in that gap rank 3 sees it at
    its iteration boundary while the others are inside the iteration, blocked on rank 3. The rank that
    applies it first releases the others (it closes its old groups and marks the switch for store
    waits), they apply it too, and the run ends exact. Before, they waited on each other until the
    store timeout killed the job.

    ``user``: the same under what a DeepSpeed user brings rather than the lab setup: bf16 with fp32
    masters, DeepSpeed's default clipping 1.0 and Adam (``USER_CONFIG``), their own data loader
    (``training_data``) and activation checkpointing on every block; the re-joined run ends with the
    masters of a fault-free run of the same configuration."""
    steps = 40
    user = setting == "user"
    deepspeed = USER_CONFIG if user else None
    extra = [*TRAINING_DATA, "--activation-checkpoint-interval", "1"] if user else []
    code, _, reference = run_job(tmp_path, name="ref", steps=steps, deepspeed=deepspeed, extra=extra)
    assert code == 0, logs(tmp_path, "ref")
    fault = {"rank": 1, "step": 2, "point": "mid_backward", "kind": "sigkill"}
    # relaunched 3 s (6 paced steps) after the failure, so that it registers after rank 3 fell behind at
    # step 5 even when its process starts in a fraction of a second (forked from the preloaded server)
    code, events, dumps = run_job(tmp_path, faults=[fault], rejoin_after=3.0, steps=steps, pace=0.5,
                                  deepspeed=deepspeed, extra=[*extra, "--lag", "3:5:0.35"])
    assert code == 0, logs(tmp_path, "job")
    assert any(e.kind == "rejoin" for e in events), [e.kind for e in events]
    joined = [r for r in dumps[1]["recovery"] if r["kind"] == "joined"]
    assert joined and 5 < joined[0]["resume_step"] < steps, dumps[1]["recovery"]
    if user:
        assert_masters_equal(dumps, reference, steps=steps)
    else:
        assert_equal_to_reference(dumps, reference, steps=steps)


@pytest.mark.timeout(600)
def test_a_rejoined_worker_plans_with_the_survivors_profile_and_a_later_failure_stays_exact(tmp_path):
    """DeepSpeed's user gives no cost model and no variant: the job profiles itself (one fused and
    one decoupled iteration) and every rank re-plans with what it measured (``auto``). Rank 1 dies
    after that and is relaunched; its configuration alone says unit costs and ``recycle``, so it
    must take rank 0's published cost model, variant and table, or the next failure (rank 3, after
    the join) would give it a different schedule from the survivors'. The run ends exact."""
    steps = 60  # paced at 0.5 s a step: the relaunched process takes seconds (17 s on a loaded machine) to join
    profiled = {"variant": None, "profile_steps": 1, "planner": {"solver": "heuristic"}}
    code, _, reference = run_job(tmp_path, name="ref", steps=steps, resilience=profiled)
    assert code == 0, logs(tmp_path, "ref")
    faults = [{"rank": 1, "step": 6, "point": "mid_backward", "kind": "sigkill"},
              {"rank": 3, "step": 52, "point": "before_forward", "kind": "sigkill"}]
    code, events, dumps = run_job(tmp_path, faults=faults, rejoin_after=0.5, steps=steps, pace=0.5,
                                  resilience=profiled)
    text = logs(tmp_path, "job")
    assert code == 0, text
    joined = [r for r in dumps[1]["recovery"] if r["kind"] == "joined"]
    assert joined and 6 < joined[0]["resume_step"] < 52, dumps[1]["recovery"]  # rank 3 dies after the join
    assert "plans rebuilt with the profiled costs" in (tmp_path / "job-logs" / "rank0.0.log").read_text()
    joiner = (tmp_path / "job-logs" / "rank1.1.log").read_text()
    line = next((x for x in joiner.splitlines() if "re-joining with rank 0's plans" in x), joiner[-3000:])
    assert "(build 1, profile" in line and line.endswith("variant auto)"), line  # not unit costs, not recycle
    crashes = [e for e in events if e.kind == "crash"]
    assert [e.rank for e in crashes] == [1, 3], [(e.kind, e.rank) for e in events]
    assert_equal_to_reference({r: d for r, d in dumps.items() if r != 3}, reference, steps=steps, dead=(3,), atol=1e-5)


PROFILED = {"variant": None, "profile_steps": 1, "planner": {"solver": "heuristic"}}
PROFILE_END = 3  # the profile (1 fused + 1 decoupled step after the memory step) ends at step 3


def _rejoin_around_the_replan(tmp_path, faults, *, joiner: int, extra):
    """A 40-step profiled run in the user's configuration with ``faults`` and re-joins, beside a
    fault-free one; asserts both ran to the end, ``joiner`` re-joined after the re-plan (before
    step 34, where the tests fail rank 3) and the survivors' masters equal the fault-free run's.
    Returns the agent's events, the ``joiner`` relaunch's log and its ``re-joining with`` line."""
    steps = 40
    code, _, reference = run_job(tmp_path, name="ref", steps=steps, resilience=PROFILED, deepspeed=USER_CONFIG,
                                 extra=extra)
    assert code == 0, logs(tmp_path, "ref")
    code, events, dumps = run_job(tmp_path, faults=faults, rejoin_after=0.5, steps=steps, pace=0.5,
                                  resilience=PROFILED, deepspeed=USER_CONFIG, extra=extra)
    assert code == 0, logs(tmp_path, "job")
    joined = [r for r in dumps[joiner]["recovery"] if r["kind"] == "joined"]
    assert joined and PROFILE_END <= joined[0]["resume_step"] < 34, dumps[joiner]["recovery"]  # after the re-plan
    assert_masters_equal({r: d for r, d in dumps.items() if r != 3}, reference, steps=steps, dead=(3,))
    log = (tmp_path / "job-logs" / f"rank{joiner}.1.log").read_text()
    line = next((x for x in log.splitlines() if "re-joining with rank 0's plans" in x), log[-3000:])
    return events, log, line


@pytest.mark.timeout(600)
def test_a_worker_relaunched_while_rank_0_rebuilds_the_plans_waits_for_that_build(tmp_path):
    """The profile is in and rank 0 has announced the re-plan (build 1), but it is slow to finish
    it (a 30 s straggler at ``in_replan``); rank 1 dies there and its relaunch comes up before the
    table does. It must wait for build 1, which the survivors adopt and answer its re-join with,
    not take build 0 (unit costs, ``recycle``): a later failure (rank 3) would then give it another
    schedule than theirs. In the user's configuration (Adam, clipping 1.0, bf16 with fp32 masters,
    their own data loader, activation checkpointing on every block); the survivors end with the
    masters of a fault-free run."""
    faults = [{"rank": 0, "step": PROFILE_END, "point": "in_replan", "kind": "delay", "seconds": 30.0},
              {"rank": 1, "step": PROFILE_END, "point": "in_replan", "kind": "sigkill"},
              {"rank": 3, "step": 34, "point": "before_forward", "kind": "sigkill"}]
    events, joiner, line = _rejoin_around_the_replan(tmp_path, faults, joiner=1,
                                                     extra=[*TRAINING_DATA, "--activation-checkpoint-interval", "1"])
    assert [e.rank for e in events if e.kind == "crash"] == [1, 3], [(e.kind, e.rank) for e in events]
    assert "waiting for rank 0's plan table (build 1" in joiner, joiner[-3000:]  # it came up during the build
    assert "(build 1, profile" in line and line.endswith("variant auto)"), line


@pytest.mark.timeout(600)
def test_when_rank_0_dies_rebuilding_the_plans_everyone_keeps_the_first_build_and_it_rejoins_with_it(tmp_path):
    """Rank 0 is SIGKILLed after it announced the re-plan (build 1) and before it published it: the
    ranks waiting for it give the re-plan up and keep build 0, and rank 0's relaunch, which finds
    build 1 announced but its publisher failed since, re-joins with build 0 too (it would wait 30
    minutes for a build nobody makes otherwise). A later failure (rank 3) is answered from build 0
    by all; the survivors end with the masters of a fault-free run (the user's configuration)."""
    faults = [{"rank": 0, "step": PROFILE_END, "point": "in_replan", "kind": "sigkill"},
              {"rank": 3, "step": 34, "point": "before_forward", "kind": "sigkill"}]
    events, joiner, line = _rejoin_around_the_replan(tmp_path, faults, joiner=0, extra=TRAINING_DATA)
    assert [e.rank for e in events if e.kind == "crash"] == [0, 3], [(e.kind, e.rank) for e in events]
    for rank in (1, 2):
        assert "re-plan abandoned" in (tmp_path / "job-logs" / f"rank{rank}.0.log").read_text(), logs(tmp_path, "job")
    assert "waiting for rank 0's plan table (build 1" in joiner, joiner[-3000:]  # announced, never published
    assert "(build 0, unit costs" in line and line.endswith("variant recycle)"), line
