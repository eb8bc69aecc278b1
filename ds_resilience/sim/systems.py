"""One policy per system: how its throughput depends on the live nodes and what a failure costs.

Baselines replay their published behaviour (the SOSP'23 Oobleck artifact's simulators, with the
throughput per live node count measured on 30 A40 nodes that the model profiles carry):

* :class:`Oobleck`: a failure pauses for the reconfiguration (2-10 s) and loses the iteration in
  flight, unless that iteration would have ended within the pause (the published simulator lets it
  finish: ``grace``); the job then runs at the measured throughput for the live nodes. Nodes that
  join while it runs wait for the next reconfiguration.
* :class:`Varuna`: checkpoint-restart "morphing". A failure pauses for the restart (its measured
  restart cost minus the checkpoint part) and rolls back to the last completed checkpoint. It
  checkpoints (blocking) after the first iteration of each restart and every ``checkpoint_every``
  iterations; a checkpoint cut by a failure does not count.
* :class:`Bamboo`: pipelines of ``stages`` nodes with redundant computation. A failed node's
  predecessor takes over its stage; the job runs ``slowdown`` times slower in fail-over until it
  rebalances (a pause) at the end of that iteration. Losing a node that already covers another, or
  whose predecessor does, is fatal: a global restart (30 s) and the in-flight iteration lost. As in
  the published simulator, losing a spare node also enters fail-over (it lasts until the next
  rebalance). The outcome depends on which node fails, so reproductions average over redraws of
  the victims (:func:`~.traces.redraw_victims`). Models that ran out of memory never run.
* :class:`CheckpointRestart`: DeepSpeed's 1F1B on the largest grid the live nodes allow, a blocking
  checkpoint every ``interval`` iterations, and a full restart with rollback at every failure of an
  active node.

Planner-driven systems take iteration times from :class:`~.models.PlanCache` (the real planner):

* :class:`ReCycle` (as published): a fixed grid; a failure re-routes the failed worker's
  micro-batches to its data-parallel peers (pause: failure detection, the in-flight iteration is
  lost); a degraded iteration never beats the healthy 1F1B one (ReCycle fills 1F1B's bubbles). A
  re-joining node fills a hole. Beyond tolerance (a stage lost every replica): full restart from
  the last persistent checkpoint (background, every ``checkpoint_interval`` iterations).
* :class:`DsResilience`: the same re-routing with the planner's plans for every failure set,
  including the empty one (the plan table's first entry); a snapshot in host memory every
  iteration (nothing beyond the in-flight iteration is lost); re-join fills holes; and a new layout
  when re-routing cannot cover the failure set or when the better layout repays its pause within
  the horizon (the mean time between membership changes seen so far). Three tiers, chosen with
  ``regrid`` (see :data:`REGRID_TIERS`):

  - ``"restart"``: every worker restarted from the in-memory snapshots onto the best ``dp`` x
    ``pp`` grid of the live nodes, only when re-routing cannot cover (what the engine does beyond
    tolerance today): a ``restart_s`` pause;
  - ``"grid"``: the survivors re-grid without a restart onto a ``dp`` x ``pp`` grid (holes
    re-routed): the live re-grid's pause as the engine measured it (:mod:`.regrid_cost`: a fixed
    rebuild plus one new stage's state moved, so a bigger model or a shallower layout pauses
    longer; :meth:`~.models.ModelProfile.regrid_pause_s`), or the profile's ``regrid_s``;
  - ``"templates"`` (default): as ``"grid"``, and pipeline templates (Oobleck's heterogeneous
    pipelines, :mod:`.template_tier`) compete with the rectangular grids.

Fail-slow workers (``slow``/``recover`` trace events, :mod:`.jobsim`). Every baseline runs at the
pace of the slowest node it uses (``1 / speed`` times its iteration): Oobleck and Varuna every live
node, Bamboo the nodes that hold a stage, checkpoint-restart its active grid, ReCycle its grid. None
of the published systems re-plans around a slow worker: Oobleck detects only lost connections;
Varuna records stragglers (``slow_machines.out``) but morphs only on preemption; Bamboo's
redundancy covers a dead successor, not a slow one; ReCycle re-routes failed workers only.
ds_resilience re-plans a slow worker as a partial failure (:meth:`DsResilience.slowdown`) as the
engine's detector decides (``runtime/stragglers.py``: each worker's fastest pace over
``detector.straggler_window`` iterations, 5 by default, against its stage peers'): a slowdown is
adopted at the iteration boundary after the iteration in flight and ``straggler_window`` whole
iterations at the slow pace, a recovery after the iteration in flight and one whole iteration (one
fast iteration makes the fastest pace fast); no pause (no process stops, no state moves).
"""

