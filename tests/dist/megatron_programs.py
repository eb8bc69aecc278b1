"""Worker programs for tests/dist/test_megatron.py: a megatron-core GPTModel (tied embeddings) trained
by a single-process reference and by the resilient forward-backward under PP x DP (module-level:
the harness pickles them by reference)."""

from __future__ import annotations

import argparse
import functools
from unittest import mock

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, MBS = 4, 32, 4, 64, 16, 2
EVAL_MICRO, EVAL_ITERATION = 2, 100


def _megatron(tp: int, pp: int, device: str = "cpu"):
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":  # megatron-core's own CUDA path: NCCL, one GPU per rank, its CUDA RNG tracker
        torch.cuda.set_device(int(os.environ.get("RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if device == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return parallel_state


def _model(pre_process: bool = True, post_process: bool = True, pp: int = 1, tp: int = 1, recompute: str | None = None,
           bf16: bool = False):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_resilience.megatron.attention import device_safe_layer_spec

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                               pipeline_dtype=torch.bfloat16 if bf16 else torch.float32, bf16=bf16,
                               pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp, **_RECOMPUTE[recompute])
    # megatron-core moves the tied output weight to CUDA before its first-to-last-stage all-reduce
    # (LanguageModule.setup_embeddings_and_output_layer); on CPU that copy is the identity
    cpu = mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self)
    with cpu if not torch.cuda.is_available() else mock.MagicMock():
        return GPTModel(config=config, transformer_layer_spec=device_safe_layer_spec(get_gpt_layer_local_spec()),
                        vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="learned_absolute",
                        pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=True)


# megatron-core's activation recompute settings (Megatron-LM: --recompute-granularity full
# --recompute-method uniform --recompute-num-layers 1, or --recompute-granularity selective)
_RECOMPUTE = {None: {}, "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": 1},
              "selective": {"recompute_granularity": "selective"}}


def make_item(pipeline: int, iteration: int, microbatch: int) -> dict:
    """The micro-batch pipeline ``pipeline``'s data iterator yields at (iteration, microbatch)."""
    import torch

    g = torch.Generator().manual_seed(1000 * iteration + 100 * pipeline + microbatch)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
    mask = torch.ones(MBS, SEQ)
    mask[:, : microbatch + 1] = 0.0  # a different number of counted tokens per micro-batch
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, -1),
            "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1) > 0.5}


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's current form: (sum of the masked losses, tokens counted, logging dict)."""
    import torch

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


def forward_step(data_iterator, model):
    """Megatron-LM's forward_step: read the micro-batch, run the model, return the loss function."""
    item = next(data_iterator)
    device = next(model.parameters()).device  # Megatron-LM's get_batch moves the batch to the GPU
    item = {k: v.to(device) for k, v in item.items()}
    output = model(item["tokens"], item["position_ids"], item["attention_mask"], labels=item["labels"])
    return output, functools.partial(loss_func, item["loss_mask"])


def _optimizer(params, kind: str):
    import torch

    return torch.optim.Adam(params, lr=1e-3) if kind == "adam" else torch.optim.SGD(params, lr=0.5)


def reference(rank: int, world: int, init_path: str, iterations: int, dp: int, microbatches: int, clip: float,
              opt_kind: str = "adam", device: str = "cpu"):
    """One process, the whole model: each iteration averages every micro-batch of every pipeline,
    clips by the global norm (Megatron's coefficient) and steps Adam."""
    import torch

    _megatron(1, 1, device)
    torch.manual_seed(0)
    model = _model()
    torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, init_path)
    model = model.to(device)
    opt = _optimizer(model.parameters(), opt_kind)
    losses = []
    for it in range(iterations):
        opt.zero_grad()
        total = 0.0
        if device == "cuda":  # megatron-core's own schedule (forward_backward_no_pipelining, its CUDA path)
            from megatron.core.pipeline_parallel import get_forward_backward_func

            items = iter([make_item(p, it, m) for p in range(dp) for m in range(microbatches)])
            reduced = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=items, model=[model],
                                                  num_microbatches=dp * microbatches, seq_length=SEQ,
                                                  micro_batch_size=MBS, forward_only=False)
            total = sum(float(d["lm loss"][0] / d["lm loss"][1]) for d in reduced)
        for p in range(dp if device != "cuda" else 0):
            for m in range(microbatches):
                output, lf = forward_step(iter([make_item(p, it, m)]), model)
                loss_sum, tokens, _ = lf(output)
                loss = loss_sum / tokens
                (loss / (dp * microbatches)).backward()
                total += float(loss)
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
        coef = clip / (float(norm) + 1e-6)
        if clip > 0 and coef < 1.0:
            for p in model.parameters():
                p.grad.mul_(coef)
        opt.step()
        losses.append(total / (dp * microbatches))
    evals = {}
    with torch.no_grad():
        for p in range(dp):
            for m in range(EVAL_MICRO):
                output, lf = forward_step(iter([make_item(p, EVAL_ITERATION, m)]), model)
                loss_sum, tokens, _ = lf(output)
                evals[(p, m)] = (float(loss_sum), int(tokens))
    return {"params": {k: v.detach().cpu().clone() for k, v in model.named_parameters()}, "losses": losses,
            "evals": evals}


