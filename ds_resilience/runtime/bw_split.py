"""Decoupled backward: B (input gradient, now) and W (weight gradient, later) for any stage.

B runs one autograd pass from the stage outputs to its inputs; a pre-hook on each *boundary node*
(a node on the input-gradient path that a parameter feeds directly) captures the gradient arriving
there. W seeds those nodes with the captured gradients and runs autograd over the parameter side
only, so the shared part of the backward is not recomputed. The idea is that of torch's private
``torch.distributed.pipelining._backward``, re-written on the public graph API because that module
writes ``inp.grad``, ``detach_()``-es the outputs (fails on views), drops parameters that reach an
output without crossing the input path, and frees buffers that a later group needs when tied weights
cross.

Modes of :class:`PendingW`: ``"split"`` (above); ``"full"`` when no input needs a gradient (first
stage: B has nothing to send, W is the whole parameter backward); ``"recompute"``, the fallback when
the split cannot be used (a non-leaf input, an input that is also a parameter, or a torch without
``GradientEdge``): B is ``autograd.grad(..., retain_graph=True)`` and W re-runs the backward
restricted to the parameters; ``"empty"`` when nothing needs a gradient. W always accumulates through
autograd's ``AccumulateGrad``: ``.grad`` semantics and grad hooks are those of ``loss.backward()``,
with one exception, the fast W's (:mod:`.fast_w`: linear and megatron-core linear layers,
LayerNorms, parameters that scale or shift an activation): in "split" mode a group that is exactly one
``nn.Linear``'s weight (and bias) behind one ``AddmmBackward0``/``MmBackward0`` boundary node, with
plain saved tensors and parameters without tensor hooks, gets its W as ``grad_out^T @ input`` (and
``grad_out`` summed for the bias) from the gradient captured in B and the input autograd saved,
with no second trip through autograd: the same kernels autograd runs, so the same bits (a test holds
it). A LayerNorm's weight and bias get theirs from ``native_layer_norm_backward``, the kernel its
node calls, asked for gamma and beta only, on the input and statistics the forward saved (the same
bits). ``autograd.backward`` from a boundary node walks the whole graph below it to find what to
run, once per group, and that walk, not the arithmetic, was most of what made B + W cost more than
a fused backward. The fast W's hold detached tensors, no node: when every group has one, B does
not retain the graph, and what a pending W holds is what its products read.
The boundary nodes, the W groups and the structural half of the fast-W test depend only on the
graph's structure, so they are worked out once per structural key (node types and edges in BFS
order, which leaves are the call's parameters and inputs) and reused for every later micro-batch
with the same key; B then costs one listing of the graph, the pre-hooks and the pass itself.
Callers should drop the stage outputs after B; in "split" mode W then frees the whole graph.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node

from ..errors import BackwardSplitError
from .fast_w import FastW, fast_spec, fast_w

try:  # public since torch 2.4; without it every stage takes the "recompute" fallback
    from torch.autograd.graph import GradientEdge, get_gradient_edge

    _HAS_EDGE_API = True
except ImportError:  # pragma: no cover - the tests monkeypatch _HAS_EDGE_API instead
    _HAS_EDGE_API = False

__all__ = ["BackwardSplitError", "PendingW", "Strategy", "WeightGradStore",
           "backward_fused", "backward_input", "backward_weight"]

Strategy = Literal["auto", "split", "recompute"]


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)


class PendingW:
    """What W needs for one micro-batch; made by :func:`backward_input`, consumed once.

    ``nbytes`` sums distinct storages (whole storage, once each; parameters' storages excluded) of
    (a) the gradients captured for W: boundary-node gradients in "split" mode, the output gradients
    in "full"/"recompute" mode, and (b) the activations saved in every autograd node this object
    keeps alive, read from the nodes' raw saved tensors without unpacking (behind saved-tensor hooks
    only a packed tensor or tuple of tensors is seen). The stage input counts when a layer saved it;
    output-side nodes kept alive only by the caller's references to the outputs do not. Computed on
    first access; 0 after W.
    """

    def __init__(self, mode: str, params: list[Tensor], *, groups: Iterable[tuple] = (),
                 outputs: Iterable[Tensor] = (), grads: Iterable[Tensor] = (), keep: Any = None) -> None:
        self._mode, self._params, self._done = mode, params, mode == "empty"
        self._groups = list(groups)  # (params, seed edges, seed grads, clamps [(node, grads)])
        self._fast: list[FastW] = []  # "split" mode's groups that skip autograd
        self._outputs, self._grads = list(outputs), list(grads)  # "full"/"recompute" modes
        self._keep = keep  # output edges owning Python-function boundary nodes (older torch)
        self._nbytes: int | None = None

    @property
    def mode(self) -> str:
        """``"split"``, ``"full"``, ``"recompute"`` or ``"empty"``."""
        return self._mode

    @property
    def done(self) -> bool:
        """True once W has run (or when there was nothing to do)."""
        return self._done

    @property
    def nbytes(self) -> int:
        """Bytes kept alive for W (see the class docstring); 0 after W."""
        if self._done:
            return 0
        if self._nbytes is None:
            self._nbytes = self._count_bytes()
        return self._nbytes

    def _count_bytes(self) -> int:
        params = {p.untyped_storage().data_ptr() for p in self._params}
        sizes: dict[tuple, int] = {}
        nodes = [o.grad_fn for o in self._outputs]
        tensors = list(self._grads)
        for _, edges, seeds, clamps in self._groups:
            nodes += [e.node for e in edges] + [n for n, _ in clamps]
            tensors += list(_tensors_in(seeds))
        for lw in self._fast:
            tensors += lw.tensors()
        seen: set[Node] = set()
        queue = deque(n for n in nodes if n is not None)
        while queue:
            node = queue.popleft()
            if node not in seen:
                seen.add(node)
                for name in _saved_names(node):
                    raw = getattr(node, name, None)
                    for saved in raw if isinstance(raw, (tuple, list)) else (raw,):
                        tensors += list(_tensors_in(getattr(saved, "data", None)))
                queue.extend(n for n, _ in node.next_functions if n is not None)
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                sizes[(str(t.device), st.data_ptr())] = st.nbytes()
        return sum(sizes.values())

    def __repr__(self) -> str:
        return f"PendingW(mode={self._mode!r}, done={self._done}, params={len(self._params)})"


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node: Node) -> tuple[str, ...]:
    """The ``_raw_saved_*`` attributes of ``node``'s type (``dir`` once per type: it costs about
    20 us a call, and a stage's graph has hundreds of nodes per micro-batch)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = _SAVED_NAMES[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    return names


