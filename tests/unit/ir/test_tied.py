"""Tied weights in the schedule IR: TIED_REDUCE (``s3TR0``), ``Schedule.tied``, the validator's rules,
the replay's collective, the cost field, the planner, the plan table, the provider and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ds_resilience.cli import main
from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError, ScheduleError
from ds_resilience.ir import (
    COLLECTIVE_KINDS,
    Action,
    ActionKind,
    Schedule,
    check_tied,
    format_grid,
    format_tied,
    parse_action,
    parse_tied,
    replay,
    simulate,
    validate,
)
from ds_resilience.planning import compute_orders, decoupled, generate, lower, one_f_one_b, repeat
from ds_resilience.planning.bounds import lower_bound, tied_cycle_bound, work_bound
from ds_resilience.planning.normalize import relabel_schedule
from ds_resilience.planning.planner import plan
from ds_resilience.planning.provider import ScheduleProvider
from ds_resilience.planning.table import TableSpec, build_table
from ds_resilience.topology import Topology, Worker
from ds_resilience.vocab import VARIANTS

TIED = ((0, 3),)


def _edit(schedule: Schedule, worker: int, fn) -> Schedule:
    """Apply ``fn`` to one worker's token list and rebuild the schedule through its text form."""
    lines = schedule.to_text().splitlines()
    label, _, body = lines[worker + 1].partition(": ")
    lines[worker + 1] = f"{label}: {' '.join(fn(body.split()))}"
    return Schedule.from_text("\n".join(lines))


def _tied_reduces(schedule: Schedule, w: int) -> list[Action]:
    return [a for a in schedule.workers[w] if a.kind is ActionKind.TIED_REDUCE]


def _check_tail(schedule: Schedule) -> None:
    """Every surviving worker of a tied stage: ... RD, its TRs in group order, OPT; others: no TR."""
    for w in schedule.alive():
        stage = w // schedule.dp
        groups = [g for g, grp in enumerate(schedule.tied) if stage in grp]
        actions = schedule.workers[w]
        assert [a.microbatch for a in _tied_reduces(schedule, w)] == groups * schedule.iterations
        if groups and schedule.iterations == 1:
            tail = [str(a) for a in actions[-(len(groups) + 2):]]
            assert tail == [f"s{stage}RD"] + [f"s{stage}TR{g}" for g in groups] + [f"s{stage}OPT"]


# --- the action ------------------------------------------------------------------------------
def test_action_text_round_trip():
    a = parse_action("s3TR0")
    assert a == Action(kind=ActionKind.TIED_REDUCE, stage=3, microbatch=0)
    assert str(a) == "s3TR0" and a.tied_group == 0 and a.pipeline is None and a.peer is None
    assert str(parse_action("s0TR12")) == "s0TR12"
    assert ActionKind.TIED_REDUCE.is_collective and ActionKind.REDUCE_GRAD.is_collective
    assert not ActionKind.OPT_STEP.is_collective and ActionKind.TIED_REDUCE in COLLECTIVE_KINDS
    assert not ActionKind.TIED_REDUCE.is_compute
    assert parse_action("p0s1F2").tied_group is None


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"stage": 3}, "tied group index"),
        ({"stage": 3, "microbatch": -1}, "tied group index"),
        ({"stage": 3, "microbatch": 0, "pipeline": 1}, "takes no pipeline"),
        ({"stage": 3, "microbatch": 0, "peer": 2}, "takes no peer"),
    ],
)
def test_action_needs_a_group_only(kwargs, fragment):
    with pytest.raises(ScheduleError, match=fragment):
        Action(kind=ActionKind.TIED_REDUCE, **kwargs)


def test_action_is_frozen():
    a = parse_action("s3TR0")
    with pytest.raises(AttributeError):
        a.microbatch = 1  # type: ignore[misc]


# --- the schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tied, fragment",
    [
        (((3, 0),), "sorted"),
        (((0, 0),), "at least 2 distinct"),
        (((2,),), "at least 2 distinct"),
        (((0, 4),), "0..3"),
        (((0, 3), (0, 3)), "listed twice"),
        (((0, "3"),), "integers"),
    ],
)
def test_bad_tied_groups_rejected(tied, fragment):
    s = one_f_one_b(1, 4, 2)
    with pytest.raises(ScheduleError, match=fragment):
        replace(s, tied=tied)


