"""The C schedule core (csrc/schedule_core.c via ds_resilience.ir.native) agrees with the Python one.

Replay times equal bit for bit, the C checks pass only schedules the Python validator passes (and
pass the valid ones), the memory peaks are equal, and without the library everything still works.
"""

import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.errors import PlanningError, ScheduleError
from ds_resilience.ir import Schedule, native
import importlib
validate_module = importlib.import_module("ds_resilience.ir.validate")
from ds_resilience.ir.replay import replay
from ds_resilience.ir.timeline import replayed_iteration_time
from ds_resilience.planning import memory
from ds_resilience.planning.planner import plan
from ds_resilience.topology import Worker

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_COST = CostModel.load(ROOT / "configs" / "costs_gpt_example.json")
# the same model on a link 200x slower: sends queue on their link (the replay's link contention)
SLOW_LINK_COST = replace(EXAMPLE_COST, p2p_bandwidth=EXAMPLE_COST.p2p_bandwidth / 200)

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C compiler here: {native.why_unavailable()}")


def _plans(seed: int, count: int):
    """Planned schedules of every variant over random grids, failures and tied groups."""
    rng = random.Random(seed)
    for _ in range(count):
        dp, pp, m = rng.randint(1, 4), rng.randint(2, 5), rng.randint(2, 7)
        cost = rng.choice([EXAMPLE_COST, SLOW_LINK_COST, CostModel.unit(), CostModel.unit()])
        if cost.name == EXAMPLE_COST.name:  # its per-stage lists are for 4 stages
            pp = 4
        failed = [Worker(pipeline=rng.randrange(dp), stage=rng.randrange(pp))] if dp > 1 and rng.random() < 0.7 else []
        tied = ((0, pp - 1),) if rng.random() < 0.4 else ()
        variant = rng.choice(["adaptive", "decoupled", "recycle"])
        yield plan(dp, pp, m, failed, variant=variant, tied=tied, cost=cost).schedule, cost


def _python_check(schedule: Schedule) -> ScheduleError | None:
    try:
        validate_module._check_shape(schedule)
        validate_module._check_coverage(schedule, validate_module._check_order(schedule))
        validate_module._check_messages(schedule)
    except ScheduleError as exc:
        return exc
    return None


def test_replay_times_equal_the_python_replay_bit_for_bit():
    seen = 0
    for schedule, cost in _plans(0, 40):
        for repeat in (1, 4):
            for mode in ("plain", "barrier", "wait"):
                ref = replay(schedule, cost, repeat=repeat, mode=mode)
                fast = native.replay_times(schedule, cost, repeat=repeat, mode=mode)
                assert fast is not None
                assert not ref.blocked and not fast.blocked
                assert fast.makespan == ref.makespan
                want = replayed_iteration_time(schedule, ref.ends, ref.makespan, repeat)
                got = fast.makespan if len(fast.iteration_ends) == 1 else \
                    replayed_iteration_time(schedule, ref.ends, ref.makespan, repeat)
                assert got == want
                # every iteration's end, not only the period
                per = []
                for w, actions in enumerate(schedule.workers):
                    k = 0
                    for a, e in zip(actions * repeat, ref.ends[w]):
                        if a.kind.name == "OPT_STEP":
                            if k >= len(per):
                                per.append(e)
                            per[k] = max(per[k], e)
                            k += 1
                assert fast.iteration_ends == per
                seen += 1
    assert seen == 240


def test_a_deadlock_is_found_where_the_python_replay_finds_it():
    s = plan(1, 3, 3, []).schedule  # fault-free adaptive schedule of one pipeline
    workers = list(s.workers)
    # stage 1 waits for a gradient before the activation it needs: both sides stall
    acts = list(workers[1])
    first_recv_grad = next(i for i, a in enumerate(acts) if a.kind.name == "RECV_GRAD")
    acts.insert(0, acts.pop(first_recv_grad))
    stuck = replace(s, workers=tuple(workers[:1] + [tuple(acts)] + workers[2:]))
    ref = replay(stuck)
    fast = native.replay_times(stuck, CostModel.unit())
    assert ref.blocked and fast.blocked == ref.blocked


