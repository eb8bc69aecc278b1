"""The validator rejects broken schedules and marks the failing step in the grid it prints."""

import re

import pytest

from ds_resilience.errors import ScheduleError
from ds_resilience.ir import Schedule, validate
from ds_resilience.planning import decoupled, one_f_one_b


def _edit(schedule: Schedule, worker: int, fn) -> Schedule:
    """Apply ``fn`` to the token list of one worker and rebuild the schedule through its text form."""
    lines = schedule.to_text().splitlines()
    label, _, body = lines[worker + 1].partition(": ")
    tokens = fn(body.split())
    lines[worker + 1] = f"{label}: {' '.join(tokens)}"
    return Schedule.from_text("\n".join(lines))


def _marked(err: ScheduleError) -> str:
    """The token the error message brackets as the failing step."""
    m = re.search(r">>(\S+)<<", str(err))
    assert m, f"no marked step in:\n{err}"
    assert "<-- ERROR HERE" in str(err)
    return m.group(1)


def test_generated_schedules_are_valid():
    for dp, pp, m in [(1, 1, 1), (1, 2, 1), (2, 4, 8), (3, 4, 6)]:
        validate(one_f_one_b(dp, pp, m))
        validate(decoupled(dp, pp, m))


def test_missing_receive_rejected():
    s = one_f_one_b(1, 3, 3)  # worker 1 (stage 1) receives p0s1RA0<0 first
    broken = _edit(s, 1, lambda t: [x for x in t if x != "p0s1RA0<0"])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    # F0 on stage 1 now runs without its input: flagged at that step.
    assert _marked(info.value) == "p0s1F0"
    assert info.value.worker == 1


def test_unmatched_send_rejected():
    s = one_f_one_b(1, 3, 3)
    broken = _edit(s, 1, lambda t: [x.replace("p0s1RA2<0", "p0s1RA1<0") if x == "p0s1RA2<0" else x for x in t])
    with pytest.raises(ScheduleError):
        validate(broken)


def test_w_before_b_rejected():
    s = decoupled(1, 2, 2)

    def swap(tokens):
        i = tokens.index("p0s0B0")
        j = tokens.index("p0s0W0")
        tokens[i], tokens[j] = tokens[j], tokens[i]
        return tokens

    with pytest.raises(ScheduleError, match="W of p0s0 mb0 before its B") as info:
        validate(_edit(s, 0, swap))
    assert _marked(info.value) == "p0s0W0"


def test_second_opt_step_rejected():
    s = one_f_one_b(2, 2, 2)
    with pytest.raises(ScheduleError, match="OPT_STEP without a REDUCE_GRAD") as info:
        validate(_edit(s, 3, lambda t: t + ["s1OPT"]))
    assert _marked(info.value) == "s1OPT"
    assert info.value.worker == 3


def test_missing_opt_step_rejected():
    s = one_f_one_b(2, 2, 2)
    with pytest.raises(ScheduleError, match="expected one of each per iteration"):
        validate(_edit(s, 0, lambda t: t[:-1]))


def test_send_to_wrong_peer_rejected():
    s = one_f_one_b(2, 2, 2)  # worker 0 (p0, s0) sends activations to worker 2 (p0, s1)
    # Worker 1 holds stage 0 as well: an activation cannot go to a same-stage worker.
    with pytest.raises(ScheduleError, match="holds stage 0, a SEND_ACT needs stage 1") as info:
        validate(_edit(s, 0, lambda t: [x.replace(">2", ">1") for x in t]))
    assert _marked(info.value) == "p0s0SA0>1"


def test_send_to_other_pipeline_without_receive_rejected():
    s = one_f_one_b(2, 2, 2)  # redirect p0's activation to worker 3 (p1, s1), which never receives it
    with pytest.raises(ScheduleError, match="no matching (receive|send)") as info:
        validate(_edit(s, 0, lambda t: [x.replace("p0s0SA1>2", "p0s0SA1>3") for x in t]))
    # Either side of the broken pair is marked: the stray send or the receive left without one.
    assert _marked(info.value) in {"p0s0SA1>3", "p0s1RA1<0"}


def test_duplicate_forward_rejected():
    s = one_f_one_b(1, 1, 2)
    with pytest.raises(ScheduleError, match="runs twice"):
        validate(_edit(s, 0, lambda t: ["p0s0F0"] + t))


def test_missing_microbatch_rejected():
    s = one_f_one_b(1, 1, 2)
    with pytest.raises(ScheduleError, match="micro-batch 1 of pipeline 0 at stage 0 never runs"):
        validate(_edit(s, 0, lambda t: [x for x in t if not x.endswith("1")]))


def test_reduce_with_pending_w_rejected():
    s = decoupled(1, 2, 2)

    def extra_w_after_reduce(tokens):
        return tokens[:-1] + ["p0s1W1", tokens[-1]]

    with pytest.raises(ScheduleError, match="between REDUCE_GRAD and OPT_STEP") as info:
        validate(_edit(s, 1, extra_w_after_reduce))
    assert _marked(info.value) == "p0s1W1"

    def drop_w(tokens):
        tokens.remove("p0s1W1")
        return tokens

    with pytest.raises(ScheduleError, match="REDUCE_GRAD with backward still pending"):
        validate(_edit(s, 1, drop_w))


def test_deadlock_rejected_with_mark():
    s = one_f_one_b(1, 2, 2)
    # worker 0 order: F0 SA0 F1 SA1 RG0 BW0 RG1 BW1; moving RG1/BW1 before RG0 is fine as data flow
    # (and with gloo's tags), but worker 1 sends gradient 0 first: NCCL would put it in mb1's buffer
    def reorder(tokens):
        rg1, bw1 = "p0s0RG1<1", "p0s0BW1"
        tokens.remove(rg1)
        tokens.remove(bw1)
        i = tokens.index("p0s0F1")
        return tokens[: i + 2] + [rg1, bw1] + tokens[i + 2:]

    with pytest.raises(ScheduleError, match="in another order .*NCCL matches a pair's messages in order") as info:
        validate(_edit(s, 0, reorder))
    assert _marked(info.value) == "p0s0RG1<1"

    def deadlock(tokens):
        # receive mb1's gradient before sending mb1's activation: stage 1 can never produce it
        tokens.remove("p0s0SA1>1")
        i = tokens.index("p0s0BW1")
        return tokens[: i + 1] + ["p0s0SA1>1"] + tokens[i + 1:]

    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(_edit(s, 0, deadlock))
    assert _marked(info.value) in {"p0s0RG1<1", "p0s1RA1<0"}
