"""What the resilient engine offers a user's loop after a failure, beside ``train_batch`` and
``eval_batch``: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` that work on the survivors
(``ds_checkpoints.py`` holds their bodies), the survivors' process group and ranks for the user's
own collectives, and the end of the snapshot tier.

:class:`SurvivorAPI` is a mixin of :class:`~.ds_engine.ResilientPipelineEngine`, before
``PipelineEngine`` in its bases, so ``super()`` here is DeepSpeed's own method.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from ..errors import ResilienceError
from .ds_checkpoints import load, save
from .ds_fused_adam import resumed_as_loaded

__all__ = ["SurvivorAPI"]


class SurvivorAPI:
    """DeepSpeed's checkpoint and group API over the survivors (a mixin of the engine)."""

    generation: Any
    coordinator: Any
    current: Any
    topology: Any
    tier: Any
    executor: Any
    optimizer: Any

    # --- checkpoints -----------------------------------------------------------------------------
    def _world_unsafe(self) -> bool:
        """Whether DeepSpeed's default (world) group must not be waited on: under the agent (a member
        may die during the wait, and a re-joined worker's default group is a stand-in), or once any
        worker failed or was left idle. The survivors' groups are used instead."""
        return self.coordinator is not None or bool(self.current.failed) or self.generation.epoch > 0

    def _survivor_barrier(self) -> None:
        if self._world_unsafe():
            if self.generation.groups is not None:
                self.generation.groups.world.barrier()
        elif dist.get_world_size() > 1:
            dist.barrier()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint``, also after a failure.

        Without the agent and fault-free it is DeepSpeed's own. Under the agent, or once a worker
        has failed, the survivors write the same files DeepSpeed writes, the whole model once: for
        each stage its first surviving replica plays data-parallel rank 0 (the layer files ``layer_XX-model_states.pt`` and the stage's
        ``mp_rank_XX_model_states.pt`` with optimizer, scheduler and counters), every wait is on
        the survivors' group, and the survivor that reports writes ``latest``. The result loads
        into a full-size job (DeepSpeed's or ours) after the repair.
        """
        return save(self, lambda: super(SurvivorAPI, self).save_checkpoint(
            save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters), save_dir, tag, client_state, save_latest,
            exclude_frozen_parameters)

    def zero_optimization(self) -> bool:
        """ZeRO-1 is ours (``runtime/zero.py``): DeepSpeed sees a plain optimizer, so its checkpoint
        files are the ZeRO-0 layout with the stage's optimizer state consolidated into one shard,
        loadable by a ZeRO-1 job of any data-parallel size (each replica keeps its range)."""
        if self.zero_optimization_stage() == 1:
            return False
        return super(SurvivorAPI, self).zero_optimization()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's ``load_checkpoint``, also after a failure (each survivor reads its stage's
        files; the broadcast that re-synchronizes tied weights over the world is skipped, as every
        copy is read from the same checkpoint). The in-memory tier keeps its snapshots: the next
        one is the loaded state."""
        result = load(self, lambda: super(SurvivorAPI, self).load_checkpoint(
            load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            custom_load_fn=custom_load_fn))
        resumed_as_loaded(self.optimizer)  # the next steps as vanilla DeepSpeed's after its own load
        return result

    def survivor_group(self):
        """The surviving workers' process group, for your own collectives after a failure.

        DeepSpeed's and torch's collectives on the default group would wait for a dead worker
        forever; pass this group instead: ``torch.distributed.all_reduce(t, group=engine.survivor_group())``
        (also ``deepspeed.comm.all_reduce`` and ``barrier``). It is a new group after every
        membership change, so ask for it at each use. Collectives that name a source or
        destination rank (``broadcast``, ``reduce``) need :meth:`survivors` to pick a rank, and
        :attr:`ds_resilience.comm.Group` methods (``engine.generation.groups.world``) take global
        ranks directly.
        """
        if self.generation.groups is None:
            raise ResilienceError("this worker is not a member of the current generation (left idle)")
        return self.generation.groups.world.pg

    def survivors(self) -> tuple[int, ...]:
        """Global ranks of the surviving workers (the members of :meth:`survivor_group`)."""
        return tuple(self.topology.rank(w) for w in self.current.alive_workers())

    def close_snapshots(self) -> None:
        """Validate the last step and stop the checkpoint tier's threads (the snapshots stay in host
        memory for the agent). A re-join still pending here is not applied: training is over."""
        self._resilient(self.executor.resolve)
        self.tier.close()

    def resume_job(self, load_dir: str) -> str | None:
        """A named job started again (``ds-resilience run --job_id``, or a requeued scheduler job):
        load the newest checkpoint its stops left in ``load_dir`` (``latest``), every stage; returns
        the tag (``None``: none there). The steps then go on as in the process that trained
        throughout (DeepSpeed's CPU FusedAdam's bias correction is walked, as for a restart)."""
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if not os.path.isfile(os.path.join(load_dir, "latest")):
            return None
        with open(os.path.join(load_dir, "latest")) as f:
            tag = f.read().strip()
        load(self, lambda: PipelineEngine.load_checkpoint(self, load_dir, tag=tag))
        return tag