def _output_pairs(outputs: Any, grad_outputs: Any) -> tuple[list[Tensor], list[Tensor]]:
    """Flatten outputs needing a gradient and their gradients. ``grad_outputs=None``: ones for all
    (a scalar loss gets 1.0); a ``None`` entry: that output sends no gradient; non-tensors ignored."""
    outs: list[Tensor] = []
    grads: list[Tensor] = []

    def visit(out: Any, grad: Any, implicit: bool) -> None:
        if isinstance(out, Tensor):
            grad = grad[0] if isinstance(grad, (tuple, list)) and len(grad) == 1 else grad
            if out.requires_grad and (implicit or grad is not None):
                if grad is not None and not isinstance(grad, Tensor):
                    raise BackwardSplitError(f"an output gradient must be a Tensor, not {type(grad).__name__}")
                outs.append(out)
                grads.append(torch.ones_like(out) if grad is None else grad)
        elif isinstance(out, (tuple, list, dict)):
            items = list(out.items()) if isinstance(out, dict) else list(enumerate(out))
            if not implicit and grad is not None and (
                    isinstance(out, dict) != isinstance(grad, dict) or len(grad) != len(out)):
                raise BackwardSplitError(f"grad_outputs does not match the {len(out)} outputs")
            for k, o in items:
                if implicit or grad is not None:
                    visit(o, None if implicit else grad[k], implicit)

    visit(outputs, grad_outputs, grad_outputs is None)
    return outs, grads


def _prepare(outputs: Any, grad_outputs: Any, inputs: Any, params: Iterable[Tensor]):
    outs, grads = _output_pairs(outputs, grad_outputs)
    ins = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    idx = [i for i, x in enumerate(ins) if isinstance(x, Tensor) and x.requires_grad]
    plist = list({id(p): p for p in params if isinstance(p, Tensor) and p.requires_grad}.values())
    return outs, grads, ins, idx, plist