def test_tied_text_and_json_round_trip():
    tied = ((0, 3), (0, 2))
    s = decoupled(2, 4, 4, tied=tied)
    assert s.tied == tied
    text = s.to_text()
    assert "tied=0,3;0,2" in text.splitlines()[0]
    assert Schedule.from_text(text) == s
    assert Schedule.from_json(s.to_json()) == s
    assert s.to_dict()["tied"] == [[0, 3], [0, 2]]
    assert s.with_name("x").tied == tied
    assert repeat(s, 2).tied == tied
    assert s.tied_groups_of(0) == (0, 1) and s.tied_groups_of(2) == (1,) and s.tied_groups_of(1) == ()
    # lists are accepted and normalized to tuples
    assert replace(s, tied=[[0, 3], [0, 2]]).tied == tied


def test_untied_text_and_old_texts():
    s = one_f_one_b(2, 2, 2)
    assert "tied=-" in s.to_text().splitlines()[0]
    assert Schedule.from_text(s.to_text()).tied == ()
    old = s.to_text().replace(" tied=-", "")  # written before tied groups existed
    assert Schedule.from_text(old) == s
    data = s.to_dict()
    del data["tied"]
    assert Schedule.from_dict(data) == s


def test_tied_helpers():
    assert format_tied(()) == "-" and parse_tied("-") == ()
    assert parse_tied(format_tied(((0, 3), (1, 2)))) == ((0, 3), (1, 2))
    assert check_tied([[0, 3]], 4) == ((0, 3),)
    with pytest.raises(ScheduleError, match="expected e.g."):
        parse_tied("0,x")


# --- generators and lowering -----------------------------------------------------------------
@pytest.mark.parametrize("dp, pp, m", [(1, 4, 1), (1, 4, 4), (2, 4, 8), (3, 4, 6), (2, 5, 3)])
def test_generated_tied_schedules_are_valid(dp, pp, m):
    tied = ((0, pp - 1),)
    for s in (one_f_one_b(dp, pp, m, tied=tied), decoupled(dp, pp, m, tied=tied)):
        validate(s)
        assert s.tied == tied
        _check_tail(s)
        staggered = replace(s, optimizer="staggered")
        validate(staggered)
        validate(repeat(staggered, 3))


def test_overlapping_groups_and_generate():
    tied = ((0, 3), (0, 2), (1, 2, 3))
    for name in ("1f1b", "decoupled"):
        s = generate(name, 2, 4, 4, tied=tied)
        validate(s)
        _check_tail(s)


def test_compute_order_unchanged_by_tying():
    for dp, pp, m in [(1, 4, 4), (2, 4, 6)]:
        assert compute_orders(one_f_one_b(dp, pp, m, tied=((0, pp - 1),))) == compute_orders(one_f_one_b(dp, pp, m))
        assert compute_orders(decoupled(dp, pp, m, tied=((0, pp - 1),))) == compute_orders(decoupled(dp, pp, m))


def test_lower_round_trip_with_tied():
    s = decoupled(2, 4, 4, tied=TIED)
    again = lower(compute_orders(s), dp=2, pp=4, microbatches=4, name=s.name, tied=s.tied)
    assert again == s


# --- the planner -----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_planned_tied_schedules_are_valid(variant, stage):
    failed = [Worker(pipeline=1, stage=stage)]
    p = plan(3, 4, 4, failed, variant=variant, tied=TIED)
    s = p.schedule
    assert s.tied == TIED
    validate(s)
    _check_tail(s)
    if s.optimizer == "staggered":
        validate(repeat(s, 3))
    # a survivor that took a dead peer's micro-batches still runs exactly one TR
    assert p.iteration_time >= p.lower_bound - 1e-9
    assert p.lower_bound >= lower_bound(Topology(dp=3, pp=4).without(failed), 4, CostModel.unit(), variant=variant)


def test_planner_with_two_failures_and_cost():
    cost = CostModel(t_tied_reduce=(0.5, 0, 0, 1.5), t_reduce=0.5, t_opt=0.25)
    failed = [Worker(pipeline=0, stage=0), Worker(pipeline=1, stage=3)]
    for variant in VARIANTS:
        p = plan(3, 4, 4, failed, variant=variant, cost=cost, tied=((0, 3), (1, 3)))
        validate(p.schedule)
        _check_tail(p.schedule)
        assert p.iteration_time >= p.lower_bound - 1e-9