def reference_bf16(rank: int, world: int, init_path: str, iterations: int, dp: int, microbatches: int, clip: float,
                   opt_kind: str = "adam"):
    """The single-process reference in bf16 as Megatron-LM runs it: the model behind Float16Module,
    fp32 master weights, each micro-batch's gradient accumulated into the masters in fp32, the
    global norm and clipping on the masters, Adam on the masters. Returns the masters by name."""
    import torch
    from megatron.core.transformer.module import Float16Module

    from ds_resilience.runtime.precision import MixedPrecisionOptimizer

    _megatron(1, 1)
    model = _model(bf16=True)
    init = torch.load(init_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    model = Float16Module(model.config, model)
    opt = MixedPrecisionOptimizer(_optimizer(model.parameters(), opt_kind), list(model.parameters()))
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]
    for it in range(iterations):
        opt.zero_grad()
        for p in range(dp):
            for m in range(microbatches):
                output, lf = forward_step(iter([make_item(p, it, m)]), model)
                loss_sum, tokens, _ = lf(output)
                (loss_sum / tokens / (dp * microbatches)).backward()
                opt.accumulate()
        norm = torch.sqrt(sum(m.grad.double().pow(2).sum() for m in opt.masters))
        coef = clip / (float(norm) + 1e-6)
        if clip > 0 and coef < 1.0:
            for m in opt.masters:
                m.grad.mul_(coef)
        opt.step()
    return {"params": {n: m.detach().clone() for n, m in zip(names, opt.masters)}}


def _global_name(name: str, stage: int, per_stage: int) -> str:
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(index) + stage * per_stage}.{rest}"
    return name


def _shard(full, param, tp_rank: int, tp: int):
    """This tensor-parallel rank's part of a whole weight (megatron-core marks the split dimension)."""
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        return full.chunk(tp, dim=param.partition_dim)[tp_rank]
    return full


