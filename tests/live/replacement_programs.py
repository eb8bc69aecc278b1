"""Worker programs of the replica re-placement test (module level: pickled by reference).

PP=2 x DP=2 without the engine: ranks ``2s`` and ``2s + 1`` are stage ``s`` and train identically
(the same seed and data), as data-parallel replicas do, so a stage restores from either's snapshot.
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

from ds_resilience.checkpoint.inmemory import InMemoryCheckpointer
from ds_resilience.checkpoint.state import apply_tree as apply
from ds_resilience.config import CheckpointConfig
from inmemory_programs import _digest, _init, _model, _state, _train_step


def _stage(rank: int) -> int:
    return rank // 2


def _store_barrier(name: str, members: int, timeout_s: float = 60.0) -> None:
    """A barrier of the survivors over the default store (the default group has a dead member)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(name, 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add(name, 0)) < members:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: {store.add(name, 0)} of {members} arrived")
        time.sleep(0.02)


def _wait_held(ck: InMemoryCheckpointer, owners, step: int, timeout_s: float = 60.0) -> dict[int, list[int]]:
    deadline = time.monotonic() + timeout_s
    while any(step not in ck.held_steps(o) for o in owners) and time.monotonic() < deadline:
        time.sleep(0.02)
    return {o: ck.held_steps(o) for o in owners}


def train_through_a_target_failure(rank: int, world: int, cfg_dict: dict, job: str, steps: int, victim: int,
                                   die_after: int) -> dict:
    """Train ``die_after`` steps replicating by group placement; ``victim`` dies (SIGKILL); the
    survivors learn it as the agent's epoch would tell them (``drop``), keep training to ``steps``
    with a boundary before every step (``at_boundary``), and wait until every survivor's newest
    version is on the machines of its new placement."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a0")
    send_before, recv_before = list(ck.send_to), list(ck.recv_from)
    model, opt, sched = _model(_stage(rank))
    ck.capture(0, _state(model, opt, sched, 0, rank))
    for step in range(1, die_after + 1):
        ck.wait_copied()
        _train_step(model, opt, sched, step, _stage(rank))
        ck.capture(step, _state(model, opt, sched, step, rank))
    assert ck.wait_committed(die_after, 30) and ck.wait_replicated(die_after, 30)
    _wait_held(ck, recv_before, die_after)
    dist.barrier()  # every version up to ``die_after`` is on its holders
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    ck.drop([victim])  # the watcher thread's reaction to the new epoch
    for step in range(die_after + 1, steps + 1):
        ck.at_boundary()  # the tier's, at the start of every iteration
        ck.wait_copied()
        _train_step(model, opt, sched, step, _stage(rank))
        ck.capture(step, _state(model, opt, sched, step, rank))
    assert ck.wait_committed(steps, 30)
    replicated = ck.wait_replicated(steps, 60)
    held = _wait_held(ck, ck.recv_from, steps)
    _store_barrier(f"{job}/held", world - 1)  # every survivor holds its sources' newest version
    stats = ck.replicator.stats if ck.replicator is not None else None
    out = {"send_before": send_before, "recv_before": recv_before, "send_to": list(ck.send_to),
           "recv_from": list(ck.recv_from), "replicated": replicated, "held": held, "placements": ck.placements,
           "errors": ck.errors + (stats.errors if stats else []), "digest": _digest(model, opt)}
    ck.close()
    return out


def restore_by_stage(rank: int, world: int, cfg_dict: dict, job: str) -> dict:
    """A restarted rank: restore the newest step held for every stage (either replica's snapshot)."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a1",
                              replicate=False)
    model, opt, sched = _model(_stage(rank) + 7)  # other initial values: everything must come back
    state, plan, _ = ck.restore(stage_of={r: _stage(r) for r in range(world)})
    steps, _ = apply(state, params=list(model.parameters()), optimizer=opt, lr_scheduler=sched, stage=0)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return {"digest": _digest(model, opt), "step": plan.step, "steps": steps, "sources": plan.sources}
