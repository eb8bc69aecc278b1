"""The fast W's of the B/W split (:mod:`.bw_split`): a parameter group's weight gradient computed
from the gradient B captured and the tensors the forward saved, with no second trip through
autograd, each with the kernels and the order of operations autograd's own W would run, so the
same bits (``tests/unit/runtime/test_bw_split.py``, ``tests/dist/test_megatron.py``).

:func:`fast_spec` is the structural half (which layer a group is, from the graph's structure, so
it is cached with the split's analysis); :func:`fast_w` checks what can change per micro-batch and
prepares the W before B runs (B then knows whether the graph must outlive it); after B, ``take``
keeps the captured gradient and ``run`` adds the gradients into ``.grad`` as ``AccumulateGrad``
does. Parameters with hooks, saved tensors behind pack/unpack hooks, complex dtypes and anything
else not recognised keep the autograd path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node

from ..errors import BackwardSplitError

__all__ = ["FastW", "fast_spec", "fast_w"]


class FastW:
    """One group's W without autograd: ``take`` the gradient B captured (False: none reached the
    layer, so its W adds nothing, as the fused backward would not), ``tensors`` held until W,
    ``run`` the W, ``after_b`` to undo what preparing B changed (nothing, by default)."""

    __slots__ = ("grad",)
    _like: str | None = None  # the attribute whose dtype the captured gradient must have

    def take(self, grads: tuple) -> bool:
        self.grad = _take_grad(grads, getattr(self, self._like) if self._like else None)
        return self.grad is not None

    def tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def after_b(self) -> None:
        return None


def _take_grad(grads: tuple, like: Tensor | None) -> Tensor | None:
    """The one gradient a fast W's node received in B (``None``: none reached it, so its W adds
    nothing, as the fused backward would not); its dtype must be ``like``'s when given."""
    if len(grads) != 1:
        raise BackwardSplitError(f"a fast W's node received {len(grads)} gradients, expected 1")
    grad = grads[0]
    if grad is not None and like is not None and grad.dtype != like.dtype:
        raise BackwardSplitError(f"a fast W's gradient is {grad.dtype}, its layer {like.dtype}")
    return grad


class _LinearW(FastW):
    """One linear layer's W: ``weight.grad += grad^T @ inp``, ``bias.grad += grad.sum(0)``."""

    __slots__ = ("weight", "bias", "inp")
    _like = "weight"

    def __init__(self, weight: Tensor, bias: Tensor | None, inp: Tensor) -> None:
        self.weight, self.bias, self.inp, self.grad = weight, bias, inp, None

    def tensors(self) -> list[Tensor]:
        return [self.grad, self.inp]

    def run(self) -> None:
        with torch.no_grad():
            # AddmmBackward0/MmBackward0 for mat2 = weight.t() (column-major): (grad^T @ mat1)^T,
            # then TBackward0 transposes back: the same product, the same kernel
            _accumulate(self.weight, self.grad.t().mm(self.inp))
            if self.bias is not None:  # the engine's sum_to of addmm's broadcast self
                _accumulate(self.bias, self.grad.sum(0, keepdim=True).view(self.bias.shape))


class _LayerNormW(FastW):
    """One LayerNorm's W: the kernel its backward node calls (``native_layer_norm_backward``), on
    the input and statistics the forward saved, asked for gamma and beta only (the node would also
    recompute the input gradient B already sent); the same bits as the node's outputs."""

    __slots__ = ("weight", "bias", "inp", "mean", "rstd", "shape")
    _like = "inp"

    def __init__(self, weight: Tensor | None, bias: Tensor | None, inp: Tensor, mean: Tensor, rstd: Tensor,
                 shape: list[int]) -> None:
        self.weight, self.bias, self.inp, self.mean, self.rstd, self.shape = weight, bias, inp, mean, rstd, shape
        self.grad = None

    def tensors(self) -> list[Tensor]:
        return [self.grad, self.inp, self.mean, self.rstd]

    def run(self) -> None:
        with torch.no_grad():
            _, dw, db = torch.ops.aten.native_layer_norm_backward(
                self.grad, self.inp, self.shape, self.mean, self.rstd, self.weight, self.bias,
                [False, self.weight is not None, self.bias is not None])
            if self.weight is not None:
                _accumulate(self.weight, dw)
            if self.bias is not None:
                _accumulate(self.bias, db)


class _ScaleW(FastW):
    """A parameter that multiplies an activation elementwise (an RMSNorm's weight where RMSNorm is
    composed of ops, a learned scale): ``grad * other``, summed to the parameter's shape and cast
    to its dtype, the formula of ``MulBackward0`` and then what the engine does to a gradient of
    another shape or dtype (``sum_to``, then the cast)."""

    __slots__ = ("param", "other")

    def __init__(self, param: Tensor, other: Tensor) -> None:
        self.param, self.other, self.grad = param, other, None

    def tensors(self) -> list[Tensor]:
        return [self.grad, self.other]

    def run(self) -> None:
        with torch.no_grad():
            _accumulate_as_engine(self.param, self.grad * self.other)