def pipelined(rank: int, world: int, init_path: str, iterations: int, pp: int, microbatches: int, clip: float,
              failed: list, reroute_data: bool, variant: str, tp: int = 1, opt_kind: str = "adam",
              device: str = "cpu", save_dir: str | None = None, load_dir: str | None = None,
              recompute: str | None = None, bf16: bool = False):
    """Megatron-LM's training loop shape over the resilient forward-backward: the hook's arguments,
    config_from_args, install(), get_forward_backward_func(), then optimizer.step()."""
    import torch

    from ds_resilience.megatron import (ResilientForwardBackward, ResilientOptimizer, add_resilience_args,
                                       config_from_args, install)
    from ds_resilience.topology import parse_worker

    ps = _megatron(tp, pp, device)
    stage = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp = world // (pp * tp)
    parser = add_resilience_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--resilience", "--resilience-variant", variant, "--resilience-max-failures", "0"])
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size = tp, pp, dp
    args.micro_batch_size, args.global_batch_size, args.clip_grad, args.seed = MBS, MBS * dp * microbatches, clip, 1234
    job = config_from_args(args)
    model = _model(pre_process=stage == 0, post_process=stage == pp - 1, pp=pp, tp=tp, recompute=recompute, bf16=bf16)
    init = torch.load(init_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_shard(init[_global_name(name, stage, LAYERS // pp)], p, tp_rank, tp))
    model = model.to(device)
    if bf16:  # Megatron-LM's bf16 chunk: Float16Module; fp32 masters in the optimizer
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
        optimizer = ResilientOptimizer.with_fp32_masters(_optimizer(model.parameters(), opt_kind), model)
    else:
        optimizer = ResilientOptimizer(_optimizer(model.parameters(), opt_kind))
    fb = ResilientForwardBackward(job, optimizer, batches=make_item if reroute_data else None,
                                  simulate_failed=[parse_worker(w) for w in failed],
                                  eval_batches=(lambda p, e, m: make_item(p, EVAL_ITERATION + e, m)) if reroute_data
                                  else None)
    install(fb)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pipeline = ps.get_data_parallel_rank()
    start = 0
    if load_dir is not None:  # a restart from a Megatron-format checkpoint
        from ds_resilience.megatron.checkpoint import load_checkpoint

        start = load_checkpoint(load_dir, model=model, optimizer=optimizer, tp_rank=tp_rank, pp_rank=stage, pp=pp,
                                forward_backward=fb)
    data = iter([make_item(pipeline, it, m) for it in range(start, iterations) for m in range(microbatches)])
    logged, results = [], []
    for _ in range(start, iterations):
        optimizer.zero_grad()
        fbf = get_forward_backward_func()
        reduced = fbf(forward_step_func=forward_step, data_iterator=data, model=[model],
                      num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        results.append(optimizer.step() if fb.rt.executor.groups is not None else None)
        logged.append(len(reduced))
    saved = None
    if save_dir is not None:
        from ds_resilience.megatron.checkpoint import save_checkpoint

        saved = save_checkpoint(fb, save_dir, iterations, model=model, optimizer=optimizer, args=args)
        saved = str(saved) if saved is not None else None
    evaluation = iter([make_item(pipeline, EVAL_ITERATION, m) for m in range(EVAL_MICRO)])
    reduced = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=evaluation, model=[model],
                                          num_microbatches=EVAL_MICRO, seq_length=SEQ, micro_batch_size=MBS,
                                          forward_only=True)
    evals = [(float(d["lm loss"][0]), int(d["lm loss"][1])) for d in reduced]
    torch.distributed.barrier()  # an idle rank 0 hosts the store: it leaves with everyone
    lp_named = [(n.removeprefix("module."), p) for n, p in model.named_parameters()]
    named = lp_named
    if bf16:  # the fp32 masters, what the reference compares
        named = [(n, m) for (n, _), m in zip(lp_named, optimizer.optimizer.masters)]
    params = {_global_name(n, stage, LAYERS // pp): p.detach().cpu().clone() for n, p in named}
    split = {_global_name(n, stage, LAYERS // pp): (p.partition_dim if tp > 1 and getattr(p, "tensor_model_parallel",
                                                                                           False) else None)
             for n, p in lp_named}
    return {"stage": stage, "pipeline": pipeline, "tp_rank": tp_rank, "tp": tp, "split": split, "params": params,
            "logged": logged, "evals": evals, "saved": saved, "start": start,
            "results": [(r[0], r[1]) if r else None for r in results]}


def attention_check(rank: int, world: int) -> dict:
    """DeviceSafeDotProductAttention on CPU against plain causal softmax attention."""
    import math

    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_resilience.megatron.attention import DeviceSafeDotProductAttention

    _megatron(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               attention_dropout=0.0)
    attn = DeviceSafeDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self")
    s, b, n, d = 8, 2, 4, 8
    torch.manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d) for _ in range(3))
    mask = torch.triu(torch.ones(1, 1, s, s), diagonal=1) > 0.5
    got = attn(q, k, v, mask)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(mask, float("-inf"))
    want = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * d)
    return {"diff": float((got - want).abs().max()), "is_subclass": issubclass(type(attn), DotProductAttention)}


def split_check(rank: int, world: int, tp: int = 1) -> dict:
    """A decoder chunk (no embedding, no head) split into B then W against one fused backward on the
    same input: bit-equality of the input and every parameter gradient, how many W groups took a
    fast path, and whether B left megatron-core's main_grad attribute behind."""
    import torch

    from ds_resilience.runtime.bw_split import backward_fused, backward_input, backward_weight

    _megatron(tp, 1)
    torch.manual_seed(0)
    model = _model(pre_process=False, post_process=False, tp=tp)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # biases away from zero, so their gradients' path matters
        p.data.add_(torch.randn_like(p) * 0.02)
    x0, g = torch.randn(SEQ, MBS, HIDDEN), torch.randn(SEQ, MBS, HIDDEN)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1) > 0.5
    got, fast, autograd = [], [], []
    for split in (True, True, False):  # twice split: the second micro-batch reuses the cached analysis
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        model.set_input_tensor(x)
        y = model(None, None, attention_mask=mask)
        if split:
            (dx,), pending = backward_input(y, g, x, params)
            fast.append(len(pending._fast))
            autograd.append(len(pending._groups))
            del y
            backward_weight(pending)
        else:
            (dx,) = backward_fused(y, g, x, params)
        got.append([dx] + [p.grad.clone() for p in params])
    equal = all(len(a) == len(got[-1]) and all(torch.equal(u, v) for u, v in zip(a, got[-1])) for a in got[:2])
    return {"equal": equal, "fast": fast, "autograd": autograd, "groups": len(params),
            "main_grad": any(hasattr(p, "main_grad") for p in params)}


def ddp_refusal(rank: int, world: int, bf16_plain: bool = False) -> str:
    """A chunk whose parameters carry megatron-core DDP's main_grad is refused with the fix named;
    ``bf16_plain``: a --bf16 job whose optimizer has no fp32 masters, refused the same way."""
    import torch

    from ds_resilience.errors import ConfigError
    from ds_resilience.megatron import ResilientForwardBackward, ResilientOptimizer, add_resilience_args, config_from_args

    _megatron(1, 1)
    args = add_resilience_args(argparse.ArgumentParser()).parse_args(["--resilience"])
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size = 1, 1, 1
    args.micro_batch_size, args.global_batch_size = MBS, MBS
    model = _model()
    if bf16_plain:
        args.bf16 = True
    else:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)  # what megatron-core's DistributedDataParallel adds
    fb = ResilientForwardBackward(config_from_args(args), ResilientOptimizer(torch.optim.SGD(model.parameters(), 0.1)))
    try:
        fb(forward_step_func=forward_step, data_iterator=iter([]), model=[model], num_microbatches=1,
           seq_length=SEQ, micro_batch_size=MBS)
    except ConfigError as exc:
        return str(exc)
    return "not refused"
