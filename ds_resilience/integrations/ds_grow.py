"""Growing back: the re-gridded survivors and the relaunched workers re-form the first grid (issue 46, part 2).

After a live re-grid (``ds_regrid.py``) the agent, with ``grow_back``, keeps relaunching the ranks
the re-grid left out; once they registered it publishes a ``rejoin`` epoch naming them. A joiner
(a fresh process whose engine was built at its first position) leaves the epoch pending
(``LiveRecovery.join``), and every participant applies it at its next iteration boundary with
:func:`grow`: the survivors at the resume step their recovery plan agreed (rolled back to it),
the joiners with ``plan=None``:

1. one group of every rank of the first grid; each says what it is (a survivor: its grid, step and
   layer partition; a joiner: nothing held);
2. the plan (``planning/grow_back.plan_grow_back``): every rank back at its first position, the
   layers it lacks sent by the small grid's holders (``layer_transfer.transfer``); the lowest
   survivor also hands each joiner its whole stage state as the pattern of counters, scheduler
   and random generators (``like``, as a re-joining worker's donor does);
3. the first grid's engine is built as the re-grid builds one (``ds_regrid._build``: the same
   layer specs at the first partition, the first micro-batch count), its data read by the first
   grid's numbering again (the composed map is the identity), the moved layers' state loaded, and
   the script's engine object takes it; the coordinator re-registers the first position.

Under ZeRO-1 each survivor's shard of the small grid is made whole first (``ds_regrid_zero.assemble``
over every participant, the joiners bringing nothing) and cut into layers; the new engine loads
its replica's range of the first grid's partition (``ds_regrid.layer_loader``). Under bf16/fp16 a
layer carries its fp32 masters, as in the re-grid.

Whether growing pays is decided before anything starts: the small grid's lowest rank posts after
every iteration what growing would save (:func:`post_figures`: its measured iteration time, the
first grid's predicted one, the pause priced by the measured re-grid cost, the iterations left when
the scheduler knows the total), and the agent publishes the ``grows`` epoch only when
``grow_back.decide_grow`` says it pays (``supervisor/agent.py``); the decision on the figures of the
moment is logged again with the grow. A grow that cannot be done (a survivor's data from an
iterator, a plan that does not fit) gives up before any state changes, as a failed re-grid does:
the agent restarts every worker from the in-memory snapshots.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

from .. import store_keys as keys
from ..checkpoint.handover import recv_state, send_state
from ..checkpoint.layer_state import layer_trees, renumber
from ..checkpoint.layer_transfer import transfer
from ..checkpoint.state import capture, tree_nbytes
from ..comm.groups import build_groups
from ..epochs import WorkerInfo
from ..errors import PlanningError, ResilienceError
from ..logs import get_logger
from ..planning.grow_back import busiest_receiver_bytes, decide_grow, full_grid_time, plan_grow_back
from ..planning.recovery import RecoveryPlan
from ..planning.regrid import RegridPlan
from ..runtime import membership
from ..sim.regrid_cost import MEASURED
from ..topology import Topology
from .ds_regrid import (RegridContext, RegridError, _build, _give_up, _unshard_own, _with_empty, layer_loader,
                        origin_source, take_over)
from .ds_regrid_zero import assemble

__all__ = ["GrowError", "grow", "post_figures"]

logger = get_logger("ds_resilience.recovery")


class GrowError(ResilienceError):
    """The survivors and the joiners cannot re-form the first grid."""


def grow(engine: Any, record: Any, plan: RecoveryPlan | None) -> None:
    """Re-form the first grid with the joiners of ``record`` (module docstring); ``engine`` becomes
    the first grid's engine at this rank's first position. ``plan``: the survivors' recovery plan
    (they are at its resume step), ``None`` on a joiner."""
    started = time.perf_counter()
    joiner = plan is None
    origin: Topology = engine.topology if joiner else engine.origin_topology
    me = origin.coord(engine.rank)[0]
    timeout = engine.resilience.detector.pg_timeout_s
    groups = build_groups(origin.healthy(), me, session=f"grow/e{record.epoch}", generation=record.epoch,
                          timeout_s=timeout, store=engine.coordinator.store, device=engine._comm_device())
    world = groups.world
    zero = engine.sharded_optimizer is not None
    mine: dict[str, Any] = {"rank": engine.rank, "joiner": joiner, "zero": zero}
    source = origin_source(engine, engine._rebuild)
    if not joiner:
        t = engine.topology
        mine.update(step=engine.global_steps, regrids=engine.regrids, bounds=list(engine.module.parts),
                    origin_bounds=list(engine.origin_parts), microbatches=engine.micro_batches,
                    grid={"dp": t.dp, "pp": t.pp, "ranks": list(t.ranks or range(t.num_workers))},
                    seconds=[e["seconds"] for e in engine.iteration_log[-5:]],
                    left=iterations_left(engine), iterator=source is None)
    views = world.all_gather_json(mine)
    try:
        survivors = sorted(v["rank"] for v in views if not v["joiner"])
        joiners = sorted(v["rank"] for v in views if v["joiner"])
        if not survivors:
            raise GrowError("no survivor of the re-formed grid takes part in growing back")
        lead = next(v for v in views if v["rank"] == survivors[0])
        if {v["step"] for v in views if not v["joiner"]} != {lead["step"]}:
            raise GrowError(f"the survivors are at different steps: {[(v['rank'], v.get('step')) for v in views]}")
        if len({v["zero"] for v in views}) != 1:
            raise GrowError("the joiners and the survivors disagree on ZeRO-1 (another config?)")
        if any(v.get("iterator") for v in views):
            raise GrowError("a survivor's data come from an iterator, which cannot be read by (pipeline, iteration, "
                            "micro-batch)")
        g = lead["grid"]
        current = Topology(dp=g["dp"], pp=g["pp"], ranks=tuple(g["ranks"]))
        origin_m = current.dp * lead["microbatches"] // origin.dp
        state, held = None, {}
        if not joiner:
            state = capture(engine.stage_host, stage=engine.stage_id, rank=engine.rank).clone(host=True)
            if zero:  # the small grid's shards made whole (a collective the joiners take part in, below)
                state, _ = _unshard_own(engine, world, state, {}, set())
            else:  # the optimizer's parameter numbering as the module's
                state = replace(state, optimizer=renumber(state.optimizer, engine.stage_host.optimizer_order))
            held = _with_empty(layer_trees(state, engine.stage_host.param_layers), engine.module.parts,
                               engine.stage_id)
        elif zero:
            assemble(world, [], set())
        # every layer's state in bytes (the survivors' own layers)
        sizes: dict[int, float] = {}
        for part in world.all_gather_json({str(k): tree_nbytes(v) for k, v in held.items()}):
            sizes.update({int(k): float(v) for k, v in part.items()})
        layer_bytes = [sizes.get(i, 0.0) for i in range(lead["origin_bounds"][-1])]
        live = plan_grow_back(current, lead["bounds"], lead["microbatches"], origin, lead["origin_bounds"],
                              origin_m, joiners, layer_bytes=layer_bytes)
    except (GrowError, RegridError, PlanningError) as exc:
        _give_up(engine, record, plan, exc)  # raises: the agent restarts every worker from the snapshots
    decision = _decision(lead["seconds"], lead["bounds"], lead["microbatches"], live, lead["left"])
    _log(engine, f"grow-back plan (at step {lead['step']}) {live.to_json()}; decision {decision.to_json()}")
    layers, report = transfer(RegridPlan(assignment=live.positions, idle=(), moves=live.moves), engine.rank,
                              group=world, rank_of={r: r for r in survivors + joiners}, held=held,
                              from_snapshot=_nowhere, timeout_s=timeout)
    # the joiners' pattern of counters, scheduler and random generators: the lowest survivor's state
    for j in joiners:
        if engine.rank == survivors[0]:
            send_state(world, j, state, timeout_s=timeout)
        elif engine.rank == j:
            state = recv_state(world, survivors[0], timeout_s=timeout)
    count = lead["regrids"] + 1
    position = live.positions[engine.rank]
    t1 = time.perf_counter()
    engine.tier.close()
    old_module = engine.module
    rebuild = dict(engine._rebuild, batch_source=source)
    old_data = engine.executor.batch_source
    if hasattr(old_data, "close") and old_data is not source:
        old_data.close()
    identity = tuple(tuple((p, i) for i in range(origin_m)) for p in range(origin.dp))
    context = RegridContext(ranks=tuple(origin.rank(w) for w in origin.workers()), coordinator=engine.coordinator,
                            session=f"live/regrid{count}", grid=count, origin=origin, gone=(),
                            recovery_log=engine.recovery_log, progress=engine.progress,
                            origin_microbatches=identity, origin_bounds=tuple(lead["origin_bounds"]),
                            load=layer_loader(layers, state))
    new = _build(engine, old_module, rebuild, live, position, context, layers)
    rebuild_s = time.perf_counter() - t1
    take_over(engine, new)  # the script's engine object (and the earlier engines) is the new engine now
    membership.register_worker(engine.coordinator.store, WorkerInfo(
        rank=engine.rank, pipeline=position.pipeline, stage=position.stage, pid=os.getpid(),
        incarnation=engine.launch.incarnation, dp=origin.dp, pp=origin.pp,
        heartbeat_interval_s=engine.coordinator.heartbeat_interval_s, grid=count))
    if joiner:
        engine.coordinator.admitted()  # the agent records its re-join
    elif engine.rank == survivors[0]:  # the small grid's figures are stale now (a later re-grid posts its own)
        engine.coordinator.store.delete_key(keys.GROW_FIGURES)
    engine.coordinator.mark_applied(record)
    entry = {"epoch": record.epoch, "kind": "grow", "joining": list(record.joining), "joiner": joiner,
             "resume_step": lead["step"], "plan": live.to_dict(), "decision": decision.to_dict(),
             "position": [position.pipeline, position.stage, position.first, position.last],
             "sent_bytes": report.sent_bytes, "received_bytes": report.received_bytes,
             "transfer_s": report.seconds, "rebuild_s": rebuild_s, "regrid_s": time.perf_counter() - started,
             "recovery_s": time.time() - record.detected_at if record.detected_at else None}
    engine.recovery_log.append(entry)
    _log(engine, f"grow-back done {json.dumps(entry, sort_keys=True)}")


def iterations_left(engine: Any) -> int | None:
    """The iterations the job still trains, when its scheduler knows its total (DeepSpeed's
    ``WarmupDecayLR``/``OneCycle``-style ``total_num_steps``); ``None`` otherwise."""
    total = getattr(getattr(engine, "lr_scheduler", None), "total_num_steps", None)
    if isinstance(total, bool) or not isinstance(total, int):
        return None
    return max(total - int(engine.global_steps), 0)


def _decision(seconds: list[float], bounds: list[int], microbatches: int, live: Any, left: int | None):
    """``decide_grow`` on the small grid's median measured iteration (of ``seconds``), the first
    grid's predicted from it (scaled by 1F1B's estimate of the two grids, layer counts standing in
    for time as in the shrink's ``ds_regrid.regrid_pays_for``), and the pause the measured re-grid
    cost gives the busiest receiver."""
    small_s = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
    unit = [1.0] * int(bounds[-1])
    full_s = full_grid_time(small_s, bounds, microbatches, live, layer_cost=unit) if seconds else 0.0
    return decide_grow(small_s, full_s, MEASURED.pause_s(busiest_receiver_bytes(live)), left)


def post_figures(engine: Any) -> None:
    """After an iteration on a re-formed (smaller) grid, its lowest rank posts what growing back
    would save (``GROW_FIGURES``: the agent decides on them, ``supervisor/agent.py``). The plan is
    made once per grid: the layers' bytes are the re-grid's, the joiners the first grid's ranks
    this grid lacks."""
    origin, t = engine.origin_topology, engine.topology
    if not engine.regrids or (t.dp, t.pp) == (origin.dp, origin.pp) or engine.coordinator is None:
        return
    ranks = list(t.ranks or range(t.num_workers))
    if engine.rank != min(ranks):
        return
    cached = getattr(engine, "_grow_figures_plan", None)
    if cached is None:
        entry = next((e for e in reversed(engine.recovery_log) if e.get("kind") == "regrid"), None)
        if entry is None or "layer_bytes" not in entry:
            return
        joiners = sorted(set(origin.rank(w) for w in origin.workers()) - set(ranks))
        origin_m = t.dp * engine.micro_batches // origin.dp
        try:
            cached = plan_grow_back(t, engine.module.parts, engine.micro_batches, origin, engine.origin_parts,
                                    origin_m, joiners, layer_bytes=entry["layer_bytes"])
        except PlanningError as exc:
            _log(engine, f"no grow-back figures: {exc}")
            cached = False
        engine._grow_figures_plan = cached
    if cached is False:
        return
    seconds = [e["seconds"] for e in engine.iteration_log[-5:]]
    d = _decision(seconds, list(engine.module.parts), engine.micro_batches, cached, iterations_left(engine))
    engine.coordinator.store.set(keys.GROW_FIGURES, json.dumps(
        {"grid": engine.regrids, "step": engine.global_steps, "small_s": d.small_s, "full_s": d.full_s,
         "pause_s": d.pause_s, "iterations_left": d.iterations_left}))


def _nowhere(layer: int) -> Any:
    raise GrowError(f"layer {layer} is held by no survivor")  # plan_grow_back names a holder for every layer


def _log(engine: Any, text: str) -> None:
    logger.info("rank %d %s", engine.rank, text)
