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

The decision whether growing pays (``grow_back.decide_grow``) is logged with the entry, not yet
enforced: the agent publishes the epoch once the joiners registered (the first grid's plan table
and layout are what the job was planned for). Not yet: ZeRO-1 (:class:`GrowError`; the shards
would be made whole and cut again, as the re-grid does); bf16/fp16 is not tested.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from typing import Any

from ..checkpoint.handover import recv_state, send_state
from ..checkpoint.layer_state import inner_param_groups, inverse, layer_trees, renumber, stage_state
from ..checkpoint.layer_transfer import transfer
from ..checkpoint.state import apply, capture, tree_nbytes
from ..comm.groups import build_groups
from ..epochs import WorkerInfo
from ..errors import ResilienceError
from ..logs import get_logger
from ..planning.grow_back import busiest_receiver_bytes, decide_grow, full_grid_time, plan_grow_back
from ..planning.recovery import RecoveryPlan
from ..planning.regrid import RegridPlan
from ..runtime import membership
from ..sim.regrid_cost import MEASURED
from ..topology import Topology
from .ds_fused_adam import counts_steps_per_group
from .ds_regrid import RegridContext, _build, _with_empty, origin_source, take_over

__all__ = ["GrowError", "grow"]

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
    if engine.sharded_optimizer is not None:
        raise GrowError("growing back with ZeRO-1 is not supported yet")
    me = origin.coord(engine.rank)[0]
    timeout = engine.resilience.detector.pg_timeout_s
    groups = build_groups(origin.healthy(), me, session=f"grow/e{record.epoch}", generation=record.epoch,
                          timeout_s=timeout, store=engine.coordinator.store, device=engine._comm_device())
    world = groups.world
    state = None if joiner else capture(engine.stage_host, stage=engine.stage_id, rank=engine.rank).clone(host=True)
    mine = {"rank": engine.rank, "joiner": joiner}
    if not joiner:
        t = engine.topology
        mine.update(step=engine.global_steps, regrids=engine.regrids, bounds=list(engine.module.parts),
                    origin_bounds=list(engine.origin_parts), microbatches=engine.micro_batches,
                    grid={"dp": t.dp, "pp": t.pp, "ranks": list(t.ranks or range(t.num_workers))},
                    seconds=[e["seconds"] for e in engine.iteration_log[-5:]])
    views = world.all_gather_json(mine)
    survivors = sorted(v["rank"] for v in views if not v["joiner"])
    joiners = sorted(v["rank"] for v in views if v["joiner"])
    if not survivors:
        raise GrowError("no survivor of the re-formed grid takes part in growing back")
    lead = next(v for v in views if v["rank"] == survivors[0])
    if {v["step"] for v in views if not v["joiner"]} != {lead["step"]}:
        raise GrowError(f"the survivors are at different steps: {[(v['rank'], v['step']) for v in views]}")
    g = lead["grid"]
    current = Topology(dp=g["dp"], pp=g["pp"], ranks=tuple(g["ranks"]))
    origin_m = current.dp * lead["microbatches"] // origin.dp
    # every layer's state in bytes (the survivors' own layers)
    held: dict[int, Any] = {}
    if not joiner:
        state = replace(state, optimizer=renumber(state.optimizer, engine.stage_host.optimizer_order))
        held = _with_empty(layer_trees(state, engine.stage_host.param_layers), engine.module.parts, engine.stage_id)
    sizes: dict[int, float] = {}
    for part in world.all_gather_json({str(k): tree_nbytes(v) for k, v in held.items()}):
        sizes.update({int(k): float(v) for k, v in part.items()})
    layer_bytes = [sizes.get(i, 0.0) for i in range(lead["origin_bounds"][-1])]
    live = plan_grow_back(current, lead["bounds"], lead["microbatches"], origin, lead["origin_bounds"], origin_m,
                          joiners, layer_bytes=layer_bytes)
    seconds = lead["seconds"]
    small_s = sorted(seconds)[len(seconds) // 2] if seconds else 0.0
    decision = decide_grow(small_s, full_grid_time(small_s, lead["bounds"], lead["microbatches"], live) if seconds
                           else 0.0, MEASURED.pause_s(busiest_receiver_bytes(live)), None)
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
    source = origin_source(engine, engine._rebuild)
    if source is None:
        raise GrowError("the data come from an iterator, which cannot be read by (pipeline, iteration, micro-batch)")
    t1 = time.perf_counter()
    engine.tier.close()
    old_module = engine.module
    rebuild = dict(engine._rebuild, batch_source=source)
    old_data = engine.executor.batch_source
    if hasattr(old_data, "close") and old_data is not source:
        old_data.close()
    like = state

    def load(new: Any) -> None:
        order = new.stage_host.optimizer_order
        groups = renumber({"state": {}, "param_groups": inner_param_groups(new.optimizer.state_dict())},
                          order)["param_groups"]
        new_state = stage_state(layers, new.stage_host.param_layers, param_groups=groups, like=like,
                                stage=new.stage_id, rank=new.rank, group_steps=counts_steps_per_group(new.optimizer))
        new_state = replace(new_state, optimizer=renumber(new_state.optimizer, inverse(order)))
        apply(new_state, new.stage_host, stage=new.stage_id)

    identity = tuple(tuple((p, i) for i in range(origin_m)) for p in range(origin.dp))
    context = RegridContext(ranks=tuple(origin.rank(w) for w in origin.workers()), coordinator=engine.coordinator,
                            session=f"live/regrid{count}", grid=count, origin=origin, gone=(),
                            recovery_log=engine.recovery_log, progress=engine.progress,
                            origin_microbatches=identity, origin_bounds=tuple(lead["origin_bounds"]), load=load)
    new = _build(engine, old_module, rebuild, live, position, context, layers)
    rebuild_s = time.perf_counter() - t1
    take_over(engine, new)  # the script's engine object (and the earlier engines) is the new engine now
    membership.register_worker(engine.coordinator.store, WorkerInfo(
        rank=engine.rank, pipeline=position.pipeline, stage=position.stage, pid=os.getpid(),
        incarnation=engine.launch.incarnation, dp=origin.dp, pp=origin.pp,
        heartbeat_interval_s=engine.coordinator.heartbeat_interval_s, grid=count))
    if joiner:
        engine.coordinator.admitted()  # the agent records its re-join
    engine.coordinator.mark_applied(record)
    entry = {"epoch": record.epoch, "kind": "grow", "joining": list(record.joining), "joiner": joiner,
             "resume_step": lead["step"], "plan": live.to_dict(), "decision": decision.to_dict(),
             "position": [position.pipeline, position.stage, position.first, position.last],
             "sent_bytes": report.sent_bytes, "received_bytes": report.received_bytes,
             "transfer_s": report.seconds, "rebuild_s": rebuild_s, "regrid_s": time.perf_counter() - started,
             "recovery_s": time.time() - record.detected_at if record.detected_at else None}
    engine.recovery_log.append(entry)
    _log(engine, f"grow-back done {json.dumps(entry, sort_keys=True)}")


def _nowhere(layer: int) -> Any:
    raise GrowError(f"layer {layer} is held by no survivor")  # plan_grow_back names a holder for every layer


def _log(engine: Any, text: str) -> None:
    logger.info("rank %d %s", engine.rank, text)
