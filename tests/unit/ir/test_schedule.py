import json

import pytest

from ds_resilience.errors import ScheduleError
from ds_resilience.ir import Action, ActionKind, Schedule, parse_action
from ds_resilience.planning import decoupled, one_f_one_b


@pytest.mark.parametrize(
    "action, text",
    [
        (Action(kind=ActionKind.F, stage=2, microbatch=5, pipeline=1), "p1s2F5"),
        (Action(kind=ActionKind.B, stage=0, microbatch=12, pipeline=10), "p10s0B12"),
        (Action(kind=ActionKind.W, stage=3, microbatch=0, pipeline=0), "p0s3W0"),
        (Action(kind=ActionKind.BW, stage=1, microbatch=2, pipeline=3), "p3s1BW2"),
        (Action(kind=ActionKind.SEND_ACT, stage=2, microbatch=5, pipeline=1, peer=7), "p1s2SA5>7"),
        (Action(kind=ActionKind.RECV_ACT, stage=3, microbatch=5, pipeline=1, peer=6), "p1s3RA5<6"),
        (Action(kind=ActionKind.SEND_GRAD, stage=2, microbatch=5, pipeline=1, peer=3), "p1s2SG5>3"),
        (Action(kind=ActionKind.RECV_GRAD, stage=1, microbatch=5, pipeline=1, peer=6), "p1s1RG5<6"),
        (Action(kind=ActionKind.REDUCE_GRAD, stage=2), "s2RD"),
        (Action(kind=ActionKind.OPT_STEP, stage=2), "s2OPT"),
        (Action(kind=ActionKind.CKPT_SEND, stage=2, microbatch=3, peer=4), "s2CS3>4"),
        (Action(kind=ActionKind.CKPT_RECV, stage=0, microbatch=3, peer=5), "s0CR3<5"),
    ],
)
def test_action_text_round_trip(action, text):
    assert str(action) == text
    assert parse_action(text) == action


@pytest.mark.parametrize(
    "text", ["p1s2X5", "s2F5", "p1F5", "p1s2SA5", "p1s2SA5<3", "p1s2RA5>3", "p1s2OPT", "s1RD3", "", "p1s2F5>3"]
)
def test_bad_action_text_rejected(text):
    with pytest.raises(ScheduleError):
        parse_action(text)


def test_action_fields_checked_per_kind():
    with pytest.raises(ScheduleError, match="peer"):
        Action(kind=ActionKind.SEND_ACT, stage=0, microbatch=0, pipeline=0)
    with pytest.raises(ScheduleError, match="takes no microbatch"):
        Action(kind=ActionKind.OPT_STEP, stage=0, microbatch=1)
    with pytest.raises(ScheduleError, match="stage"):
        Action(kind=ActionKind.F, stage=-1, microbatch=0, pipeline=0)


@pytest.mark.parametrize("make", [one_f_one_b, decoupled])
@pytest.mark.parametrize("dp,pp,m", [(1, 2, 2), (2, 3, 5), (3, 4, 6)])
def test_schedule_text_and_json_round_trip(make, dp, pp, m):
    s = make(dp, pp, m)
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_json(s.to_json()) == s
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_failed_worker_round_trips_and_is_checked():
    s = one_f_one_b(2, 2, 2)
    text = s.to_text()
    assert "(failed)" not in text
    with pytest.raises(ScheduleError, match="failed worker 1 has"):
        Schedule(dp=2, pp=2, microbatches=2, workers=s.workers, failed=frozenset({1}))


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("w0: p0s0F0", "must start with"),
        ("# ds_resilience schedule pp=2\nw0: p0s0F0", "lacks dp/pp/microbatches"),
        ("# ds_resilience schedule dp=1 pp=1 microbatches=1\nx0: p0s0F0", "does not start with"),
        ("# ds_resilience schedule dp=1 pp=1 microbatches=1\nw3: p0s0F0", "out of range"),
        ("# ds_resilience schedule dp=1 pp=1 microbatches=1\nw0: p0s0Q0", "cannot parse action"),
    ],
)
def test_bad_schedule_text(text, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Schedule.from_text(text)


def test_trusted_action_equals_the_checked_one():
    """The unchecked constructor the list scheduler and the lowering use builds the same action
    (equal, same hash, same text) as the checked one, for every kind."""
    from ds_resilience.ir.action import trusted_action

    for text in ("p1s2F5", "p1s2B5", "p1s2W5", "p1s2BW5", "p1s2SA5>7", "p1s3RA5<6", "p1s2SG5>3", "p1s1RG5<6",
                 "s2RD", "s2OPT", "s3TR0", "s2CS3>4", "s2CR3<5"):
        a = parse_action(text)
        b = trusted_action(a.kind, a.stage, a.microbatch, a.pipeline, a.peer)
        assert b == a and hash(b) == hash(a) and str(b) == text and type(b) is Action