def _grad_state(params: list[Tensor]) -> list:
    grads = [p.grad for p in params]
    return [(id(g), g._version) if g is not None else None for g in grads]


def _split_blocker(inputs: list[Tensor], params: list[Tensor]) -> str | None:
    if not _HAS_EDGE_API:
        return "this torch has no torch.autograd.graph.get_gradient_edge"
    if any(not x.is_leaf for x in inputs):
        return "an input is not a leaf (pass x.detach().requires_grad_())"
    if {id(x) for x in inputs} & {id(p) for p in params}:
        return "a tensor is both an input and a parameter"
    return None


def _accumulate_type() -> type:
    leaf = torch.zeros(1, requires_grad=True)
    with torch.enable_grad():
        return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


_ACCUMULATE = _accumulate_type()  # the node type of a leaf's gradient accumulator
_PLANS: dict[tuple, "_SplitPlan"] = {}  # structural key -> analysis (bounded: see _remember)
_PLANS_MAX = 64
_plan_misses = 0  # analyses run (tests read it: the second micro-batch of a stage must not analyse)


class _SplitPlan:
    """The structural part of a split, as indices into the graph's BFS order (so it carries over
    to every graph with the same key): the boundary nodes to capture in B, and per W group its
    parameters (indices into the call's parameter list), its boundary nodes, the outputs that
    reach it without crossing an input, and its fast-W spec (:func:`.fast_w.fast_spec`) or ``None``."""

    __slots__ = ("targets", "groups", "python_nodes")

    def __init__(self, targets: list[int], groups: list[tuple[list[int], list[int], list[int], tuple | None]],
                 python_nodes: bool) -> None:
        self.targets, self.groups, self.python_nodes = targets, groups, python_nodes


def _graph_key(out_edges: list, inputs: list[Tensor], params: list[Tensor]) -> tuple[list[Node], tuple]:
    """The nodes reachable from the outputs in BFS order and a flat key that
    determines the graph: the outputs' (position, output number), then per node its type and
    either its next edges as (position, output number) pairs (-1 for none) or, for a leaf's
    accumulator, which of the call's parameters (0, k) or inputs (1, k) it is (2, -1: neither).
    Two graphs with equal keys are the same graph up to the node objects, with nodes matched by
    position, so an analysis in positions holds for both. (Flat ints: hashing and comparing the
    key stays a few microseconds for hundreds of nodes.)"""
    pid = {id(p): k for k, p in enumerate(params)}
    xid = {id(x): k for k, x in enumerate(inputs)}
    index: dict[Node, int] = {}
    order: list[Node] = []
    for e in out_edges:
        if e.node not in index:
            index[e.node] = len(order)
            order.append(e.node)
    key: list = [len(out_edges)]
    for e in out_edges:
        key += (index[e.node], e.output_nr)
    append, position, grow = key.append, index.get, order.append
    for node in order:  # a list iterator sees the nodes appended below: BFS
        kind = type(node)
        append(kind)
        if kind is _ACCUMULATE:
            v = id(node.variable)
            k = pid.get(v)
            if k is not None:
                key += (0, k)
            else:
                k = xid.get(v)
                key += (2, -1) if k is None else (1, k)
            continue
        nxt = node.next_functions
        append(len(nxt))
        for n, nr in nxt:
            if n is None:
                key += (-1, 0)
                continue
            j = position(n)
            if j is None:
                j = index[n] = len(order)
                grow(n)
            key += (j, nr)
    return order, tuple(key)


def _structure(key: tuple, n: int) -> list[tuple]:
    """Per node of the BFS order: ``("p", k)``/``("x", k)``/``("leaf",)`` for a leaf's accumulator,
    else ``(type, next edges)`` with each edge ``(position, output number)`` or ``None``: the flat
    key of :func:`_graph_key` (``n`` nodes) unpacked, once per key, for the analysis."""
    graph: list[tuple] = []
    i = 1 + 2 * key[0]  # past the outputs
    for _ in range(n):
        kind = key[i]
        if kind is _ACCUMULATE:
            tag, k = key[i + 1], key[i + 2]
            graph.append(("p", k) if tag == 0 else ("x", k) if tag == 1 else ("leaf",))
            i += 3
            continue
        m = key[i + 1]
        pairs = key[i + 2:i + 2 + 2 * m]
        graph.append((kind, tuple(None if pairs[e] == -1 else (pairs[e], pairs[e + 1]) for e in range(0, 2 * m, 2))))
        i += 2 + 2 * m
    return graph