class _ShiftW(FastW):
    """A parameter added to an activation (``x + alpha * p``): ``grad`` (times alpha when it is not 1),
    summed to the parameter's shape and cast to its dtype, as ``AddBackward0`` and then the engine do."""

    __slots__ = ("param", "alpha")

    def __init__(self, param: Tensor, alpha: Any) -> None:
        self.param, self.alpha, self.grad = param, alpha, None

    def tensors(self) -> list[Tensor]:
        return [self.grad]

    def run(self) -> None:
        with torch.no_grad():
            _accumulate_as_engine(self.param, self.grad if self.alpha == 1 else self.grad * self.alpha)


class _MegatronLinearW(FastW):
    """A megatron-core linear layer's W (``LinearWithGradAccumulationAndAsyncCommunication``, what
    its ``ColumnParallelLinear``/``RowParallelLinear`` run). B sets the node's own deferral
    (``grad_output_buffer``, the mechanism megatron-core uses to defer a weight gradient), so its
    backward sends the input gradient (all-reduced over tensor parallelism as before) and skips the
    weight gradient; W then does what that backward would have done: the same reshape to 2-D,
    ``grad^T @ input`` and the bias sum, with no second input-gradient matmul or all-reduce."""

    __slots__ = ("weight", "bias", "inp")

    def __init__(self, weight: Tensor, bias: Tensor | None, inp: Tensor) -> None:
        self.weight, self.bias, self.inp, self.grad = weight, bias, inp, None

    def after_b(self) -> None:
        self.weight.__dict__.pop("main_grad", None)  # set to None by megatron-core's fusion branch

    def tensors(self) -> list[Tensor]:
        return [self.grad, self.inp]

    def run(self) -> None:
        with torch.no_grad():
            grad, inp = self.grad.contiguous(), self.inp.contiguous()  # prepare_input_tensors_for_wgrad_compute
            if grad.dim() == 3:
                grad = grad.view(grad.shape[0] * grad.shape[1], grad.shape[2])
                inp = inp.view(inp.shape[0] * inp.shape[1], inp.shape[2])
            _accumulate_as_engine(self.weight, grad.t().matmul(inp))
            if self.bias is not None:
                _accumulate_as_engine(self.bias, grad.sum(dim=0))


def _accumulate_as_engine(param: Tensor, grad: Tensor) -> None:
    """A function's gradient as the engine hands it to ``AccumulateGrad``: summed to the parameter's
    shape (``sum_to``, for a broadcast parameter), cast to its dtype, then accumulated."""
    if grad.shape != param.shape:
        grad = grad.sum_to_size(param.shape)
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    _accumulate(param, grad)


def _accumulate(param: Tensor, grad: Tensor) -> None:
    """What ``AccumulateGrad`` does outside grad mode: adopt the first gradient, add in place after."""
    if param.grad is None:
        param.grad = grad if grad.stride() == param.stride() else grad.contiguous()
    else:
        param.grad += grad


_LINEAR_NODES = {"AddmmBackward0": ("_raw_saved_mat1", 2), "MmBackward0": ("_raw_saved_self", 1)}
_LAYER_NORM = "NativeLayerNormBackward0"
_MEGATRON_LINEAR = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def fast_spec(pk: list[int], hits: list[int], root_outs: list[int], order: list[Node], graph: list[tuple]) -> tuple | None:
    """The structural half of a group's W without autograd, from the graph's structure (so it
    holds for every graph with that key): ``("linear", saved-input name, weight, bias)`` for one
    linear layer's weight (and bias) behind one ``AddmmBackward0``/``MmBackward0`` (``mat2`` a
    ``TBackward0`` of the weight), ``("layernorm", weight, bias)`` for a LayerNorm's affine
    parameters, ``("scale", saved operand, parameter)`` for a parameter one ``MulBackward0``
    multiplies with an activation, ``("shift", side, parameter)`` for one ``AddBackward0`` adds,
    ``("megatron", weight, bias)`` for a megatron-core linear layer's
    autograd function; parameters as indices into the call's list (a bias may be ``None``). ``None``: the
    group needs autograd. What can change between micro-batches (saved-tensor hooks, dtypes, dims,
    scalars, parameter hooks) is checked per micro-batch by :func:`fast_w`."""
    if len(hits) != 1 or root_outs or not 1 <= len(pk) <= 2:
        return None

    def param(edge) -> int | None:  # the call's parameter behind a next edge, or None
        tag = graph[edge[0]] if edge is not None else None
        return tag[1] if tag is not None and tag[0] == "p" else None

    j = hits[0]
    name, nxt = order[j].name(), graph[j][1]
    linear = _LINEAR_NODES.get(name)
    if linear is not None:
        raw_inp, mat2_at = linear
        t = nxt[mat2_at] if len(nxt) > mat2_at else None
        if t is None or order[t[0]].name() != "TBackward0":
            return None
        weight = param(graph[t[0]][1][0])
        bias = param(nxt[0]) if mat2_at == 2 else None
        if weight is None or (mat2_at == 2 and bias is None) or set(pk) != {weight} | ({bias} - {None}):
            return None
        return ("linear", raw_inp, weight, bias)
    if name == _LAYER_NORM and len(nxt) == 3 and param(nxt[0]) is None:
        weight, bias = param(nxt[1]), param(nxt[2])
        if sorted(k for k in (weight, bias) if k is not None) == sorted(pk):
            return ("layernorm", weight, bias)
    if name == _MEGATRON_LINEAR and len(nxt) >= 2 and param(nxt[0]) is None:
        weight, bias = param(nxt[1]), (param(nxt[2]) if len(nxt) > 2 else None)
        if weight is not None and sorted(k for k in (weight, bias) if k is not None) == sorted(pk):
            return ("megatron", weight, bias)
    if name in ("MulBackward0", "AddBackward0") and len(nxt) == 2 and len(pk) == 1:
        sides = [i for i in (0, 1) if param(nxt[i]) == pk[0]]
        if len(sides) == 1 and name == "MulBackward0":  # p * x or x * p (not p * p): W reads the other operand
            return ("scale", "_raw_saved_other" if sides[0] == 0 else "_raw_saved_self", pk[0])
        if len(sides) == 1:  # x + p (a bias added on its own, as megatron-core's skip_bias_add does)
            return ("shift", sides[0], pk[0])
    return None


