"""The iteration's global loss without a barrier, and the parking of a worker left idle.

The last stage's survivors sum their losses among themselves; the first of them publishes the mean
in the store (:class:`LossPost`), where every other worker reads it when it finishes its iteration
(:func:`aggregate_loss`). Gradient clipping and fp16's overflow check are agreed through the same
store (:func:`step_validator`). While workers are simulated failed (``resilience.simulate_failed``), the
same survivor also sets the iteration's idle key, which a parked worker waits on (:func:`park`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import store_keys
from ..errors import ConfigError, ResilienceError
from ..runtime.validation import StepValidator
from ..topology import Topology, Worker

__all__ = ["LossPost", "aggregate_loss", "park", "step_validator"]


@dataclass(frozen=True)
class LossPost:
    """The store this worker's losses (and idle keys) are posted to and read from."""

    session: str
    rank: int
    coordinator: Any | None  # the agent's coordinator; None: the default store (no agent)
    store_timeout_s: float

    def store(self):
        if self.coordinator is not None:
            return self.coordinator.store
        return dist.distributed_c10d._get_default_store()

    def loss_key(self, step: int) -> str:
        epoch = self.coordinator.applied if self.coordinator is not None else 0
        return store_keys.loss(self.session, epoch, step)

    def idle_key(self, step: int) -> str:
        """Set once per iteration while workers are simulated-failed; never deleted (a parked
        worker may be late), one tiny key per iteration."""
        return store_keys.idle(self.session, step)

    def wait(self, key: str, timeout_s: float, what: str) -> bytes:
        """A store key, waited for at most ``timeout_s``; a timeout names what was awaited."""
        store = self.store()
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # c10d's timeout (DistStoreError) names neither the key nor why
            raise ResilienceError(f"rank {self.rank}: waited {timeout_s:.0f} s for {what} (store key {key}): {exc}") from None
        return store.get(key)


def aggregate_loss(post: LossPost, local_sum: float, *, step: int, me: Worker, topology: Topology, current: Topology,
                   stage_group: Any, microbatches: int) -> torch.Tensor:
    """Global mean loss of the iteration of optimizer step ``step``, without a barrier over all stages.

    The last stage's survivors sum their losses among themselves (``stage_group``); the first of
    them publishes the mean in the store, where every other worker reads it when it finishes its
    iteration (after the last stage's final backward, so the value is already there). The last
    stage never waits for the first, and with the staggered optimizer the next iteration starts
    stage by stage. The key of iteration k-2 is deleted at k: by then every worker has read it
    (each worker's next forwards feed the last stage's reduce).
    """
    key = post.loss_key(step)
    last = topology.pp - 1
    if me.stage == last:
        total = torch.tensor([local_sum], dtype=torch.float64)
        stage_group.all_reduce(total)
        loss = total / (topology.dp * microbatches)
        if me == current.stage_peers(last)[0]:
            store = post.store()
            store.set(key, repr(float(loss)))
            if step >= 2:
                store.delete_key(post.loss_key(step - 2))
            if current.failed and post.coordinator is None:
                store.set(post.idle_key(step), "1")  # wakes the simulated-failed workers
        return loss
    if post.coordinator is not None:
        value = post.coordinator.wait_key(key)
    else:
        value = post.wait(key, post.store_timeout_s, "this iteration's loss")
    return torch.tensor([float(value)], dtype=torch.float64)


def park(post: LossPost, iteration: int, timeout_s: float) -> None:
    """Block (not spin) until the survivors published iteration ``iteration``'s loss.

    A simulated-failed worker must not race ahead into collectives of later code, where
    DeepSpeed's CPU communication backend busy-waits and steals a core from the survivors.
    """
    post.wait(post.idle_key(iteration), timeout_s,
              f"the survivors to finish iteration {iteration} (this worker is left idle)")


def step_validator(post: Callable[[], LossPost], *, clip: float, fp16: bool, mode: str,
                   num_stages: int) -> StepValidator | None:
    """Clipping and fp16 overflow agreed without a barrier (``runtime/validation.py``); ``post``
    gives the store's current view (the session and coordinator are read at each use), ``mode``
    is ``resilience.clipping``."""
    if clip <= 0 and not fp16:
        return None
    if mode == "barrier":
        if fp16:
            raise ConfigError("resilience.clipping", "'barrier' covers gradient clipping only; fp16's overflow "
                              "check needs 'speculative'")
        return None  # the executor all-reduces the global norm over every survivor before stepping

    def wait(key: str) -> bytes:
        now = post()
        if now.coordinator is not None:
            return now.coordinator.wait_key(key)
        return now.wait(key, now.store_timeout_s, "the other stages' gradient norms")

    def peek(key: str) -> bytes | None:
        store = post().store()
        return store.get(key) if store.check([key]) else None

    return StepValidator(clip=clip, check_overflow=fp16, num_stages=num_stages,
                         key=lambda iteration, stage: store_keys.validation(post().session, iteration, stage),
                         publish=lambda key, value: post().store().set(key, value), wait=wait,
                         delete=lambda key: post().store().delete_key(key), peek=peek)