from __future__ import annotations

import copy
import math
import random
import statistics
from dataclasses import replace
from typing import Iterable

from ..errors import PlanningError
from ..logs import progress_bar
from .jobsim import NOTHING, Action, JobView, Policy, Result, run_policy
from .models import Grid, ModelProfile, PlanCache, ThroughputTable, divisors, stage_layers
from .template_tier import TemplateLayout, TemplateTier
from .traces import SimulationError, Trace, redraw_victims

__all__ = ["SYSTEMS", "REGRID_TIERS", "Oobleck", "Varuna", "Bamboo", "CheckpointRestart", "ReCycle", "DsResilience", "make_policy", "simulate_system", "mean_over_redraws"]

SYSTEMS = ("ds_resilience", "recycle", "oobleck", "bamboo", "varuna", "checkpoint_restart")
REGRID_TIERS = ("restart", "grid", "templates")
"""How ds_resilience changes layout beyond re-routing (see :class:`DsResilience`)."""


def _table_time(model: ModelProfile, table: ThroughputTable | None, nodes: int) -> float:
    rate = table.at(nodes) if table is not None else 0.0
    return model.global_batch / rate if rate > 0 else math.inf


class Oobleck(Policy):
    name = "oobleck"

    def __init__(self, model: ModelProfile, *, grace: bool = True) -> None:
        if model.oobleck is None:
            raise SimulationError(f"model {model.name!r} has no Oobleck throughput list")
        self.model = model
        self.grace = grace

    def on_ready(self, job: JobView, node: str) -> Action:
        return Action(pause_s=self.model.oobleck_reconfigure_s) if job.phase == "idle" else NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        if job.phase == "idle":
            return NOTHING
        return Action(pause_s=self.model.oobleck_reconfigure_s, grace=self.grace)

    def on_resume(self, job: JobView) -> Action:
        return Action(iteration_s=_table_time(self.model, self.model.oobleck, len(job.live)))


class Varuna(Policy):
    name = "varuna"

    def __init__(self, model: ModelProfile) -> None:
        if model.varuna is None:
            raise SimulationError(f"model {model.name!r} has no Varuna throughput list")
        self.model = model
        self.config_nodes: int | None = None
        self.count = 0
        self.restarted = False

    def _restart(self) -> float:
        m = self.model
        full = m.varuna_restart_s if self.config_nodes is None else m.restart_varuna(self.config_nodes)
        return max(0.0, full - m.varuna_checkpoint_s)

    def on_ready(self, job: JobView, node: str) -> Action:
        return Action(pause_s=self._restart()) if job.phase == "idle" else NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        if job.phase == "idle":
            return NOTHING
        self.count, self.restarted = 0, True
        return Action(pause_s=self._restart(), rollback=True)

    def on_resume(self, job: JobView) -> Action:
        self.config_nodes = len(job.live)
        return Action(iteration_s=_table_time(self.model, self.model.varuna, len(job.live)))

    def after_iteration(self, job: JobView) -> Action:
        self.count += 1
        if (self.restarted and self.count == 1) or self.count % self.model.varuna_checkpoint_every == 0:
            self.restarted = False
            return Action(checkpoint_s=self.model.varuna_checkpoint_s)
        return NOTHING