def test_the_c_checks_pass_what_the_python_validator_passes():
    for schedule, _ in _plans(1, 30):
        assert _python_check(schedule) is None
        assert native.check(schedule)


def _mutations(schedule: Schedule, rng: random.Random):
    """Schedules one edit away from ``schedule``: a swapped pair, a dropped, a duplicated or a
    retargeted action on one worker."""
    n = len(schedule.workers)
    for _ in range(60):
        w = rng.randrange(n)
        acts = list(schedule.workers[w])
        if len(acts) < 2:
            continue
        i, j = sorted(rng.sample(range(len(acts)), 2))
        edit = rng.choice(["swap", "drop", "dup", "peer", "mb", "pipeline"])
        a = acts[i]
        if edit == "swap":
            acts[i], acts[j] = acts[j], acts[i]
        elif edit == "drop":
            del acts[i]
        elif edit == "dup":
            acts.insert(j, a)
        elif edit == "peer" and a.peer is not None:
            acts[i] = replace(a, peer=rng.randrange(n))
        elif edit == "mb" and a.microbatch is not None:
            acts[i] = replace(a, microbatch=rng.randrange(schedule.microbatches + 1))
        elif edit == "pipeline" and a.pipeline is not None:
            acts[i] = replace(a, pipeline=rng.randrange(schedule.dp + 1))
        else:
            continue
        try:
            yield replace(schedule, workers=schedule.workers[:w] + (tuple(acts),) + schedule.workers[w + 1:])
        except ScheduleError:
            continue  # the schedule's own checks refuse it already


def test_the_c_checks_never_pass_what_the_python_validator_rejects():
    rng = random.Random(2)
    rejected = passed = 0
    for schedule, _ in _plans(3, 25):
        for broken in _mutations(schedule, rng):
            python_says = _python_check(broken)
            if python_says is not None:
                rejected += 1
                assert not native.check(broken), f"C passed what Python rejects: {python_says}"
            else:
                passed += 1
                assert native.check(broken)  # a harmless edit (e.g. two independent actions swapped)
    assert rejected > 500 and passed > 0


def test_validate_names_the_fault_with_the_c_checks_on():
    s = plan(2, 3, 4, [Worker(pipeline=1, stage=1)]).schedule
    acts = [a for a in s.workers[2] if a.kind.name != "RECV_ACT"]  # worker 2 = pipeline 0, stage 1
    broken = replace(s, workers=s.workers[:2] + (tuple(acts),) + s.workers[3:])
    with pytest.raises(ScheduleError, match="input activation was not received"):
        validate_module.validate(broken)