def test_planner_rejects_bad_tied():
    with pytest.raises(PlanningError, match="bad tied groups"):
        plan(2, 4, 2, [Worker(pipeline=0, stage=1)], tied=((0, 4),))


def test_cpsat_keeps_tied():
    pytest.importorskip("ortools")
    p = plan(2, 3, 3, [Worker(pipeline=1, stage=1)], variant="decoupled", solver="cpsat", time_limit_s=2.0,
             tied=((0, 2),))
    assert p.schedule.tied == ((0, 2),)
    validate(p.schedule)
    _check_tail(p.schedule)


def test_tied_cycle_bound_is_met_and_tight():
    # the staggered optimizer loses the overlap of the last stage's tail with the next iteration:
    # period >= (pp - 1) forwards + the last stage's whole iteration of work
    unit = CostModel.unit()
    top = Topology(dp=3, pp=4)
    assert work_bound(top, 6, unit) == 18
    assert tied_cycle_bound(top, 6, unit, TIED) == 21
    assert lower_bound(top, 6, unit, variant="recycle", tied=TIED) == 21
    # untied: the fill bound, stage 0 runs its 6 forwards, then waits one unit for the round trip
    assert lower_bound(top, 6, unit, variant="recycle") == 19
    # with twice 1F1B's memory, where the staggered optimizer overlaps iterations (at 1F1B's own
    # cap both plans take 22: memory, not the tied reduce, limits them there)
    tied_plan, free_plan = plan(3, 4, 6, tied=TIED, memory_cap=8), plan(3, 4, 6, memory_cap=8)
    assert tied_plan.iteration_time == pytest.approx(21)
    assert free_plan.iteration_time < tied_plan.iteration_time


# --- the validator ---------------------------------------------------------------------------
def _marked(err: ScheduleError) -> str:
    text = str(err)
    assert "<-- ERROR HERE" in text
    return text.split(">>", 1)[1].split("<<", 1)[0]


def test_missing_tied_reduce_rejected():
    s = one_f_one_b(2, 4, 4, tied=TIED)
    broken = _edit(s, 6, lambda t: [x for x in t if x != "s3TR0"])
    with pytest.raises(ScheduleError, match=r"OPT_STEP without TIED_REDUCE\(0\).*exactly one TIED_REDUCE\(0\)") as info:
        validate(broken)
    assert info.value.worker == 6 and _marked(info.value) == "s3OPT"


def test_tied_reduce_on_untied_worker_rejected():
    s = one_f_one_b(2, 4, 4, tied=TIED)
    broken = _edit(s, 2, lambda t: t[:-1] + ["s1TR0"] + t[-1:])
    with pytest.raises(ScheduleError, match="outside tied group 0") as info:
        validate(broken)
    assert info.value.worker == 2 and _marked(info.value) == "s1TR0"


def test_tied_reduce_before_last_backward_rejected():
    s = decoupled(2, 4, 4, tied=TIED)

    def early(tokens):
        tokens = [x for x in tokens if x != "s0TR0"]
        i = max(j for j, x in enumerate(tokens) if x.startswith("p0s0B"))
        return tokens[:i] + ["s0TR0"] + tokens[i:]

    with pytest.raises(ScheduleError, match="before the worker's last compute action") as info:
        validate(_edit(s, 0, early))
    assert info.value.worker == 0 and _marked(info.value) == "s0TR0"


def test_tied_reduce_before_reduce_grad_rejected():
    s = one_f_one_b(2, 4, 4, tied=TIED)

    def swap(tokens):
        i, j = tokens.index("s3RD"), tokens.index("s3TR0")
        tokens[i], tokens[j] = tokens[j], tokens[i]
        return tokens

    with pytest.raises(ScheduleError, match="before the worker's REDUCE_GRAD"):
        validate(_edit(s, 7, swap))


def test_tied_reduce_after_opt_step_rejected():
    s = one_f_one_b(2, 4, 4, tied=TIED)

    def late(tokens):
        tokens = [x for x in tokens if x != "s3TR0"]
        return tokens + ["s3TR0"]

    with pytest.raises(ScheduleError, match="after the iteration's OPT_STEP") as info:
        validate(_edit(s, 6, late))
    assert _marked(info.value) == "s3TR0"