class Bamboo(Policy):
    name = "bamboo"

    def __init__(self, model: ModelProfile, *, spare_loss_slows: bool = True) -> None:
        self.model = model
        self.spare_loss_slows = spare_loss_slows
        self.coords: dict[str, list[tuple[int, int]]] = {}
        self.pipelines = 0
        self.waiting = 0
        self.fallback = False
        self.base_s = math.inf

    def on_ready(self, job: JobView, node: str) -> Action:
        if job.phase == "idle":
            return Action(pause_s=self.model.bamboo_fatal_restart_s)
        if job.phase == "running":
            self.waiting += 1  # joins at the next rebalance
        return NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        m = self.model
        mine = self.coords.pop(node, [])
        if job.phase == "paused":
            return Action(extend_pause_s=m.bamboo_rebalance_s)  # the rendezvous starts over
        if job.phase == "idle":
            return NOTHING
        if mine:
            if len(mine) > 1:
                return Action(pause_s=m.bamboo_fatal_restart_s)
            p, s = mine[0]
            pred = (p, (s - 1) % m.bamboo_stages)
            holder = next((n for n, c in self.coords.items() if pred in c), None)
            if holder is None or len(self.coords[holder]) > 1:
                return Action(pause_s=m.bamboo_fatal_restart_s)
            self.coords[holder].append(mine[0])
        if not self.fallback and (mine or self.spare_loss_slows):
            self.fallback = True
            return Action(stretch_inflight=m.bamboo_slowdown, iteration_s=self.base_s * m.bamboo_slowdown)
        return NOTHING

    def on_resume(self, job: JobView) -> Action:
        m, n = self.model, len(job.live)
        s = m.bamboo_stages
        self.pipelines = n // s
        slots = [(p, j) for p in range(self.pipelines) for j in range(s)]
        self.coords = {node: ([slots[i]] if i < len(slots) else []) for i, node in enumerate(job.live)}
        self.waiting = n - len(slots)
        self.fallback = False
        self.base_s = _table_time(m, m.bamboo, n) if self.pipelines else math.inf
        return Action(iteration_s=self.base_s, redundant_fraction=m.bamboo_redundant_fraction)

    def active_nodes(self, job: JobView) -> list[str]:
        return [n for n, c in self.coords.items() if c]

    def after_iteration(self, job: JobView) -> Action:
        s = self.model.bamboo_stages
        overloaded = sum(1 for c in self.coords.values() if len(c) > 1)
        active = self.pipelines * s - overloaded
        rebalance = (
            (overloaded and self.waiting >= overloaded)
            or (overloaded and 2 * overloaded / max(active, 1) > 0.05)
            or (active + self.waiting) // s > self.pipelines
        )
        return Action(durable=True, pause_s=self.model.bamboo_rebalance_s if rebalance else None)


class CheckpointRestart(Policy):
    name = "checkpoint_restart"

    def __init__(self, model: ModelProfile, cache: PlanCache, *, interval: int = 10) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise SimulationError(f"checkpoint interval must be an integer >= 1 iterations, got {interval!r}")
        self.model, self.cache, self.interval = model, cache, interval
        self.active: set[str] = set()
        self.count = 0

    def on_ready(self, job: JobView, node: str) -> Action:
        return Action(pause_s=self.model.restart_s) if job.phase == "idle" else NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        if node not in self.active or job.phase == "idle":
            return NOTHING
        return Action(pause_s=self.model.restart_s, rollback=True)

    def on_resume(self, job: JobView) -> Action:
        m = self.model
        usable = min(len(job.live), m.nodes) // m.pp
        dp = max((d for d in divisors(m.total_microbatches) if d <= usable), default=0)
        self.active = set(job.live[: dp * m.pp])
        self.count = 0
        return Action(iteration_s=self.cache.one_f_one_b_s(dp, m.pp) if dp else math.inf)

    def active_nodes(self, job: JobView) -> set[str]:
        return self.active

    def after_iteration(self, job: JobView) -> Action:
        self.count += 1
        return Action(checkpoint_s=self.model.checkpoint_s) if self.count % self.interval == 0 else NOTHING


