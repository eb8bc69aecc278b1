"""Any pipeline's training micro-batch, from the data a DeepSpeed user gives the engine.

Re-routing runs a failed worker's micro-batches on its data-parallel peers, so a worker must be able
to load *another* pipeline's micro-batch ``(pipeline, iteration, microbatch)``, and a replay after a
failure must load the same one again. The engine's batch source (what the executor calls) is one of:

* ``batch_source=`` given to ``initialize``: used as is, for every pipeline.
* :class:`DatasetSource`, for a map-style ``training_data``: DeepSpeed's own data semantics made
  addressable. ``PipelineEngine._build_data_iter`` gives data-parallel rank ``p`` a
  ``DistributedSampler(dataset, num_replicas=dp, rank=p, shuffle=False)``, batches it by
  ``train_micro_batch_size_per_gpu`` with the engine's ``collate_fn`` and ``dataloader_drop_last``,
  and repeats it (``RepeatingLoader``: the next epoch is the same order again, the sampler's epoch
  never changes). Micro-batch ``m`` of iteration ``i`` of pipeline ``p`` is batch ``i * M + m`` of
  that stream (``M`` = gradient_accumulation_steps), computed directly, so any worker reads any
  pipeline's micro-batch and a replay reads the same samples. A worker's own pipeline streams
  through a ``torch`` DataLoader with DeepSpeed's worker processes (prefetching, positioned at the
  batch asked for); other pipelines' micro-batches are read in the worker's own process.
* :class:`IteratorSource` + :class:`FactorySource` for ``train_batch(data_iter)``: a worker reads
  its own pipeline from the iterator it is given, positionally, as DeepSpeed does (keeping the
  current and the previous iteration's items for a replay), and another pipeline's from
  ``data_iter_factory(pipeline, iteration) -> iterator``, one cached iterator per pipeline,
  re-created when the iteration needed is behind it (a rollback, a load) or far ahead.

:class:`EngineData` picks between the last two at each request (``train_batch(data_iter)`` replaces
the loader built from ``training_data``, as in DeepSpeed). :func:`engine_batch_source` is what the
engine calls at construction.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Iterator

import torch

from ..accelerator import device_count
from ..errors import ConfigError, ResilienceError
from ..logs import get_logger

__all__ = ["DataIterFactory", "DatasetSource", "EngineData", "FactorySource", "IteratorSource", "LoaderSpec",
           "engine_batch_source", "is_map_style", "planned_tolerance", "reroute_data_error", "unfed_reason", "unfed_by"]

log = get_logger(__name__)

DataIterFactory = Callable[[int, int], Iterator[Any]]
"""(pipeline, iteration) -> an iterator over that pipeline's micro-batches from that iteration on."""