def test_memory_peaks_equal_the_python_count():
    for schedule, cost in _plans(4, 30):
        weights = cost.memory_weights(schedule.pp)
        want = tuple(memory._order_peak(actions, *weights[w // schedule.dp]) if actions else 0.0
                     for w, actions in enumerate(schedule.workers))
        assert memory.worker_peaks(schedule, cost) == want
        top, acts, pend, state = native.peaks(schedule, [(1.0, 1.0)] * schedule.pp)
        for w, actions in enumerate(schedule.workers):
            a = p = pa = pw = ps = 0
            for x in actions:
                name = x.kind.name
                a += (name == "F") - (name in ("B", "BW"))
                p += (name == "B") - (name == "W")
                pa, pw, ps = max(pa, a), max(pw, p), max(ps, a + p)
            assert (acts[w], pend[w], state[w]) == (pa, pw, ps)


def test_without_the_library_the_planner_gives_the_same_plan(tmp_path):
    code = (
        "from ds_resilience.ir import native\n"
        "from ds_resilience.planning.planner import plan\n"
        "from ds_resilience.topology import Worker\n"
        "p = plan(3, 4, 6, [Worker(pipeline=0, stage=1)], tied=((0, 3),))\n"
        "print(native.available(), repr(p.iteration_time), max(p.peak_memory), p.schedule.to_text().count(' '))\n"
    )
    outs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "DSR_NATIVE": flag, "DSR_NATIVE_CACHE": str(tmp_path)}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr
        outs[flag] = done.stdout.split()
    assert outs["0"][0] == "False" and outs["1"][0] == "True"
    assert outs["0"][1:] == outs["1"][1:]


def test_the_c_list_scheduler_gives_the_python_orders(monkeypatch):
    """Random placements (re-routed after failures), caps, memory weights and start times, fused
    and split backward: the C loop's orders and makespan equal the Python loop's."""
    from ds_resilience.planning import list_scheduler
    from ds_resilience.planning.reroute import reroute_assignment
    from ds_resilience.topology import Topology

    rng = random.Random(11)
    cases = []
    for _ in range(40):
        dp, pp, m = rng.randint(1, 4), rng.randint(1, 5), rng.randint(1, 8)
        topo = Topology(dp=dp, pp=pp)
        if dp > 1 and rng.random() < 0.7:
            topo = topo.without([Worker(pipeline=rng.randrange(dp), stage=rng.randrange(pp))])
        n = dp * pp
        cost = CostModel.from_dict({"name": "r", "t_f": [rng.uniform(0.5, 2) for _ in range(pp)],
                                    "t_b": [rng.uniform(0.5, 2) for _ in range(pp)],
                                    "t_w": [rng.uniform(0.2, 2) for _ in range(pp)],
                                    "p2p_latency": rng.choice([0.0, 0.05])})
        kwargs = dict(dp=dp, pp=pp, microbatches=m, cost=cost, assignment=reroute_assignment(topo, m),
                      split_backward=rng.random() < 0.7, act_caps=[rng.randint(1, m + 1) for _ in range(n)],
                      w_caps=[rng.choice([None, 1, 2, m]) for _ in range(n)],
                      mem_caps=rng.choice([None, [float(rng.randint(2, 2 * m + 2)) for _ in range(n)]]),
                      start_times=rng.choice([None, [rng.uniform(0, 3) for _ in range(n)]]),
                      mem_weights=rng.choice([None, [(rng.uniform(0.5, 2), rng.uniform(0.1, 2.5)) for _ in range(n)]]))
        cases.append(kwargs)
    direct = [native.list_orders(**kw) for kw in cases]
    fast = [list_scheduler.list_schedule(**kw) if d is not None else None for kw, d in zip(cases, direct)]
    monkeypatch.setattr(native, "list_orders", lambda **kw: None)
    ran = 0
    for kw, got in zip(cases, fast):
        try:
            want = list_scheduler.list_schedule(**kw)
        except PlanningError:  # caps too tight for the weights: the C loop gives up too, and Python says why
            assert got is None
            continue
        assert got is not None and got.orders == want.orders and got.makespan == want.makespan
        ran += 1
    assert ran >= 30


def test_a_stuck_list_schedule_still_says_why():
    from ds_resilience.planning.list_scheduler import list_schedule
    from ds_resilience.planning.reroute import reroute_assignment
    from ds_resilience.topology import Topology

    with pytest.raises(PlanningError, match="list scheduling cannot proceed"):
        list_schedule(dp=1, pp=2, microbatches=2, cost=CostModel.unit(),
                      assignment=reroute_assignment(Topology(dp=1, pp=2), 2), split_backward=True,
                      act_caps=[1, 1], w_caps=[None, None], mem_caps=[0.5, 0.5])


def test_the_c_core_compiles_warning_free_as_c99(tmp_path):
    """The planner's C core is strict C99 with every warning an error (what any cc must accept)."""
    import shutil

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    done = subprocess.run([compiler, "-std=c99", "-pedantic", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                           "-o", str(tmp_path / "core.so"), str(native.SOURCE)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
