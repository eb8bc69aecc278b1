"""Worker programs of the in-memory checkpoint tests (module level: pickled by reference)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ds_resilience.checkpoint.inmemory import InMemoryCheckpointer
from ds_resilience.checkpoint.state import apply_tree as apply, collect
from ds_resilience.config import CheckpointConfig


def _init(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))


def _model(rank: int, width: int = 64):
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train_step(model, opt, sched, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, model[0].in_features, generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _state(model, opt, sched, step: int, rank: int):
    return collect(params=list(model.parameters()), optimizer=opt, lr_scheduler=sched, steps=step, samples=8 * step,
                   stage=0, rank=rank)


def _digest(model, opt) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
            "lr": opt.param_groups[0]["lr"]}


def train_and_replicate(rank: int, world: int, cfg_dict: dict, job: str, steps: int, width: int = 64) -> dict:
    """Train ``steps`` steps, capturing every one; wait until the last is replicated everywhere."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a0")
    model, opt, sched = _model(rank, width)
    ck.capture(0, _state(model, opt, sched, 0, rank))
    for step in range(1, steps + 1):
        ck.wait_copied()  # the optimizer may change the tensors only after the copy
        _train_step(model, opt, sched, step, rank)
        ck.capture(step, _state(model, opt, sched, step, rank))
    assert ck.wait_committed(steps, 30)
    replicated = ck.replicator.wait_replicated(steps, 30) if ck.replicator else True
    dist.barrier()  # every rank has sent its last version; receivers commit before the goodbye
    ck.close()
    stats = ck.replicator.stats if ck.replicator else None
    dist.barrier()
    dist.destroy_process_group()
    return {"digest": _digest(model, opt), "replicated": replicated, "send_to": ck.send_to,
            "recv_from": ck.recv_from, "errors": ck.errors + (stats.errors if stats else []),
            "received": stats.versions_received if stats else 0, "persisted": ck.persisted}


def restore(rank: int, world: int, cfg_dict: dict, job: str, width: int = 64, newer_than: int | None = None) -> dict:
    """A restarted rank: build a fresh model, restore it, return its digest and the plan
    (``newer_than``: only a newer step; ``{"step": None}`` when none is)."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a1",
                              replicate=False)
    model, opt, sched = _model(rank + 7, width)  # different initial values: everything must come back
    found = ck.restore(newer_than=newer_than)
    if found is None:
        ck.close()
        dist.barrier()
        dist.destroy_process_group()
        return {"step": None, "params": [p.detach().clone() for p in model.parameters()]}
    state, plan, timings = found
    steps, samples = apply(state, params=list(model.parameters()), optimizer=opt, lr_scheduler=sched, stage=0)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return {"digest": _digest(model, opt), "step": plan.step, "steps": steps, "sources": plan.sources,
            "timings": timings, "corrupt": [c.reason for c in ck.store.corrupt]}


def kill_mid_replication(rank: int, world: int, cfg_dict: dict, job: str) -> dict:
    """Rank 0 SIGKILLs itself after the first chunk of version 2 went out; rank 1 keeps version 1."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a0")
    model, opt, sched = _model(rank, 256)
    for step in range(2):
        if step:
            ck.wait_copied()
            _train_step(model, opt, sched, step, rank)
        ck.capture(step, _state(model, opt, sched, step, rank))
        assert ck.wait_committed(step, 30)
        if rank == 0:
            assert ck.replicator.wait_replicated(step, 30)
    dist.barrier()  # version 1 of rank 0 is committed on rank 1
    if rank == 0:
        group = ck.replicator._groups[1]
        real = group.isend
        sent = []

        frames = []

        def dying_isend(tensor, dst, tag):
            work = real(tensor, dst, tag)
            if tensor.dtype == torch.int64:  # a transport message starts: frame, header, payload...
                frames.clear()
            frames.append(tensor.numel())
            if len(frames) > 2:  # a payload chunk
                sent.append(tensor.numel())
                if len(sent) == 2:
                    work.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
            return work

        group.isend = dying_isend
        ck.wait_copied()
        _train_step(model, opt, sched, 2, rank)
        ck.capture(2, _state(model, opt, sched, 2, rank))
        time.sleep(60)  # killed before this ends
    deadline = time.monotonic() + 30
    while ck.replicator.stats.errors == [] and time.monotonic() < deadline:
        time.sleep(0.05)
    held = ck.store.holdings().get("rank0", [])
    newest = ck.store.load("rank0")
    return {"held": held, "newest_steps": newest["steps"], "errors": list(ck.replicator.stats.errors),
            "leftovers": sorted(p.name for p in (ck.store.root / "rank0").rglob(".payload*"))}


def gated_replication(rank: int, world: int, cfg_dict: dict, job: str) -> dict:
    """Rank 0 captures 5 versions while its gate stays closed (no idle span), then opens it: the
    version in flight finishes and only the newest follows; the ones between are skipped."""
    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a0")
    model, opt, sched = _model(rank, 128)
    out: dict = {}
    if rank == 0:
        for step in range(5):
            if step:
                ck.wait_copied()
                _train_step(model, opt, sched, step, rank)
            ck.capture(step, _state(model, opt, sched, step, rank))
            assert ck.wait_committed(step, 30)
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        out["held_while_closed"] = ck.store.holdings().get("rank0", [])
    dist.barrier()
    if rank == 0:
        ck.gate.open(None)  # an idle span of unknown length
        out["replicated"] = ck.replicator.wait_replicated(4, 30)
        out["skipped"] = ck.replicator.stats.versions_skipped
        out["sent"] = ck.replicator.stats.versions_sent
        out["digest"] = _digest(model, opt)
    dist.barrier()
    if rank == 1:  # sent is not yet committed: the holder checksums the bytes first
        deadline = time.monotonic() + 30
        while 4 not in ck.store.holdings(verify=False).get("rank0", []) and time.monotonic() < deadline:
            time.sleep(0.02)
        out["held"] = ck.store.holdings().get("rank0", [])
        out["newest"] = ck.store.load("rank0")
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


def fetch_peer(rank: int, world: int, cfg_dict: dict, job: str, owner: int, to: int, step: int) -> dict:
    """Every rank joins ``fetch_versions``: ``to`` gets ``owner``'s version ``step`` from a holder."""
    from ds_resilience.checkpoint.fetch import fetch_versions
    from ds_resilience.comm.groups import world_group

    _init(rank, world)
    cfg = CheckpointConfig.from_dict(cfg_dict)
    ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=job, local_world_size=1, name=f"{job}/a1",
                              replicate=False)
    group = world_group(60.0)
    out = {"holds": ck.holds(owner, step)}
    trees = fetch_versions(ck, [owner], step, group, receiver_of=lambda o: to)
    out["received"] = sorted(trees)
    if owner in trees:
        out["params"] = [p.clone() for p in trees[owner]["params"]]
        out["steps"] = trees[owner]["steps"]
        out["now_holds"] = ck.holds(owner, step)
    out["missing"] = fetch_versions(ck, [owner], step + 10, group, receiver_of=lambda o: to)
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    return out