def is_map_style(dataset: Any) -> bool:
    """Whether ``dataset`` can be addressed by index: ``__getitem__`` and ``__len__`` (DeepSpeed's
    own test), and not a ``torch.utils.data.IterableDataset``."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return False
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def reroute_data_error(training_data: Any, batch_source: Any, data_iter_factory: Any, *,
                       unfed: str | None = None) -> ConfigError | None:
    """The error for a data path that cannot serve a failed peer's micro-batches, or ``None``.

    Re-routing runs a failed worker's micro-batches on its data-parallel peers. While either end
    of the failed worker's pipeline survives, that end hands them over from its own ``data_iter``
    (``planning/data_relay.py``), so a data iterator alone serves them. Only a pipeline that loses
    both ends needs an addressable source: ``batch_source``, a map-style ``training_data`` or
    ``data_iter_factory``. ``unfed`` says when that can happen (the failure sets the tolerance
    plans for, or the simulated ones); ``None``: it cannot, and any data path serves.
    """
    if unfed is None or batch_source is not None or data_iter_factory is not None:
        return None
    if training_data is not None and is_map_style(training_data):
        return None
    how = ("pass training_data=<a map-style torch Dataset> (DeepSpeed's sampler, made addressable), "
           "batch_source=(pipeline, iteration, microbatch) -> (inputs, labels), or "
           "data_iter_factory=(pipeline, iteration) -> iterator over that pipeline's micro-batches from that "
           "iteration")
    if training_data is not None:
        return ConfigError("training_data", f"{type(training_data).__name__} is an iterable-style dataset and "
                           f"{unfed}: then no worker reads that pipeline's data, and its samples cannot be addressed "
                           f"by (pipeline, iteration, micro-batch); {how}")
    return ConfigError("batch_source", f"{unfed}: then no worker reads that pipeline's data_iter (only a pipeline's "
                       f"first and last stages read it) and its micro-batches cannot be re-routed; {how}")


def planned_tolerance(resilience: Any) -> int:
    """The largest failure set the plans cover, for :func:`unfed_reason`: ``max_failures``, and
    with ``planner.all_coverable`` any set (2 is enough to lose both ends of a pipeline)."""
    return max(resilience.max_failures, 2) if resilience.planner.all_coverable else resilience.max_failures


def unfed_reason(num_stages: int, tolerance: int, simulated: Any = None) -> str | None:
    """Why a pipeline can lose both its ends (``reroute_data_error``'s ``unfed``), or ``None``.

    ``simulated``: the ``simulate_failed`` grid (a Topology) if any; ``tolerance``: the largest
    failure set the plans cover."""
    from ..planning.data_relay import can_lose_both_ends, unfed_pipelines

    if simulated is not None:
        lost = unfed_pipelines(simulated)
        return f"resilience.simulate_failed fails both ends of pipeline(s) {list(lost)}" if lost else None
    if not can_lose_both_ends(num_stages, tolerance):
        return None
    # the tolerance is the user's to lower: the reason says so (a simulated set's is not)
    if num_stages == 1:
        return ("with one pipeline stage, a failure within the tolerance (resilience.max_failures "
                f"{tolerance}, which you may lower) takes a pipeline's only worker")
    return (f"a failure set within the tolerance (resilience.max_failures {tolerance}, which you may lower) can take "
            "both the first and the last stage worker of one pipeline")


def unfed_by(num_stages: int, resilience: Any, *, simulated: Any = None, live: bool) -> str | None:
    """Why a pipeline may lose both its ends (then only an addressable source feeds it): the
    simulated failure set (``simulated``: the grid without it), or under the agent any set within
    the tolerance (``None``: never)."""
    if simulated is not None:
        return unfed_reason(num_stages, 0, simulated=simulated)
    if not live:
        return None
    return unfed_reason(num_stages, planned_tolerance(resilience))


# --- training_data --------------------------------------------------------------------------------
class LoaderSpec:
    """How DeepSpeed samples, batches and loads ``training_data`` for one data-parallel rank.

    Read from the engine's own loader (``RepeatingLoader(DeepSpeedDataLoader)`` built by
    ``PipelineEngine._build_data_iter``) where the engine has one (first and last stages), else
    from the engine's config with DeepSpeed's defaults.
    """

    def __init__(self, *, batch_size: int, drop_last: bool = False, collate_fn: Callable | None = None,
                 num_workers: int = 0, pin_memory: bool = False, shuffle: bool = False, seed: int = 0,
                 epoch: int = 0, sampler_drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ConfigError("train_micro_batch_size_per_gpu", f"must be >= 1, got {batch_size}")
        self.batch_size, self.drop_last, self.collate_fn = int(batch_size), bool(drop_last), collate_fn
        self.num_workers, self.pin_memory = int(num_workers or 0), bool(pin_memory)
        self.shuffle, self.seed, self.epoch, self.sampler_drop_last = bool(shuffle), int(seed), int(epoch), bool(sampler_drop_last)

    @classmethod
    def of_engine(cls, engine: Any) -> LoaderSpec:
        from deepspeed.runtime.dataloader import DeepSpeedDataLoader, RepeatingLoader

        loader = getattr(engine, "training_dataloader", None)
        # the first and last stages hold _build_data_iter's RepeatingLoader; a middle stage keeps the
        # base engine's loader (never read), whose sampler is not the pipeline engine's
        loader = loader.loader if isinstance(loader, RepeatingLoader) else None
        if isinstance(loader, DeepSpeedDataLoader):
            sampler = loader.data_sampler
            if not isinstance(sampler, torch.utils.data.DistributedSampler):
                raise ConfigError("training_data", f"DeepSpeed samples it with a {type(sampler).__name__}, which "
                                  "ds_resilience cannot address per (pipeline, iteration, micro-batch) "
                                  "(curriculum learning / data efficiency sampling?); pass batch_source=")
            return cls(batch_size=loader.batch_size, drop_last=loader.dataloader_drop_last,
                       collate_fn=loader.collate_fn, num_workers=loader.num_local_io_workers,
                       pin_memory=loader.pin_memory, shuffle=sampler.shuffle, seed=sampler.seed,
                       epoch=sampler.epoch, sampler_drop_last=sampler.drop_last)
        # a middle stage (DeepSpeed gives it no loader; it never loads data) or no loader at all
        return cls(batch_size=engine.train_micro_batch_size_per_gpu(), drop_last=engine.dataloader_drop_last(),
                   collate_fn=getattr(engine, "collate_fn", None), num_workers=2, pin_memory=True)


class _Shard:
    """Pipeline ``p``'s sample order: ``list(DistributedSampler(dataset, dp, p, shuffle, seed, drop_last))``
    with the sampler's epoch, computed per position (the padding of an uneven split wraps around
    to the start, as the sampler's does)."""

    def __init__(self, length: int, dp: int, pipeline: int, spec: LoaderSpec, order: torch.Tensor | None) -> None:
        self.length, self.dp, self.pipeline, self.order = length, dp, pipeline, order
        if spec.sampler_drop_last and length % dp:
            self.num_samples = math.ceil((length - dp) / dp)
        else:
            self.num_samples = math.ceil(length / dp)

    def __getitem__(self, t: int) -> int:
        j = (self.pipeline + t * self.dp) % self.length
        return int(self.order[j]) if self.order is not None else j


