"""DeepSpeed's checkpoint files, written by the survivors.

:func:`save_on_survivors` writes exactly what DeepSpeed's ``save_checkpoint`` writes for a pipeline
with ZeRO-0 (``<tag>/layer_XX-model_states.pt`` per layer, ``<tag>/mp_rank_XX_model_states.pt``
per stage with the optimizer, scheduler and counters, ``latest``), but each stage's first
surviving replica plays data-parallel rank 0, so the whole model is there once whoever died, and
every wait is on the survivors' group. :func:`save` and :func:`load` are the engine's
``save_checkpoint`` and ``load_checkpoint`` (DeepSpeed's own where the world group is safe to wait
on). :func:`export_stage` writes a stage in the same layout when a job stops (beyond tolerance, or
interrupted), and :func:`export_done` names it in ``latest``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


from ..durable import save_durably, write_durably
from ..errors import ResilienceError
from .ds_reporting import is_reporter

__all__ = ["export_done", "export_stage", "load", "save", "save_layers", "save_on_survivors"]


def save(engine: Any, deepspeed_save: Callable[[], Any], save_dir: str, tag, client_state: dict, save_latest: bool,
         exclude_frozen_parameters: bool) -> Any:
    """The engine's ``save_checkpoint``: ``deepspeed_save()`` (DeepSpeed's own) without the agent and
    fault-free, else :func:`save_on_survivors` (a worker left idle writes nothing). Under ZeRO-1 the
    files hold the stage's whole optimizer state, consolidated first."""
    if not save_dir:
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    engine._resilient(engine.executor.resolve)
    sharded = engine.sharded_optimizer
    if sharded is not None and engine.alive:  # ZeRO-1: the files hold the stage's whole optimizer state
        sharded.saving = engine._resilient(lambda: sharded.consolidated_state_dict(engine.executor.groups.stage))
    try:
        if not engine._world_unsafe():
            return deepspeed_save()
        if not engine.alive:
            return True  # a worker left idle holds no state worth saving
        return engine._resilient(lambda: save_on_survivors(engine, save_dir, tag, client_state, save_latest,
                                                           exclude_frozen_parameters))
    finally:
        if sharded is not None:
            sharded.saving = None


def load(engine: Any, deepspeed_load: Callable[[], Any]) -> Any:
    """The engine's ``load_checkpoint``: ``deepspeed_load()`` (DeepSpeed's own), where the world
    group is unsafe without the broadcast that re-synchronizes tied weights over the world (every
    copy is read from the same checkpoint) and followed by a barrier over the survivors; a worker
    left idle reads nothing. ZeRO-1 then keeps each replica's range."""
    engine.executor.forget_pending()  # the loaded state replaces whatever step awaited validation
    persistent = engine.persistent_engine
    if persistent is not None and engine.checkpoint_engine is persistent:
        persistent.flush()  # this job's own saves are complete and `latest` is current
    unsafe = engine._world_unsafe()
    if unsafe and not engine.alive:
        return None, None
    module = engine.module
    sync = module._synchronize_tied_weights
    if unsafe:
        module._synchronize_tied_weights = lambda: None
    try:
        result = deepspeed_load()
    finally:
        if unsafe:
            module._synchronize_tied_weights = sync
    engine._reshard_loaded()
    if unsafe:
        engine._survivor_barrier()
    return result


def save_on_survivors(engine: Any, save_dir: str, tag, client_state: dict, save_latest: bool,
                      exclude_frozen_parameters: bool) -> bool:
    """``save_checkpoint`` by the survivors (see ``ResilientPipelineEngine.save_checkpoint``)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    world = engine.generation.groups.world
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    ce = engine.checkpoint_engine
    if is_reporter(engine):
        ce.makedirs(save_dir, exist_ok=True)
    world.barrier()
    tags = set(world.all_gather_json(tag))
    if len(tags) != 1:
        raise ResilienceError(f"the checkpoint tag differs between the survivors: {sorted(tags)}")
    info = CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=save_latest)
    ce.create(info)
    if engine.me == engine.current.stage_peers(engine.stage_id)[0]:  # this stage's writer
        path = os.path.join(save_dir, tag)
        ce.makedirs(path, exist_ok=True)
        save_layers(engine, path, exclude_frozen_parameters)
        state = engine._common_checkpoint_state(None, False, False)
        state.update(client_state)
        ce.save(state_dict=state, path=engine._get_ckpt_name(save_dir, tag))
    if not ce.is_decoupled():
        ce.commit(info)
        if save_latest and is_reporter(engine):
            with open(os.path.join(save_dir, "latest"), "w") as fd:
                fd.write(tag)
    world.barrier()
    return True


def save_layers(engine: Any, path: str, exclude_frozen: bool) -> None:
    """``PipelineModule.save_state_dict`` for this stage, whichever data-parallel rank writes it."""
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

    module, ce = engine.module, engine.checkpoint_engine
    for idx, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        state = layer.state_dict()
        if exclude_frozen:
            for name in module._get_frozen_parameter_names(layer):
                del state[name]
        if ce.preserves_storage_sharing():
            state = clone_tensors_for_torch_save(state)
        ce.save(state_dict=state, path=module.ckpt_layer_path(path, idx))


def export_stage(engine: Any, ckpt_dir: str, step: int, *, writer: bool = True) -> None:
    """This stage at optimizer step ``step`` when the job stops (beyond tolerance, or interrupted),
    in DeepSpeed's layout: ``ckpt_dir`` is ``<save_dir>/<tag>``, the writer writes the stage's layer
    files and its ``mp_rank_XX_model_states.pt`` (optimizer, scheduler, counters), durably, as
    ``save_checkpoint`` would; :func:`export_done` then writes ``latest``, so ``load_checkpoint
    (save_dir)`` (ours or vanilla DeepSpeed's) resumes from it.

    Under ZeRO-1 each replica holds a shard of the optimizer state, which a stop cannot gather (the
    groups are down): every replica writes its own ``stage<S>-pipeline<P>-optim_states.pt``
    beside the layer files and the model-states file without the optimizer."""
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    sharded = getattr(engine, "sharded_optimizer", None)
    if sharded is not None:
        _save_optimizer(engine, os.path.join(ckpt_dir, f"stage{engine.stage_id}-pipeline{engine.me.pipeline}-"
                                                       f"optim_states.pt"), step)
    if not writer:
        return
    for idx, layer in enumerate(engine.module.forward_funcs):
        if not hasattr(layer, "state_dict"):
            continue
        save_durably({k: v.detach().clone() for k, v in layer.state_dict().items()},
                     engine.module.ckpt_layer_path(ckpt_dir, idx))
    save_dir, tag = os.path.split(os.path.normpath(ckpt_dir))
    state = engine._common_checkpoint_state(None, False, False)
    if sharded is not None:
        state["optimizer"] = None  # in the shard files above
    save_durably(state, engine._get_ckpt_name(save_dir, tag))


def export_done(ckpt_dir: str, step: int) -> None:
    """Every stage's export is written: ``latest`` names it (durably, after the data)."""
    save_dir, tag = os.path.split(os.path.normpath(ckpt_dir))
    write_durably(os.path.join(save_dir, "latest"), tag)


def _save_optimizer(engine: Any, optim_path: str, step: int) -> None:
    save_durably({"step": step, "optimizer": engine.optimizer.state_dict(),
                  "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None},
                 optim_path)
