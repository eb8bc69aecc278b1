"""Megatron's evaluation (``forward_only=True``) on the resilient schedule.

Forward passes only, of ``microbatches`` micro-batches per pipeline, a failed replica's re-routed to
its stage's survivors (:func:`~ds_resilience.planning.inference.inference_actions`). A rank reads
its own pipeline's evaluation micro-batches from the ``data_iterator`` Megatron passes; a
re-routed one from ``eval_batches(pipeline, evaluation, microbatch)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from ..errors import ResilienceError
from ..planning.inference import inference_actions
from ..runtime.executor import Executor
from ..topology import Topology, Worker
from .data import Item

__all__ = ["EvalItems", "forward_only"]


class EvalItems:
    """The reader of one evaluation's micro-batches: ``(pipeline, iteration, microbatch) -> item``,
    the iteration ignored (an evaluation has one)."""

    def __init__(self, pipeline: int, data: Iterator | None, eval_batches: Callable[[int, int, int], Any] | None,
                 evaluation: int) -> None:
        self.pipeline, self.data, self.eval_batches, self.evaluation = pipeline, data, eval_batches, evaluation
        self._own: list = []

    def __call__(self, pipeline: int, _iteration: int, microbatch: int) -> Any:
        if pipeline != self.pipeline:
            if self.eval_batches is None:
                raise ResilienceError(f"evaluation micro-batch {microbatch} of pipeline {pipeline} was re-routed "
                                      f"to this rank: give ResilientForwardBackward(eval_batches=...) to read any "
                                      f"pipeline's evaluation micro-batches")
            return self.eval_batches(pipeline, self.evaluation, microbatch)
        while len(self._own) <= microbatch:
            self._own.append(next(self.data) if self.data is not None else None)
        return self._own[microbatch]


def forward_only(executor: Executor, topology: Topology, me: Worker, microbatches: int, item: EvalItems,
                 switch: Callable | None) -> None:
    """This rank's forward passes of one evaluation; ``switch``: megatron-core's activation
    recompute, switched off meanwhile (no graph: no recompute)."""
    actions = inference_actions(topology, microbatches)[topology.worker_index(me)]
    with switch() if switch is not None else contextlib.nullcontext():
        executor.evaluate(actions, load=lambda p, k: ((Item(item(p, 0, k)),), None), microbatches=microbatches)