class ReCycle(Policy):
    name = "recycle"
    clamp_to_1f1b = True

    def __init__(self, model: ModelProfile, cache: PlanCache, *, checkpoint_interval: int = 10) -> None:
        self.model, self.cache = model, cache
        self.checkpoint_interval = checkpoint_interval
        self.grid: Grid | None = None
        self.rebuild = True
        self.count = 0

    def grid_time(self, grid: Grid | TemplateLayout) -> float:
        if isinstance(grid, TemplateLayout):
            return grid.seconds()
        if not grid.covered():
            return math.inf
        failed = grid.failed
        if not failed:
            return self.healthy_s(grid.dp, grid.pp)
        planned = self.cache.plan_s(grid.dp, grid.pp, failed)
        return max(planned, self.cache.one_f_one_b_s(grid.dp, grid.pp)) if self.clamp_to_1f1b else planned

    def healthy_s(self, dp: int, pp: int) -> float:
        return self.cache.one_f_one_b_s(dp, pp)

    def _new_grid(self, job: JobView) -> Grid:
        return Grid(self.model, self.model.dp, self.model.pp, job.live)

    def active_nodes(self, job: JobView) -> set[str]:
        return self.grid.nodes if self.grid is not None else set()

    def _spares(self, job: JobView) -> list[str]:
        used = self.grid.nodes if self.grid else set()
        return [n for n in job.live if n not in used]

    def on_ready(self, job: JobView, node: str) -> Action:
        if job.phase == "idle":
            self.rebuild = True
            return Action(pause_s=self.model.regrid_pause_s())
        if self.grid is not None and job.phase != "paused" and self.grid.fill(node):
            return Action(iteration_s=self.grid_time(self.grid))  # re-join: from the next iteration
        return NOTHING

    def on_remove(self, job: JobView, node: str) -> Action:
        if self.grid is None or not self.grid.vacate(node):
            return NOTHING
        if self.grid.covered() or any(self.grid.fill(n) for n in self._spares(job)):
            return Action(pause_s=self.model.detect_s)
        self.rebuild = True  # beyond tolerance: restart from the persistent checkpoint
        return Action(pause_s=self.model.detect_s + self.model.restart_s, rollback=True)

    def on_resume(self, job: JobView) -> Action:
        if self.rebuild or self.grid is None:
            self.grid, self.rebuild = self._new_grid(job), False
        for n in self._spares(job):
            if not self.grid.fill(n):
                break
        if len(self.grid.nodes) < self.grid.pp:
            self.rebuild = True
            return Action(iteration_s=math.inf)
        return Action(iteration_s=self.grid_time(self.grid))

    def after_iteration(self, job: JobView) -> Action:
        self.count += 1
        if self.count % self.checkpoint_interval == 0:
            return Action(background_checkpoint_s=self.model.checkpoint_s)
        return NOTHING


