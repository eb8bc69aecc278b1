"""The failure-trace simulator: a discrete-event loop that runs one training job through a trace.

The loop owns time, the live node set and the accounting; a :class:`Policy` (one per system, see
:mod:`.systems`) owns the system's decisions and answers each event with an :class:`Action`.

Fail-slow (``slow``/``recover`` trace events): the loop keeps each node's speed in
:attr:`JobView.speeds` and runs every iteration :meth:`Policy.slowdown` times longer than the
policy's ``iteration_s`` (the pace of the slowest node the policy uses, unless the policy re-plans);
a speed change stretches or shrinks the rest of the iteration in flight by the ratio of the new
slowdown to the old one, then asks :meth:`Policy.on_speed`. A removal is an ordinary failure
whether the node was slow or not.

Phases of the job: *idle* (cannot run), *paused* (a recovery: rendezvous, restart, re-grid),
*running* (one iteration in flight), *checkpoint* (a blocking persistent checkpoint). Events at
equal times are taken in a fixed order: node add, node remove, node ready, checkpoint durable, end
of phase (a speed change comes right after removals); then by insertion order (a heap of ``(time, priority, sequence)``), so every run is
deterministic. A node becomes usable ``boot_s`` after it is added (the published simulators' 45 s).

Accounting (seconds of wall time, they sum to the window): ``useful`` (iterations that count),
``redundant`` (the redundant share of those iterations, Bamboo's shadow computation), ``checkpoint``
(blocking checkpoint writes), ``recovery`` (pauses), ``lost`` (iterations discarded: in flight at a
failure, or rolled back to a checkpoint) and ``idle`` (too few nodes to run). Completed iterations are *tentative* until the policy makes them durable; a rollback loses
the tentative ones. The window runs from the first iteration's start to the trace's last event (less
the iteration that event cuts off, which is neither counted nor charged) and the throughput is the
samples of the iterations that count over it (as in the published simulators).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .traces import Trace

__all__ = ["Action", "NOTHING", "JobView", "Policy", "Result", "BREAKDOWN_KEYS", "run_policy"]

BREAKDOWN_KEYS = ("useful", "redundant", "checkpoint", "recovery", "lost", "idle")

_ADD, _REMOVE, _SPEED, _READY, _DURABLE, _PHASE = range(6)


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """A policy's answer to an event (every field optional).

    Attributes:
        pause_s: stop now and pause this long (a recovery); the in-flight iteration is lost and
            :meth:`Policy.on_resume` is asked for the iteration time at the end of the pause.
        extend_pause_s: while paused, push the end of the pause back by this much.
        rollback: with ``pause_s``: the tentative (not yet durable) iterations are lost too.
        grace: with ``pause_s``: an in-flight iteration that would end within the pause still
            completes and counts (durable at once); the pause then runs from the failure.
        iteration_s: seconds per iteration from the next iteration on (``math.inf``: cannot run).
        stretch_inflight: the in-flight iteration's remaining time is multiplied by this.
        redundant_fraction: share of each iteration that is redundant work.
        durable: after an iteration: all completed iterations are durable now.
        checkpoint_s: after an iteration: a blocking checkpoint this long makes them durable.
        background_checkpoint_s: after an iteration: they become durable this much later, no stall.
    """

    pause_s: float | None = None
    extend_pause_s: float = 0.0
    rollback: bool = False
    grace: bool = False
    iteration_s: float | None = None
    stretch_inflight: float = 1.0
    redundant_fraction: float | None = None
    durable: bool = False
    checkpoint_s: float = 0.0
    background_checkpoint_s: float | None = None


NOTHING = Action()


@dataclass(slots=True)
class JobView:
    """What a policy may read: the clock, the ready nodes (join order), the phase, and the speed of
    each slow node (a fraction of full speed; nodes at full speed are absent)."""

    now: float = 0.0
    live: list[str] = field(default_factory=list)
    phase: str = "idle"
    started: bool = False
    iteration_s: float = math.inf
    speeds: dict[str, float] = field(default_factory=dict)

    def pace(self, nodes: Iterable[str]) -> float:
        """The slowest speed among ``nodes`` (1.0 when none is slow)."""
        return min((self.speeds.get(n, 1.0) for n in nodes), default=1.0)


class Policy:
    """Base of the per-system policies; every hook returns :data:`NOTHING` unless overridden."""

    name = "policy"

    def on_ready(self, job: JobView, node: str) -> Action:
        """A node finished booting and joined the live set."""
        return NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        """A live node left (``node`` is no longer in ``job.live``)."""
        return NOTHING

    def on_resume(self, job: JobView) -> Action:
        """A pause ended: return the iteration time (and redundant share) to run with."""
        return Action(iteration_s=math.inf)

    def after_iteration(self, job: JobView) -> Action:
        """An iteration completed: durability, checkpoints, rebalancing."""
        return Action(durable=True)

    def active_nodes(self, job: JobView) -> Iterable[str]:
        """The nodes whose pace the iterations run at (default: every live node)."""
        return job.live

    def slowdown(self, job: JobView) -> float:
        """Iterations take this many times ``iteration_s``: by default a synchronous job runs at
        the pace of its slowest active node (``1 / min speed``)."""
        if not job.speeds:
            return 1.0
        return 1.0 / job.pace(self.active_nodes(job))

    def on_speed(self, job: JobView, node: str) -> Action:
        """``node`` slowed down or recovered (:attr:`JobView.speeds` is updated already)."""
        return NOTHING


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """One system's run over one trace."""

    system: str
    model: str
    trace: str
    throughput: float
    samples: float
    start_s: float
    end_s: float
    iterations: int
    failures: int
    breakdown: tuple[tuple[str, float], ...]
    series: tuple[tuple[float, float, float], ...] = ()

    @property
    def wall_s(self) -> float:
        return max(0.0, self.end_s - self.start_s)

    @property
    def breakdown_dict(self) -> dict[str, float]:
        return dict(self.breakdown)

    def to_dict(self, *, with_series: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "throughput": self.throughput,
            "breakdown": self.breakdown_dict,
            "samples": self.samples,
            "iterations": self.iterations,
            "failures": self.failures,
            "window_s": [self.start_s, self.end_s],
        }
        if with_series:
            out["series"] = [list(s) for s in self.series]
        return out


