"""The executor: one worker's actions run through one table, ``ActionKind -> callable``.

:class:`Executor` holds a stage's module, its per-iteration state and one swappable set of the
current generation's process groups (:meth:`Executor.install`). It knows nothing about DeepSpeed or
Megatron: an integration hands it actions (DeepSpeed's ``_INSTRUCTION_MAP`` maps its one IR
instruction to :meth:`Executor.execute`) and supplies the stage's optimizer step. Hooks
(:class:`ExecutorHooks`) let the checkpoint tier wrap the optimizer step and gate replication
around the actions the timeline marks link-idle.

What keeps the math of fault-free training, wherever a micro-batch runs:

* micro-batch identity is global, (pipeline, index): its data come from ``batch_source(pipeline,
  iteration, index)`` and its forward runs under an RNG seeded from (seed, iteration, pipeline,
  index, stage), the same on whichever replica runs it;
* each micro-batch's loss is scaled by 1 / (dp * microbatches), the global count, and REDUCE_GRAD
  sums gradients over the stage's surviving replicas: the sum over every micro-batch of the
  iteration, exactly what the fault-free average is (up to summation order);
* gradient clipping uses the global norm: every stage contributes its squared norm once (each
  replica a 1/n share) to one sum over all surviving workers.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..comm.groups import GenerationGroups
from ..comm.p2p import Messenger, message_tag
from ..errors import ResilienceError
from ..ir import Action, ActionKind
from .bw_split import WeightGradStore, backward_fused, backward_input
from .progress import Progress

__all__ = ["BatchSource", "EvalResult", "Executor", "ExecutorHooks", "IterationStats", "StageSpec", "squared_norm"]

_PEER_WAITS = frozenset({ActionKind.RECV_ACT, ActionKind.RECV_GRAD, ActionKind.REDUCE_GRAD, ActionKind.TIED_REDUCE,
                         ActionKind.OPT_STEP})
"""Actions that wait for other workers (a receive, a collective, the step check): not timed as a hang."""

_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
"""Forward and backward passes: what a slow worker (``Executor.speed``) runs slower."""

BatchSource = Callable[[int, int, int], tuple[Any, Any]]
"""(pipeline, iteration, microbatch) -> (inputs, labels)."""


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _fork_rng(device: str) -> ContextManager[Any]:
    """The RNG streams the stage's forward draws from, restored afterwards: the CPU generator and,
    on an accelerator, the stage's device's (dropout on a GPU draws there)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = dev.index if dev.index is not None else getattr(torch, dev.type).current_device()
    return torch.random.fork_rng(devices=[index], device_type=dev.type)


def _seed_stage_rng(device: str, value: int) -> None:
    """Seed the streams :func:`_fork_rng` forks: the CPU generator and, on an accelerator, the
    stage's device's. Not ``torch.manual_seed``: on a machine without CUDA it formats a stack for
    the lazy seed of CUDA, XPU and MTIA at every call (120 us against 2 us here, 50x; a micro-batch's
    forward on the CPU test jobs is a few ms), and on a GPU it would reseed the other devices too,
    outside the fork."""
    torch.random.default_generator.manual_seed(value)
    dev = torch.device(device)
    if dev.type == "cpu":
        return
    backend = getattr(torch, dev.type)
    index = dev.index if dev.index is not None else backend.current_device()
    generators = getattr(backend, "default_generators", None)
    if generators is not None:
        generators[index].manual_seed(value)
    else:  # pragma: no cover - a backend without per-device generators
        backend.manual_seed(value)