class DsResilience(ReCycle):
    name = "ds_resilience"
    clamp_to_1f1b = False

    def __init__(self, model: ModelProfile, cache: PlanCache, *, healthy: str = "planned",
                 horizon_s: float | None = None, regrid: str = "templates", straggler_window: int | None = None) -> None:
        super().__init__(model, cache)
        if straggler_window is None:
            from ..config import DetectorConfig

            straggler_window = DetectorConfig().straggler_window
        if isinstance(straggler_window, bool) or not isinstance(straggler_window, int) or straggler_window < 1:
            raise SimulationError(f"straggler_window must be an integer >= 1 iterations, got {straggler_window!r}")
        self.straggler_window = straggler_window
        if healthy not in ("planned", "1f1b"):
            raise SimulationError(f"healthy schedule {healthy!r} must be 'planned' or '1f1b'")
        if regrid not in REGRID_TIERS:
            raise SimulationError(f"re-grid tier {regrid!r}; allowed: {', '.join(REGRID_TIERS)}")
        self.healthy, self.horizon_s, self.regrid = healthy, horizon_s, regrid
        self.templates = TemplateTier(cache) if regrid == "templates" else None
        self.layouts: dict[str, int] = {}  # what each new layout was, and how often (for reports)
        self.regrid_pause_s = self.pause_s(None)  # onto the profile's depth (reports)
        self.changes: list[float] = []
        self.pending: Grid | TemplateLayout | None = None  # the layout after the pause
        self.deferred: Grid | TemplateLayout | None = None  # a voluntary change, at the iteration's end
        self.plan_speeds: dict[str, float] = {}  # the slow nodes (and speeds) the running plan was made for
        self.window = 0  # iteration boundaries until a speed change is adopted
        self._adapted: dict[tuple, float] = {}

    def pause_s(self, layout: Grid | TemplateLayout | None) -> float:
        """The pause of a change onto ``layout``: a restart of every worker (tier ``restart``) or a
        live re-grid, whose busiest receiver takes one stage of ``layout``'s shallowest pipeline."""
        if self.regrid == "restart":
            return self.model.restart_s
        return self.model.regrid_pause_s(None if layout is None else layout.pp)

    def healthy_s(self, dp: int, pp: int) -> float:
        if self.healthy == "1f1b":
            return self.cache.one_f_one_b_s(dp, pp)
        return self.cache.plan_s(dp, pp, ())

    def _spares(self, job: JobView) -> list[str]:
        return [n for n in super()._spares(job) if n not in self.plan_speeds]  # a known slow node is no spare

    def _horizon(self, now: float) -> float:
        if self.horizon_s is not None:
            return self.horizon_s
        self.changes.append(now)
        if len(self.changes) < 3:
            return 3600.0
        return (self.changes[-1] - self.changes[0]) / (len(self.changes) - 1)

    def _candidates(self, live: list[str]) -> list[Grid]:
        m = self.model
        n = min(len(live), m.nodes)
        out: list[tuple[float, Grid]] = []
        for pp in m.stage_options():
            costs = [l * (1 + m.backward_ratio + m.weight_ratio) for l in stage_layers(m.layers, pp)]
            for dp in divisors(m.total_microbatches):
                if (dp - 1) * pp >= n or dp * pp < n - pp:
                    continue  # a whole pipeline of holes, or a whole pipeline of spares
                grid = Grid(m, dp, pp, live[:n])
                if not grid.covered():
                    continue
                reps = [sum(1 for p in range(dp) if grid.slot[(p, s)] is not None) for s in range(pp)]
                work = max(math.ceil(m.total_microbatches / r) * c for r, c in zip(reps, costs))
                out.append((work, grid))
        out.sort(key=lambda x: x[0])
        return [g for _, g in out[:3]]

    def _best(self, job: JobView, exclude: Iterable[str] = ()) -> tuple[float, Grid | TemplateLayout | None]:
        best: tuple[float, Grid | TemplateLayout | None] = (math.inf, None)
        m = self.model
        out = set(exclude)
        live = [n for n in job.live if n not in out]
        home = Grid(m, m.dp, m.pp, live[: m.nodes])  # the configured grid wins ties
        layouts: list[Grid | TemplateLayout] = [home, *self._candidates(live)]
        if self.templates is not None:
            layout = self.templates.layout(live[: m.nodes])
            if layout is not None:
                layouts.append(layout)
        for grid in layouts:
            if not grid.covered():
                continue
            if grid is home and not grid.failed:
                return self.grid_time(grid), grid  # healthy: the job's own configuration
            try:
                t = self.grid_time(grid)
            except PlanningError:
                continue
            if t < best[0] * (1 - 1e-9):
                best = (t, grid)
        return best

    def _decide(self, job: JobView, pause_keep: float) -> Action:
        horizon = self._horizon(job.now)
        keep = self.grid_time(self.grid) if self.grid is not None else math.inf
        if self.regrid == "restart" and math.isfinite(keep):  # the engine restarts only when it must
            return Action(pause_s=pause_keep) if pause_keep > 0 else Action(iteration_s=keep)
        t_new, grid = self._best(job)
        regrid_pause = pause_keep + self.pause_s(grid)
        if grid is not None and (horizon - regrid_pause) / t_new > max(0.0, horizon - pause_keep) / keep:
            if pause_keep == 0 and job.phase == "running":  # nothing forces it: at the iteration's end
                self.deferred = grid
                return NOTHING
            self.pending = grid
            return Action(pause_s=regrid_pause)
        return Action(pause_s=pause_keep) if pause_keep > 0 else Action(iteration_s=keep)

    def on_ready(self, job: JobView, node: str) -> Action:
        if job.phase == "idle":
            self.pending = self.deferred = None
            self.rebuild = True
            return Action(pause_s=self.model.regrid_pause_s())  # a start from idle, in every tier
        if self.grid is None or job.phase == "paused":
            return NOTHING
        if self.grid.fill(node):
            return Action(iteration_s=self.grid_time(self.grid))
        return self._decide(job, 0.0)

    def on_remove(self, job: JobView, node: str) -> Action:
        dropped = self.deferred is not None and node in self.deferred.nodes
        if dropped:
            self.deferred = None  # the voluntary change lost a node: decided again
        if self.grid is None or not self.grid.vacate(node):
            return self._decide(job, 0.0) if dropped and job.phase == "running" else NOTHING
        self.deferred = None
        for spare in self._spares(job):
            if self.grid.fill(spare):
                break
        if not self.grid.covered():
            t_new, grid = self._best(job)
            self.pending = grid
            self.rebuild = grid is None
            self._horizon(job.now)
            return Action(pause_s=self.model.detect_s + self.pause_s(grid))
        return self._decide(job, self.model.detect_s)

    def on_resume(self, job: JobView) -> Action:
        if self.pending is not None:
            self.grid, self.pending, self.rebuild = self.pending, None, False
            self._count(self.grid)
        elif self.rebuild or self.grid is None:
            _, self.grid = self._best(job)
            self.rebuild = self.grid is None
            if self.grid is None:
                return Action(iteration_s=math.inf)
            self._count(self.grid)
        return super().on_resume(job)

    def _count(self, layout: Grid | TemplateLayout) -> None:
        self.layouts[layout.describe()] = self.layouts.get(layout.describe(), 0) + 1

    # --- fail-slow workers ---------------------------------------------------------------------
    def on_speed(self, job: JobView, node: str) -> Action:
        # the rest of the iteration in flight, then the detector's window of whole iterations: all
        # of them slow to see a slowdown (it holds the fastest pace), one fast one to see a recovery
        slower = any(v < self.plan_speeds.get(n, 1.0) for n, v in job.speeds.items())
        self.window = 1 + (self.straggler_window if slower else 1)
        return NOTHING

    def slowdown(self, job: JobView) -> float:
        """The running plan's iteration over :meth:`grid_time`'s: the plan made for
        :attr:`plan_speeds` (:meth:`adapted_s`), slowed further by any node now slower than that
        plan assumed (pace of the slowest, ``planned speed / speed``)."""
        layout = self.grid
        if layout is None or not (job.speeds or self.plan_speeds):
            return 1.0
        nodes = layout.nodes
        actual = {n: v for n, v in job.speeds.items() if n in nodes}
        planned = {n: v for n, v in self.plan_speeds.items() if n in nodes}
        if not actual and not planned:
            return 1.0
        base = self.grid_time(layout)
        if not math.isfinite(base) or base <= 0:
            return 1.0
        adapted = self.adapted_s(layout, planned) if planned else base
        lag = max(1.0, max(planned.get(n, 1.0) / actual.get(n, 1.0) for n in set(actual) | set(planned)))
        return adapted * lag / base

    def adapted_s(self, layout: Grid | TemplateLayout, speeds: dict[str, float]) -> float:
        """Seconds per iteration of the plan that treats slow nodes as partial failures.

        Per stage (a stage of a template group for templates) with ``r`` live replicas whose slow
        ones lose ``l = sum(1 - speed)`` of a replica's capacity: the planner's plans with the
        ``k - 1`` and ``k = ceil(l)`` slowest of them as holes (their micro-batches re-routed to the
        peers) bracket the capacities ``r - k + 1`` and ``r - k``, and the iteration time is
        interpolated between the two plans in the inverse of the capacity ``r - l`` (the bound of
        the remaining capacity: at speed 1 the first plan, at speed 0 the second). The slowest
        stage sets the time. Never slower than running the unchanged plan at the slowest node's
        pace (what a stage of one replica, which has no peer to take work, does).
        """
        key = (layout.describe(), frozenset(layout.slot.items()), frozenset(speeds.items()))
        if key in self._adapted:
            return self._adapted[key]
        base = self.grid_time(layout)
        unadapted = base / min(speeds.values(), default=1.0)
        stages: dict[object, list[str]] = {}
        for pos, node in layout.slot.items():
            if node is not None:
                stages.setdefault(pos[1] if len(pos) == 2 else (pos[0], pos[2]), []).append(node)
        worst = base
        for members in stages.values():
            slow = sorted((speeds[n], n) for n in members if n in speeds)
            if not slow:
                continue
            r, lost = len(members), sum(1.0 - v for v, _ in slow)
            k = math.ceil(lost - 1e-9)
            if k >= r:
                worst = math.inf
                break
            try:
                t_a, t_b = (self.grid_time(self._without(layout, [n for _, n in slow[:j]])) for j in (k - 1, k))
            except PlanningError:
                worst = math.inf
                break
            c_a, c_b, c_v = r - k + 1, r - k, r - lost
            t = t_a + (t_b - t_a) * (1 / c_v - 1 / c_a) / (1 / c_b - 1 / c_a)
            worst = max(worst, t)
        result = min(worst, unadapted)
        self._adapted[key] = result
        return result

    @staticmethod
    def _without(layout: Grid | TemplateLayout, nodes: list[str]) -> Grid | TemplateLayout:
        out = copy.copy(layout)
        out.slot = dict(layout.slot)
        for n in nodes:
            out.vacate(n)
        return out

    def _adopt(self, job: JobView) -> None:
        """A speed change seen over a whole iteration: the weighted plan from now on; and, beyond
        re-routing (tiers grid and templates), a layout without the slow nodes (or with the
        recovered ones back) when it repays its pause within the horizon, as for a failure."""
        self.plan_speeds = dict(job.speeds)
        if self.regrid == "restart" or self.grid is None or self.deferred is not None:
            return
        keep = self.grid_time(self.grid) * self.slowdown(job)
        t_new, layout = self._best(job, exclude=job.speeds)
        if layout is None or not math.isfinite(t_new):
            return
        n = len(self.changes)
        horizon = self.horizon_s or (3600.0 if n < 3 else (self.changes[-1] - self.changes[0]) / (n - 1))
        if (horizon - self.pause_s(layout)) / t_new > horizon / keep:
            self.deferred = layout

    def after_iteration(self, job: JobView) -> Action:
        if self.window:
            self.window -= 1
            if not self.window:
                self._adopt(job)
        if self.deferred is not None:  # a change of layout nothing forced: at the iteration boundary
            self.pending, self.deferred = self.deferred, None
            return Action(durable=True, pause_s=self.pause_s(self.pending))
        return Action(durable=True)  # a snapshot in host memory every iteration