class _Loop:
    def __init__(self, trace: Trace, policy: Policy, *, samples_per_iteration: float, boot_s: float) -> None:
        self.trace, self.policy = trace, policy
        self.samples_per_iteration = samples_per_iteration
        self.boot_s = boot_s
        self.job = JobView()
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.epoch = 0  # invalidates scheduled phase ends
        self.generation = 0  # invalidates scheduled background durability
        self.phase_start = 0.0
        self.phase_end = math.inf
        self.redundant = 0.0
        self.start: float | None = None
        self.acc = {k: 0.0 for k in BREAKDOWN_KEYS}
        self.tentative: list[list[float]] = []  # [duration, redundant share, series index]
        self.covered = 0  # tentative iterations a running checkpoint covers
        self.series: list[list[float]] = []
        self.samples = 0.0
        self.iterations = 0
        self.failures = 0
        self.booting: set[str] = set()
        self.factor = 1.0  # the in-flight iteration's slowdown

    # --- plumbing ------------------------------------------------------------------------
    def push(self, time: float, priority: int, payload: Any) -> None:
        heapq.heappush(self.heap, (time, priority, self.seq, payload))
        self.seq += 1

    def charge(self, bucket: str, seconds: float) -> None:
        if self.start is not None and seconds > 0:
            self.acc[bucket] += seconds

    def set_phase(self, phase: str, until: float) -> None:
        self.job.phase = phase
        self.phase_start = self.job.now
        self.phase_end = until
        self.epoch += 1
        if math.isfinite(until):
            self.push(until, _PHASE, ("phase", self.epoch))

    def close_phase(self) -> None:
        """Charge the current phase's elapsed time as if it were cut off now (in-flight work lost)."""
        elapsed = self.job.now - self.phase_start
        phase = self.job.phase
        if phase == "running":
            self.charge("lost", elapsed)
        elif phase == "checkpoint":
            self.charge("checkpoint", elapsed)
            self.covered = 0
        elif phase == "paused":
            self.charge("recovery", elapsed)
        elif phase == "idle":
            self.charge("idle", elapsed)

    def commit(self, count: int) -> None:
        for duration, share, index in self.tentative[:count]:
            self.charge("useful", duration * (1.0 - share))
            self.charge("redundant", duration * share)
            self.samples += self.samples_per_iteration
            self.series[int(index)][3] = 1.0
        del self.tentative[:count]
        self.covered = max(0, self.covered - count)

    def run_next(self) -> None:
        now = self.job.now
        if math.isfinite(self.job.iteration_s) and self.job.iteration_s > 0:
            if self.start is None:
                self.start = now
                self.job.started = True
            self.factor = self.policy.slowdown(self.job)
            self.set_phase("running", now + self.job.iteration_s * self.factor)
        else:
            self.set_phase("idle", math.inf)

    # --- applying actions ----------------------------------------------------------------
    def apply(self, action: Action) -> None:
        job = self.job
        if action.redundant_fraction is not None:
            self.redundant = action.redundant_fraction
        if action.pause_s is not None:
            until = job.now + max(0.0, action.pause_s)
            if action.grace and job.phase == "running" and self.phase_end <= until:
                self.complete(self.phase_end)
                self.commit(len(self.tentative))
                self.set_phase("paused", until)
                self.phase_start = self.series[-1][1]  # the pause is charged from the completion on
                return
            self.close_phase()
            if action.rollback:
                for duration, _, index in self.tentative:
                    self.charge("lost", duration)
                    self.series[int(index)][2] = 0.0
                self.tentative.clear()
                self.covered = 0
                self.generation += 1
            self.set_phase("paused", until)
            return
        if action.extend_pause_s and job.phase == "paused":
            self.phase_end += action.extend_pause_s
            self.epoch += 1
            self.push(self.phase_end, _PHASE, ("phase", self.epoch))
        if action.stretch_inflight != 1.0 and job.phase == "running":
            self.phase_end = job.now + (self.phase_end - job.now) * action.stretch_inflight
            self.epoch += 1
            self.push(self.phase_end, _PHASE, ("phase", self.epoch))
        if action.iteration_s is not None:
            job.iteration_s = action.iteration_s
            if job.phase == "idle" and job.started and math.isfinite(action.iteration_s):
                self.close_phase()
                self.run_next()

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> Result:
        for e in self.trace.events:
            priority = {"add": _ADD, "remove": _REMOVE}.get(e.kind, _SPEED)
            self.push(e.time_s, priority, (e.kind, e.node, e.speed))
        end = self.trace.end_s
        job = self.job
        while self.heap:
            time, _, _, payload = heapq.heappop(self.heap)
            if time >= end:
                break
            job.now = time
            kind = payload[0]
            if kind == "add":
                self.booting.add(payload[1])
                self.push(time + self.boot_s, _READY, ("ready", payload[1]))
            elif kind == "ready":
                if payload[1] in self.booting:
                    self.booting.discard(payload[1])
                    job.live.append(payload[1])
                    self.apply(self.policy.on_ready(job, payload[1]))
            elif kind == "remove":
                job.speeds.pop(payload[1], None)
                if payload[1] in self.booting:
                    self.booting.discard(payload[1])
                elif payload[1] in job.live:
                    job.live.remove(payload[1])
                    self.failures += 1
                    self.apply(self.policy.on_remove(job, payload[1]))
            elif kind in ("slow", "recover"):
                if kind == "slow":
                    job.speeds[payload[1]] = payload[2]
                else:
                    job.speeds.pop(payload[1], None)
                self.speed_changed(payload[1])
            elif kind == "durable":
                if payload[1] == self.generation:
                    self.commit(payload[2] - (self.iterations - len(self.tentative)))
            elif kind == "phase" and payload[1] == self.epoch:
                self.end_phase()
        job.now = end
        if job.phase == "running":
            end = self.phase_start  # the window closes before the iteration cut off by the trace's end
        else:
            self.close_phase()
        self.commit(len(self.tentative))  # no failure took them: the job keeps them
        return self.result(end)

    def speed_changed(self, node: str) -> None:
        job = self.job
        if job.phase == "running":
            factor = self.policy.slowdown(job)
            if factor != self.factor:
                self.phase_end = job.now + (self.phase_end - job.now) * factor / self.factor
                self.factor = factor
                self.epoch += 1
                self.push(self.phase_end, _PHASE, ("phase", self.epoch))
        self.apply(self.policy.on_speed(job, node))

    def complete(self, when: float) -> None:
        """The running iteration completed at ``when``: record it as tentative."""
        duration = when - self.phase_start
        rate = self.samples_per_iteration / duration if duration > 0 else 0.0
        self.series.append([self.phase_start, when, rate, 0.0])
        self.tentative.append([duration, self.redundant, len(self.series) - 1])
        self.iterations += 1
        self.job.phase, self.phase_start = "between", when  # charged already: nothing to close

    def end_phase(self) -> None:
        job = self.job
        phase = job.phase
        if phase == "paused":
            self.charge("recovery", job.now - self.phase_start)
            epoch = self.epoch
            self.apply(self.policy.on_resume(job))
            if self.epoch == epoch:  # the policy did not pause again
                self.run_next()
        elif phase == "checkpoint":
            self.charge("checkpoint", job.now - self.phase_start)
            self.commit(self.covered)
            self.run_next()
        elif phase == "running":
            self.complete(job.now)
            action = self.policy.after_iteration(job)
            if action.durable:
                self.commit(len(self.tentative))
            if action.background_checkpoint_s is not None:
                self.push(job.now + action.background_checkpoint_s, _DURABLE, ("durable", self.generation, self.iterations))
            if action.pause_s is not None:
                self.apply(action)
                return
            self.apply(action)
            if action.checkpoint_s > 0:
                self.covered = len(self.tentative)
                self.set_phase("checkpoint", job.now + action.checkpoint_s)
                return
            self.run_next()

    def result(self, end: float) -> Result:
        start = self.start if self.start is not None else end
        window = max(0.0, end - start)
        series = tuple((a, min(b, end), r if done else 0.0) for a, b, r, done in self.series)
        return Result(
            system=self.policy.name,
            model="",
            trace=self.trace.name,
            throughput=self.samples / window if window > 0 else 0.0,
            samples=self.samples,
            start_s=start,
            end_s=end,
            iterations=self.iterations,
            failures=self.failures,
            breakdown=tuple((k, self.acc[k]) for k in BREAKDOWN_KEYS),
            series=series,
        )


def run_policy(trace: Trace, policy: Policy, *, samples_per_iteration: float, boot_s: float = 45.0) -> Result:
    """Run ``policy`` over ``trace`` (see the module docstring); deterministic for equal inputs."""
    return _Loop(trace, policy, samples_per_iteration=samples_per_iteration, boot_s=boot_s).run()
