"""Models and data of the conformance suite: what GPT-style DeepSpeed pipelines use every day.

* the example GPT (``examples/gpt_model.py``), optionally with activation checkpointing;
* a GPT whose token embedding (first stage) is tied to its output projection (last stage) through
  DeepSpeed's ``TiedLayerSpec``, as every GPT pipeline written for DeepSpeed does;
* a plain ``nn.Sequential`` of ``Linear(32, 32)`` layers and a ``Linear(32, 1)`` head given to
  ``PipelineModule`` as it is (``"seq"``; DeepSpeed's own pipeline-module tests build one), with an
  MSE loss or none (``eval_batch`` then returns the outputs);
* data addressed by (pipeline, iteration, micro-batch), optionally of varying sequence length (for
  ``PipelineModule(dynamic_shape=True)``), served as DeepSpeed iterators or as ``batch_source``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

import gpt_model  # noqa: E402

MBS = 2


class TiedEmbedding(nn.Module):
    """Token embedding whose weight is also the output projection (``tied_head``)."""

    def __init__(self, vocab: int, d_model: int, seq_len: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(vocab, d_model, generator=gen) * 0.05)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model, generator=gen) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.long(), self.weight) + self.pos[: tokens.shape[1]]


def tied_head(embedding: TiedEmbedding, x: torch.Tensor) -> torch.Tensor:
    """The last stage's use of the tied module: logits = x @ E^T."""
    return F.linear(x, embedding.weight)


class FinalNorm(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x)


def config(**overrides) -> gpt_model.GPTConfig:
    base = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    base.update(overrides)
    return gpt_model.GPTConfig(**base)


HIDDEN, SEQ_LAYERS = 32, 8


def sequential(seed: int) -> nn.Sequential:
    """``SEQ_LAYERS`` x ``Linear(HIDDEN, HIDDEN)`` and a ``Linear(HIDDEN, 1)`` head, the same weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(SEQ_LAYERS)], nn.Linear(HIDDEN, 1))


def build(model: str, *, num_stages: int, seed: int = 5, loss: str | None = "mse", **kwargs):
    """A ``PipelineModule``: ``model`` is ``"gpt"``, ``"tied"`` or ``"seq"`` (``loss``: ``"mse"`` or
    ``None``); ``kwargs`` go to PipelineModule (``activation_checkpoint_interval``, ``dynamic_shape``, ...)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    cfg = config()
    if model == "gpt":
        return gpt_model.build_pipeline_module(cfg, num_stages=num_stages, seed=seed, **kwargs)
    if model == "seq":  # the nn.Sequential itself, as DeepSpeed's tests pass one
        return PipelineModule(layers=sequential(seed), num_stages=num_stages,
                              loss_fn=nn.MSELoss() if loss == "mse" else None, **kwargs)
    if model != "tied":
        raise ValueError(model)
    torch.manual_seed(seed)
    specs = [TiedLayerSpec("embed", TiedEmbedding, cfg.vocab_size, cfg.d_model, cfg.seq_len, seed,
                           tied_weight_attr=["weight"])]
    specs += [LayerSpec(gpt_model.Block, cfg, seed=seed, layer_index=1 + i) for i in range(cfg.n_layers)]
    specs.append(LayerSpec(FinalNorm, cfg.d_model))
    specs.append(TiedLayerSpec("embed", TiedEmbedding, cfg.vocab_size, cfg.d_model, cfg.seq_len, seed,
                               forward_fn=tied_head, tied_weight_attr=["weight"]))
    return PipelineModule(layers=specs, num_stages=num_stages, loss_fn=gpt_model.gpt_loss_fn,
                          partition_method="uniform", **kwargs)


_CORPUS: dict[int, gpt_model.SyntheticCorpus] = {}


def micro_batch(pipeline: int, iteration: int, microbatch: int, *, dp: int, microbatches: int, dynamic: bool = False,
                split: str = "train", mbs: int = MBS, model: str = "gpt") -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``microbatch`` of ``pipeline`` at ``iteration`` (the same samples wherever it
    runs); ``dynamic`` cuts it to a length that varies with the micro-batch; ``split`` "eval" reads
    other samples; ``model`` "seq": float vectors and targets instead of tokens."""
    seed = 11 if split == "train" else 97
    if model == "seq":
        start = gpt_model.sample_index(pipeline=pipeline, iteration=iteration, microbatch=microbatch, dp=dp,
                                       microbatches=microbatches, micro_batch_size=mbs)
        gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(start, start + mbs)]
        return (torch.stack([torch.randn(HIDDEN, generator=g) for g in gens]),
                torch.stack([torch.randn(1, generator=g) for g in gens]))
    corpus = _CORPUS.setdefault(seed, gpt_model.SyntheticCorpus(config(), seed=seed))
    x, y = gpt_model.micro_batch(corpus, pipeline=pipeline, iteration=iteration, microbatch=microbatch, dp=dp,
                                 microbatches=microbatches, micro_batch_size=mbs)
    if dynamic:
        length = x.shape[1] - 4 * ((iteration + microbatch) % 3)
        x, y = x[:, :length].contiguous(), y[:, :length].contiguous()
    return x, y


def iterator(pipeline: int, *, dp: int, microbatches: int, start: int = 0, **kw):
    """Pipeline ``pipeline``'s micro-batches in DeepSpeed's order, from iteration ``start`` on."""
    it = start
    while True:
        for m in range(microbatches):
            yield micro_batch(pipeline, it, m, dp=dp, microbatches=microbatches, **kw)
        it += 1