@pytest.mark.parametrize("token, fragment", [("s3TR1", "tied group index 1 out of range"), ("s3TR7", "out of range")])
def test_bad_group_index_rejected(token, fragment):
    s = one_f_one_b(2, 4, 4, tied=TIED)
    broken = _edit(s, 6, lambda t: [token if x == "s3TR0" else x for x in t])
    with pytest.raises(ScheduleError, match=fragment):
        validate(broken)


def test_tied_reduce_without_tied_groups_rejected():
    s = one_f_one_b(2, 4, 4)
    broken = _edit(s, 6, lambda t: t[:-1] + ["s3TR0"] + t[-1:])
    with pytest.raises(ScheduleError, match="no tied groups"):
        validate(broken)


def test_tied_reduce_twice_rejected():
    s = one_f_one_b(2, 4, 4, tied=TIED)
    broken = _edit(s, 6, lambda t: t[:-1] + ["s3TR0"] + t[-1:])
    with pytest.raises(ScheduleError, match=r"TIED_REDUCE\(0\) twice"):
        validate(broken)


def test_inconsistent_group_order_deadlocks():
    s = one_f_one_b(2, 4, 2, tied=((0, 3), (0, 2)))

    def swap(tokens):
        i, j = tokens.index("s0TR0"), tokens.index("s0TR1")
        tokens[i], tokens[j] = tokens[j], tokens[i]
        return tokens

    broken = _edit(s, 0, swap)  # worker 0 reduces group 1 first, worker 1 group 0 first
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(broken)


# --- replay, timeline, costs -----------------------------------------------------------------
def _last_backward_end(schedule: Schedule, ends, stage: int) -> float:
    out = 0.0
    for w in range(stage * schedule.dp, (stage + 1) * schedule.dp):
        for a, e in zip(schedule.workers[w], ends[w]):
            if a.kind in (ActionKind.B, ActionKind.W, ActionKind.BW):
                out = max(out, e)
    return out


def _opt_starts(schedule: Schedule, starts, stage: int) -> list[float]:
    return [
        s
        for w in range(stage * schedule.dp, (stage + 1) * schedule.dp)
        for a, s in zip(schedule.workers[w], starts[w])
        if a.kind is ActionKind.OPT_STEP
    ]


@pytest.mark.parametrize("generator", [one_f_one_b, decoupled])
def test_last_stage_steps_after_first_stage_backward_when_tied(generator):
    for tied in (TIED, ()):
        s = replace(generator(2, 4, 4, tied=tied), optimizer="staggered")
        r = replay(s)
        assert not r.blocked
        first_done = _last_backward_end(s, r.ends, 0)
        last_steps = _opt_starts(s, r.starts, 3)
        if tied:
            assert min(last_steps) >= first_done
            # the tied reduce is one collective: every member starts and ends it together
            spans = {(r.starts[w][i], r.ends[w][i]) for w in s.alive() for i, a in enumerate(s.workers[w])
                     if a.kind is ActionKind.TIED_REDUCE}
            assert len(spans) == 1
        elif generator is one_f_one_b:  # untied, the last stage steps as soon as its own reduce is done
            assert max(last_steps) < first_done


def test_t_tied_reduce_adds_time():
    s = one_f_one_b(2, 4, 4, tied=TIED)
    base = simulate(s).makespan
    assert base == simulate(one_f_one_b(2, 4, 4)).makespan  # free by default
    slow = simulate(s, CostModel(t_tied_reduce=2.0))
    assert slow.makespan == pytest.approx(base + 2.0)
    # a group's reduce lasts the slowest of its stages; stages outside the group are not charged
    per_stage = simulate(s, CostModel(t_tied_reduce=(0.0, 5.0, 5.0, 3.0)))
    assert per_stage.makespan == pytest.approx(base + 3.0)
    for w in (0, 6):
        i = next(j for j, a in enumerate(s.workers[w]) if a.kind is ActionKind.TIED_REDUCE)
        assert per_stage.ends[w][i] - per_stage.starts[w][i] == pytest.approx(3.0)
        assert any(b <= per_stage.starts[w][i] and per_stage.ends[w][i] <= e for b, e in per_stage.busy[w])
    # the global optimizer barrier still works after the tied reduce
    r = replay(s, CostModel(t_tied_reduce=2.0, t_opt=1.0))
    opt = {r.starts[w][-1] for w in s.alive()}
    assert len(opt) == 1
    # and the staggered period grows too
    stag = replace(s, optimizer="staggered")
    slow_period = simulate(stag, CostModel(t_tied_reduce=2.0), repeat=4).iteration_time
    assert slow_period > simulate(stag, repeat=4).iteration_time