def fast_w(spec: tuple, params: list[Tensor], group: list[int], node: Node) -> FastW | None:
    """The group's W without autograd for this micro-batch, before B runs (so B knows whether the
    graph must outlive it), or ``None`` when it needs autograd. Its gradient comes after B."""
    for k in group:
        p = params[k]
        if p._backward_hooks or p._post_accumulate_grad_hooks:
            return None  # a hook on the parameter fires only through AccumulateGrad
    if spec[0] == "megatron":
        if (getattr(node, "gradient_accumulation_fusion", True) or getattr(node, "sequence_parallel", True)
                or getattr(node, "grad_output_buffer", 0) is not None or getattr(node, "_fwd_used_autocast", True)):
            return None  # fused main_grad kernels, a gathered input, megatron's own deferral, autocast
        raws = node._raw_saved_tensors
        if len(raws) != 2 or any(r.unpack_hook is not None for r in raws):
            return None
        inp = raws[0].data
        _, wk, bk = spec
        weight = params[wk]
        if not isinstance(inp, Tensor) or inp.dim() not in (2, 3) or hasattr(weight, "main_grad"):
            return None
        # B: the input gradient only. megatron-core skips the weight gradient when it defers it into
        # grad_output_buffer, which it honours on its gradient-accumulation-fusion branch; that
        # branch then returns no weight gradient (the weight has no grad_added_to_main_grad) and
        # only sets weight.main_grad to the None it saved, which _split removes after B. Whatever
        # B does with the weight gradient, W uses the gradient captured by the pre-hook.
        node.grad_output_buffer, node.wgrad_deferral_limit, node.gradient_accumulation_fusion = [], 0, True
        return _MegatronLinearW(weight, params[bk] if bk is not None else None, inp.detach())
    if spec[0] == "shift":
        param = params[spec[2]]
        if param.is_complex():
            return None
        return _ShiftW(param, node._saved_alpha if spec[1] == 1 else 1)
    if spec[0] == "scale":
        saved = getattr(node, spec[1], None)
        if saved is None or saved.unpack_hook is not None:
            return None
        other = saved.data
        if not isinstance(other, Tensor) or other.is_complex() or params[spec[2]].is_complex():
            return None  # complex: the formula conjugates
        return _ScaleW(params[spec[2]], other.detach())
    if spec[0] == "layernorm":
        raws = [node._raw_saved_input, node._raw_saved_result1, node._raw_saved_result2]
        if any(r.unpack_hook is not None for r in raws):
            return None  # behind saved-tensor hooks (offload, checkpointing): autograd unpacks them
        inp, mean, rstd = (r.data.detach() for r in raws)  # no grad_fn: W keeps no node alive
        _, wk, bk = spec
        return _LayerNormW(params[wk] if wk is not None else None, params[bk] if bk is not None else None,
                           inp, mean, rstd, list(node._saved_normalized_shape))
    _, raw_inp, wk, bk = spec
    weight = params[wk]
    bias = params[bk] if bk is not None else None
    if bias is not None and (bias.dim() != 1 or node._saved_alpha != 1 or node._saved_beta != 1):
        return None  # an addmm (mm has neither bias nor scalars)
    saved = getattr(node, raw_inp)
    if saved.unpack_hook is not None:
        return None
    inp = saved.data
    if not isinstance(inp, Tensor) or inp.dim() != 2 or inp.dtype != weight.dtype:
        return None
    return _LinearW(weight, bias, inp.detach())
