"""What the runtime sees of a DeepSpeed pipeline engine: its stage, and its data.

:class:`DeepSpeedStage` is the stage (``checkpoint.state.StageHost``): parameters, optimizer,
scheduler, step counters, and DeepSpeed's optimizer step for this stage alone.
:class:`IteratorSource` turns a DeepSpeed-style data iterator into a batch source.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.pipe.engine import PipelineEngine

from ..errors import ResilienceError

__all__ = ["DeepSpeedStage", "IteratorSource"]


class IteratorSource:
    """A batch source over a DeepSpeed-style data iterator: own pipeline's micro-batches only."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.cache: dict[tuple[int, int], Any] = {}
        self.next_mb: dict[int, int] = {}

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> tuple[Any, Any]:
        if pipeline != self.engine.me.pipeline:
            raise ResilienceError(
                f"re-routed micro-batch {microbatch} of pipeline {pipeline} needs that pipeline's data: pass "
                "batch_source=(pipeline, iteration, microbatch) -> (inputs, labels) to ds_resilience.initialize"
            )
        key = (iteration, microbatch)
        while key not in self.cache:
            m = self.next_mb.get(iteration, 0)
            self.cache[(iteration, m)] = next(self.engine.data_iterator)
            self.next_mb[iteration] = m + 1
        return self.cache.pop(key)


class DeepSpeedStage:
    """The stage of a DeepSpeed pipeline engine as the runtime sees it (``checkpoint.state.StageHost``)."""

    def __init__(self, engine: PipelineEngine) -> None:
        self.engine = engine
        self.parameters = [p for p in engine.module.parameters() if p.requires_grad]

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def counters(self) -> tuple[int, int]:
        return self.engine.global_steps, self.engine.global_samples

    def set_counters(self, steps: int, samples: int) -> None:
        self.engine.global_steps, self.engine.global_samples = steps, samples

    def step(self) -> None:
        """DeepSpeed's optimizer step for this stage only (gradients already reduced and clipped)."""
        e = self.engine
        e._force_grad_boundary = True
        e.optimizer.step()
        e.zero_grad()
        if e.lr_scheduler is not None:
            e.lr_scheduler.step()
        e._force_grad_boundary = False
        e.global_steps += 1
        e.global_samples += e.train_batch_size()