def _to_device(value: Any, device: str) -> Any:
    """Tensors in ``value`` (a tensor, or a tuple/list of values) on ``device``; the rest as is."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def rng_seed(seed: int, iteration: int, pipeline: int, microbatch: int, stage: int) -> int:
    """The seed of one micro-batch's RNG stream on one stage (or, with ``stage`` a layer key, on one
    layer: ``integrations/ds_engine.py`` reseeds every layer so a re-formed grid draws the same)."""
    return _rng_seed(seed, iteration, pipeline, microbatch, stage)


def _rng_seed(seed: int, iteration: int, pipeline: int, microbatch: int, stage: int) -> int:
    value = seed
    for part in (iteration, pipeline, microbatch, stage):
        value = (value * 1_000_003 + part) % (2**62)
    return value


@dataclass
class IterationStats:
    """What one iteration of this worker did (for progress output and tests)."""

    forwards: int = 0
    rerouted: int = 0
    loss_sum: float = 0.0
    losses: int = 0
    seconds: float = 0.0
    peak_pending_w: int = 0
    peak_pending_w_bytes: int = 0  # 0 unless count_w_bytes was set for the iteration
    loss_dtype: Any = None
    durations: dict = field(default_factory=dict)
    """Seconds per action, by action kind code (``F``, ``B``, ``W``, ``BW``, ``RD``, ``OPT``, ...)."""

    @property
    def compute_seconds(self) -> float:
        """Time spent in forward and backward passes (from :attr:`durations`)."""
        return sum(sum(self.durations.get(code, ())) for code in ("F", "B", "W", "BW"))


@dataclass
class EvalResult:
    """What one evaluation left on a worker.

    Attributes:
        by_pipeline: per pipeline, the per-micro-batch values (losses, or outputs) this worker
            computed on the last stage, by micro-batch: :attr:`total` sums each pipeline's in
            micro-batch order, in their dtype, as that pipeline's own last stage would fault-free.
        count: how many micro-batches it evaluated on the last stage.
        own: its own pipeline's per-micro-batch values, in micro-batch order (last stage).
        last_outputs: the stage outputs of the last of its own pipeline's micro-batches (last stage).
    """

    by_pipeline: dict = field(default_factory=dict)
    count: int = 0
    own: list = field(default_factory=list)
    last_outputs: Any = None

    @property
    def total(self) -> Any:
        """The sum over the pipelines' sums, in float64 (``None`` when none was computed): a worker
        that ran a failed peer's micro-batches adds that pipeline's sum as the peer would have
        computed it, so the reduced mean equals the fault-free one (one float32 running sum over
        both pipelines' values would round differently)."""
        if not self.by_pipeline:
            return None
        sums = []
        for p in sorted(self.by_pipeline):  # each pipeline's values summed in micro-batch order
            values = [self.by_pipeline[p][m] for m in sorted(self.by_pipeline[p])]
            acc = values[0].clone() if torch.is_tensor(values[0]) else [v.clone() for v in values[0]]
            for v in values[1:]:
                acc = acc + v if torch.is_tensor(acc) else [t + x for t, x in zip(acc, v)]
            sums.append(acc)
        if torch.is_tensor(sums[0]):
            return torch.stack([v.to(torch.float64) for v in sums]).sum(0)
        return [torch.stack([v[i].to(torch.float64) for v in sums]).sum(0) for i in range(len(sums[0]))]


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """Where a worker sits in the grid and the rules every iteration follows.

    Attributes:
        stage, pipeline: this worker's position; ``num_stages`` the pipeline depth.
        dp, microbatches: the grid (micro-batches per pipeline).
        seed: base of the per-micro-batch RNG streams (``resilience.seed``).
        gradient_clipping: max global gradient norm (0 = off).
        timeout_s: how long a message or collective may wait.
        dynamic_shapes: activation shapes may change from one micro-batch to the next (the shape
            travels with every message).
        mark_inputs: the first stage's floating-point inputs require grad (what DeepSpeed does when
            reentrant activation checkpointing is on).
        device: where the stage computes; loaded micro-batches are moved there ("cpu": as loaded).
    """

    stage: int
    pipeline: int
    num_stages: int
    dp: int
    microbatches: int
    seed: int = 1234
    gradient_clipping: float = 0.0
    timeout_s: float = 300.0
    dynamic_shapes: bool = False
    mark_inputs: bool = False
    device: str = "cpu"


def squared_norm(grads: Sequence[torch.Tensor]) -> float:
    """The squared L2 norm of ``grads`` together, the same bits wherever it is computed.

    Each tensor's norm in float32 (``torch.linalg.vector_norm``, no copy of the gradient), the
    per-tensor squares summed in float64 in list order. A float64 copy of every gradient (the
    earlier way) cost 0.28 s per step on 40M parameters, 14x the optimizer step itself. The
    speculative step and the barrier's both use this function, so they agree bitwise. A tensor whose
    float32 norm overflows while its values are finite is summed again in float64 (no spurious
    "infinite norm", which would read as an overflow or leave a huge gradient unclipped).
    """
    if not grads:
        return 0.0
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    total = torch.stack(norms).to(torch.float64).pow(2)
    finite = torch.isfinite(total)
    if not bool(finite.all()):
        for i in torch.nonzero(~finite).flatten().tolist():
            g = grads[i]
            if bool(torch.isfinite(g).all()):
                total[i] = g.detach().to(torch.float64).pow(2).sum()
    return float(total.sum())


class ExecutorHooks:
    """What another component may add around the executor's actions (no-ops by default)."""

    def action_window(self, index: int) -> ContextManager[None]:
        """Context around the ``index``-th action of the iteration (the replication gate)."""
        return contextlib.nullcontext()

    def before_step(self, speculative: bool = False) -> None:
        """Right before the stage's optimizer step changes the parameters; ``speculative``: the
        step may be undone (:meth:`undo_step`) once validated, so its pre-step state is needed."""

    def after_step(self) -> None:
        """Right after the stage's optimizer step, once it is final (and the counters moved)."""

    def undo_step(self) -> None:
        """Put the stage back to the state before its last optimizer step (a wrong speculation)."""
        raise ResilienceError("this executor's hooks cannot undo an optimizer step")


class Executor:
    """Executes one worker's actions for a stage module.

    Args:
        spec: the worker's position and the iteration's rules.
        module: the stage's callable (its layers); called as ``module(inputs)``.
        parameters: the stage's trainable parameters.
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage.
        batch_source: loads any pipeline's micro-batch (first and last stages).
        rank_of: worker index (``stage * dp + pipeline``) -> global rank.
        step: the stage's optimizer step (the clip coefficient already applied to the gradients).
        forward_fn: optional wrapper ``forward_fn(inputs) -> outputs`` (e.g. DeepSpeed's forward).
        recompute: activation checkpointing, at stage granularity: the stage's forward without
            checkpointing. F then runs it under ``no_grad`` (between F and B the stage keeps only
            its inputs) and B runs it again, under the micro-batch's own RNG stream (same dropout
            masks), to build the graph that B and W split as usual. Neither B nor W enters a
            checkpoint function, so reentrant and non-reentrant checkpointing both work with the
            split, and W keeps what B recomputed (as many as the plan's pending-W cap allows).
        fault_hook: ``fault_hook(point, iteration)`` at the fault-injection points (tests, demos).
        hooks: see :class:`ExecutorHooks`.
        precision: mixed precision (``runtime.precision.MixedPrecisionOptimizer``): gradients are
            folded into its fp32 masters after every micro-batch's W, reduced, clipped and stepped
            there; on fp16 the last stage's loss is scaled by its loss scale.
        validator: clipping and overflow agreement without a barrier (``runtime.validation``).
        zero_grad: clears every gradient the stage holds (default: ``.grad = None``).
        tied: tied group index -> this stage's parameters of that group (its copies of the tied
            module's tied weights). They leave REDUCE_GRAD: TIED_REDUCE sums them over every
            surviving worker of the group's stages. ``counted_tied`` lists the groups whose copies
            this stage counts in the global gradient norm (the first stage of each group), so a
            tied weight is counted once.
        counted_param: which of the stage's parameters this worker counts in the global gradient
            norm (default: all but the uncounted tied copies); with tensor parallelism a rank > 0
            leaves out the parameters every rank of the group holds whole.
    """

    def __init__(self, spec: StageSpec, *, module: Callable[[Any], Any], parameters: Sequence[torch.nn.Parameter],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, batch_source: BatchSource | None,
                 rank_of: Callable[[int], int], step: Callable[[], None],
                 forward_fn: Callable[[Any], Any] | None = None, recompute: Callable[[Any], Any] | None = None,
                 fault_hook: Callable[[str, int], None] | None = None, hooks: ExecutorHooks | None = None,
                 tied: dict[int, Sequence[torch.nn.Parameter]] | None = None,
                 counted_tied: Sequence[int] = (), precision: Any = None, validator: Any = None,
                 zero_grad: Callable[[], None] | None = None,
                 counted_param: Callable[[torch.nn.Parameter], bool] | None = None) -> None:
        self.spec = spec
        self.stage, self.pipeline = spec.stage, spec.pipeline
        self.num_stages, self.dp, self.microbatches = spec.num_stages, spec.dp, spec.microbatches
        self.module = module
        self.parameters = list(parameters)
        self.loss_fn = loss_fn
        self.batch_source = batch_source
        self.rank_of = rank_of
        self.step_fn = step
        self.forward_fn = forward_fn
        self.recompute = recompute
        self.fault_hook = fault_hook
        self.hooks = hooks or ExecutorHooks()
        self.precision = precision
        self.validator = validator
        self._zero_grad = zero_grad
        # where the reduced gradients live: the fp32 masters under mixed precision, else the parameters
        master = (lambda p: precision.master_of[id(p)]) if precision is not None else (lambda p: p)
        self.grad_parameters = [master(p) for p in self.parameters]
        self.tied = {g: [master(p) for p in ps] for g, ps in (tied or {}).items()}
        tied_ids = {id(p) for ps in self.tied.values() for p in ps}
        self.untied = [p for p in self.grad_parameters if id(p) not in tied_ids]
        uncounted = {id(p) for g, ps in self.tied.items() if g not in set(counted_tied) for p in ps}
        if counted_param is not None:  # e.g. a tensor-parallel rank > 0 skips the parameters every rank duplicates
            uncounted |= {id(master(p)) for p in self.parameters if not counted_param(p)}
        self.counted = [p for p in self.grad_parameters if id(p) not in uncounted]
        self.last_grad_norm: float | None = None
        self.pending: int | None = None  # the iteration whose speculative step awaits validation
        # the "ready" path: a stage that finds every stage's norm published when it publishes its own
        # (the last to reduce, stage 0 in a healthy pipeline) steps exactly at once, with no wait and no
        # pre-step copy. Off where every replica of a stage must choose alike (ZeRO-1's collective steps)
        self.ready_path = True
        self.groups: GenerationGroups | None = None
        self.messenger: Messenger | None = None
        self.iteration = 0
        self.current: tuple[int, int, int] | None = None  # (pipeline, iteration, micro-batch) being computed
        self.cursor = 0  # index of the next action within the iteration
        self._actions: tuple[Action, ...] = ()  # this iteration's actions (for early receive posts)
        self._posts: dict[int, tuple[int, ...]] = {}  # action index -> receives posted right before it
        self._posted: dict[int, Any] = {}  # receive index -> its posted receive (comm.p2p.Posted or None)
        self.progress: Progress | None = None  # the main thread's progress, for hang detection
        self.stats = IterationStats()
        self.count_w_bytes = False  # peak pending-W bytes in the stats (a profile sets it: it costs a graph walk per B)
        # the fraction of its own speed its forward and backward passes run at now (an injected
        # ``slow`` fault: runtime/faults.py); None: full speed
        self.speed: Callable[[], float] | None = None
        self.fast_w = True  # W without autograd where bw_split can (resilience.fast_w)
        self.wstore = WeightGradStore(count_bytes=False)
        self._inputs: dict = {}
        self._outputs: dict = {}
        self._grads_out: dict = {}
        self._received: dict = {}
        self._labels: dict = {}
        self.handlers: dict[ActionKind, Callable[[Action], None]] = {
            ActionKind.F: self.forward,
            ActionKind.B: self.backward_input,
            ActionKind.W: self.backward_weight,
            ActionKind.BW: self.backward_fused,
            ActionKind.SEND_ACT: self.send_activation,
            ActionKind.RECV_ACT: self.recv_activation,
            ActionKind.SEND_GRAD: self.send_grad,
            ActionKind.RECV_GRAD: self.recv_grad,
            ActionKind.REDUCE_GRAD: self.reduce_grads,
            ActionKind.TIED_REDUCE: self.reduce_tied_grads,
            ActionKind.OPT_STEP: self.optimizer_step,
        }
        """The one dispatch table: every compute and communication kind a training schedule uses."""

    # --- the generation's groups ---------------------------------------------------------------
    def install(self, groups: GenerationGroups | None) -> None:
        """Use ``groups`` (a new membership generation's) for every message and collective;
        ``None``: this worker is out of the membership (it idles)."""
        self.groups = groups
        self.messenger = (Messenger(group=groups.world, timeout_s=self.spec.timeout_s, dynamic=self.spec.dynamic_shapes)
                          if groups is not None else None)

    @property
    def stage_replicas(self) -> int:
        return len(self.groups.stage) if self.groups is not None else 1

    # --- driving ---------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def begin_iteration(self, iteration: int, actions: Sequence[Action] = (),
                        posts: dict[int, tuple[int, ...]] | None = None) -> None:
        """Start an iteration of ``actions``; ``posts``: action index -> receive indices to post
        right before it (:func:`ds_resilience.ir.pairs.early_posts`, NCCL's pair order)."""
        self.iteration = iteration
        self._actions = tuple(actions)
        self._posts = posts or {}
        self._posted = {}
        self.cursor = 0
        self.stats = IterationStats()
        self.wstore = WeightGradStore(count_bytes=self.count_w_bytes)  # fresh peaks per iteration

    def run(self, actions: Sequence[Action]) -> IterationStats:
        """Run a whole action list (one iteration) through the handler table, between
        :meth:`begin_iteration` (which names its early receive posts) and :meth:`end_iteration`
        (``LiveStage.iteration`` calls both)."""
        started = time.perf_counter()
        for action in actions:
            self.execute(action)
        self.stats.seconds = time.perf_counter() - started
        return self.stats

    def execute(self, action: Action) -> None:
        """Run one action through the table (timed; inside the hooks' window for its index)."""
        handler = self.handlers.get(action.kind)
        if handler is None:
            raise ResilienceError(f"the executor has no handler for {action.kind.name} ({action})")
        index = self.cursor
        self.cursor += 1
        for r in self._posts.get(index, ()):
            self._post_early(r)
        t0 = time.perf_counter()
        progress = self.progress
        if progress is None:
            with self.hooks.action_window(index):
                handler(action)
        else:  # hang detection: compute is timed, a wait on peers is not (runtime/progress.py)
            progress.advance(f"step {index} ({action})")
            with self.hooks.action_window(index), (progress.waiting() if action.kind in _PEER_WAITS else contextlib.nullcontext()):
                handler(action)
        if self.speed is not None and action.kind in _COMPUTE and (speed := self.speed()) < 1.0:
            time.sleep((time.perf_counter() - t0) * (1.0 / speed - 1.0))  # a fail-slow worker
        self.stats.durations.setdefault(action.kind.value, []).append(time.perf_counter() - t0)

    def reset(self) -> None:
        """Drop everything an interrupted iteration left behind (activations, pending W, sends,
        partial gradients)."""
        if self.pending is None:  # a step awaiting validation keeps its gradients (no forward ran since)
            for p in self.parameters + self.grad_parameters:
                p.grad = None
        self._inputs.clear()
        self._outputs.clear()
        self._grads_out.clear()
        self._received.clear()
        self._labels.clear()
        self.wstore = WeightGradStore(count_bytes=self.count_w_bytes)
        self.cursor = 0
        self._posted.clear()  # receives posted on the abandoned iteration's groups
        if self.messenger is not None:
            self.messenger.drop_pending()

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point, self.iteration)

    def end_iteration(self) -> None:
        """Wait for posted sends and check nothing is left over."""
        self.messenger.wait_sends()
        self.wstore.assert_empty()
        left = [k for d in (self._inputs, self._outputs, self._grads_out, self._received, self._labels) for k in d]
        if left:
            raise ResilienceError(f"worker p{self.pipeline}s{self.stage}: iteration ended with state left for {left[:4]}")
        self.stats.peak_pending_w = self.wstore.peak_count
        self.stats.peak_pending_w_bytes = self.wstore.peak_bytes

    # --- compute -----------------------------------------------------------------------------
    def _load(self, pipeline: int, microbatch: int) -> tuple[Any, Any]:
        if self.batch_source is None:
            raise ResilienceError("this worker needs micro-batches but no batch_source was given")
        return self._on_device(self.batch_source(pipeline, self.iteration, microbatch))

    def _on_device(self, item: tuple[Any, Any]) -> tuple[Any, Any]:
        """A data loader yields host tensors; the stage computes on its device."""
        inputs, labels = item
        if self.spec.device != "cpu":
            inputs, labels = _to_device(inputs, self.spec.device), _to_device(labels, self.spec.device)
        return inputs, labels

    def forward(self, a: Action) -> None:
        self._fault("before_forward")
        key = (a.pipeline, a.microbatch)
        labels = None
        if self.is_first:
            inputs, labels = self._load(a.pipeline, a.microbatch)
            inputs = tuple(t.clone() if torch.is_tensor(t) else t for t in _as_tuple(inputs))
            if self.spec.mark_inputs:
                for t in inputs:
                    if torch.is_tensor(t) and t.is_floating_point():
                        t.requires_grad_(True)
        else:
            inputs = tuple(self._received.pop(("act",) + key))
        if self.is_last and labels is None:
            _, labels = self._load(a.pipeline, a.microbatch)
        if self.recompute is not None:
            with torch.no_grad():
                outputs, loss = self._compute(a, inputs, labels, self.recompute)
            if self.is_last:
                self._labels[key] = labels
        else:
            outputs, loss = self._compute(a, inputs, labels, self.forward_fn or self.module)
        if loss is not None:
            self.stats.loss_sum += float(loss.detach())
            self.stats.losses += 1
            self.stats.loss_dtype = loss.dtype
        self._inputs[key] = inputs
        self._outputs[key] = outputs
        self.stats.forwards += 1
        self.stats.rerouted += int(a.pipeline != self.pipeline)

    def _compute(self, a: Action, inputs: tuple, labels: Any, fn: Callable[[Any], Any]) -> tuple[Any, Any]:
        """The stage's forward under the micro-batch's RNG stream; on the last stage, the loss too.

        Returns ``(outputs, loss)``: on the last stage ``outputs`` is the loss scaled by the global
        micro-batch count, what its backward starts from."""
        arg = inputs[0] if len(inputs) == 1 else inputs
        self.current = (a.pipeline, self.iteration, a.microbatch)  # read by integrations that load data themselves
        with _fork_rng(self.spec.device):
            _seed_stage_rng(self.spec.device, _rng_seed(self.spec.seed, self.iteration, a.pipeline, a.microbatch,
                                                        self.stage))
            outputs = fn(arg)
        if not self.is_last:
            return outputs, None
        if self.loss_fn is None:
            raise ResilienceError("the last stage needs a loss_fn")
        loss = self.loss_fn(outputs, labels)
        scale = self.precision.loss_scale if self.precision is not None else 1.0
        return loss * (scale / (self.dp * self.microbatches)), loss

    def _backward_args(self, a: Action):
        key = (a.pipeline, a.microbatch)
        inputs = self._inputs.pop(key)
        outputs = self._outputs.pop(key)
        if self.recompute is not None:  # activation checkpointing: the graph is built now
            outputs, _ = self._compute(a, inputs, self._labels.pop(key, None), self.recompute)
        grads = None if self.is_last else self._received.pop(("grad",) + key)
        out_t = [t for t in _as_tuple(outputs) if torch.is_tensor(t) and t.requires_grad]
        if grads is not None and len(grads) != len(out_t):
            raise ResilienceError(f"received {len(grads)} gradients for {len(out_t)} outputs of {key}")
        grad_inputs = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
        return out_t, grads, grad_inputs

    def backward_input(self, a: Action) -> None:
        key = (a.pipeline, a.microbatch)
        outputs, grads, inputs = self._backward_args(a)
        input_grads, pending = backward_input(outputs, grads, inputs, list(self.parameters), fast_linear=self.fast_w)
        self._fault("mid_backward")
        self.wstore.put(key, pending)
        if not self.is_first:
            self._grads_out[key] = [g for g in input_grads if g is not None]

    def backward_weight(self, a: Action) -> None:
        self.wstore.pop((a.pipeline, a.microbatch))
        if self.precision is not None:
            self.precision.accumulate()

    def backward_fused(self, a: Action) -> None:
        key = (a.pipeline, a.microbatch)
        outputs, grads, inputs = self._backward_args(a)
        input_grads = backward_fused(outputs, grads, inputs, list(self.parameters))
        if self.precision is not None:
            self.precision.accumulate()
        self._fault("mid_backward")
        if not self.is_first:
            self._grads_out[key] = [g for g in input_grads if g is not None]

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, actions: Sequence[Action], *, load: Callable[[int, int], tuple[Any, Any]], microbatches: int,
                 compute_loss: bool = True) -> EvalResult:
        """Run a forward-only action list (``planning.inference``) without autograd.

        ``load(pipeline, microbatch)`` gives an evaluation micro-batch ``(inputs, labels)``. On the
        last stage each micro-batch's value is ``loss_fn(outputs, labels)`` (or the outputs with
        ``compute_loss=False``). Messages carry their shapes (evaluation batches may differ from
        training's) on the evaluation channel, apart from training's tags.
        """
        messenger = Messenger(group=self.groups.world, timeout_s=self.spec.timeout_s, dynamic=True)
        received: dict[tuple[int, int], list] = {}
        outputs_of: dict[tuple[int, int], Any] = {}
        result = EvalResult()

        def tag(a: Action) -> int:
            return message_tag("eval", a.pipeline, a.microbatch, 0, dp=self.dp, microbatches=microbatches)

        with torch.no_grad():
            for a in actions:
                key = (a.pipeline, a.microbatch)
                if a.kind is ActionKind.RECV_ACT:
                    received[key] = messenger.recv(self.rank_of(a.peer), tag(a), f"eval{a.stage - 1}")
                elif a.kind is ActionKind.SEND_ACT:
                    tensors = [t for t in _as_tuple(outputs_of.pop(key)) if torch.is_tensor(t)]
                    messenger.send(tensors, self.rank_of(a.peer), tag(a), f"eval{a.stage}")
                elif a.kind is ActionKind.F:
                    labels = None
                    if self.is_first:
                        inputs, labels = self._on_device(load(a.pipeline, a.microbatch))
                        # a copy, as DeepSpeed loads one: partitioned activation checkpointing
                        # empties its input's storage, and an iterator may yield one tensor again
                        inputs = tuple(t.clone() if torch.is_tensor(t) else t for t in _as_tuple(inputs))
                    else:
                        inputs = tuple(received.pop(key))
                    if self.is_last and labels is None:
                        _, labels = self._on_device(load(a.pipeline, a.microbatch))
                    self.current = (a.pipeline, self.iteration, a.microbatch)
                    # without autograd a checkpoint saves nothing: the stage's forward without it
                    # (DeepSpeed's partitioned, contiguous checkpoints would fill buffers sized for
                    # one backward's worth of forwards: vanilla resets them after each)
                    forward = self.recompute or self.forward_fn or self.module
                    outputs = forward(inputs[0] if len(inputs) == 1 else inputs)
                    if not self.is_last:
                        outputs_of[key] = outputs
                        continue
                    value = self.loss_fn(outputs, labels) if compute_loss and self.loss_fn is not None else outputs
                    value = value.detach() if torch.is_tensor(value) else [v.detach() for v in value]
                    result.by_pipeline.setdefault(a.pipeline, {})[a.microbatch] = value
                    result.count += 1
                    if a.pipeline == self.pipeline:
                        result.own.append(value)
                        result.last_outputs = outputs
                else:
                    raise ResilienceError(f"an evaluation runs forward passes and activations only, not {a}")
        messenger.wait_sends()
        return result

    # --- messages ----------------------------------------------------------------------------
    def _tag(self, channel: str, a: Action) -> int:
        return message_tag(channel, a.pipeline, a.microbatch, 0, dp=self.dp, microbatches=self.microbatches)

    def _post_early(self, index: int) -> None:
        """Post the receive at ``index`` of this iteration's actions now (it is waited for there)."""
        a = self._actions[index]
        if a.kind is ActionKind.RECV_ACT:
            self._posted[index] = self.messenger.post(self.rank_of(a.peer), self._tag("act", a), f"act{a.stage - 1}")
        elif a.kind is ActionKind.RECV_GRAD:
            self._posted[index] = self.messenger.post(self.rank_of(a.peer), self._tag("grad", a), f"grad{a.stage + 1}")
        else:
            raise ResilienceError(f"early post of {a} (step {index}): only receives can be posted early")

    def send_activation(self, a: Action) -> None:
        outputs = self._outputs[(a.pipeline, a.microbatch)]
        tensors = [t for t in _as_tuple(outputs) if torch.is_tensor(t)]
        self.messenger.send(tensors, self.rank_of(a.peer), self._tag("act", a), f"act{a.stage}")

    def recv_activation(self, a: Action) -> None:
        tensors = self.messenger.recv(self.rank_of(a.peer), self._tag("act", a), f"act{a.stage - 1}",
                                      posted=self._posted.pop(self.cursor - 1, None))
        for t in tensors:
            if t.is_floating_point():
                t.requires_grad_(True)
        self._received[("act", a.pipeline, a.microbatch)] = tensors

    def send_grad(self, a: Action) -> None:
        grads = self._grads_out.pop((a.pipeline, a.microbatch))
        self.messenger.send(grads, self.rank_of(a.peer), self._tag("grad", a), f"grad{a.stage}")

    def recv_grad(self, a: Action) -> None:
        self._received[("grad", a.pipeline, a.microbatch)] = self.messenger.recv(
            self.rank_of(a.peer), self._tag("grad", a), f"grad{a.stage + 1}", posted=self._posted.pop(self.cursor - 1, None)
        )

    # --- optimizer ---------------------------------------------------------------------------
    def _grads(self, params: Sequence[torch.nn.Parameter] | None = None) -> list[torch.Tensor]:
        out = []
        for p in self.grad_parameters if params is None else params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    @staticmethod
    def _all_reduce(group, grads: list[torch.Tensor]) -> None:
        """One flat all-reduce (sum) of ``grads`` over ``group``."""
        if not grads or group is None or len(group) <= 1:
            return
        group.all_reduce_flat(grads)

    def reduce_grads(self, a: Action) -> None:
        """Sum this stage's gradients over its surviving replicas (one flat all-reduce)."""
        self._fault("in_reduce")
        if self.grad_parameters and self.stats.forwards and all(p.grad is None for p in self.grad_parameters):
            raise ResilienceError(
                f"worker p{self.pipeline}s{self.stage}: none of the stage's {len(self.parameters)} trainable "
                f"parameters received a gradient in iteration {self.iteration} (an autograd graph cut between the "
                f"stage's inputs and its parameters?); training would silently not move them")
        self._grads()
        self._all_reduce(self.groups.stage if self.groups is not None else None, self._grads(self.untied))

    def reduce_tied_grads(self, a: Action) -> None:
        """Sum the tied weights' gradients of group ``a.tied_group`` over every surviving worker of
        the group's stages (they left REDUCE_GRAD; each copy then holds the sum over every
        micro-batch of every use, DeepSpeed's ReduceTiedGrads followed by its data-parallel reduce)."""
        g = a.tied_group
        if g not in self.tied or g not in self.groups.tied:
            raise ResilienceError(f"worker p{self.pipeline}s{self.stage}: {a} names tied group {g}, which this "
                                  f"stage does not hold (its groups: {sorted(self.tied)})")
        self._all_reduce(self.groups.tied[g], self._grads(self.tied[g]))

    def global_grad_norm(self) -> float:
        """sqrt(sum over stages of the stage's squared gradient norm), from all survivors."""
        local = squared_norm(self._grads(self.counted))
        share = torch.tensor([local / self.stage_replicas], dtype=torch.float64)
        self.groups.world.all_reduce(share)
        return float(share.item()) ** 0.5

    def optimizer_step(self, a: Action) -> None:
        """The stage's optimizer step, on its own (see ``runtime/validation.py`` for clipping and
        fp16 overflow: a speculative step now, validated before the next forward)."""
        self._fault("in_optimizer")
        v = self.validator
        if v is None or not v.active:
            clip = self.spec.gradient_clipping
            if clip > 0:  # without a validator: the global norm with a barrier over every survivor
                norm = self.last_grad_norm = self.global_grad_norm()
                coef = clip / (norm + 1e-6)
                if coef < 1.0:
                    for g in self._grads():
                        g.mul_(coef)
            self._step()
            return
        sq = squared_norm(self._grads(self.counted))
        overflow = self.precision.overflow() if self.precision is not None else False
        v.publish(self.iteration, self.stage, sq, overflow)
        decision = v.ready(self.iteration) if self.ready_path else None
        if decision is not None:  # every stage's value is in already: the exact step, now
            v.record(self.iteration, "ready")
            self._apply(decision)
            return
        if v.should_speculate(sq, overflow, self.iteration):
            self.hooks.before_step(speculative=True)
            self.step_fn(zero_grad=False)  # the gradients stay until the step is validated
            self.pending = self.iteration
            return
        decision = v.decide(self.iteration)
        v.record(self.iteration, "waited")
        self._apply(decision)

    def resolve(self) -> None:
        """Validate a speculative step (call before the next forward, save or evaluation): keep it,
        or roll it back and redo it exactly (clipped, or skipped on an overflow)."""
        if self.pending is None:
            return
        iteration, self.pending = self.pending, None
        t0 = time.perf_counter()
        decision = self.validator.decide(iteration)
        self.stats.durations.setdefault("VAL", []).append(time.perf_counter() - t0)
        self.last_grad_norm = decision.norm
        if decision.speculation_holds:
            self.validator.record(iteration, "speculated")
            if self.precision is not None and self.precision.scaler is not None:
                self.precision.scaler.update(False)
            self.zero_grad()
            self.hooks.after_step()
            return
        self.validator.record(iteration, "rolled back")
        saved = [p.grad for p in self.grad_parameters]
        t0 = time.perf_counter()
        self.hooks.undo_step()
        self.stats.durations.setdefault("UNDO", []).append(time.perf_counter() - t0)
        for p, g in zip(self.grad_parameters, saved):
            p.grad = g
        self._apply(decision)

    def forget_pending(self) -> None:
        """A recovery rolled this stage back past its speculative step: nothing to validate."""
        self.pending = None

    def _apply(self, decision) -> None:
        """The exact step: skipped on a global overflow, else scaled by the clip coefficient."""
        self.last_grad_norm = decision.norm
        scaler = self.precision.scaler if self.precision is not None else None
        if decision.overflow:
            self.hooks.before_step()
            self.step_fn(skip=True)
            if self.precision is not None:
                self.precision.skip()
            if scaler is not None:
                scaler.update(True)
            self.hooks.after_step()
            return
        if decision.coef < 1.0:
            if self.validator is not None:
                self.validator.clipped += 1
            for g in self._grads():
                g.mul_(decision.coef)
        self._step()
        if scaler is not None:
            scaler.update(False)

    def _step(self) -> None:
        self.hooks.before_step()
        self.step_fn()
        self.hooks.after_step()

    def zero_grad(self) -> None:
        if self._zero_grad is not None:
            self._zero_grad()
        for p in self.parameters + self.grad_parameters:
            p.grad = None