def make_policy(system: str, model: ModelProfile, cache: PlanCache | None = None, *,
                checkpoint_interval: int = 10, healthy: str = "planned", regrid: str = "templates") -> Policy:
    """The policy of ``system`` (one of :data:`SYSTEMS`) for ``model``; ``healthy`` and ``regrid``
    (one of :data:`REGRID_TIERS`) are ds_resilience's (see :class:`DsResilience`).

    Raises:
        SimulationError: an unknown system (the message lists the allowed ones).
    """
    if system not in SYSTEMS:
        raise SimulationError(f"unknown system {system!r}; allowed: {', '.join(SYSTEMS)}")
    if system in ("ds_resilience", "recycle", "checkpoint_restart") and cache is None:
        cache = PlanCache(model)
    if system == "oobleck":
        return Oobleck(model)
    if system == "varuna":
        return Varuna(model)
    if system == "bamboo":
        return Bamboo(model)
    if system == "checkpoint_restart":
        return CheckpointRestart(model, cache, interval=checkpoint_interval)  # type: ignore[arg-type]
    if system == "recycle":
        return ReCycle(model, cache, checkpoint_interval=checkpoint_interval)  # type: ignore[arg-type]
    return DsResilience(model, cache, healthy=healthy, regrid=regrid)  # type: ignore[arg-type]


