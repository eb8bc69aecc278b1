"""The training micro-batches a Megatron rank reads.

Each micro-batch is identified by (pipeline, iteration, index) wherever it runs. With
``batches(pipeline, iteration, microbatch)`` any pipeline's micro-batch can be read (a failure
re-routes another pipeline's micro-batches to this rank); without it the rank reads its own
pipeline's micro-batches from the ``data_iterator`` Megatron passes, in order, and keeps those it
read for the current and the previous iteration (a replay after a recovery reads them again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import ResilienceError

__all__ = ["Item", "MicroBatches"]


@dataclass(frozen=True)
class Item:
    """A first-stage micro-batch on its way through the executor (not a tensor: passed as is)."""

    item: Any


class MicroBatches:
    """The reader of one rank's training micro-batches: ``batches`` if given, else ``iterator``
    (its own ``pipeline``'s data iterator, set for each call of the schedule)."""

    def __init__(self, batches: Callable[[int, int, int], Any] | None, pipeline: int) -> None:
        self.batches = batches
        self.pipeline = pipeline
        self.iterator: Iterator | None = None
        self._own: dict[tuple[int, int], Any] = {}  # (iteration, microbatch) -> item, own pipeline

    def item(self, pipeline: int, iteration: int, microbatch: int) -> Any:
        if self.batches is not None:
            return self.batches(pipeline, iteration, microbatch)
        if pipeline != self.pipeline:
            raise ResilienceError(f"micro-batch {microbatch} of pipeline {pipeline} was re-routed to this rank, "
                                  f"which reads only its own pipeline's data iterator: give "
                                  f"ResilientForwardBackward(batches=...) to read any pipeline's micro-batches")
        key = (iteration, microbatch)
        while key not in self._own:
            have = [k[1] for k in self._own if k[0] == iteration]
            nxt = max(have) + 1 if have else 0
            if nxt > microbatch:
                raise ResilienceError(f"micro-batch {microbatch} of iteration {iteration} was already consumed")
            self._own[(iteration, nxt)] = next(self.iterator) if self.iterator is not None else None
        return self._own[key]

    def batch(self, pipeline: int, iteration: int, microbatch: int) -> tuple[Any, Any]:
        """The executor's ``batch_source``: the item, passed as is to the first stage's forward."""
        return (Item(self.item(pipeline, iteration, microbatch)),), None

    def keep_from(self, iteration: int) -> None:
        """Forget the own pipeline's micro-batches of the iterations before ``iteration``."""
        self._own = {k: v for k, v in self._own.items() if k[0] >= iteration}
