"""``eval_batch`` on the survivors: every pipeline's evaluation micro-batches, re-routed as in training.

Micro-batch m of pipeline p runs forward at each stage on the worker the re-routing assignment
gives it (``planning/inference.py``): its own worker, or a surviving data-parallel peer of that
stage. A worker reads its own pipeline's micro-batches from the ``data_iter`` it is given, as in
DeepSpeed, and other pipelines' from ``eval_source(pipeline, step, microbatch)`` if given, else from
the surviving end of their pipeline, which reads the same items from its own ``data_iter`` and
hands them over before the forwards (``integrations/ds_relay.py``). The last stage's
survivors sum their micro-batches' losses and divide by the global count, exactly vanilla's average
over micro-batches and then over data-parallel ranks; the value travels to every survivor as
vanilla's broadcast leaves it (0-dim on the last stage, shape (1,) elsewhere, float32).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ResilienceError
from ..planning.data_relay import relay_plan
from ..planning.inference import inference_actions
from .ds_relay import exchange, unserved_error
from .ds_reporting import is_reporter, write_monitor

__all__ = ["evaluate"]


def evaluate(engine: Any, data_iter, micro_batches: int, return_logits: bool, compute_loss: bool, reduce_output,
             bcast_loss: bool):
    """One ``eval_batch`` on the survivors (see ``ResilientPipelineEngine.eval_batch``)."""
    if not engine.alive:
        return None
    groups = engine.generation.groups
    groups.world.barrier()  # as vanilla's: consecutive evaluations never cross
    own: dict[int, Any] = {}
    step = engine.global_steps

    relayed: dict[tuple[int, int], Any] = {}

    def load(pipeline: int, microbatch: int):
        if pipeline == engine.me.pipeline and data_iter is not None:
            while microbatch not in own:
                own[len(own)] = next(data_iter)
            return own[microbatch]
        if (pipeline, microbatch) in relayed:
            return relayed[(pipeline, microbatch)]
        if engine.eval_source is None:
            raise ResilienceError(
                f"evaluation micro-batch {microbatch} of pipeline {pipeline} runs on this worker (its own worker "
                f"failed, or no data_iter was given): pass data_iter to eval_batch on every first and last stage, "
                f"or eval_source=(pipeline, step, microbatch) -> (inputs, labels) to ds_resilience.initialize")
        return engine.eval_source(pipeline, step, microbatch)

    every = inference_actions(engine.current, micro_batches)
    actions = every[engine.my_index]
    if engine.eval_source is None:
        plan = relay_plan(engine.current, every)
        if plan.starves(actions):
            raise unserved_error(plan, what="evaluation micro-batches",
                                 how="pass eval_source=(pipeline, step, microbatch) -> (inputs, labels) to "
                                     "ds_resilience.initialize")
        relayed.update(exchange(plan, engine.my_index, group=groups.world, rank_of=engine._rank_of, read=load,
                                channel="evaldata", dp=engine.topology.dp, microbatches=micro_batches,
                                timeout_s=engine.resilience.detector.pg_timeout_s))
    result = engine.executor.evaluate(actions, load=load, microbatches=micro_batches, compute_loss=compute_loss)
    last = engine.stage_id == engine.num_stages - 1
    eval_output = None
    if last:
        if reduce_output is None:
            eval_output = result.own
        else:
            total = result.total if torch.is_tensor(result.total) else torch.stack(list(result.total))
            total = total.to(torch.float64)
            groups.stage.all_reduce(total)
            eval_output = (total / (engine.topology.dp * micro_batches)).to(result.own[0].dtype if result.own else torch.float32)
    if compute_loss and (bcast_loss or engine.monitor.enabled) and reduce_output is not None:
        # vanilla broadcasts the last stage's value down its pipeline: a 0-dim tensor stays on the
        # last stage, the others receive a tensor of shape (1,), all float32
        leader = engine.me == engine.current.stage_peers(engine.num_stages - 1)[0]
        value = torch.zeros(1, dtype=torch.float64)
        if leader:
            value += float(eval_output)
        groups.world.all_reduce(value)
        eval_output = (eval_output.detach().to(torch.float32) if last
                       else value.to(torch.float32).to(engine.device))
    if is_reporter(engine) and engine._config.monitor_config.enabled and eval_output is not None and reduce_output:
        write_monitor(engine, [("Train/Samples/eval_loss", float(eval_output.mean()), engine.global_samples)])
    if return_logits:
        return eval_output, (result.last_outputs if last else None)
    return eval_output