def _analyse(order: list[Node], key: tuple, n_params: int) -> _SplitPlan:
    """The split's structure (see :func:`_split`), in positions of ``order``."""
    global _plan_misses
    _plan_misses += 1
    n = len(order)
    graph = _structure(key, n)
    consumers: list[list[int]] = [[] for _ in range(n)]
    start = [-1] * n_params  # parameter -> its AccumulateGrad's position
    path: set[int] = set()  # the input-gradient path: nodes downstream of an input
    for j, entry in enumerate(graph):
        if entry[0] == "p":
            start[entry[1]] = j
        elif entry[0] == "x":
            path.add(j)
        elif entry[0] != "leaf":
            for e in entry[1]:
                if e is not None:
                    consumers[e[0]].append(j)
    queue = deque(path)
    while queue:
        for c in consumers[queue.popleft()]:
            if c not in path:
                path.add(c)
                queue.append(c)
    outs = [key[1 + 2 * m] for m in range(key[0])]
    roots = set(outs) - path  # outputs that do not depend on any input
    owner: dict[int, dict] = {}
    for k in range(n_params):  # walk forward from each parameter to the input path or such an output
        if start[k] < 0:
            continue  # unused by these outputs: .grad stays as it is, as with loss.backward()
        hits, seen, queue = set(), {start[k]}, deque([start[k]])
        while queue:
            j = queue.popleft()
            if j in roots:
                hits.add(j)
            for c in consumers[j]:
                if c in path:
                    hits.add(c)
                elif c not in seen:
                    seen.add(c)
                    queue.append(c)
        group = {"params": [k], "hits": hits}  # parameters sharing a boundary node share a W pass
        for old in {id(owner[h]): owner[h] for h in hits if h in owner}.values():
            group = {"params": old["params"] + group["params"], "hits": old["hits"] | group["hits"]}
        for h in group["hits"]:
            owner[h] = group
    groups = []
    for g in {id(g): g for g in owner.values()}.values():
        hits = [h for h in sorted(g["hits"]) if h in path]
        root_outs = [m for m, j in enumerate(outs) if j in g["hits"] and j in roots]
        groups.append((g["params"], hits, root_outs, fast_spec(g["params"], hits, root_outs, order, graph)))
    targets = sorted(h for h in owner if h in path)
    python_nodes = any(isinstance(order[h], BackwardCFunction) for h in owner)
    return _SplitPlan(targets, groups, python_nodes)


def _remember(key: tuple, plan: _SplitPlan) -> None:
    if len(_PLANS) >= _PLANS_MAX:  # a stage has a few shapes; a job that keeps making new ones stays bounded
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = plan


