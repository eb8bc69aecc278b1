"""A small GPT and a synthetic corpus for CPU pipeline-training runs (tests, benchmarks, demo).

Importable as a plain module (``sys.path.insert(0, "examples"); import gpt_model``); it imports
only the standard library, torch and deepspeed (lazily, for :func:`build_pipeline_module`).

Model
    ``[EmbeddingLayer, Block x n_layers, Head]``: one ``nn.Module`` per pipeline layer, so a
    DeepSpeed ``PipelineModule`` can cut between any two of them. Activations between layers are a
    single ``[B, T, d_model]`` tensor; the first layer takes int64 token ids ``[B, T]`` and the last
    returns logits ``[B, T, vocab_size]``. ``tied=True`` (:func:`gpt_layer_specs`) ties the token
    embedding to the output projection as GPT-2 does, through DeepSpeed's ``TiedLayerSpec``:
    ``[TokenEmbedding (tied), PositionEmbedding, Block x n_layers, FinalNorm, TokenEmbedding (tied,
    as the logits)]``, the first and last stage each holding a copy DeepSpeed keeps equal.

Determinism
    Each layer draws its initial weights from its own ``torch.Generator`` seeded with
    ``seed * 1000 + layer_index`` and never touches the global RNG, so layer ``i`` has the same
    weights whichever process, stage or partition builds it, and in whatever order.
    :func:`build_full_model` and :func:`build_pipeline_module` with the same seed hold the same
    weights, under the same names: ``"<global layer index>.<param>"`` (``nn.Sequential`` and
    ``PipelineModule`` both name their children by layer index).

Data
    :class:`SyntheticCorpus` is an infinite, indexable language: sample ``i`` is a pure function of
    ``(seed, i)``: walks of a sparse random Markov chain (a bigram model learns them within tens of
    steps), a quarter of them a short walk repeated (attention can learn to copy it). :func:`micro_batch` maps (pipeline, iteration, micro-batch) to global sample indices;
    :func:`data_iterator` yields a pipeline's micro-batches in the order DeepSpeed's
    ``PipelineEngine.train_batch`` consumes them.

Global sample layout (``G = dp * microbatches * micro_batch_size`` samples per iteration)::

    iteration i            : samples [i*G, (i+1)*G)
    pipeline p             : its contiguous shard [i*G + p*M*b, i*G + (p+1)*M*b)
    micro-batch m of p     : [i*G + (p*M + m)*b, i*G + (p*M + m + 1)*b)

(``torch.utils.data.DistributedSampler`` would stride rather than shard contiguously; the math of a
global batch is the same, and contiguous shards make "whose micro-batch is this" a one-liner.)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig", "EmbeddingLayer", "Block", "Head", "gpt_layer_specs", "gpt_loss_fn",
    "build_pipeline_module", "build_full_model", "layer_seed", "SyntheticCorpus", "sample_index",
    "micro_batch", "data_iterator", "CorpusDataset",
]

_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the example GPT. ``dtype`` is that of every parameter (float32 or float64)."""

    vocab_size: int = 96
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.0
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.n_layers, bool) or not isinstance(self.n_layers, int) or self.n_layers < 0:
            raise ValueError(f"GPTConfig.n_layers must be an integer >= 0, got {self.n_layers!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by "
                             f"n_heads ({self.n_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"GPTConfig.dtype must be torch.float32 or torch.float64, got {self.dtype}")
        if self.vocab_size < 4:
            raise ValueError(f"GPTConfig.vocab_size must be >= 4, got {self.vocab_size}")

    @property
    def num_layers_total(self) -> int:
        """Pipeline layers: embedding + blocks + head."""
        return self.n_layers + 2


def layer_seed(seed: int, layer_index: int) -> int:
    """The seed of layer ``layer_index``'s initial weights."""
    return seed * 1000 + layer_index


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (2**63))


def _init_linear(linear: nn.Linear, gen: torch.Generator, std: float = _INIT_STD) -> None:
    with torch.no_grad():
        nn.init.normal_(linear.weight, 0.0, std, generator=gen)
        if linear.bias is not None:
            linear.bias.zero_()


