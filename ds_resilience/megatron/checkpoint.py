"""Megatron-LM's checkpoint format, written and read by the surviving ranks.

When a failure is beyond what re-routing covers, the job stops and restarts; a Megatron user then
wants a checkpoint Megatron-LM itself can ``--load``. This module writes Megatron-LM's legacy
``torch`` format (``--ckpt-format torch``, checkpoint version 3.0)::

    <dir>/latest_checkpointed_iteration.txt          the iteration, as text
    <dir>/iter_<7 digits>/mp_rank_<tp:02d>/model_optim_rng.pt            (PP = 1)
    <dir>/iter_<7 digits>/mp_rank_<tp:02d>_<pp:03d>/model_optim_rng.pt   (PP > 1)

each file a dict with ``args``, ``checkpoint_version``, ``iteration``, ``model`` (the chunk's
``state_dict_for_save_checkpoint()``), ``optimizer``, ``opt_param_scheduler`` and ``rng_state``
(a list of one dict, Megatron's keys). Megatron writes each (tensor, pipeline) shard from data-parallel
rank 0; here the first *surviving* replica of the stage writes it (the replicas hold the same
weights and optimizer state), so a dead data-parallel rank 0 costs nothing. Files are written to a
temporary name and renamed; the tracker file is written last, by the lowest surviving rank, once
every shard is in place, so a crash mid-save never leaves a tracker naming a partial checkpoint.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import store_keys
from ..errors import ResilienceError

__all__ = ["CHECKPOINT_VERSION", "TRACKER", "checkpoint_file", "load_checkpoint", "save_checkpoint", "write_shard"]

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"
_SAVES = [0]


def checkpoint_file(directory: str | os.PathLike[str], iteration: int, tp_rank: int, pp_rank: int, pp: int) -> Path:
    """Megatron-LM's path of one (tensor, pipeline) shard (``get_checkpoint_name``'s layout)."""
    shard = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return Path(directory) / f"iter_{iteration:07d}" / shard / "model_optim_rng.pt"


def _rng_state() -> list[dict[str, Any]]:
    state: dict[str, Any] = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                             "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        try:
            from megatron.core import tensor_parallel

            state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
        except Exception:  # noqa: BLE001 - no tracker configured: Megatron then has none to restore either
            pass
    return [state]


def _model_state(model: Any) -> dict[str, Any]:
    save = getattr(model, "state_dict_for_save_checkpoint", None)
    return save() if callable(save) else model.state_dict()


def write_shard(directory: str | os.PathLike[str], iteration: int, *, model: Any, optimizer: Any, tp_rank: int,
                pp_rank: int, pp: int, scheduler: Any = None, args: Any = None) -> Path:
    """Write one (tensor, pipeline) shard, atomically (a temporary name, then a rename)."""
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
             "model": _model_state(model), "rng_state": _rng_state()}
    inner = getattr(optimizer, "optimizer", optimizer)  # ResilientOptimizer: the wrapped one's state
    if inner is not None:
        state["optimizer"] = inner.state_dict()
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    path = checkpoint_file(directory, iteration, tp_rank, pp_rank, pp)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def save_checkpoint(forward_backward: Any, directory: str | os.PathLike[str], iteration: int, *, model: Any,
                    optimizer: Any, scheduler: Any = None, args: Any = None, timeout_s: float = 300.0) -> Path | None:
    """Write this stage's shard if this rank is its writer; every rank of the job calls it (the
    survivors; an idle replica returns at once). Returns the file written, or ``None``.

    ``forward_backward``: the job's :class:`~ds_resilience.megatron.schedule.ResilientForwardBackward`
    (after its first call: it knows the grid and who survives).
    """
    rt = forward_backward.rt
    if rt is None:
        raise ResilienceError("save_checkpoint needs the resilient forward-backward to have run once (it knows "
                              "the grid and the survivors)")
    grid, topology = rt.grid, rt.topology
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ResilienceError(f"{len(model)} model chunks per rank: interleaving is not supported")
        model = model[0]
    me, tp_rank = grid.coord(dist.get_rank())
    store = dist.distributed_c10d._get_default_store()
    key = store_keys.megatron_save(_SAVES[0])
    _SAVES[0] += 1
    alive = [w for w in topology.alive_workers()]
    if me not in alive:
        return None
    writer = min(topology.stage_peers(me.stage), key=lambda w: w.pipeline)
    path = None
    if me == writer:
        path = write_shard(directory, iteration, model=model, optimizer=optimizer, scheduler=scheduler, args=args,
                           tp_rank=tp_rank, pp_rank=me.stage, pp=grid.pp)
        store.set(f"{key}/s{me.stage}t{tp_rank}", "1")
    if dist.get_rank() == min(grid.rank(w, 0) for w in alive):  # the tracker, once every shard is there
        store.wait([f"{key}/s{s}t{t}" for s in range(grid.pp) for t in range(grid.tp)], timedelta(seconds=timeout_s))
        tracker = Path(directory) / TRACKER
        tmp = tracker.with_name(f"{TRACKER}.tmp-{os.getpid()}")
        tmp.write_text(str(iteration))
        os.replace(tmp, tracker)
        store.set(f"{key}/tracker", "1")
    store.wait([f"{key}/tracker"], timedelta(seconds=timeout_s))
    return path


def load_checkpoint(directory: str | os.PathLike[str], *, model: Any, optimizer: Any = None, scheduler: Any = None,
                    tp_rank: int, pp_rank: int, pp: int, iteration: int | None = None,
                    forward_backward: Any = None) -> int:
    """Read this rank's shard of the checkpoint the tracker names (or of ``iteration``) into
    ``model``, ``optimizer`` and ``scheduler``; returns the iteration. ``forward_backward``: the
    job's resilient forward-backward, which then goes on from that iteration (its micro-batch
    identities and RNG streams are keyed by the iteration).

    Raises:
        ResilienceError: no tracker or no shard file, naming the path; a shard of another format.
    """
    if iteration is None:
        tracker = Path(directory) / TRACKER
        if not tracker.is_file():
            raise ResilienceError(f"no {TRACKER} in {directory}: no complete checkpoint was written there")
        text = tracker.read_text().strip()
        if not text.isdigit():
            raise ResilienceError(f"{tracker} holds {text!r}, not an iteration")
        iteration = int(text)
    path = checkpoint_file(directory, iteration, tp_rank, pp_rank, pp)
    if not path.is_file():
        raise ResilienceError(f"checkpoint shard {path} is missing (tensor rank {tp_rank}, pipeline rank {pp_rank} "
                              f"of iteration {iteration})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "model" not in state:
        raise ResilienceError(f"{path} is not a Megatron checkpoint shard (no 'model' key)")
    if isinstance(model, (list, tuple)):
        model = model[0]
    model.load_state_dict(state["model"])  # strict: a missing or extra weight is an error, never skipped
    if optimizer is not None and "optimizer" in state:
        getattr(optimizer, "optimizer", optimizer).load_state_dict(state["optimizer"])
    if scheduler is not None and "opt_param_scheduler" in state:
        scheduler.load_state_dict(state["opt_param_scheduler"])
    loaded = int(state.get("iteration", iteration))
    if forward_backward is not None:  # the schedule goes on from there (micro-batch ids and RNG streams)
        forward_backward.iteration = forward_backward.steps = forward_backward.base = loaded
        forward_backward.calls = 0
    return loaded
