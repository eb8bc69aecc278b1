"""Re-grid a DeepSpeed pipeline job on its survivors, in their running processes (issue 18, part 4).

When a stage loses every replica (``resilience.regrid``), :func:`regrid` is the recovery plan's
``regrid`` action for one survivor. Every survivor computes the same
:class:`~ds_resilience.planning.live_regrid.LiveRegridPlan`, then:

1. **state**: its stage's state at the resume step (after the plan's rollback) is cut into layers
   (``checkpoint/layer_state.py``); the survivor the plan names fetches each lost stage's snapshot
   from the in-memory tier (``checkpoint/fetch.py``, collective over the survivors) and cuts it too
   (a snapshot records the layer of each of its parameters); under bf16/fp16 a layer carries its
   fp32 masters, and DeepSpeed's ``FusedAdam`` (its step counted on each group's last parameter)
   gets its group's step on every new group;
2. **moves**: each survivor receives the layers its new position lacks from the survivors that hold
   them, in one global order over one group of the survivors (``checkpoint/layer_transfer.py``);
3. **rebuild**: DeepSpeed's default process group is replaced by a local stand-in one of the new
   grid's size (every real message goes through ds_resilience's own groups on the agent's store,
   as for a re-joining worker), and a new :class:`~.ds_engine.ResilientPipelineEngine` is built for
   the new position: a ``PipelineModule`` of the same layer specs cut at the plan's bounds, the
   DeepSpeed config with the new micro-batch count (same global batch), the same optimizer and
   scheduler settings, the data source (the user's ``batch_source``, or ``training_data`` read by
   index as the first grid's sampler dealt it) re-mapped so that each new pipeline trains the old global
   batch's micro-batches the plan dealt it, and the moved layers' state loaded before its first
   snapshot;
4. **swap**: the engine object the training script holds takes the new engine's state (they share
   one ``__dict__``), so ``engine.train_batch()`` simply goes on; the coordinator (heartbeats, the
   agent's epochs) is the same one, re-registered with the new position.

The new grid names its workers by the agent's ranks (a ``Topology`` with a rank table), so every
store key, snapshot owner and later recovery plan keeps using them. What this does not do yet
(:func:`regrid_blocker` refuses it at start-up):
data from iterators (a ``batch_source`` or a map-style ``training_data`` is needed), an optimizer
object that is no ``torch.optim.Optimizer`` or a scheduler object without ``.optimizer`` (the
caller's objects belong to the old parameters: an optimizer is rebuilt from its class, defaults
and the moved layers' parameter groups, a scheduler copied and re-pointed), and tensor parallelism.
Dropout draws the old grid's masks: the engine reseeds every layer from (iteration, the
micro-batch as the first grid numbered it, layer), and the new engine takes the composed map.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from ..comm.standin import init_stand_in
from ..logs import get_logger
from ..checkpoint.fetch import fetch_versions
from ..checkpoint.inmemory import owner_name
from ..checkpoint.layer_state import (LAYER_FORMAT, inner_param_groups, inverse, layer_trees, renumber,
                                      stage_state)
from ..checkpoint.layer_transfer import transfer
from ..checkpoint.state import StageState, apply, capture, tree_nbytes
from ..comm.groups import build_groups
from ..epochs import WorkerInfo
from ..errors import PlanningError, ResilienceError
from ..planning.live_regrid import (LiveRegridPlan, choose_grid, lost_stage_sources, one_f_one_b_time,
                                    plan_live_regrid, regrid_pays)
from ..planning.recovery import RecoveryPlan
from ..planning.layers import LayerProfile
from ..planning.regrid import RegridPlan
from ..planning.templates import partition
from ..runtime import membership
from ..runtime.recovery import BeyondTolerance
from ..topology import Topology
from .ds_fused_adam import counts_steps_per_group
from .ds_regrid_objects import RebuildError, rebuilt_optimizer, repointed_scheduler
from .ds_regrid_zero import assemble, reshard_state, unshard, unsharded_param_groups

__all__ = ["HORIZON", "RegridContext", "RegridError", "layer_loader", "origin_source", "regrid", "regrid_blocker",
           "regrid_pays_for", "take_over"]

HORIZON = 20
"""Iterations over which a re-grid must beat re-routing, its own pause (taken as two fault-free
iterations) included, before the survivors re-form the grid around failures re-routing covers."""

logger = get_logger("ds_resilience.recovery")


class RegridError(ResilienceError):
    """The survivors cannot re-form the grid (a lost stage's snapshot is held by no survivor)."""


@dataclass
class RegridContext:
    """What the new engine takes over from the old one (``ResilientPipelineEngine(regrid_from=...)``)."""

    ranks: tuple[int, ...]  # the new grid's rank table (worker index -> the agent's rank)
    coordinator: Any
    session: str
    grid: int  # how many re-grids so far, this one included (the new engine's ``regrids``)
    origin: Topology  # the first grid: the machines' placement of the snapshots
    gone: tuple[int, ...]  # every rank lost so far
    recovery_log: list
    progress: Any  # what the heartbeat reads of the main thread (a stalled one stops the beats)
    origin_microbatches: tuple  # new (pipeline, micro-batch) -> the first grid's (the data and dropout keys)
    origin_bounds: tuple[int, ...]  # the first grid's layer partition (what growing back returns to)
    load: Callable[[Any], None] = field(repr=False)  # puts the moved state into the new engine


def regrid_blocker(engine: Any, rebuild: dict[str, Any] | None) -> str | None:
    """Why this engine cannot re-grid in place (``None``: it can)."""
    if engine.launch is None:
        return "a re-grid needs the agent (ds-resilience run)"
    if not engine.resilience.checkpoint.enabled:
        return "a lost stage comes back from the in-memory snapshots: resilience.checkpoint.enabled must be true"
    if engine.stage_host.param_layers is None:
        return "a parameter belongs to no layer of its stage (registered outside the PipelineModule's layers)"
    if rebuild is None or origin_source(engine, rebuild) is None:
        return ("the new pipelines read other pipelines' micro-batches: pass batch_source= or a map-style "
                "training_data= to initialize (a data iterator cannot be addressed)")
    opt, sched = rebuild.get("optimizer"), rebuild.get("lr_scheduler")
    if opt is not None and not callable(opt) and not isinstance(opt, torch.optim.Optimizer):
        return ("an optimizer object that is no torch.optim.Optimizer cannot be rebuilt around a new stage's "
                "parameters: configure it in the DeepSpeed config or pass a callable")
    if sched is not None and hasattr(sched, "state_dict") and not hasattr(sched, "optimizer"):
        return ("an LR scheduler object without an .optimizer cannot be re-pointed at a new stage's optimizer: "
                "configure it in the DeepSpeed config or pass a callable")
    return None


def origin_source(engine: Any, rebuild: dict[str, Any]) -> Callable | None:
    """Any (pipeline, iteration, micro-batch) of the first grid's data, read by index: the user's
    ``batch_source``, or, for a map-style ``training_data`` the engine reads (``ds_data.EngineData``),
    a :class:`~.ds_data.DatasetSource` of the same dataset, sampler and collate as the first grid's
    (its data-parallel size and micro-batch count), every read in this process. ``None``: the data
    come from iterators, which cannot be addressed."""
    from .ds_data import DatasetSource, EngineData

    if rebuild.get("batch_source") is not None:
        return rebuild["batch_source"]
    data = getattr(getattr(engine, "executor", None), "batch_source", None)
    if not isinstance(data, EngineData) or data.dataset is None or not data.from_dataset:
        return None
    first = data.dataset  # the first grid's: a re-gridded engine is given the origin source as its batch_source
    return DatasetSource(first.dataset, dp=first.dp, microbatches=first.microbatches, spec=first.spec, own=None)


def regrid_pays_for(engine: Any, failed: frozenset) -> bool:
    """Whether re-forming the grid beats re-routing around ``failed`` (a set re-routing covers) over
    :data:`HORIZON` iterations: the re-routed plan's predicted iteration time (the plan table's or
    the planner's, as every survivor gets it) against the re-formed grid's, the fault-free time
    scaled by 1F1B's estimate of the two grids on the model's layers (layer counts stand in for
    the memory each may hold, at most twice the largest old stage)."""
    figures = engine.provider.schedule_for(failed).figures or {}
    reroute, base = figures.get("iteration_time"), figures.get("fault_free_iteration_time")
    if not reroute or not base:
        return False
    parts = tuple(engine.module.parts)
    layers = parts[-1]
    widest = max(b - a for a, b in zip(parts, parts[1:]))
    alive = engine.topology.num_workers - len(failed)
    try:
        grid = choose_grid(alive, layers, engine.topology.dp * engine.micro_batches,
                           layer_memory=[1.0] * layers, memory_cap=2.0 * widest)
    except PlanningError:
        return False
    regrid_s = base * grid.predicted / one_f_one_b_time(parts, engine.micro_batches, [1.0] * layers)
    return regrid_pays(reroute, regrid_s, 2.0 * base, HORIZON)


def _compose(origin: tuple | None, plan: LiveRegridPlan) -> tuple:
    """New (pipeline, micro-batch) -> the first grid's, through this re-grid and the ones before."""
    if origin is None:
        return plan.microbatches
    return tuple(tuple(origin[p][i] for p, i in block) for block in plan.microbatches)


def _remap(source: Callable | None, table: tuple) -> Callable | None:
    """A batch source of the new grid: new (pipeline, step, micro-batch) -> the first grid's (the
    user's source numbers micro-batches as the job started)."""
    if source is None:
        return None

    def remapped(pipeline: int, iteration: int, microbatch: int):
        old_pipeline, old_microbatch = table[pipeline][microbatch]
        return source(old_pipeline, iteration, old_microbatch)

    return remapped


def _module_class(bounds: tuple[int, ...]):
    from deepspeed.pipe import PipelineModule

    class RegriddedPipelineModule(PipelineModule):
        """A ``PipelineModule`` cut at the re-grid's bounds (not by a partition method)."""

        def _partition_layers(self, method: str = "uniform") -> None:
            stage = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(bounds)
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return RegriddedPipelineModule


def _log(engine: Any, text: str) -> None:
    logger.info("rank %d %s", engine.rank, text)


def regrid(engine: Any, record: Any, plan: RecoveryPlan) -> None:
    """Re-form the grid on the survivors (module docstring); ``engine`` becomes the new engine."""
    started = time.perf_counter()
    old = engine.topology
    failed = [r for r in record.failed if old.has_rank(r)]
    survivors = sorted(r for r in (old.rank(w) for w in old.workers()) if r not in set(failed))
    step = plan.resume_step
    # before anything else: the agent relaunches nobody into the grid that is going away
    engine.coordinator.store.set(membership.REGRIDDED_KEY, f"epoch {record.epoch}: {len(survivors)} survivors "
                                                           f"of {old.dp} x {old.pp}")
    # 1. one group of the survivors, for the sizes, the fetch and the moves
    engine.recovery._arrive(record.epoch, engine.recovery.view.ranks(survivors))
    target = old.without(frozenset(old.coord(r)[0] for r in failed))
    timeout = engine.resilience.detector.pg_timeout_s
    # held to the end: dropping the stage and tied groups at once closed this rank's pairs while a
    # slower peer was still connecting to them ("Connection closed by peer" in its group build);
    # the world collectives below wait for every member, so by the end every build has finished
    groups = build_groups(target, engine.me, session=f"{engine.session}/regrid", generation=record.epoch,
                          timeout_s=timeout, store=engine.coordinator.store, device=engine._comm_device())
    world = groups.world
    lost_ranks = snapshot_owners(old, failed, zero=engine.sharded_optimizer is not None)
    try:
        source = origin_source(engine, engine._rebuild)
        if source is None:  # train_batch(data_iter) replaced the training_data loader since initialize
            raise RegridError("the data come from an iterator, which cannot be read by (pipeline, iteration, micro-batch)")
        step = _agree_step(engine, world, lost_ranks, step)
        if step == plan.resume_step:
            state = capture(engine.stage_host, stage=engine.stage_id, rank=engine.rank).clone(host=True)
        else:  # a lost stage's newest snapshot is older than the resume step: every survivor goes back to it
            state = StageState.from_tree(engine.tier.memory.load_peer(engine.rank, step))
            engine.tier.memory.store.discard_after(owner_name(engine.rank), step)  # the old layout's later steps
        parts = engine.module.parts
        zero = engine.sharded_optimizer is not None
        # ZeRO-1: a shard is not cut into layers (it is made whole below); the plan sizes layers by their weights
        if not zero:  # the optimizer's parameter numbering as the module's (a caller's optimizer with groups)
            state = replace(state, optimizer=renumber(state.optimizer, engine.stage_host.optimizer_order))
        held = _with_empty(layer_trees(replace(state, optimizer=None) if zero else state,
                                       engine.stage_host.param_layers), parts, engine.stage_id)
        # every layer's state in bytes, from its holders (a lost stage's layers: the mean of the others)
        sizes: dict[int, float] = {}
        for part in world.all_gather_json({str(k): tree_nbytes(v) for k, v in held.items()}):
            sizes.update({int(k): float(v) for k, v in part.items()})
        mean = sum(sizes.values()) / max(len(sizes), 1)
        layer_bytes = [sizes.get(i, mean) for i in range(parts[-1])]
        # a worker may hold up to twice the state of the largest stage it had (no profile of the
        # device's memory yet); each stage count's partition is the template planner's best one,
        # with the layers' state standing in for their time (DeepSpeed's "parameters" method)
        cap = 2.0 * max(sum(layer_bytes[a:b]) for a, b in zip(parts, parts[1:]))
        bounds_for = _templates(layer_bytes, cap)
        if engine.tied_groups and engine.get_data_types()[0] != torch.float32:
            # one stage would hold every copy of a tied weight in one module, whose gradients autograd
            # then sums in bf16/fp16: the fault-free grid folds each copy's into fp32 and sums those
            bounds_for = _not_one_stage(bounds_for)
        live = plan_live_regrid(old, failed, parts, engine.micro_batches, layer_bytes=layer_bytes, memory_cap=cap,
                                bounds_for=bounds_for, layer_cost=layer_bytes)
        _log(engine, f"re-grid plan (from step {step}) {live.to_json()}")
        receivers = {dead: receiver for dead, receiver in live.fetches.values()}
        planned = set(receivers)
        if zero:  # every dead rank's shard: each stage's ranges are summed whole
            receivers.update(_zero_receivers(old, failed, survivors, receivers))
        t0 = time.perf_counter()
        fetched = fetch_versions(engine.tier.memory, sorted(receivers), step, world, receiver_of=receivers.__getitem__)
        if fetched is None:
            raise RegridError(f"the snapshot of step {step} of a lost stage ({sorted(receivers)}) is held by no survivor")
        if zero:
            state, full = _unshard_own(engine, world, state, fetched, planned)
            held = _with_empty(layer_trees(state, engine.stage_host.param_layers), parts, engine.stage_id)
        for dead, tree in fetched.items():
            if dead not in planned:
                continue  # ZeRO-1: fetched for its shard only
            lost = StageState.from_tree(tree)
            if zero:
                if "zero_groups" not in lost.extra:
                    raise RegridError(f"rank {lost.rank}'s snapshot records no ZeRO-1 group layout (an older version)")
                lost = replace(lost, optimizer=unshard(lost.optimizer, full[lost.stage], lost.extra["zero_groups"],
                                                       lost.params))
            else:
                lost = replace(lost, optimizer=renumber(lost.optimizer, lost.extra.get("optimizer_order")))
            layers = lost.extra.get("param_layers")
            if layers is None:
                raise RegridError(f"rank {lost.rank}'s snapshot records no layer per parameter (written by an older version)")
            held.update(_with_empty(layer_trees(lost, layers), parts, lost.stage))
    except (RegridError, PlanningError) as exc:
        _give_up(engine, record, plan, exc)
    fetch_s = time.perf_counter() - t0
    moves = RegridPlan(assignment=live.positions, idle=live.idle, moves=live.moves)
    layers, report = transfer(moves, engine.rank, group=world, rank_of={r: r for r in survivors}, held=held,
                              from_snapshot=lambda layer: held[layer], timeout_s=timeout)
    if engine.rank in live.idle:
        engine.coordinator.mark_applied(record)
        raise BeyondTolerance(f"rank {engine.rank} holds no position in the re-formed grid {live.grid.dp} x "
                              f"{live.grid.pp}: it stops", checkpoint_dir=None, step=step, lost_stages=[])
    # 2. the new engine, on a local default group of the new grid's size
    position = live.positions[engine.rank]
    grid = live.grid
    table = live.rank_table()
    ranks = tuple(table[(p, s)] for s in range(grid.pp) for p in range(grid.dp))
    t1 = time.perf_counter()
    engine.tier.close()
    old_module = engine.module
    rebuild = dict(engine._rebuild, batch_source=source)  # the new grids read the first grid's data by index
    old_data = engine.executor.batch_source
    if hasattr(old_data, "close") and old_data is not source:
        old_data.close()  # training_data: the own pipeline's loader workers
    count = engine.regrids + 1
    load = layer_loader(layers, state)
    context = RegridContext(ranks=ranks, coordinator=engine.coordinator, session=f"live/regrid{count}", grid=count,
                            origin=engine.origin_topology, gone=tuple(sorted(set(engine.gone) | set(failed))),
                            recovery_log=engine.recovery_log, progress=engine.progress,
                            origin_microbatches=_compose(engine.origin_microbatches, live),
                            origin_bounds=engine.origin_parts, load=load)
    try:
        new = _build(engine, old_module, rebuild, live, position, context, layers)
    except (RegridError, RebuildError) as exc:  # nothing of the old engine is needed any more, but nothing new stands either
        engine.coordinator.store.set(membership.REGRID_FAILED_KEY, f"rank {engine.rank}: {exc}")
        raise BeyondTolerance(f"rank {engine.rank} cannot build its re-formed stage ({exc}); the agent restarts "
                              f"every worker from the in-memory snapshots", checkpoint_dir=None, step=step,
                              lost_stages=[], restart=True) from exc
    rebuild_s = time.perf_counter() - t1
    take_over(engine, new)  # the script's engine object is the new engine now
    membership.register_worker(engine.coordinator.store, WorkerInfo(
        rank=engine.rank, pipeline=position.pipeline, stage=position.stage, pid=os.getpid(),
        incarnation=engine.launch.incarnation, dp=grid.dp, pp=grid.pp,
        heartbeat_interval_s=engine.coordinator.heartbeat_interval_s, grid=count))
    engine.coordinator.mark_applied(record)
    entry = {"epoch": record.epoch, "kind": "regrid", "failed": list(record.failed), "resume_step": plan.resume_step,
             "from_step": step,
             "plan": live.to_dict(), "position": [position.pipeline, position.stage, position.first, position.last],
             # the first grid, what growing back re-forms (planning/grow_back.py)
             "origin": {"dp": engine.origin_topology.dp, "pp": engine.origin_topology.pp,
                        "bounds": list(engine.origin_parts), "microbatches": grid.dp * grid.microbatches
                        // engine.origin_topology.dp},
             "sent_bytes": report.sent_bytes, "received_bytes": report.received_bytes,
             "fetched_ranks": sorted(fetched), "fetched_bytes": sum(tree_nbytes(t) for t in fetched.values()),
             "fetch_s": fetch_s, "transfer_s": report.seconds, "layer_bytes": list(live.layer_bytes),
             "rebuild_s": rebuild_s, "regrid_s": time.perf_counter() - started,
             "recovery_s": time.time() - record.detected_at if record.detected_at else None}
    engine.recovery_log.append(entry)
    _log(engine, f"re-grid done {json.dumps(entry, sort_keys=True)}")


def layer_loader(layers: dict[int, Any], like: StageState) -> Callable[[Any], None]:
    """``load(new)``: the new engine's stage state built from the moved ``layers`` (their weights,
    masters and optimizer state; counters, scheduler and random generators as in ``like``) and
    applied to it: the optimizer's own numbering, or under ZeRO-1 this replica's range of the new
    stage's partition."""

    def load(new: Any) -> None:
        sharded = new.sharded_optimizer is not None
        order = None if sharded else new.stage_host.optimizer_order
        groups = (unsharded_param_groups(new) if sharded else
                  renumber({"state": {}, "param_groups": inner_param_groups(new.optimizer.state_dict())},
                           order)["param_groups"])
        new_state = stage_state(layers, new.stage_host.param_layers, param_groups=groups, like=like,
                                stage=new.stage_id, rank=new.rank, group_steps=counts_steps_per_group(new.optimizer))
        if sharded:  # ZeRO-1: this replica's range of the new stage's partition
            new_state = replace(new_state, optimizer=reshard_state(new_state.optimizer, new))
        else:  # back to the optimizer's own numbering
            new_state = replace(new_state, optimizer=renumber(new_state.optimizer, inverse(order)))
        apply(new_state, new.stage_host, stage=new.stage_id)

    return load


def take_over(engine: Any, new: Any) -> None:
    """``engine`` (and every object sharing its state: the script's, and the engines of earlier
    re-grids, whose hooks are bound to them) becomes ``new``: one ``__dict__`` for all of them,
    filled with ``new``'s."""
    shared = engine.__dict__
    state = dict(new.__dict__)
    shared.clear()
    shared.update(state)
    object.__setattr__(new, "__dict__", shared)


def _not_one_stage(bounds_for: Callable[[int], tuple[int, ...] | None]) -> Callable[[int], tuple[int, ...] | None]:
    """``bounds_for`` without the one-stage grid."""
    return lambda pp: None if pp == 1 else bounds_for(pp)


def _zero_receivers(old: Topology, failed: list[int], survivors: list[int], planned: dict[int, int]) -> dict[int, int]:
    """ZeRO-1: a receiver for each dead rank the plan does not fetch: its stage's lowest survivor,
    else the survivor that fetches its stage's planned snapshot, else the lowest survivor."""
    stage = {r: old.coord(r)[0].stage for r in (*failed, *survivors)}
    out = {}
    for dead in failed:
        if dead in planned:
            continue
        same = [r for r in survivors if stage[r] == stage[dead]]
        fetching = [planned[d] for d in sorted(planned) if stage[d] == stage[dead]]
        out[dead] = min(same) if same else fetching[0] if fetching else min(survivors)
    return out


def _unshard_own(engine: Any, world: Any, state: StageState, fetched: dict[int, Any], planned: set[int]):
    """ZeRO-1: every old stage's optimizer ranges summed whole over the survivors (own shards and the
    dead ranks' from the snapshots, ``ds_regrid_zero.assemble``); returns this survivor's state
    unsharded and the full buffers of the stages it cuts (its own and the planned lost ones)."""
    from .ds_regrid_zero import shard_of

    lost = {dead: StageState.from_tree(tree) for dead, tree in fetched.items()}
    entries = [(engine.stage_id, shard_of(state.optimizer))] + [(s.stage, shard_of(s.optimizer)) for s in lost.values()]
    need = {engine.stage_id} | {s.stage for dead, s in lost.items() if dead in planned}
    try:
        full = assemble(world, entries, need)
    except RuntimeError as exc:
        raise RegridError(str(exc)) from exc
    own = unshard(state.optimizer, full[engine.stage_id], engine.stage_host.zero_groups, state.params)
    return replace(state, optimizer=own), full


def _with_empty(trees: dict[int, Any], parts: Any, stage: int) -> dict[int, Any]:
    """``trees`` and an empty tree for each layer of the old ``stage`` that has no parameters of
    its own there (a parameter-free layer, or a tied layer whose module the stage's lower layer
    of the same key carries): every layer the re-grid moves is held by someone."""
    for layer in range(parts[stage], parts[stage + 1]):
        trees.setdefault(layer, {"format": LAYER_FORMAT, "layer": layer, "params": [], "optimizer": [], "groups": []})
    return trees


def _templates(layer_bytes: list[float], cap: float) -> Callable[[int], tuple[int, ...] | None]:
    """``pp -> bounds`` of the best ``pp``-stage template (``planning/templates.py``) under the
    memory cap, the layers' state bytes standing in for their time; ``None`` when none fits."""
    n = len(layer_bytes)
    profile = LayerProfile(t_f=tuple(layer_bytes), t_b=tuple(2.0 * b for b in layer_bytes), t_w=(0.0,) * n,
                           param_bytes=tuple(layer_bytes), optimizer_bytes=(0.0,) * n, activation_bytes=(0.0,) * n,
                           output_bytes=(0.0,) * n, name="layer state bytes")

    def bounds_for(pp: int) -> tuple[int, ...] | None:
        template = partition(profile, pp, memory_cap=cap)
        return None if template is None else template.bounds

    return bounds_for


def _give_up(engine: Any, record: Any, plan: RecoveryPlan | None, exc: Exception) -> NoReturn:
    """This worker cannot re-form the grid (nothing changed yet): tell the agent, which stops the
    job with a restart of every worker from the in-memory snapshots (the tier below), make sure the
    snapshot of the resume step is committed, and leave the training loop. ``plan``: a survivor's
    recovery plan; ``None`` on a worker growing the grid back as a joiner (it holds no snapshot)."""
    engine.coordinator.store.set(membership.REGRID_FAILED_KEY, f"rank {engine.rank}: {exc}")
    step = plan.resume_step if plan is not None else engine.global_steps
    ready = engine.tier.ready_for_restart(step) if plan is not None else {}
    engine.coordinator.mark_applied(record)
    engine.recovery_log.append({"epoch": record.epoch, "kind": "regrid_failed", "resume_step": step,
                                "reason": str(exc), **ready})
    _log(engine, f"cannot re-form the grid: {exc}; the agent restarts every worker from the snapshots")
    raise BeyondTolerance(f"the survivors could not re-form the grid ({exc}); the agent restarts every worker from "
                          f"the in-memory snapshots", checkpoint_dir=None, step=step,
                          lost_stages=list(plan.lost_stages) if plan is not None else [], restart=True) from exc


def snapshot_owners(old: Topology, failed: list[int], *, zero: bool) -> list[int]:
    """The dead ranks whose snapshots the re-grid fetches, so the step it starts from must hold them
    all (:func:`_agree_step`): one per lost stage (its layers), and with ZeRO-1 every dead rank (its
    optimizer shard; CI caught a step agreed on the layers' owner alone while the other replica,
    killed mid-commit, left that step uncommitted, and the fetch then found it held by no survivor)."""
    owners = set(lost_stage_sources(old, failed).values())
    if zero:
        owners |= set(failed)
    return sorted(owners)


def _agree_step(engine: Any, world: Any, lost: list[int], resume: int) -> int:
    """The step the re-grid starts from: the resume step when every lost stage's snapshot of it is
    held by some survivor, else the newest older step at which those snapshots and every
    survivor's own are held (a worker killed mid-copy leaves its newest snapshot uncommitted; with
    a snapshot interval above 1 the step before is not captured at all); the iterations after it
    are replayed. Collective over ``world``."""
    if not lost:
        return resume
    memory = engine.tier.memory

    def held(rank: int) -> list[int]:
        return [s for s in memory.held_steps(rank) if s <= resume] if memory is not None else []

    views = world.all_gather_json({"own": held(engine.rank), "lost": {str(d): held(d) for d in lost}})
    candidates = {resume} | {s for v in views for s in v["own"]} | {s for v in views for h in v["lost"].values() for s in h}
    for s in sorted(candidates, reverse=True):
        if (all(s == resume or s in v["own"] for v in views)
                and all(any(s in v["lost"][str(d)] for v in views) for d in lost)):
            return s
    raise RegridError(f"no step up to {resume} has both the lost stages' snapshots (ranks {lost}) and every "
                      f"survivor's own in host memory")


def _build(engine: Any, old_module: Any, rebuild: dict[str, Any], live: LiveRegridPlan, position, context,
           trees: dict[int, Any]):
    """The new engine for ``position`` of ``live``'s grid (step 3 of the module docstring)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    grid = live.grid
    if dist.is_initialized():
        dist.destroy_process_group()
    init_stand_in(position.stage * grid.dp + position.pipeline, grid.dp * grid.pp)
    module = _module_class(grid.bounds)(
        layers=old_module._layer_specs, num_stages=grid.pp, loss_fn=old_module.loss_fn, seed_layers=False,
        activation_checkpoint_interval=old_module.activation_checkpoint_interval,
        activation_checkpoint_func=old_module.activation_checkpoint_func,
        checkpointable_layers=old_module.checkpointable_layers,
        dynamic_shape=bool(getattr(old_module, "dynamic_shape", False)))
    config = dict(rebuild["config"])
    config["gradient_accumulation_steps"] = grid.microbatches
    config.pop("train_batch_size", None)
    mpu = module.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, module)
    optimizer, scheduler = rebuild.get("optimizer"), rebuild.get("lr_scheduler")
    if isinstance(optimizer, torch.optim.Optimizer):  # the user's object belongs to the old parameters
        optimizer = rebuilt_optimizer(optimizer, module, trees)
    if scheduler is not None and hasattr(scheduler, "state_dict") and hasattr(scheduler, "optimizer"):
        scheduler = repointed_scheduler(scheduler)
    return type(engine)(  # the engine's own class (ResilientPipelineEngine)
        args=rebuild.get("args"), model=module, optimizer=optimizer,
        model_parameters=[p for p in module.parameters() if p.requires_grad], training_data=None,
        lr_scheduler=scheduler, mpu=mpu, dist_init_required=False,
        collate_fn=rebuild.get("collate_fn"), config=config, config_class=config_class,
        resilience=replace(engine.resilience, microbatches=None),
        batch_source=_remap(rebuild["batch_source"], context.origin_microbatches),
        eval_source=_remap(rebuild.get("eval_source"), context.origin_microbatches), launch=engine.launch,
        config_dir=rebuild.get("config_dir"), regrid_from=context, rebuild=rebuild)