def _split(outs: list[Tensor], grads: list[Tensor], inputs: list[Tensor], params: list[Tensor], fast: bool):
    """B in "split" mode: returns (input grads, W groups for autograd, fast W's, keep-alive tokens
    or None); ``fast=False`` sends every group through autograd.

    The boundary nodes and the W groups come from the graph's structure alone: they are found once
    per structural key (:func:`_graph_key`) and reused for every later micro-batch whose graph has
    the same key, so a stage pays a BFS listing per micro-batch, not the analysis. When every group
    gets a fast W (checked before B), B does not retain the graph: each node frees its saved
    tensors as it runs, as in a plain backward, and W holds only what its products read."""
    out_edges = [get_gradient_edge(o) for o in outs]
    order, key = _graph_key(out_edges, inputs, params)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _analyse(order, key, len(params))
        _remember(key, plan)
    quick: list[FastW | None] = []
    if fast:
        quick = [fast_w(spec, params, pk, order[hits[0]]) if spec is not None else None
                 for pk, hits, _, spec in plan.groups]
    detached = bool(quick) and all(w is not None for w in quick)  # nothing needs the graph after B
    targets = [order[j] for j in plan.targets]
    captured: dict[Node, tuple] = {}  # a pre-hook gets the node's gradients as a tuple (after tensor hooks)
    handles = [n.register_prehook(partial(captured.__setitem__, n)) for n in targets]  # C calls, no frames
    try:
        dinputs = torch.autograd.grad(outs, inputs, grads, retain_graph=bool(plan.groups) and not detached,
                                      allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        for w in quick:
            if w is not None:
                w.after_b()
    if len(captured) != len(targets):
        raise BackwardSplitError(f"{len(targets) - len(captured)} boundary node(s) did not run in B")
    packed, ready = [], []
    for (pk, hits, root_outs, _), w in zip(plan.groups, quick or [None] * len(plan.groups)):
        clamps = [(order[j], captured[order[j]]) for j in hits]
        if w is not None:
            if w.take(clamps[0][1]):
                ready.append(w)
            continue
        edges = [GradientEdge(n, i) for n, gs in clamps for i, x in enumerate(gs) if x is not None]
        seeds = [x for _, gs in clamps for x in gs if x is not None]
        for m in root_outs:
            edges.append(out_edges[m])
            seeds.append(grads[m])
        packed.append(([params[k] for k in pk], edges, seeds, clamps))
    return dinputs, packed, ready, (out_edges if plan.python_nodes and packed else None)


def backward_input(outputs: Any, grad_outputs: Any, inputs: Any, params: Iterable[Tensor], *,
                   strategy: Strategy = "auto", fast_linear: bool = True) -> tuple[tuple[Tensor | None, ...], PendingW]:
    """B: gradients of ``outputs`` w.r.t. ``inputs``, touching no ``.grad``, and the state for W.

    Args:
        outputs: a tensor or a (nested) tuple/list/dict of them; a scalar loss on the last stage.
        grad_outputs: the same structure (``None`` entries send no gradient), or ``None`` for ones.
        inputs: the stage inputs, a tensor or a sequence (integer tensors and non-tensors allowed).
        params: the stage's parameters (duplicates and frozen ones are skipped).
        strategy: ``"auto"`` (split when possible, else recompute), ``"split"`` (raise if it
            cannot be used) or ``"recompute"`` (the simple, slower fallback).
        fast_linear: in "split" mode, linear layers' W without autograd (module docstring);
            ``False`` sends every group through autograd.

    Returns:
        One gradient per input (``None`` where the input needs none or is unused) and the
        :class:`PendingW` for :func:`backward_weight`.
    """
    if strategy not in ("auto", "split", "recompute"):
        raise BackwardSplitError(f"strategy must be 'auto', 'split' or 'recompute', not {strategy!r}")
    outs, grads, ins, idx, plist = _prepare(outputs, grad_outputs, inputs, params)
    result: list[Tensor | None] = [None] * len(ins)
    if not outs:
        return tuple(result), PendingW("empty", plist)
    if not idx:  # first stage: nothing to send, W does the whole parameter backward
        return tuple(result), PendingW("full", plist, outputs=outs, grads=grads)
    req = [ins[i] for i in idx]
    blocker = _split_blocker(req, plist)
    if strategy == "split" and blocker:
        raise BackwardSplitError(f"cannot split this backward: {blocker}")
    before = _grad_state(plist)
    if strategy == "recompute" or blocker:
        dins = torch.autograd.grad(outs, req, grads, retain_graph=True, allow_unused=True)
        pending = PendingW("recompute", plist, outputs=outs, grads=grads)
    else:
        dins, groups, quick, keep = _split(outs, grads, req, plist, fast_linear)
        pending = PendingW("split", plist, groups=groups, keep=keep)
        pending._fast = quick
    if _grad_state(plist) != before:
        raise BackwardSplitError(
            "B accumulated into parameters' .grad (a custom Function that runs backward itself, "
            "e.g. reentrant checkpointing); use backward_fused for this stage")
    for i, d in zip(idx, dins):
        result[i] = d
    return tuple(result), pending


def backward_weight(pending: PendingW) -> None:
    """W: add the parameter gradients of one micro-batch to ``.grad``, then free its state."""
    if pending._done:
        if pending._mode != "empty":
            raise BackwardSplitError("backward_weight called twice for the same PendingW")
        return
    try:
        if pending._mode != "split":
            if pending._params:
                torch.autograd.backward(pending._outputs, pending._grads, inputs=pending._params)
        fast, pending._fast = pending._fast[::-1], []
        while fast:  # each W's operands freed once it ran: the next W's product reuses that memory
            fast.pop().run()
        for k, (params, edges, seeds, clamps) in enumerate(pending._groups):
            # a boundary node's gradient is the one captured in B, whatever reaches it again here
            handles = [n.register_prehook(lambda _g, s=s: s) for n, s in clamps]
            try:  # retain until the last group: tied weights' groups may cross the same nodes
                torch.autograd.backward(edges, seeds, inputs=params,
                                        retain_graph=k < len(pending._groups) - 1)
            finally:
                for h in handles:
                    h.remove()
    finally:
        pending._done = True
        pending._groups, pending._outputs, pending._grads, pending._keep = [], [], [], None
        pending._fast = []


def backward_fused(outputs: Any, grad_outputs: Any, inputs: Any,
                   params: Iterable[Tensor]) -> tuple[Tensor | None, ...]:
    """B and W in one autograd pass (a fused BW action); the inputs' ``.grad`` is left as it was."""
    outs, grads, ins, idx, plist = _prepare(outputs, grad_outputs, inputs, params)
    pids = {id(p) for p in plist}
    req = list({id(ins[i]): ins[i] for i in idx if id(ins[i]) not in pids}.values())
    result: list[Tensor | None] = [None] * len(ins)
    if not outs or not (plist or req):
        return tuple(result)
    old = [x.grad for x in req]
    for x in req:
        x.grad = None
    try:
        torch.autograd.backward(outs, grads, inputs=plist + req)
        got = {id(x): x.grad for x in req}
    finally:
        for x, g in zip(req, old):
            x.grad = g
    for i in idx:
        result[i] = got.get(id(ins[i]), ins[i].grad)
    return tuple(result)


class WeightGradStore:
    """A worker's pending W's keyed by ``(pipeline, microbatch)`` (or any hashable): keyed, not FIFO,
    because a worker mixes its own and re-routed micro-batches.

    ``pending_count``/``pending_bytes``: W's held now and the sum of their :attr:`PendingW.nbytes`
    (a storage shared by two W's counts twice); ``peak_count``/``peak_bytes``: the largest values
    seen right after a :meth:`put` since construction. ``count_bytes=False`` leaves ``peak_bytes``
    at 0: counting walks each W's graph and reads every saved tensor (about 0.5 ms a micro-batch on
    the example GPT's stage), so the engine counts only while a profile measures memory.
    """

    def __init__(self, *, count_bytes: bool = True) -> None:
        self._pending: dict[Hashable, PendingW] = {}
        self._peak_count = self._peak_bytes = 0
        self._count_bytes = count_bytes

    def put(self, key: Hashable, pending: PendingW) -> None:
        """Hold the W of ``key``; raises if ``key`` is already pending or this W already ran."""
        if key in self._pending:
            raise BackwardSplitError(f"a W for {key!r} is already pending")
        if pending.done and pending.mode != "empty":
            raise BackwardSplitError(f"the PendingW given for {key!r} has already run")
        self._pending[key] = pending
        self._peak_count = max(self._peak_count, len(self._pending))
        if self._count_bytes:
            self._peak_bytes = max(self._peak_bytes, self.pending_bytes)

    def pop(self, key: Hashable) -> None:
        """Run the W of ``key`` (adding to ``.grad``) and forget it."""
        if key not in self._pending:
            raise BackwardSplitError(f"no W pending for {key!r}; pending: {list(self._pending)!r}")
        backward_weight(self._pending.pop(key))

    def pop_all(self) -> None:
        """Run every pending W, oldest first."""
        for key in list(self._pending):
            self.pop(key)

    def keys(self) -> list[Hashable]:
        """Pending keys, oldest first."""
        return list(self._pending)

    def __contains__(self, key: object) -> bool:
        return key in self._pending

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def pending_bytes(self) -> int:
        return sum(p.nbytes for p in self._pending.values())

    @property
    def peak_count(self) -> int:
        return self._peak_count

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    def assert_empty(self) -> None:
        """Raise :class:`BackwardSplitError` naming the keys whose W has not run."""
        if self._pending:
            raise BackwardSplitError(
                f"{len(self._pending)} weight-gradient pass(es) still pending for "
                f"{list(self._pending)!r}; run their W before reducing gradients or stepping")