class EmbeddingLayer(nn.Module):
    """Token + learned positional embedding: int64 ids ``[B, T]`` -> ``[B, T, d_model]``."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model, dtype=cfg.dtype)
        self.drop = nn.Dropout(cfg.dropout)
        gen = _generator(layer_seed(seed, layer_index))
        with torch.no_grad():
            nn.init.normal_(self.tok.weight, 0.0, _INIT_STD, generator=gen)
            nn.init.normal_(self.pos.weight, 0.0, _INIT_STD, generator=gen)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"EmbeddingLayer expects token ids [B, T], got shape {tuple(tokens.shape)}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens.long()) + self.pos(positions))


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention (plain matmuls) and a GELU MLP."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 1) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d, dtype=cfg.dtype)
        self.qkv = nn.Linear(d, 3 * d, dtype=cfg.dtype)
        self.proj = nn.Linear(d, d, dtype=cfg.dtype)
        self.ln2 = nn.LayerNorm(d, dtype=cfg.dtype)
        self.fc = nn.Linear(d, 4 * d, dtype=cfg.dtype)
        self.out = nn.Linear(4 * d, d, dtype=cfg.dtype)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril()
        self.register_buffer("causal", mask, persistent=False)
        gen = _generator(layer_seed(seed, layer_index))
        # GPT-2 style: residual projections scaled down by depth
        resid_std = _INIT_STD / math.sqrt(2 * max(cfg.n_layers, 1))
        for linear, std in ((self.qkv, _INIT_STD), (self.proj, resid_std),
                            (self.fc, _INIT_STD), (self.out, resid_std)):
            _init_linear(linear, gen, std)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.reshape(B, T, h, d // h).transpose(1, 2) for t in (q, k, v))  # [B, h, T, hd]
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        scores = scores.masked_fill(~self.causal[:T, :T], float("-inf"))
        weights = self.attn_drop(torch.softmax(scores, dim=-1))
        y = torch.matmul(weights, v).transpose(1, 2).reshape(B, T, d)
        return self.resid_drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.resid_drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    """Final LayerNorm and the (untied) projection to the vocabulary: -> logits ``[B, T, V]``."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model, dtype=cfg.dtype)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, dtype=cfg.dtype)
        _init_linear(self.lm, _generator(layer_seed(seed, layer_index)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class TokenEmbedding(nn.Module):
    """The token embedding alone (``tied=True``): ids ``[B, T]`` -> ``[B, T, d_model]``; as the
    tied output projection (:func:`tied_logits`) its weight gives the logits."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype))
        with torch.no_grad():
            nn.init.normal_(self.weight, 0.0, _INIT_STD, generator=_generator(layer_seed(seed, layer_index)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.long(), self.weight)


def tied_logits(embedding: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The tied output projection: ``[B, T, d_model]`` -> logits ``[B, T, V]``."""
    return torch.matmul(x, embedding.weight.t())


class PositionEmbedding(nn.Module):
    """Adds the learned positional embedding (``tied=True``, after the token embedding)."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 1) -> None:
        super().__init__()
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model, dtype=cfg.dtype)
        self.drop = nn.Dropout(cfg.dropout)
        with torch.no_grad():
            nn.init.normal_(self.pos.weight, 0.0, _INIT_STD, generator=_generator(layer_seed(seed, layer_index)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.pos(torch.arange(x.shape[1], device=x.device)))


class FinalNorm(nn.Module):
    """The final LayerNorm (``tied=True``: the projection is the tied embedding)."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, layer_index: int = 0) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def gpt_layer_specs(cfg: GPTConfig, seed: int = 0, tied: bool = False) -> list:
    """DeepSpeed ``LayerSpec`` s of the model, one per pipeline layer, each seeded by its index.
    ``tied``: the token embedding and the output projection share one weight (module docstring)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if tied:
        n = cfg.n_layers
        return ([TiedLayerSpec("embed", TokenEmbedding, cfg, seed=seed, layer_index=0, tied_weight_attr="weight"),
                 LayerSpec(PositionEmbedding, cfg, seed=seed, layer_index=1)]
                + [LayerSpec(Block, cfg, seed=seed, layer_index=2 + i) for i in range(n)]
                + [LayerSpec(FinalNorm, cfg, seed=seed, layer_index=n + 2),
                   TiedLayerSpec("embed", TokenEmbedding, cfg, seed=seed, layer_index=0, forward_fn=tied_logits,
                                 tied_weight_attr="weight")])
    specs = [LayerSpec(EmbeddingLayer, cfg, seed=seed, layer_index=0)]
    specs += [LayerSpec(Block, cfg, seed=seed, layer_index=1 + i) for i in range(cfg.n_layers)]
    specs.append(LayerSpec(Head, cfg, seed=seed, layer_index=cfg.n_layers + 1))
    return specs


def gpt_loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long())


def build_pipeline_module(cfg: GPTConfig, num_stages: int, seed: int,
                          partition_method: str = "uniform", tied: bool = False, **kwargs):
    """A DeepSpeed ``PipelineModule`` of the GPT; needs ``torch.distributed`` initialized.

    Only the local stage's layers are built, each with the same weights as in
    :func:`build_full_model` (per-layer seeds; ``tied``: the tied model of :func:`gpt_layer_specs`,
    which :func:`build_full_model` does not build). ``kwargs`` go to ``PipelineModule``.
    """
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(seed)  # global RNG (dropout) identical on every rank at the start
    return PipelineModule(layers=gpt_layer_specs(cfg, seed, tied), num_stages=num_stages, loss_fn=gpt_loss_fn,
                          partition_method=partition_method, **kwargs)


def build_full_model(cfg: GPTConfig, seed: int) -> nn.Sequential:
    """The whole GPT in one ``nn.Sequential``, same layers and weights as the pipeline module."""
    torch.manual_seed(seed)
    layers = [EmbeddingLayer(cfg, seed=seed, layer_index=0)]
    layers += [Block(cfg, seed=seed, layer_index=1 + i) for i in range(cfg.n_layers)]
    layers.append(Head(cfg, seed=seed, layer_index=cfg.n_layers + 1))
    return nn.Sequential(*layers)


# --- data ---------------------------------------------------------------------------------------
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A stable 63-bit hash of integers (splitmix64 chain); the same in every process and run."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


class SyntheticCorpus:
    """A deterministic synthetic language over ``cfg.vocab_size`` tokens, indexable without end.

    Every sample is built from walks of a sparse Markov chain (fixed by ``seed``): each token has
    ``branching`` successors with random probabilities, so the next-token entropy (about 1.3 nats
    for the defaults) is far below ``log(vocab_size)`` (4.56) and a bigram model gets most of the way
    within ~100 Adam steps. Two kinds, chosen per sample (probability ``copy_fraction`` for the second):

    * one walk over the whole sequence;
    * a walk of 3..8 tokens repeated over the whole sequence: after one period the rest is
      predictable exactly by copying from ``period`` positions back (room below the bigram loss).

    :meth:`sample` is a pure function of ``(seed, global_index)``.
    """

    def __init__(self, cfg: GPTConfig, seed: int, *, branching: int = 4, copy_fraction: float = 0.25) -> None:
        if not 1 <= branching <= cfg.vocab_size:
            raise ValueError(f"branching must be in [1, {cfg.vocab_size}], got {branching}")
        if not 0.0 <= copy_fraction <= 1.0:
            raise ValueError(f"copy_fraction must be in [0, 1], got {copy_fraction}")
        self.cfg = cfg
        self.seed = int(seed)
        self.copy_fraction = float(copy_fraction)
        gen = _generator(_mix(self.seed, 0xC0))
        V = cfg.vocab_size
        successors = torch.stack([torch.randperm(V, generator=gen)[:branching] for _ in range(V)])
        weights = torch.rand(V, branching, generator=gen, dtype=torch.float64) + 0.1
        probs = weights / weights.sum(dim=1, keepdim=True)
        #: successors[v] and their probabilities, as Python lists for fast sequential sampling
        self._succ = successors.tolist()
        self._cum = probs.cumsum(dim=1).tolist()
        for row in self._cum:
            row[-1] = 1.0 + 1e-9
        self.transition = torch.zeros(V, V, dtype=torch.float64)
        self.transition.scatter_(1, successors, probs)

    def sample(self, global_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, labels)``, each int64 ``[seq_len]``; ``labels`` is ``tokens`` shifted by one."""
        if global_index < 0:
            raise ValueError(f"global_index must be >= 0, got {global_index}")
        T, V = self.cfg.seq_len, self.cfg.vocab_size
        gen = _generator(_mix(self.seed, int(global_index)))
        kind, first, period = torch.rand(3, generator=gen, dtype=torch.float64).tolist()
        draws = torch.rand(T, generator=gen, dtype=torch.float64).tolist()
        length = T + 1
        if kind < self.copy_fraction:
            length = 3 + min(int(period * 6), 5)  # a period of 3..8 tokens
        token = min(int(first * V), V - 1)
        walk = [token]
        for u in draws[: length - 1]:
            token = self._succ[token][bisect_right(self._cum[token], u)]
            walk.append(token)
        seq = torch.tensor((walk * (T // length + 2))[: T + 1], dtype=torch.int64)
        return seq[:-1].clone(), seq[1:].clone()

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack the samples of ``indices`` into ``([len, T], [len, T])``."""
        pairs = [self.sample(i) for i in indices]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _check_layout(pipeline: int, dp: int, microbatches: int, micro_batch_size: int) -> None:
    for name, value in (("dp", dp), ("microbatches", microbatches), ("micro_batch_size", micro_batch_size)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= pipeline < dp:
        raise ValueError(f"pipeline must be in [0, {dp}), got {pipeline}")


def sample_index(*, pipeline: int, iteration: int, microbatch: int, dp: int, microbatches: int,
                 micro_batch_size: int) -> int:
    """Global index of the first sample of that micro-batch (see the module docstring)."""
    _check_layout(pipeline, dp, microbatches, micro_batch_size)
    if iteration < 0 or not 0 <= microbatch < microbatches:
        raise ValueError(f"need iteration >= 0 and 0 <= microbatch < {microbatches}, "
                         f"got iteration={iteration}, microbatch={microbatch}")
    global_batch = dp * microbatches * micro_batch_size
    return iteration * global_batch + (pipeline * microbatches + microbatch) * micro_batch_size


def micro_batch(corpus: SyntheticCorpus, *, pipeline: int, iteration: int, microbatch: int, dp: int,
                microbatches: int, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch ``(inputs, labels)``, each int64 ``[micro_batch_size, T]``, that pipeline
    ``pipeline`` trains on at ``iteration`` as its micro-batch ``microbatch``. Any process can load
    any pipeline's micro-batch."""
    start = sample_index(pipeline=pipeline, iteration=iteration, microbatch=microbatch, dp=dp,
                         microbatches=microbatches, micro_batch_size=micro_batch_size)
    return corpus.batch(range(start, start + micro_batch_size))


def data_iterator(corpus: SyntheticCorpus, *, pipeline: int, dp: int, microbatches: int,
                  micro_batch_size: int, start_iteration: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pipeline ``pipeline``'s micro-batches, without end, in the order DeepSpeed's
    ``PipelineEngine.train_batch`` reads them (``microbatches`` per call, on the first and the last
    stage, each of which gets the whole ``(inputs, labels)`` tuple)."""
    _check_layout(pipeline, dp, microbatches, micro_batch_size)
    if start_iteration < 0:
        raise ValueError(f"start_iteration must be >= 0, got {start_iteration}")
    return _iterate(corpus, pipeline, dp, microbatches, micro_batch_size, start_iteration)


def _iterate(corpus, pipeline, dp, microbatches, micro_batch_size, iteration):
    while True:
        for m in range(microbatches):
            yield micro_batch(corpus, pipeline=pipeline, iteration=iteration, microbatch=m, dp=dp,
                              microbatches=microbatches, micro_batch_size=micro_batch_size)
        iteration += 1


class CorpusDataset(torch.utils.data.Dataset):
    """The first ``size`` samples of a corpus as a map-style torch ``Dataset``: item ``i`` is
    ``corpus.sample(i)``, ``(tokens, labels)``. What a DeepSpeed user passes as
    ``initialize(training_data=...)``: DeepSpeed's ``DistributedSampler`` picks each data-parallel
    rank's items and its loader batches them (the default collate stacks the pairs)."""

    def __init__(self, corpus: SyntheticCorpus, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.corpus, self.size = corpus, int(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for a dataset of {self.size}")
        return self.corpus.sample(index)