class _BatchStream:
    """An endless batch sampler: pipeline ``p``'s batches (lists of dataset indices) from ``start`` on."""

    def __init__(self, source: DatasetSource, pipeline: int, start: int) -> None:
        self.source, self.pipeline, self.start = source, pipeline, start

    def __iter__(self):
        k = self.start
        while True:
            yield self.source.indices(self.pipeline, k)
            k += 1


def _die_with_parent(parent: int, worker_id: int) -> None:
    """A loader worker process dies with the rank that forked it (Linux ``PR_SET_PDEATHSIG``).

    Workers are forked after the rank joined its process groups, so they hold copies of its gloo
    and store sockets. Left alone, the workers of a SIGKILLed rank live on for up to torch's
    5-second status-check interval, orphaned, keeping the dead rank's connections half-open; with
    this they go at once, and with them the dead rank's sockets.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux") or os.getppid() != parent:
        return  # not forked by the rank (a spawn or forkserver context, or the rank is gone already)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the rank died between the check and arming the signal
        os._exit(1)


class DatasetSource:
    """Any pipeline's micro-batch of a map-style ``training_data``, with DeepSpeed's semantics.

    ``source(pipeline, iteration, microbatch)`` is batch ``iteration * microbatches + microbatch``
    of the stream DeepSpeed's pipeline engine gives data-parallel rank ``pipeline`` (see the
    module docstring), exactly: the same sample indices, the dataset's ``__getitems__`` or
    ``__getitem__``, the same ``collate_fn`` (torch's ``default_collate`` when none).

    Args:
        dataset: the map-style dataset.
        dp: data-parallel size (pipelines).
        microbatches: micro-batches per pipeline and iteration.
        spec: the loader's settings (:meth:`LoaderSpec.of_engine`).
        own: this worker's pipeline, whose batches stream through a DataLoader with
            ``spec.num_workers`` worker processes (``None``: every read in this process).
    """

    #: how far ahead of the own stream a request may be and still be reached by reading on
    #: (beyond, or behind it, the stream is re-created at the batch asked for)
    SKIP_LIMIT_ITERATIONS = 2

    def __init__(self, dataset: Any, *, dp: int, microbatches: int, spec: LoaderSpec, own: int | None = None) -> None:
        if not is_map_style(dataset):
            raise ConfigError("training_data", f"{type(dataset).__name__} is not a map-style dataset")
        self.dataset, self.dp, self.microbatches, self.spec, self.own = dataset, dp, microbatches, spec, own
        self.length = len(dataset)
        if self.length < 1:
            raise ConfigError("training_data", "the dataset is empty")
        self.collate = spec.collate_fn
        if self.collate is None:
            from torch.utils.data import default_collate

            self.collate = default_collate
        order = None
        if spec.shuffle:  # DistributedSampler's permutation (DeepSpeed never calls set_epoch: one epoch's order)
            g = torch.Generator()
            g.manual_seed(spec.seed + spec.epoch)
            order = torch.randperm(self.length, generator=g)
        self._shards = [_Shard(self.length, dp, p, spec, order) for p in range(dp)]
        samples = self._shards[0].num_samples
        bs = spec.batch_size
        self.batches_per_epoch = samples // bs if spec.drop_last else math.ceil(samples / bs)
        if self.batches_per_epoch < 1:
            raise ConfigError("training_data", f"{self.length} samples over {dp} data-parallel ranks give "
                              f"{samples} per rank, less than one micro-batch of {bs} with dataloader_drop_last")
        self._cache: dict[tuple[int, int], Any] = {}
        self._stream: Iterator[Any] | None = None
        self._stream_next = 0  # the batch the own stream yields next
        self.reads = {"stream": 0, "direct": 0, "restarts": 0}
        """How batches were read (tests, diagnostics): from the own pipeline's stream, directly in
        this process, and how many times the stream was (re-)created."""

    @classmethod
    def of_engine(cls, engine: Any, dataset: Any) -> DatasetSource:
        return cls(dataset, dp=engine.grid.data_parallel_size, microbatches=engine.micro_batches,
                   spec=LoaderSpec.of_engine(engine), own=engine.grid.data_parallel_id)

    # --- addressing ----------------------------------------------------------------------------
    def indices(self, pipeline: int, batch: int) -> list[int]:
        """The dataset indices of batch ``batch`` (counted over epochs) of ``pipeline``'s stream."""
        shard = self._shards[pipeline]
        j = batch % self.batches_per_epoch
        bs = self.spec.batch_size
        return [shard[t] for t in range(j * bs, min((j + 1) * bs, shard.num_samples))]

    def fetch(self, indices: list[int]) -> Any:
        """What torch's DataLoader makes of one batch of indices (its map-style fetcher)."""
        getitems = getattr(self.dataset, "__getitems__", None)
        data = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return self.collate(data)

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> Any:
        if not 0 <= pipeline < self.dp:
            raise ResilienceError(f"pipeline {pipeline} requested; there are {self.dp}")
        if not 0 <= microbatch < self.microbatches:
            raise ResilienceError(f"micro-batch {microbatch} requested; an iteration has {self.microbatches}")
        k = iteration * self.microbatches + microbatch
        # keep the iteration before the one asked for: a stage that stepped ahead replays it after a rollback
        floor = (iteration - 1) * self.microbatches
        for key in [key for key in self._cache if key[0] == pipeline and key[1] < floor]:
            del self._cache[key]
        key = (pipeline, k)
        if key not in self._cache:
            if pipeline == self.own and self.spec.num_workers > 0:
                self._read_stream(k)
            else:
                self._cache[key] = self.fetch(self.indices(pipeline, k))
                self.reads["direct"] += 1
        return self._cache[key]

    # --- the own pipeline's prefetching stream ------------------------------------------------
    def _read_stream(self, k: int) -> None:
        ahead = k - self._stream_next
        if self._stream is None or ahead < 0 or ahead >= self.SKIP_LIMIT_ITERATIONS * self.microbatches:
            self._open_stream(k)
        while (self.own, k) not in self._cache:
            batch = next(self._stream)
            self._cache[(self.own, self._stream_next)] = batch
            self._stream_next += 1
            self.reads["stream"] += 1

    def _open_stream(self, k: int) -> None:
        self.close()
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=_BatchStream(self, self.own, k),
                                             collate_fn=self.collate, num_workers=self.spec.num_workers,
                                             pin_memory=self.spec.pin_memory and device_count() > 0,
                                             worker_init_fn=functools.partial(_die_with_parent, os.getpid()))
        self._stream, self._stream_next = iter(loader), k
        self.reads["restarts"] += 1

    def close(self) -> None:
        """Stop the own stream's worker processes (a later read starts a new stream)."""
        stream, self._stream = self._stream, None
        shutdown = getattr(stream, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


# --- train_batch(data_iter) ------------------------------------------------------------------------
class IteratorSource:
    """A batch source over the engine's DeepSpeed-style data iterator: its own pipeline's micro-batches.

    Micro-batch ``m`` of an iteration is the ``m``-th item the iterator yields in that iteration,
    as in DeepSpeed: an iteration it has not read reads the next items, whatever its number (after
    ``load_checkpoint`` the step count goes back and the iterator simply goes on, as in
    DeepSpeed). The items of the current and the previous iteration are kept, so a replay after a
    failure reads the same micro-batches again, also on a stage that had stepped ahead into the
    next iteration and is rolled back (by one step at most), and a stage that reads a micro-batch
    twice (first and last stage on one rank) gets the same item. (A load back to one of those two
    steps replays their items too.) It never reads more than ``microbatches`` items per
    iteration: a request it cannot serve is an error naming the micro-batch, never a loop.
    """

    KEEP_ITERATIONS = 2

    def __init__(self, engine: Any, microbatches: int, *, catch_up: bool = False) -> None:
        self.engine = engine
        self.microbatches = microbatches
        self.items: dict[int, dict[int, Any]] = {}
        self._order: list[int] = []  # iterations in the order they were first read
        # a relaunched worker (re-join, restart) builds its data_iter as at the job's start: its
        # first read skips the items of the iterations its pipeline ran before (the others read them)
        self.catch_up = catch_up
        self.skipped = 0

    @property
    def iteration(self) -> int | None:
        """The iteration read last."""
        return self._order[-1] if self._order else None

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> tuple[Any, Any]:
        if pipeline != self.engine.me.pipeline:
            raise ResilienceError(
                f"re-routed micro-batch {microbatch} of pipeline {pipeline} needs that pipeline's data: pass "
                "batch_source=(pipeline, iteration, microbatch) -> (inputs, labels), training_data=<a map-style "
                "Dataset> or data_iter_factory=(pipeline, iteration) -> iterator to ds_resilience.initialize"
            )
        if not 0 <= microbatch < self.microbatches:
            raise ResilienceError(f"micro-batch {microbatch} requested; an iteration has {self.microbatches}")
        items = self.items.get(iteration)
        if items is None:
            items = self.items[iteration] = {}
            self._order.append(iteration)
            for old in self._order[:-self.KEEP_ITERATIONS]:
                self.items.pop(old, None)
            self._order = self._order[-self.KEEP_ITERATIONS:]
        while microbatch not in items:
            if self.engine.data_iterator is None:
                raise ResilienceError("train_batch() needs data: pass data_iter=..., training_data= to initialize, "
                                      "or batch_source= to ds_resilience.initialize")
            if self.catch_up:
                self.catch_up = False
                self._skip(iteration * self.microbatches)
            items[len(items)] = next(self.engine.data_iterator)
        return items[microbatch]

    def _skip(self, count: int) -> None:
        for _ in range(count):
            next(self.engine.data_iterator)
        self.skipped = count
        if count:
            log.info("rank %s: relaunched at iteration %s: skipped the first %s items of its data_iter (its pipeline "
                     "ran them before; the iterator is taken as built at the job's start)",
                     getattr(self.engine, "rank", "?"), count // self.microbatches, count)


class FactorySource:
    """Any pipeline's micro-batches from ``data_iter_factory(pipeline, iteration) -> iterator``.

    One iterator per pipeline, kept with the position of the micro-batch it yields next; it is
    read on to the micro-batch asked for (items on the way are kept for the current and the
    previous iteration), and re-created at the iteration asked for when that is behind it (a
    rollback, a load) or more than two iterations ahead.
    """

    def __init__(self, factory: DataIterFactory, microbatches: int) -> None:
        self.factory, self.microbatches = factory, microbatches
        self._iters: dict[int, list] = {}  # pipeline -> [iterator, next position]
        self._cache: dict[tuple[int, int], Any] = {}
        self.created = 0  # iterators made (tests, diagnostics)

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> Any:
        if not 0 <= microbatch < self.microbatches:
            raise ResilienceError(f"micro-batch {microbatch} requested; an iteration has {self.microbatches}")
        M = self.microbatches
        k = iteration * M + microbatch
        floor = (iteration - 1) * M
        for key in [key for key in self._cache if key[0] == pipeline and key[1] < floor]:
            del self._cache[key]
        if (pipeline, k) in self._cache:
            return self._cache[(pipeline, k)]
        state = self._iters.get(pipeline)
        if state is None or not state[1] <= k < state[1] + 2 * M:
            state = self._iters[pipeline] = [iter(self.factory(pipeline, iteration)), iteration * M]
            self.created += 1
        it = state[0]
        while (pipeline, k) not in self._cache:
            try:
                item = next(it)
            except StopIteration:
                raise ResilienceError(f"data_iter_factory({pipeline}, {iteration})'s iterator ended before "
                                      f"micro-batch {microbatch} of iteration {iteration}") from None
            self._cache[(pipeline, state[1])] = item
            state[1] += 1
        return self._cache[(pipeline, k)]


class EngineData:
    """The engine's batch source when no ``batch_source`` was given.

    While the engine reads the loader DeepSpeed built from ``training_data`` (no ``data_iter`` was
    passed to ``train_batch``, which replaces it as in DeepSpeed), every pipeline's micro-batch,
    the worker's own included, comes from :class:`DatasetSource`. Otherwise the worker's own
    pipeline comes from its data iterator (:class:`IteratorSource`) and the others from
    ``data_iter_factory`` (:class:`FactorySource`).
    """

    def __init__(self, engine: Any, microbatches: int, *, dataset: DatasetSource | None = None,
                 factory: FactorySource | None = None) -> None:
        self.engine, self.dataset, self.factory = engine, dataset, factory
        self.loader = getattr(engine, "training_dataloader", None) if dataset is not None else None
        launch = getattr(engine, "launch", None)
        relaunched = launch is not None and bool(launch.rejoin or launch.restart)
        self.iterator = IteratorSource(engine, microbatches, catch_up=relaunched)
        self.relayed: dict[tuple[int, int], Any] = {}  # (pipeline, microbatch) -> item, this iteration's
        self.relayed_iteration: int | None = None

    @property
    def relays(self) -> bool:
        """Whether other pipelines' micro-batches come from their pipelines' surviving ends
        (``integrations/ds_relay.py``): no addressable source serves them."""
        return not self.from_dataset and self.factory is None

    @property
    def from_dataset(self) -> bool:
        """Whether micro-batches come from ``training_data`` (the engine still holds its loader)."""
        return self.dataset is not None and (self.loader is None or self.engine.training_dataloader is self.loader)

    def __call__(self, pipeline: int, iteration: int, microbatch: int) -> Any:
        if self.from_dataset:
            return self.dataset(pipeline, iteration, microbatch)
        if pipeline == self.engine.me.pipeline:
            return self.iterator(pipeline, iteration, microbatch)
        if self.factory is not None:
            return self.factory(pipeline, iteration, microbatch)
        if self.relayed_iteration == iteration and (pipeline, microbatch) in self.relayed:
            return self.relayed[(pipeline, microbatch)]
        return self.iterator(pipeline, iteration, microbatch)  # its error names the sources

    def close(self) -> None:
        if self.dataset is not None:
            self.dataset.close()


def engine_batch_source(engine: Any, *, batch_source: Callable | None, data_iter_factory: DataIterFactory | None,
                        rerouting: bool, unfed: str | None = None) -> Callable:
    """The batch source a :class:`~.ds_engine.ResilientPipelineEngine` gives its executor.

    ``rerouting``: the engine may run another pipeline's micro-batches (under the agent, or with
    simulated failures); ``unfed``: why a pipeline may lose both its ends (:func:`unfed_reason`),
    then a data path that cannot serve its micro-batches is a :class:`ConfigError`, and so is a
    ``training_data`` whose sampling cannot be addressed.
    """
    if batch_source is not None:
        return batch_source
    dataset = getattr(engine, "training_data", None)
    if rerouting:
        error = reroute_data_error(dataset, batch_source, data_iter_factory, unfed=unfed)
        if error is not None:
            raise error
    source = None
    if dataset is not None and is_map_style(dataset):
        if engine.curriculum_learning_enabled():
            # the loader's items are relayed by a pipeline's surviving end; with both ends lost
            # nothing can give them: sampled by difficulty, they cannot be addressed
            if rerouting and data_iter_factory is None and unfed is not None:
                raise ConfigError("data_efficiency", f"curriculum learning samples training_data by difficulty, "
                                  f"which cannot be addressed per (pipeline, iteration, micro-batch), and {unfed}: "
                                  f"pass batch_source=")
        else:
            source = DatasetSource.of_engine(engine, dataset)
            _stop_deepspeed_prefetch(engine)
    factory = FactorySource(data_iter_factory, engine.micro_batches) if data_iter_factory is not None else None
    return EngineData(engine, engine.micro_batches, dataset=source, factory=factory)


def _stop_deepspeed_prefetch(engine: Any) -> None:
    """Stop the worker processes DeepSpeed's own loader started at construction.

    ``DeepSpeedDataLoader._create_dataloader`` writes ``self.data = (x for x in self.dataloader)``:
    a generator expression evaluates its first iterable at once, so the loader's worker processes
    start (and prefetch) when ``_build_data_iter`` builds the ``RepeatingLoader``, before anything
    is read. The :class:`DatasetSource` reads instead, so they would sit idle for the whole run.
    Closing the generator releases its DataLoader iterator, which shuts them down; the loader stays
    usable (``RepeatingLoader`` re-iterates it on the ``StopIteration`` a closed generator raises).
    """
    from deepspeed.runtime.dataloader import RepeatingLoader

    loader = getattr(engine, "training_dataloader", None)
    if isinstance(loader, RepeatingLoader):
        data = getattr(loader.loader, "data", None)
        if hasattr(data, "close") and hasattr(data, "gi_frame"):
            data.close()