def test_cost_field_round_trip():
    c = CostModel(t_tied_reduce=(1.0, 0.0, 0.0, 2.5))
    assert c.stage(3).t_tied_reduce == 2.5 and CostModel.unit().stage(2).t_tied_reduce == 0.0
    assert CostModel.from_dict(c.to_dict()) == c
    assert c.tied_reduce_time((0, 3)) == 2.5 and c.tied_reduce_time((0, 1)) == 1.0
    assert CostModel.from_dict({"t_tied_reduce": 0.5}).stage(1).t_tied_reduce == 0.5


def test_grid_shows_tied_reduce():
    s = one_f_one_b(1, 4, 2, tied=TIED)
    t = simulate(s, CostModel(t_tied_reduce=1.0))
    grid = format_grid(s, t.starts, t.ends)
    rows = grid.splitlines()
    assert "T0" in rows[0] and "T0" in rows[3] and "T0" not in rows[1]


def test_gantt_draws_tied_reduce(tmp_path):
    pytest.importorskip("matplotlib")
    from ds_resilience.ir.gantt import KIND_COLORS, render_gantt

    assert ActionKind.TIED_REDUCE in KIND_COLORS
    s = decoupled(2, 4, 4, tied=TIED)
    cost = CostModel(t_tied_reduce=1.0)
    path = tmp_path / "tied.png"
    render_gantt(s, simulate(s, cost), path, cost=cost)
    assert path.read_bytes()[:4] == b"\x89PNG"


# --- relabelling, the plan table, the provider -----------------------------------------------
def test_relabel_keeps_tied():
    p = plan(3, 4, 4, [Worker(pipeline=0, stage=3)], variant="decoupled", tied=TIED)
    moved = relabel_schedule(p.schedule, (2, 0, 1))
    assert moved.tied == TIED
    validate(moved)


