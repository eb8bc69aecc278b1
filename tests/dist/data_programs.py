"""Programs the data-source tests run in every rank (module-level, so they pickle).

A dataset whose items carry their sample index, and a tiny two-stage ``PipelineModule`` that records
which samples each micro-batch it ran held: its first layer records the ids of the inputs (the
first feature column), the loss function the ids of the labels (labels are ``(class, id)``). Each
scenario trains PP=2 x DP=2 for a few steps in the same processes, one engine after the other:
vanilla DeepSpeed, and the resilient engine fed by ``training_data`` or by ``train_batch(data_iter)``
with ``data_iter_factory``, fault-free and with a simulated failure.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D, H, C = 6, 8, 3  # features, hidden width, classes
MICRO_BATCH_SIZE = 2
MICROBATCHES = 2
DATASET_SIZE = 23  # odd: DistributedSampler pads rank 1 with sample 0; 12 per rank, 6 batches per epoch
# (full batches: vanilla DeepSpeed sizes its pipeline buffers by the first micro-batch)

SEEN: list[tuple[str, int, tuple[int, ...]]] = []
"""(where, step, sample ids) of every micro-batch this process ran: ``in`` on the first stage, ``loss`` on the last."""
STEP = [0]


class IndexedDataset(torch.utils.data.Dataset):
    """Item ``i``: ``(x, (y, i))``; ``x[0]`` is ``i`` (as a float), the rest features drawn from ``i``."""

    def __init__(self, size: int = DATASET_SIZE) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + int(i))
        x = torch.cat([torch.tensor([float(i)]), torch.randn(D, generator=g)])
        return x, (torch.tensor(int(i) % C), torch.tensor(int(i)))


class Stream(torch.utils.data.IterableDataset):
    """An iterable-style dataset (cannot be addressed by index)."""

    def __iter__(self):
        return iter(IndexedDataset())


def halving_collate(items):
    """A user's collate_fn: the default one, with the features halved (the ids kept)."""
    x, (y, i) = torch.utils.data.default_collate(items)
    x = x.clone()
    x[:, 1:] *= 0.5
    return x, (y, i)


class Ids(nn.Module):
    """First layer: records the micro-batch's sample ids, passes the features on."""

    def forward(self, x):
        SEEN.append(("in", STEP[0], tuple(int(v) for v in x[:, 0].tolist())))
        return x[:, 1:]


def loss_fn(outputs, labels):
    y, ids = labels
    SEEN.append(("loss", STEP[0], tuple(int(v) for v in ids.tolist())))
    return F.cross_entropy(outputs, y)


def build_module(num_stages: int = 2):
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(7)
    layers = [Ids(), nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C)]
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn, partition_method="uniform")


def ds_config(dp: int, *, drop_last: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH_SIZE,
        "gradient_accumulation_steps": MICROBATCHES,
        "train_batch_size": MICRO_BATCH_SIZE * MICROBATCHES * dp,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "steps_per_print": 10_000,
        "dataloader_drop_last": drop_last,
        "zero_optimization": {"stage": 0},
    }


