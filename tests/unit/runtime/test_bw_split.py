"""B/W split (ds_resilience.runtime.bw_split) against a fused ``loss.backward()`` reference, fp64.

Every stage runs on leaf copies of its inputs (as a pipeline stage does after a receive); the
reference runs the same modules as one graph and reads the boundary gradients with retain_grad().
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from ds_resilience.errors import ResilienceError  # noqa: E402
from ds_resilience.runtime import bw_split  # noqa: E402
from ds_resilience.runtime.bw_split import (  # noqa: E402
    BackwardSplitError,
    PendingW,
    WeightGradStore,
    backward_fused,
    backward_input,
    backward_weight,
)

D = torch.float64
H = 8
TOL = 1e-12
STRATEGIES = ["split", "recompute"]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


# ----------------------------------------------------------------------------- stage modules
class ResMLP(nn.Module):
    """Linear/LayerNorm/GELU with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H)
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Block(nn.Module):
    """Pre-LN transformer block: causal multi-head attention (with dropout) and an MLP."""

    def __init__(self, heads: int = 2, p: float = 0.0) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H), nn.Dropout(p))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(H, dim=-1)
        q, k, v = (z.view(b, t, self.heads, H // self.heads).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(H // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = F.dropout(att.masked_fill(mask, float("-inf")).softmax(-1), self.p, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, H)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """First stage: token + learned position embedding on integer ids."""

    def __init__(self, vocab: int = 11, seq: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, H)
        self.pos = nn.Parameter(torch.randn(seq, H))

    def forward(self, ids):
        return F.dropout(self.tok(ids) + self.pos[: ids.shape[1]], 0.1, self.training)


class Head(nn.Module):
    """Last stage: LayerNorm, vocabulary projection and cross-entropy against integer targets."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(H), nn.Linear(H, vocab)

    def forward(self, x, targets):
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MseHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x, target):
        return ((self.fc(x) - target) ** 2).mean()


def build(*mods):
    torch.manual_seed(0)
    return [m.to(D) for m in mods]


# ----------------------------------------------------------------------------- pipeline drivers
def _leaf(t):
    return t.detach().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t


def reference(stages, first_inputs, extras, seed=1, scale=1.0):
    """One graph through all stages, ``loss.backward()``; returns the gradient of each stage's
    float inputs (None for stage 0's integer ids)."""
    torch.manual_seed(seed)
    x, bounds = first_inputs, []
    for s, st in enumerate(stages):
        ins = tuple(x) + tuple(extras[s])
        for t in ins:
            if torch.is_tensor(t) and t.requires_grad and not t.is_leaf:
                t.retain_grad()
        bounds.append(ins)
        out = st(*ins)
        x = out if isinstance(out, tuple) else (out,)
    (x[0] * scale).backward()
    return [tuple(t.grad if torch.is_tensor(t) and t.requires_grad else None for t in ins) for ins in bounds]


def split_forward(stages, first_inputs, extras, seed=1):
    """Forward on leaf copies; returns per stage (inputs, outputs)."""
    torch.manual_seed(seed)
    x, acts = first_inputs, []
    for s, st in enumerate(stages):
        ins = tuple(_leaf(t) if s else t for t in x) + tuple(extras[s])  # stage 0: data, no grad
        out = st(*ins)
        acts.append((ins, out))
        x = out if isinstance(out, tuple) else (out,)
    return acts


def split_backward(stages, acts, strategy, scale=1.0):
    """All B's, last stage first; returns (input grads per stage, PendingW per stage)."""
    grads, pendings = [None] * len(stages), [None] * len(stages)
    g = None if scale == 1.0 else torch.tensor(scale, dtype=D)
    for s in reversed(range(len(stages))):
        ins, out = acts[s]
        grads[s], pendings[s] = backward_input(out, g, ins, stages[s].parameters(), strategy=strategy)
        g = grads[s][0]
    return grads, pendings


def snapshot(stages):
    return [[None if p.grad is None else p.grad.clone() for p in st.parameters()] for st in stages]


def zero(stages):
    for st in stages:
        for p in st.parameters():
            p.grad = None


def max_diff(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None, "one gradient is None and the other is not"
            continue
        worst = max(worst, (x - y).abs().max().item())
    return worst


def assert_grads_equal(stages, ref):
    got = snapshot(stages)
    for s, (g, r) in enumerate(zip(got, ref)):
        assert max_diff(g, r) <= TOL, f"stage {s} parameter gradients differ"


def check_pipeline(stages, first_inputs, extras, strategy, w_order=None):
    ref_in = reference(stages, first_inputs, extras)
    ref = snapshot(stages)
    zero(stages)
    acts = split_forward(stages, first_inputs, extras)
    grads, pendings = split_backward(stages, acts, strategy)
    assert all(p.grad is None for st in stages for p in st.parameters()), "B touched .grad"
    for ins, _ in acts:
        assert all(not torch.is_tensor(t) or t.grad is None for t in ins), "B wrote an input's .grad"
    for s in w_order or range(len(stages)):
        assert pendings[s].nbytes > 0
        backward_weight(pendings[s])
        assert pendings[s].done and pendings[s].nbytes == 0
    for s in range(len(stages)):
        assert max_diff(grads[s], ref_in[s]) <= TOL, f"stage {s} input gradients differ"
    assert_grads_equal(stages, ref)
    return pendings


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_linear_layernorm_gelu_residual_stack(strategy):
    stages = build(ResMLP(), ResMLP(), ResMLP(), MseHead())
    torch.manual_seed(5)
    x, target = torch.randn(4, H, dtype=D), torch.randn(4, H, dtype=D)
    pend = check_pipeline(stages, (x,), [(), (), (), (target,)], strategy, w_order=[2, 0, 3, 1])
    assert [p.mode for p in pend] == ["full"] + [strategy] * 3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tiny_transformer_embedding_first_and_cross_entropy_last(strategy):
    stages = build(Embed(), Block(p=0.1), Block(p=0.1), Head())
    for st in stages:
        st.train()
    torch.manual_seed(7)
    ids, targets = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    pend = check_pipeline(stages, (ids,), [(), (), (), (targets,)], strategy, w_order=[0, 3, 1, 2])
    assert pend[0].mode == "full", "integer-id first stage: W does the whole parameter backward"
    assert [p.mode for p in pend[1:]] == [strategy] * 3


def test_dropout_is_active_and_reseeding_makes_it_reproducible():
    stages = build(ResMLP(), Block(p=0.5), MseHead())
    torch.manual_seed(3)
    x, t = torch.randn(2, 5, H, dtype=D), torch.randn(2, 5, H, dtype=D)
    a = split_forward(stages, (x,), [(), (), (t,)], seed=1)[-1][1]
    b = split_forward(stages, (x,), [(), (), (t,)], seed=1)[-1][1]
    c = split_forward(stages, (x,), [(), (), (t,)], seed=2)[-1][1]
    assert a.item() == b.item() and a.item() != c.item()
    check_pipeline(stages, (x,), [(), (), (t,)], "split")


class Tied(nn.Module):
    """One Linear used twice, a weight pair used in a crossing pattern, a term that reaches the
    output without the input path, a parameter that is never used and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.w1, self.w2 = nn.Parameter(torch.randn(H)), nn.Parameter(torch.randn(H))
        self.bias_only = nn.Parameter(torch.randn(H))
        self.unused = nn.Parameter(torch.randn(H))
        self.frozen = nn.Parameter(torch.randn(H), requires_grad=False)

    def forward(self, x):
        h = self.lin(F.gelu(self.lin(x)))
        c = h * self.w1 + h * self.w2
        return (c * self.w1) * self.w2 + self.bias_only.tanh() + self.frozen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tied_and_crossing_parameters_in_one_stage(strategy):
    stages = build(ResMLP(), Tied(), MseHead())
    torch.manual_seed(2)
    x, t = torch.randn(4, H, dtype=D), torch.randn(4, H, dtype=D)
    check_pipeline(stages, (x,), [(), (), (t,)], strategy)
    assert stages[1].unused.grad is None and stages[1].frozen.grad is None


def test_tied_embedding_and_output_head_in_a_single_stage():
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.blk = nn.Embedding(11, H), Block()

        def forward(self, ids, targets):
            logits = self.blk(self.emb(ids)) @ self.emb.weight.t()
            return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))

    (st,) = build(TiedLM())
    ids, targets = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))
    st(ids, targets).backward()
    ref = snapshot([st])
    zero([st])
    grads, pend = backward_input(st(ids, targets), None, (ids, targets), st.parameters())
    assert grads == (None, None) and pend.mode == "full" and st.emb.weight.grad is None
    backward_weight(pend)
    assert_grads_equal([st], ref)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tuple_outputs_non_tensor_inputs_and_partial_grad_outputs(strategy):
    (lin,) = build(nn.Linear(H, H))
    w = nn.Parameter(torch.randn(H, dtype=D))

    def stage(x, mask, flag, meta):
        h = lin(x).masked_fill(mask, 0.0)
        # a view output, an output that does not depend on x, an int passthrough, a non-tensor
        return h.view(-1), x * w, w.tanh() * 3, mask, meta

    params = [*lin.parameters(), w, w]  # duplicate entries are tolerated
    torch.manual_seed(4)
    x0, mask = torch.randn(3, H, dtype=D), torch.rand(3, H) > 0.5
    g0, g2 = torch.randn(3 * H, dtype=D), torch.randn(H, dtype=D)
    for g1 in (torch.randn(3, H, dtype=D), None):
        x = x0.clone().requires_grad_()
        out = stage(x, mask, 1, "m")
        pairs = [(o, g) for o, g in zip(out, (g0, g1, g2)) if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ref, ref_x = [None if p.grad is None else p.grad.clone() for p in params], x.grad.clone()
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        out = stage(x, mask, 1, "m")
        grads, pend = backward_input(out, (g0, g1, g2, None, None), (x, mask, 1, "m"), params,
                                     strategy=strategy)
        assert grads[1:] == (None, None, None) and out[0].requires_grad  # outputs are not detached
        backward_weight(pend)
        assert max_diff([grads[0]], [ref_x]) <= TOL
        assert max_diff([p.grad for p in params], ref) <= TOL
        for p in params:
            p.grad = None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_reentrant_checkpoint_and_custom_function_stage(strategy):
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, s):
            ctx.save_for_backward(a, s)
            return a * s

        @staticmethod
        def backward(ctx, g):
            a, s = ctx.saved_tensors
            return g * s, (g * a).sum(0)

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.s = ResMLP(), nn.Parameter(torch.randn(H))

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
            return Scale.apply(h, self.s)

    stages = build(ResMLP(), Stage(), MseHead())
    x, t = torch.randn(4, H, dtype=D), torch.randn(4, H, dtype=D)
    check_pipeline(stages, (x,), [(), (), (t,)], strategy)


# ----------------------------------------------------------------------------- micro-batches and store
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_microbatches_w_in_another_order_through_the_store(strategy):
    stages = build(Embed(), Block(p=0.1), Head())
    torch.manual_seed(9)
    mbs = [(torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 5))) for _ in range(4)]
    keys = [(p, m) for p in (0, 1) for m in (0, 1)]  # own and re-routed micro-batches
    for st in stages:  # gradients already present: W must add to them, like autograd
        for p in st.parameters():
            p.grad = torch.full_like(p, 0.25)
    for i, (ids, tg) in enumerate(mbs):
        reference(stages, (ids,), [(), (), (tg,)], seed=100 + i, scale=1 / len(mbs))
    ref = snapshot(stages)
    for st in stages:
        for p in st.parameters():
            p.grad = torch.full_like(p, 0.25)
    before = snapshot(stages)
    store = WeightGradStore()
    for i in (2, 0, 3, 1):  # B's in one order
        ids, tg = mbs[i]
        acts = split_forward(stages, (ids,), [(), (), (tg,)], seed=100 + i)
        _, pendings = split_backward(stages, acts, strategy, scale=1 / len(mbs))
        del acts
        for s, pend in enumerate(pendings):
            store.put((keys[i], s), pend)
    assert all(max_diff(a, b) == 0.0 for a, b in zip(snapshot(stages), before)), "B changed .grad"
    assert store.pending_count == store.peak_count == 12 and store.peak_bytes == store.pending_bytes > 0
    for i in (1, 3, 0, 2):  # W's later, in another order, stage order shuffled too
        for s in (1, 0, 2):
            store.pop((keys[i], s))
    store.assert_empty()
    assert store.pending_count == 0 and store.pending_bytes == 0 and store.peak_count == 12
    assert_grads_equal(stages, ref)


def test_store_accounting_and_errors():
    (lin,) = build(nn.Linear(H, 2 * H))
    store = WeightGradStore()
    sizes = []
    for m in range(3):
        x = torch.randn(16, H, dtype=D, requires_grad=True)
        _, pend = backward_input(lin(x), torch.randn(16, 2 * H, dtype=D), (x,), lin.parameters())
        # W keeps the saved input activation (x, 1 KiB) and the output gradient (2 KiB)
        assert pend.nbytes >= x.nbytes + 16 * 2 * H * 8
        sizes.append(pend.nbytes)
        store.put((0, m), pend)
        assert store.pending_bytes == sum(sizes) == store.peak_bytes
    store.pop((0, 1))
    assert store.pending_count == 2 and store.peak_count == 3
    assert store.pending_bytes == sizes[0] + sizes[2] and store.peak_bytes == sum(sizes)
    quiet = WeightGradStore(count_bytes=False)  # the engine outside a profile: counts, no graph walks
    x = torch.randn(16, H, dtype=D, requires_grad=True)
    _, pend = backward_input(lin(x), torch.randn(16, 2 * H, dtype=D), (x,), lin.parameters())
    quiet.put("m", pend)
    assert quiet.peak_count == 1 and quiet.peak_bytes == 0 and pend._nbytes is None
    quiet.pop("m")
    assert (0, 2) in store and store.keys() == [(0, 0), (0, 2)]
    with pytest.raises(BackwardSplitError, match=r"\(0, 0\).*\(0, 2\)") as err:
        store.assert_empty()
    assert isinstance(err.value, ResilienceError) and "2 weight-gradient" in str(err.value)
    with pytest.raises(BackwardSplitError, match=r"no W pending for \(0, 1\)"):
        store.pop((0, 1))
    x = torch.randn(2, H, dtype=D, requires_grad=True)
    _, pend = backward_input(lin(x), torch.ones(2, 2 * H, dtype=D), (x,), lin.parameters())
    with pytest.raises(BackwardSplitError, match="already pending"):
        store.put((0, 0), pend)
    backward_weight(pend)
    with pytest.raises(BackwardSplitError, match="twice"):
        backward_weight(pend)
    with pytest.raises(BackwardSplitError, match="already run"):
        store.put((5, 5), pend)
    store.pop_all()
    store.assert_empty()


def test_graph_is_freed_after_w():
    stages = build(ResMLP(), Block())
    x = torch.randn(2, 5, H, dtype=D, requires_grad=True)
    params = [p for st in stages for p in st.parameters()]
    keep = {p.untyped_storage().data_ptr() for p in params} | {x.untyped_storage().data_ptr()}
    refs = []

    def pack(t):  # saves a detached alias (no grad_fn, so no reference cycle) and watches it
        t = t.detach()
        if t.untyped_storage().data_ptr() not in keep:
            refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stages[1](stages[0](x))
    _, pend = backward_input(out, torch.ones_like(out), (x,), params)
    del out
    gc.collect()
    assert len(refs) > 10 and pend.nbytes > 0
    alive = sum(r() is not None for r in refs)
    assert alive > 0, "W needs saved activations"
    backward_weight(pend)
    gc.collect()
    assert sum(r() is not None for r in refs) == 0, "W must release the graph and its saved activations"


def test_last_stage_scalar_loss_with_implicit_gradient_and_empty_cases():
    (lin,) = build(nn.Linear(H, 1))
    x = torch.randn(3, H, dtype=D)
    lin(x).sum().backward()
    ref = snapshot([lin])
    zero([lin])
    xl = x.clone().requires_grad_()
    grads, pend = backward_input(lin(xl).sum(), None, [xl], lin.parameters())
    backward_weight(pend)
    assert_grads_equal([lin], ref)
    assert max_diff(grads, [lin.weight.detach().expand(3, H)]) <= TOL
    grads, pend = backward_input(lin(xl).detach(), None, (xl,), lin.parameters())
    assert grads == (None,) and pend.mode == "empty" and pend.nbytes == 0
    backward_weight(pend)  # nothing to do, and allowed


# ----------------------------------------------------------------------------- fallback and fused
def test_fallback_when_the_graph_edge_api_is_missing(monkeypatch):
    monkeypatch.setattr(bw_split, "_HAS_EDGE_API", False)
    stages = build(ResMLP(), Block(), MseHead())
    x, t = torch.randn(2, 5, H, dtype=D), torch.randn(2, 5, H, dtype=D)
    pend = check_pipeline(stages, (x,), [(), (), (t,)], "auto")
    assert [p.mode for p in pend] == ["full", "recompute", "recompute"]
    xl = x.clone().requires_grad_()
    with pytest.raises(BackwardSplitError, match="get_gradient_edge"):
        backward_input(stages[0](xl), torch.ones_like(x), (xl,), stages[0].parameters(), strategy="split")


def test_auto_uses_split_and_falls_back_for_non_leaf_inputs():
    (st,) = build(ResMLP())
    x = torch.randn(2, H, dtype=D, requires_grad=True)
    _, pend = backward_input(st(x), torch.ones(2, H, dtype=D), (x,), st.parameters())
    assert pend.mode == "split"
    backward_weight(pend)
    zero([st])
    base = torch.randn(2, H, dtype=D, requires_grad=True)
    y = base * 2  # not a leaf
    st(y).backward(torch.ones(2, H, dtype=D))
    ref, ref_y = snapshot([st]), base.grad / 2
    zero([st])
    y = base * 2
    grads, pend = backward_input(st(y), torch.ones(2, H, dtype=D), (y,), st.parameters())
    assert pend.mode == "recompute"
    backward_weight(pend)
    assert max_diff(grads, [ref_y]) <= TOL
    assert_grads_equal([st], ref)
    with pytest.raises(BackwardSplitError, match="not a leaf"):
        backward_input(st(base * 2), torch.ones(2, H, dtype=D), (y,), st.parameters(), strategy="split")
    with pytest.raises(BackwardSplitError, match="strategy"):
        backward_input(st(x), None, (x,), st.parameters(), strategy="fast")


def test_reentrant_checkpoint_is_refused():
    (st,) = build(ResMLP())
    x = torch.randn(2, H, dtype=D, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(st, x, use_reentrant=True)
    with pytest.raises(Exception, match="reentrant"):
        backward_input(out, torch.ones_like(out), (x,), st.parameters())


def test_backward_fused_matches_reference_and_leaves_input_grad_alone():
    stages = build(ResMLP(), Block(), MseHead())
    torch.manual_seed(1)
    x, t = torch.randn(2, 5, H, dtype=D), torch.randn(2, 5, H, dtype=D)
    ref_in = reference(stages, (x,), [(), (), (t,)])
    ref = snapshot(stages)
    zero(stages)
    acts = split_forward(stages, (x,), [(), (), (t,)])
    g = None
    for s in reversed(range(3)):
        ins, out = acts[s]
        grads = backward_fused(out, g, ins, stages[s].parameters())
        assert all(not torch.is_tensor(i) or i.grad is None for i in ins)
        assert max_diff(grads, ref_in[s]) <= TOL
        g = grads[0]
    assert_grads_equal(stages, ref)


def test_pending_w_repr_and_public_names():
    assert set(bw_split.__all__) >= {"PendingW", "WeightGradStore", "backward_input", "backward_weight",
                                     "backward_fused", "BackwardSplitError"}
    (lin,) = build(nn.Linear(H, H))
    x = torch.randn(2, H, dtype=D, requires_grad=True)
    _, pend = backward_input(lin(x), torch.ones(2, H, dtype=D), (x,), lin.parameters())
    assert isinstance(pend, PendingW) and "split" in repr(pend) and not pend.done
    backward_weight(pend)


class _Counted(torch.autograd.Function):
    """Identity whose backward is counted: it sits on the input-gradient path only."""

    calls = 0

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        return g


@pytest.mark.parametrize("strategy,runs", [("split", 1), ("recompute", 2)])
def test_split_does_not_recompute_the_input_path(strategy, runs):
    (lin1, lin2) = build(nn.Linear(H, H), nn.Linear(H, H))
    x = torch.randn(3, H, dtype=D, requires_grad=True)
    out = lin2(_Counted.apply(F.gelu(lin1(x))))
    _Counted.calls = 0
    _, pend = backward_input(out, torch.ones_like(out), (x,), [*lin1.parameters(), *lin2.parameters()],
                             strategy=strategy)
    assert _Counted.calls == 1
    backward_weight(pend)
    assert _Counted.calls == runs


def test_b_that_writes_grad_is_refused():
    w = nn.Parameter(torch.randn(H, dtype=D))

    class Sneaky(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            w.grad = g.sum(0)  # a weight gradient computed inside B
            return g * 2

    x = torch.randn(3, H, dtype=D, requires_grad=True)
    out = Sneaky.apply(x) * w
    with pytest.raises(BackwardSplitError, match="accumulated into parameters"):
        backward_input(out, torch.ones_like(out), (x,), [w])


# ----------------------------------------------------------------------------- the fast linear W
class _NoBiasMix(nn.Module):
    """A bias-free linear on a non-contiguous input (the MmBackward0 path) and a bias linear on a
    contiguous 3-D one (AddmmBackward0), between LayerNorms (groups that stay with autograd)."""

    def __init__(self, dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H, dtype=dtype)
        self.a = nn.Linear(H, 2 * H, dtype=dtype)
        self.b = nn.Linear(2 * H, H, bias=False, dtype=dtype)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(self.ln(x)))
        return x + self.b(h.transpose(0, 1)).transpose(0, 1)


def _w_grads(stage, xs, gs, fast):
    for p in stage.parameters():
        p.grad = None
    pendings = []
    for x, g in zip(xs, gs):  # two micro-batches: the second W adds into .grad
        x = x.detach().requires_grad_()
        out = stage(x)
        (dx,), pw = backward_input(out, g, (x,), stage.parameters(), strategy="split", fast_linear=fast)
        pendings.append((pw, dx, len(pw._fast)))
    for pw, _, _ in reversed(pendings):  # W in another order than B, as a schedule may run them
        backward_weight(pw)
    return [p.grad.clone() for p in stage.parameters()], [dx for _, dx, _ in pendings], [n for _, _, n in pendings]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_linear_and_layernorm_w_equal_autograd_w_bit_for_bit(dtype):
    torch.manual_seed(3)
    stage = nn.Sequential(_NoBiasMix(dtype), _NoBiasMix(dtype))
    xs = [torch.randn(3, 5, H, dtype=dtype) for _ in range(2)]
    gs = [torch.randn(3, 5, H, dtype=dtype) for _ in range(2)]
    fast, dx_fast, n_fast = _w_grads(stage, xs, gs, True)
    slow, dx_slow, n_slow = _w_grads(stage, xs, gs, False)
    assert n_fast == [6, 6] and n_slow == [0, 0]  # every linear and LayerNorm skipped autograd, only with it on
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    assert all(torch.equal(a, b) for a, b in zip(dx_fast, dx_slow))
    # and equal to one fused loss.backward() per micro-batch
    for p in stage.parameters():
        p.grad = None
    for x, g in zip(xs, gs):
        stage(x.detach().requires_grad_()).backward(g)
    assert all(torch.equal(a, p.grad) for a, p in zip(fast, stage.parameters()))


def test_fast_linear_w_leaves_hooked_parameters_and_hooked_saved_tensors_to_autograd():
    torch.manual_seed(4)
    stage = nn.Sequential(_NoBiasMix(D))
    seen = []
    stage[0].a.weight.register_hook(lambda g: seen.append(g.shape))
    x = torch.randn(3, 5, H, dtype=D, requires_grad=True)
    _, pw = backward_input(stage(x), torch.ones(3, 5, H, dtype=D), (x,), stage.parameters(), strategy="split")
    assert len(pw._fast) == 2  # b and the LayerNorm: a's weight has a hook, which must fire in W
    backward_weight(pw)
    assert seen == [stage[0].a.weight.shape]
    with torch.autograd.graph.save_on_cpu():
        out = stage(x)
    _, pw = backward_input(out, torch.ones(3, 5, H, dtype=D), (x,), stage.parameters(), strategy="split")
    assert pw._fast == []  # saved behind pack/unpack hooks: autograd unpacks them
    backward_weight(pw)


# ----------------------------------------------------------------------------- the structural plan cache
class _Branchy(nn.Module):
    """Data-dependent control flow: the graph of a micro-batch depends on its values."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(H, dtype=D)
        self.a = nn.Linear(H, H, dtype=D)
        self.b = nn.Linear(H, H, dtype=D)

    def forward(self, x):
        h = self.ln(x)
        return x + (self.a(h) if float(x.detach().sum()) > 0 else torch.tanh(self.b(h)) * self.a(h))


def _split_then_fused(stage, x0, g):
    """One micro-batch's (dx, grads) by B then W, and by one fused backward."""
    got = []
    for split in (True, False):
        for p in stage.parameters():
            p.grad = None
        x = x0.detach().requires_grad_()
        out = stage(x)
        if split:
            (dx,), pw = backward_input(out, g, (x,), stage.parameters(), strategy="split")
            del out
            backward_weight(pw)
        else:
            (dx,) = backward_fused(out, g, (x,), list(stage.parameters()))
        got.append((dx, [None if p.grad is None else p.grad.clone() for p in stage.parameters()]))
    return got


def _equal(a, b):
    return torch.equal(a[0], b[0]) and all((u is None and v is None) or torch.equal(u, v) for u, v in zip(a[1], b[1]))


def test_a_stage_analyses_its_graph_once_and_every_later_micro_batch_reuses_it():
    torch.manual_seed(5)
    stage = nn.Sequential(_NoBiasMix(D), ResMLP().double())
    misses = bw_split._plan_misses
    for m in range(4):
        split, fused = _split_then_fused(stage, torch.randn(3, 5, H, dtype=D), torch.randn(3, 5, H, dtype=D))
        assert _equal(split, fused), f"micro-batch {m}"
    assert bw_split._plan_misses - misses <= 1  # 0 when an earlier test built the same graph
    twin = nn.Sequential(_NoBiasMix(D), ResMLP().double())  # same structure, other parameters
    misses = bw_split._plan_misses
    split, fused = _split_then_fused(twin, torch.randn(3, 5, H, dtype=D), torch.randn(3, 5, H, dtype=D))
    assert bw_split._plan_misses == misses and _equal(split, fused)  # the plan names parameters by position


def test_data_dependent_graphs_get_their_own_plans():
    torch.manual_seed(6)
    stage = _Branchy()
    misses = bw_split._plan_misses
    for sign in (1, -1, 1, -1):
        x0 = sign * (torch.rand(2, H, dtype=D) + 0.1)
        split, fused = _split_then_fused(stage, x0, torch.randn(2, H, dtype=D))
        assert _equal(split, fused), sign
        assert (split[1][4] is None) == (sign > 0)  # b's weight (ln, a, then b) only in the negative branch
    assert bw_split._plan_misses - misses == 2


def test_a_fast_w_refused_for_one_micro_batch_is_taken_by_the_next():
    # the profile's first iteration saves tensors through hooks; the plan must not remember that
    torch.manual_seed(7)
    stage = nn.Sequential(_NoBiasMix(D))
    x = torch.randn(3, 5, H, dtype=D, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        out = stage(x)
    _, pw = backward_input(out, torch.ones(3, 5, H, dtype=D), (x,), stage.parameters(), strategy="split")
    assert pw._fast == []
    backward_weight(pw)
    _, pw = backward_input(stage(x), torch.ones(3, 5, H, dtype=D), (x,), stage.parameters(), strategy="split")
    assert len(pw._fast) == 3
    backward_weight(pw)


# ----------------------------------------------------------------------------- B without the graph
def _mlp_stage():
    return nn.Sequential(nn.LayerNorm(H, dtype=D), nn.Linear(H, 4 * H, dtype=D), nn.GELU(),
                         nn.Linear(4 * H, H, dtype=D, bias=False), nn.LayerNorm(H, dtype=D, bias=False),
                         nn.LayerNorm(H, dtype=D, elementwise_affine=False))


@pytest.mark.parametrize("hooked", [False, True])
def test_a_stage_whose_w_is_all_fast_frees_its_graph_in_b(hooked):
    torch.manual_seed(8)
    stage = _mlp_stage()
    if hooked:  # one group back to autograd: the graph must outlive B
        stage[3].weight.register_hook(lambda g: g)
    seen = []
    stage[1].register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))  # only GELU saves fc1's output
    x0, g = torch.randn(3, 5, H, dtype=D), torch.randn(3, 5, H, dtype=D)
    split, fused = _split_then_fused(stage, x0, g)
    assert _equal(split, fused)
    x = x0.clone().requires_grad_()
    out = stage(x)
    _, pend = backward_input(out, g, (x,), stage.parameters())
    del out
    gc.collect()
    assert len(pend._fast) == (3 if hooked else 4) and len(pend._groups) == int(hooked)
    assert (seen[-1]() is not None) == hooked, "B keeps the graph only when a W group needs autograd"
    if not hooked:  # W holds what its products read and nothing else
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for w in pend._fast for t in w.tensors()}
        assert pend.nbytes == sum(held.values())
    backward_weight(pend)


def test_layernorm_w_without_bias_or_affine_equals_autograd_bit_for_bit():
    torch.manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        stage = _mlp_stage().to(dtype)
        for p in stage.parameters():  # away from the init values, so gamma and beta matter
            p.data.add_(torch.randn_like(p) * 0.1)
        x0, g = torch.randn(4, 3, H, dtype=dtype), torch.randn(4, 3, H, dtype=dtype)
        split, fused = _split_then_fused(stage, x0, g)
        assert _equal(split, fused), dtype


class _RMSBlock(nn.Module):
    """Llama-style: RMSNorm (composed of ops on CPU: its weight is a MulBackward0's operand), a
    bias-free projection and a learned scalar gate broadcast over the activation."""

    def __init__(self, dtype, param_dtype=None) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, dtype=dtype)
        self.proj = nn.Linear(H, H, bias=False, dtype=dtype)
        self.gate = nn.Parameter(torch.full((1,), 0.5, dtype=param_dtype or dtype))

    def forward(self, x):
        return x + self.gate * self.proj(self.norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scale_parameters_get_a_fast_w_equal_to_autograd_bit_for_bit(dtype):
    torch.manual_seed(10)
    stage = nn.Sequential(_RMSBlock(dtype), _RMSBlock(dtype))
    for p in stage.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    x0, g = torch.randn(4, 3, H, dtype=dtype), torch.randn(4, 3, H, dtype=dtype)
    split, fused = _split_then_fused(stage, x0, g)
    assert _equal(split, fused)
    x = x0.clone().requires_grad_()
    _, pend = backward_input(stage(x), g, (x,), stage.parameters())
    assert len(pend._fast) == 6 and not pend._groups  # norm, projection and gate of both blocks
    backward_weight(pend)


def test_scale_w_sums_and_casts_like_the_engine_for_a_mixed_dtype_gate():
    torch.manual_seed(11)
    stage = _RMSBlock(torch.float32, param_dtype=torch.bfloat16)  # bf16 gate * fp32 activation -> fp32
    x0, g = torch.randn(2, 5, H), torch.randn(2, 5, H)
    split, fused = _split_then_fused(stage, x0, g)
    gate = [n for n, _ in stage.named_parameters()].index("gate")
    assert _equal(split, fused) and split[1][gate].dtype == torch.bfloat16


class _Shifts(nn.Module):
    """Parameters added on their own: a broadcast bias after a bias-free projection, one scaled by
    alpha, one on the left of the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, H, bias=False, dtype=D)
        self.b1 = nn.Parameter(torch.randn(H, dtype=D))
        self.b2 = nn.Parameter(torch.randn(1, 1, H, dtype=D))
        self.b3 = nn.Parameter(torch.randn(1, dtype=D))

    def forward(self, x):
        h = torch.add(self.proj(x) + self.b1, self.b2, alpha=2.5)
        return torch.tanh(self.b3 + h)


def test_added_parameters_get_a_fast_w_equal_to_autograd_bit_for_bit():
    torch.manual_seed(12)
    stage = _Shifts()
    x0, g = torch.randn(3, 5, H, dtype=D), torch.randn(3, 5, H, dtype=D)
    split, fused = _split_then_fused(stage, x0, g)
    assert _equal(split, fused)
    x = x0.clone().requires_grad_()
    _, pend = backward_input(stage(x), g, (x,), stage.parameters())
    assert len(pend._fast) == 4 and not pend._groups
    backward_weight(pend)


def test_w_frees_each_fast_w_operands_once_it_ran(monkeypatch):
    """W hands each fast W's captured gradient and saved input back as soon as that W ran, so the
    next W's products reuse the memory (on a CPU, holding them all to the end cost every W a fresh
    page per 4 KB it wrote), and W's peak is one W's operands, not all of them."""
    torch.manual_seed(10)
    stage = _mlp_stage()
    x = torch.randn(3, 5, H, dtype=D, requires_grad=True)
    out = stage(x)
    _, pend = backward_input(out, torch.randn(3, 5, H, dtype=D), (x,), stage.parameters())
    del out
    order = [w for w in pend._fast]
    refs = [[weakref.ref(t) for t in w.tensors()] for w in order]
    alive_at_run: list[list[bool]] = []
    for kind in {type(w) for w in order}:
        monkeypatch.setattr(kind, "run", lambda self, run=kind.run: (
            alive_at_run.append([any(r() is not None for r in rs) for rs in refs]), run(self))[1])
    del order
    backward_weight(pend)
    assert len(alive_at_run) == len(refs) >= 3
    for k, alive in enumerate(alive_at_run):  # the k-th W runs after the first k were released
        assert alive[:k] == [False] * k and alive[k], (k, alive)