@pytest.fixture(scope="module")
def tied_table(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tied_plans")
    spec = TableSpec(dp=2, pp=4, microbatches=4, cost=CostModel.unit(), max_failures=1, tied=TIED)
    table, summary = build_table(spec, cache_dir=cache, workers=1)
    return spec, table, summary, cache


def test_table_spec_carries_tied(tied_table):
    spec, *_ = tied_table
    untied = TableSpec(dp=2, pp=4, microbatches=4, cost=CostModel.unit(), max_failures=1)
    assert spec.to_dict()["tied"] == [[0, 3]] and untied.to_dict()["tied"] == []
    assert spec.digest() != untied.digest()
    with pytest.raises(PlanningError, match="bad tied groups"):
        TableSpec(dp=2, pp=4, microbatches=4, cost=CostModel.unit(), tied=((3, 0),))


def test_table_round_trips_tied_plans(tied_table):
    spec, table, summary, cache = tied_table
    assert not summary["cached"]
    again, summary2 = build_table(spec, cache_dir=cache, workers=1)
    assert summary2["cached"] and summary2["path"] == summary["path"]
    for failed in ([Worker(pipeline=1, stage=0)], [Worker(pipeline=1, stage=3)], [Worker(pipeline=0, stage=2)]):
        for t in (table, again):
            view = t.lookup(failed)
            s = view.schedule()
            assert s.tied == TIED
            assert s.failed == {failed[0].stage * 2 + failed[0].pipeline}
            validate(s)
            _check_tail(s)
            for w in s.alive():
                assert view.actions_for(w) == s.workers[w]
            assert view.plan().schedule.tied == TIED
    # a table for untied plans is another cache entry
    untied = TableSpec(dp=2, pp=4, microbatches=4, cost=CostModel.unit(), max_failures=1)
    other, summary3 = build_table(untied, cache_dir=cache, workers=1)
    assert not summary3["cached"] and other.lookup([Worker(pipeline=1, stage=3)]).schedule().tied == ()


def test_provider_passes_tied(tied_table):
    spec, table, _, cache = tied_table
    top = Topology(dp=2, pp=4)
    for schedule in ("1f1b", "decoupled"):
        provider = ScheduleProvider(top, 4, CostModel.unit(), schedule=schedule, variant="recycle", solver="heuristic",
                                    time_limit_s=1.0, memory_cap=None, tied=TIED)
        choice = provider.schedule_for([])
        assert choice.source == "fault-free" and choice.schedule.tied == TIED
        _check_tail(choice.schedule)
        planned = provider.schedule_for([Worker(pipeline=0, stage=3)])
        assert planned.source == "planner" and planned.schedule.tied == TIED
        _check_tail(planned.schedule)
    built = ScheduleProvider.build(top, 4, CostModel.unit(), schedule="1f1b", variant="recycle", solver="heuristic",
                                   time_limit_s=spec.time_limit_s, memory_cap=None, max_failures=1, all_coverable=False,
                                   cache_dir=cache, workers=1, tied=TIED)
    assert built.table is not None and built.table.spec.tied == TIED
    assert built.table_summary is not None and built.table_summary["cached"]  # the fixture's table
    looked_up = built.schedule_for([Worker(pipeline=1, stage=1)])
    assert looked_up.source == "table" and looked_up.schedule.tied == TIED
    beyond = built.schedule_for([Worker(pipeline=0, stage=1), Worker(pipeline=1, stage=2)])
    assert beyond.source == "planner" and beyond.schedule.tied == TIED
    with pytest.raises(PlanningError, match="tied groups"):
        ScheduleProvider(top, 4, CostModel.unit(), schedule="1f1b", variant="recycle", solver="heuristic",
                         time_limit_s=1.0, memory_cap=None, table=table)


# --- the CLI ---------------------------------------------------------------------------------
def _run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_tied(capsys):
    d = _run_json(capsys, "plan", "--dp", "2", "--pp", "4", "-m", "4", "--tied", "0,3", "--json")
    assert d["tied"] == [[0, 3]]
    assert d["schedule"][0].endswith("s0RD s0TR0 s0OPT") and "TR" not in d["schedule"][2]
    d = _run_json(capsys, "plan", "--dp", "2", "--pp", "4", "-m", "4", "--tied", "3,0", "--tied", "0,2",
                  "--schedule", "decoupled", "--json")
    assert d["tied"] == [[0, 3], [0, 2]] and d["schedule"][0].endswith("s0RD s0TR0 s0TR1 s0OPT")
    d = _run_json(capsys, "plan", "--dp", "2", "--pp", "4", "-m", "4", "--tied", "0,3", "--fail", "1:3",
                  "--solver", "heuristic", "--json")
    assert d["tied"] == [[0, 3]] and d["failed"] == ["1:3"] and d["schedule"][6].endswith("s3RD s3TR0 s3OPT")
    d = _run_json(capsys, "plan", "--dp", "2", "--pp", "2", "-m", "2", "--json")
    assert d["tied"] == []


def test_cli_tied_text_and_errors(capsys):
    assert main(["plan", "--dp", "1", "--pp", "4", "-m", "2", "--tied", "0,3"]) == 0
    assert "tied=0,3" in capsys.readouterr().out
    assert main(["plan", "--dp", "1", "--pp", "4", "-m", "2", "--tied", "0,4"]) == 2
    assert "0..3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--dp", "1", "--pp", "4", "-m", "2", "--tied", "0"])


def test_cli_plan_table_tied(capsys, tmp_path):
    argv = ["plan-table", "--dp", "2", "--pp", "4", "-m", "2", "--workers", "1", "--out", str(tmp_path), "--json"]
    assert main(argv + ["--tied", "0,3"]) == 0
    tied_path = json.loads(capsys.readouterr().out)["path"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["path"] != tied_path  # another cache entry
    spec = TableSpec(dp=2, pp=4, microbatches=2, cost=CostModel.unit(), tied=TIED)
    table, summary = build_table(spec, cache_dir=tmp_path, workers=1)
    assert summary["cached"] and summary["path"] == tied_path
    assert table.lookup([Worker(pipeline=0, stage=0)]).schedule().tied == TIED