def simulate_system(trace: Trace, model: ModelProfile, system: str, *, cache: PlanCache | None = None,
             checkpoint_interval: int = 10, healthy: str = "planned", regrid: str = "templates") -> Result:
    """Run ``system`` on ``model`` over ``trace`` and return its :class:`~.jobsim.Result`."""
    policy = make_policy(system, model, cache, checkpoint_interval=checkpoint_interval, healthy=healthy,
                         regrid=regrid)
    result = run_policy(trace, policy, samples_per_iteration=float(model.global_batch), boot_s=model.boot_s)
    return replace(result, model=model.name)


def mean_over_redraws(trace: Trace, model: ModelProfile, system: str, *, draws: int = 64, seed: int = 0,
                      cache: PlanCache | None = None) -> float:
    """Mean throughput of ``system`` over ``draws`` redraws of the trace's victims (seeded).

    For systems whose outcome depends on which node fails (Bamboo) on traces whose victims were
    drawn at random (the published periodic traces).
    """
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise SimulationError(f"draws must be an integer >= 1, got {draws!r}")
    rng = random.Random(seed)
    throughputs = []
    with progress_bar(draws, f"{system} on {trace.name}", unit="draw") as bar:  # a terminal's only
        for _ in range(draws):
            throughputs.append(simulate_system(redraw_victims(trace, rng), model, system, cache=cache).throughput)
            bar.update()
    return statistics.fmean(throughputs)