def pipeline_stream(dataset, pipeline: int, dp: int, *, collate_fn=None, drop_last: bool = False, num_workers: int = 0,
                    start: int = 0):
    """Pipeline ``pipeline``'s micro-batches as DeepSpeed's pipeline engine builds them, endlessly,
    from batch ``start`` on (what a user's ``data_iter`` / ``data_iter_factory`` yields)."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp, rank=pipeline, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH_SIZE, sampler=sampler, drop_last=drop_last,
                                         collate_fn=collate_fn, num_workers=num_workers)
    endless = (batch for _ in itertools.count() for batch in loader)
    return itertools.islice(endless, start, None)


def _allow_children() -> None:
    """The harness's workers are daemonic, and a daemonic process may not start DataLoader worker
    processes (DeepSpeed's loader starts 2 per rank); the harness still kills the job on timeout."""
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False


def _close_loaders() -> None:
    """Shut down the worker processes of every DataLoader iterator left in this process (an engine's
    loader outlives ``del engine`` until a collection): one program trains several engines in turn,
    and a previous engine's loader worker dying later (CI saw a SIGSEGV at its exit) would fail the
    next engine's collectives through DataLoader's SIGCHLD handler."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, _MultiProcessingDataLoaderIter):
            obj._shutdown_workers()


def _ids(batch) -> tuple[tuple[int, ...], tuple[int, ...]]:
    x, (_, i) = batch
    return tuple(int(v) for v in x[:, 0].tolist()), tuple(int(v) for v in i.tolist())


def _batch_values(batch) -> list[torch.Tensor]:
    x, (y, i) = batch
    return [x.clone(), y.clone(), i.clone()]


def loader_streams(rank: int, world: int, batches: int, variant: dict) -> dict[str, Any]:
    """(a): DeepSpeed's own ``training_dataloader`` for this rank, and the resilient engine's
    dataset source for every pipeline, ``batches`` micro-batches each."""
    import deepspeed

    import ds_resilience

    _allow_children()
    deepspeed.init_distributed(dist_backend="gloo")
    dp = world // 2
    dataset = IndexedDataset(variant.get("size", DATASET_SIZE))
    collate = halving_collate if variant.get("collate") else None
    config = ds_config(dp, drop_last=variant.get("drop_last", False))
    module = build_module()
    engine, _, loader, _ = deepspeed.initialize(model=module, config=config, training_data=dataset, collate_fn=collate,
                                                model_parameters=[p for p in module.parameters() if p.requires_grad])
    theirs = [_batch_values(next(loader)) for _ in range(batches)]
    pipeline = engine.grid.data_parallel_id
    del engine
    _close_loaders()
    module = build_module()
    config["resilience"] = {"planner": {"solver": "heuristic"}}
    engine, _, _, _ = ds_resilience.initialize(model=module, config=config, training_data=dataset, collate_fn=collate,
                                               model_parameters=[p for p in module.parameters() if p.requires_grad])
    source = engine.executor.batch_source.dataset
    ours = {p: [_batch_values(source(p, k // MICROBATCHES, k % MICROBATCHES)) for k in range(batches)] for p in range(dp)}
    # the own pipeline streams through DataLoader worker processes; the others are read directly
    reads = dict(source.reads)
    source.close()
    torch.distributed.barrier()
    return {"pipeline": pipeline, "stage": engine.stage_id, "theirs": theirs, "ours": ours, "reads": reads,
            "workers": source.spec.num_workers}


def train_scenarios(rank: int, world: int, scenarios: list[dict], steps: int) -> dict[str, Any]:
    """(b), (c): train each scenario; returns its parameters, losses and the sample ids recorded."""
    import deepspeed

    import ds_resilience

    _allow_children()
    deepspeed.init_distributed(dist_backend="gloo")
    dp = world // 2
    dataset = IndexedDataset()
    out: dict[str, Any] = {}
    for sc in scenarios:
        module = build_module()
        config = ds_config(dp)
        params = [p for p in module.parameters() if p.requires_grad]
        data = sc["data"]
        kwargs: dict[str, Any] = {}
        if data == "training_data":
            kwargs["training_data"] = dataset
        if sc["engine"] == "vanilla":
            engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params, **kwargs)
        else:
            config["resilience"] = {"planner": {"solver": "heuristic"}, "simulate_failed": sc.get("failed", [])}
            if data == "data_iter":
                kwargs["data_iter_factory"] = lambda p, i: pipeline_stream(dataset, p, dp, start=i * MICROBATCHES)
            # "iter_only": train_batch(data_iter) and nothing else, as DeepSpeed users write it: a
            # failed end's micro-batches come from the other end of its pipeline
            engine, *_ = ds_resilience.initialize(model=module, config=config, model_parameters=params, **kwargs)
        pipeline = engine.grid.data_parallel_id
        # a user's own DataLoader with worker processes, as DeepSpeed users feed train_batch(data_iter)
        data_iter = (pipeline_stream(dataset, pipeline, dp, num_workers=2) if data in ("data_iter", "iter_only")
                     else None)
        SEEN.clear()
        losses = []
        for _ in range(steps):
            STEP[0] = engine.global_steps
            loss = engine.train_batch(data_iter) if data_iter is not None else engine.train_batch()
            losses.append(None if loss is None else float(loss))
        source = getattr(getattr(engine, "executor", None), "batch_source", None)
        out[sc["name"]] = {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "losses": losses,
            "seen": list(SEEN),
            "stage": engine.stage_id,
            "pipeline": pipeline,
            "alive": getattr(engine, "alive", True),
            "factory_iterators": getattr(getattr(source, "factory", None), "created", None),
        }
        if getattr(source, "close", None):
            source.close()
        del engine
        _close_loaders()
        torch.distributed.barrier()
    return out


def rejections(rank: int, world: int) -> dict[str, Any]:
    """(d): what ``initialize`` says to a data path that cannot re-route, where re-routing can happen."""
    import deepspeed

    import ds_resilience
    import ds_resilience.integrations.deepspeed as dsi
    from ds_resilience.errors import ConfigError

    deepspeed.init_distributed(dist_backend="gloo")
    dp = world // 2
    out: dict[str, Any] = {}

    def attempt(name: str, resilience: dict, **kwargs) -> None:
        module = build_module()
        config = ds_config(dp)
        config["resilience"] = {"planner": {"solver": "heuristic"}, **resilience}
        try:
            engine, *_ = ds_resilience.initialize(model=module, config=config,
                                                  model_parameters=[p for p in module.parameters()], **kwargs)
        except ConfigError as exc:
            out[name] = {"error": str(exc), "path": exc.path}
            return
        STEP[0] = 0
        loss = engine.train_batch(pipeline_stream(IndexedDataset(), engine.grid.data_parallel_id, dp))
        out[name] = {"error": None, "loss": None if loss is None else float(loss)}
        del engine
        _close_loaders()

    both_ends = {"simulate_failed": ["1:0", "1:1"]}
    attempt("simulated_iterator_only", both_ends)
    attempt("simulated_one_end_iterator_only", {"simulate_failed": ["1:1"]})
    attempt("no_rerouting_iterator_only", {})
    saved = dsi.launch_env
    dsi.launch_env = lambda: object()  # as under `ds-resilience run`: the check comes before the launch is used
    try:
        attempt("agent_iterator_only", {"max_failures": 2})
        attempt("agent_iterable_dataset", {"planner": {"solver": "heuristic", "all_coverable": True}},
                training_data=Stream())
    finally:
        dsi.launch_env = saved
    torch.distributed.barrier()
    return out
