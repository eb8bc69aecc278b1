"""Programs of the conformance suite: one case, run by vanilla DeepSpeed and by ds_resilience in the
same processes, exactly as a DeepSpeed user would drive each (``engine.train_batch(data_iter)``).

A case is a dict: ``model`` ("gpt", "tied" or "seq"), ``pp``, ``microbatches``, ``steps``, ``module``
(PipelineModule kwargs), ``pipeline`` (the DeepSpeed config's ``pipeline`` section), ``dynamic``
(variable sequence lengths), ``mbs``, ``eval`` (also run ``eval_batch``), ``failed`` (ds_resilience
only: ``simulate_failed``, with ``batch_source``), ``resilience`` (extra section keys), ``zero``
(``zero_optimization.stage``), ``clip``, ``precision`` ("bf16", "fp16"), ``optimizer`` (a name of
:data:`OPTIMIZERS` for the config's section, or of :data:`CLIENT_OPTIMIZERS` for ``optimizer=``),
``loss`` ("mse" or None, model "seq"), ``ds_checkpointing`` (``deepspeed.checkpointing.configure``
keywords, applied after initialize), ``eval_data`` ("repeat": one item yielded again, label 0).
"""

from __future__ import annotations

import os
from typing import Any

import conformance_models as cm
import torch

ENGINES = ("vanilla", "resilient")

# the config's "optimizer" section by name. "ds_adam" is DeepSpeed's own pipeline tests' section:
# "Adam" without torch_adam is DeepSpeed's FusedAdam (AdamW mode, weight_decay given), as is "adamw"
OPTIMIZERS: dict[str, dict] = {
    "adam": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "ds_adam": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "sgd": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
    "adagrad": {"type": "Adagrad", "params": {"lr": 0.05}},
}


class BareMomentum(torch.optim.Optimizer):
    """A client's ``torch.optim.Optimizer`` subclass with its own signatures: ``step(self)`` without
    a closure and ``zero_grad(self)`` without ``set_to_none``, as DeepSpeed's FusedLion and
    FusedLamb (which do not run on CPU) declare theirs. SGD with heavy-ball momentum."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = p.grad.detach().clone()
                else:
                    state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def _client_optimizer(name: str, params):
    """What a user passes as ``deepspeed.initialize(optimizer=...)``: an optimizer object, or a
    callable DeepSpeed calls with the model parameters."""
    if name == "client_object":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if name == "client_callable":
        return lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5)
    if name == "client_bare":
        return BareMomentum(params)
    raise ValueError(name)


CLIENT_OPTIMIZERS = ("client_object", "client_callable", "client_bare")


def ds_config(case: dict, dp: int) -> dict[str, Any]:
    m, mbs = case.get("microbatches", 4), case.get("mbs", cm.MBS)
    cfg = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": m,
        "train_batch_size": mbs * m * dp,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": case.get("zero", 0)},
    }
    name = case.get("optimizer", "adam")
    if name not in CLIENT_OPTIMIZERS:  # a client's optimizer: no section (DeepSpeed takes one or the other)
        cfg["optimizer"] = OPTIMIZERS[name]
    if case.get("pipeline"):
        cfg["pipeline"] = dict(case["pipeline"])
    if case.get("clip"):
        cfg["gradient_clipping"] = case["clip"]
    if case.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case.get("precision") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": case.get("scale_power", 8), "loss_scale_window": 2,
                       "hysteresis": 1}
    return cfg


def make_engine(kind: str, case: dict, world: int):
    import deepspeed

    import ds_resilience

    if case.get("precision") == "fp16":
        # DeepSpeed refuses fp16 where the CPU lacks native fp16 (mkldnn); torch runs fp16 on any
        # CPU, slowly: lift the check, for both engines alike
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True

    pp = case["pp"]
    dp = world // pp
    module = cm.build(case["model"], num_stages=pp, loss=case.get("loss", "mse"), **case.get("module", {}))
    config = ds_config(case, dp)
    params = [p for p in module.parameters() if p.requires_grad]
    name = case.get("optimizer", "adam")
    optimizer = _client_optimizer(name, params) if name in CLIENT_OPTIMIZERS else None
    if kind == "vanilla":
        engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params, optimizer=optimizer)
        return _configure_checkpointing(engine, case)
    m = case.get("microbatches", 4)
    config["resilience"] = {"planner": {"solver": "heuristic"}, "simulate_failed": case.get("failed", []),
                            **case.get("resilience", {})}
    kw = _data_kw(case)

    def source(p, i, mb):
        return cm.micro_batch(p, i, mb, dp=dp, microbatches=m, **kw)

    def eval_source(p, step, mb):
        return cm.micro_batch(p, step, mb, dp=dp, microbatches=m, split="eval", **kw)

    kwargs = {"batch_source": source, "eval_source": eval_source} if case.get("failed") else {}
    engine, *_ = ds_resilience.initialize(model=module, config=config, model_parameters=params, optimizer=optimizer,
                                          **kwargs)
    if case.get("ready_path") is False:  # every step speculates or waits, whenever the norm arrives
        engine.executor.ready_path = False
    return _configure_checkpointing(engine, case)


def _data_kw(case: dict) -> dict:
    return {"dynamic": case.get("dynamic", False), "mbs": case.get("mbs", cm.MBS), "model": case["model"]}


def _configure_checkpointing(engine, case: dict):
    """DeepSpeed's activation checkpointing configured after initialize, as its own pipeline-module
    test does (e.g. partitioned, contiguous activations); a process-wide setting. (The engine's
    config without its batch sizes: read without the engine's topology, they would not add up.)"""
    if case.get("ds_checkpointing"):
        import deepspeed

        config = {k: v for k, v in engine.config.items() if k not in ("train_batch_size", "gradient_accumulation_steps")}
        deepspeed.checkpointing.configure(None, deepspeed_config=config, **case["ds_checkpointing"])
    return engine


def _unconfigure_checkpointing(case: dict) -> None:
    """Back to DeepSpeed's defaults (the next engine in these processes starts from them)."""
    if case.get("ds_checkpointing"):
        import deepspeed

        deepspeed.checkpointing.configure(None, partition_activations=False, contiguous_checkpointing=False)
        deepspeed.checkpointing.reset()


def _describe(t) -> dict:
    import torch

    if t is None:
        return {"none": True}
    if isinstance(t, (tuple, list)):
        return {"seq": [_describe(x) for x in t]}
    return {"shape": tuple(t.shape), "dtype": str(t.dtype), "device": str(t.device),
            "value": float(t.reshape(-1)[0]) if t.numel() else None, "cls": type(t).__name__ if not torch.is_tensor(t) else "Tensor"}


def train(kind: str, case: dict, world: int, *, start: int = 0, steps: int | None = None, engine=None,
          load_from: str | None = None, save_to: str | None = None, save_after: int | None = None) -> dict:
    """Train one engine; returns losses, what train_batch/eval_batch returned, the final params."""
    import torch

    pp = case["pp"]
    dp = world // pp
    m = case.get("microbatches", 4)
    steps = case.get("steps", 4) if steps is None else steps
    engine = engine or make_engine(kind, case, world)
    if load_from is not None:
        engine.load_checkpoint(load_from)
    pipeline = engine.grid.data_parallel_id
    kw = _data_kw(case)
    data = cm.iterator(pipeline, dp=dp, microbatches=m, start=start, **kw)
    losses, returned = [], None
    for step in range(steps):
        loss = engine.train_batch(data)
        if loss is not None:
            losses.append(float(loss))
            returned = returned or _describe(loss)
        if save_to is not None and step + 1 == save_after:
            engine.save_checkpoint(save_to, tag="ck")
    out = {"losses": losses, "returned": returned, "stage": engine.stage_id, "pipeline": pipeline,
           "global_steps": engine.global_steps, "global_samples": engine.global_samples, "lr": engine.get_lr(),
           "alive": getattr(engine, "alive", True)}
    if case.get("eval"):
        def eval_data():
            if case.get("eval_data") != "repeat":
                return cm.iterator(pipeline, dp=dp, microbatches=m, start=engine.global_steps, split="eval", **kw)
            # as DeepSpeed's pipeline-module test: one item, yielded again for every micro-batch, an
            # integer label; an iterator on the first and last stages only
            if not (engine.is_first_stage() or engine.is_last_stage()):
                return None
            from deepspeed.utils import RepeatingLoader

            return iter(RepeatingLoader([(cm.micro_batch(pipeline, 0, 0, dp=dp, microbatches=m, split="eval",
                                                         **kw)[0], 0)]))

        value = engine.eval_batch(eval_data())
        out["eval"] = _describe(value)
        out["eval_value"] = value.detach().clone().float() if torch.is_tensor(value) else None
        logits = engine.eval_batch(eval_data(), return_logits=True)
        out["eval_logits"] = _describe(logits[1]) if isinstance(logits, tuple) else None
        out["eval_logits_value"] = (logits[1].detach().clone().float()
                                    if isinstance(logits, tuple) and torch.is_tensor(logits[1]) else None)
    out["param_dtype"] = str(next(engine.module.parameters()).dtype)
    out["params"] = {n: p.detach().clone().float() for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    out["optimizer"] = type(getattr(engine, "basic_optimizer", None) or opt).__name__
    out["loss_scale"] = float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 1.0)) or 1.0)
    out["skipped_steps"] = int(getattr(engine, "skipped_steps", 0))
    validator = getattr(engine, "validator", None)
    out["validation"] = (None if validator is None else
                         {"speculated": validator.speculated, "rolled back": validator.rollbacks, "waited": validator.waited,
                          "ready": validator.ready_steps})
    out["grad_norm"] = engine.get_global_grad_norm()
    sharded = getattr(engine, "sharded_optimizer", None)
    if sharded is not None:
        out["zero"] = {"shard": sharded.shard_numel, "total": sum(sharded.numels), "members": list(sharded.members),
                       "state_bytes": sharded.state_bytes()}
    if hasattr(opt, "masters"):
        out["masters"] = [m.detach().clone() for m in opt.masters]
    if getattr(engine, "persistent_engine", None) is not None:
        engine.persistent_engine.flush()  # what the end of a job does (atexit): its saves are complete
    _unconfigure_checkpointing(case)
    del engine
    torch.distributed.barrier()
    return out


def run_case(rank: int, world: int, case: dict) -> dict:
    """Every variant of the case (``case["variants"]``: name -> overrides; default one, "base"),
    each with every engine (``engines`` of the variant, default both), one after the other in
    these processes; results keyed ``"<variant>/<engine>"``."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, overrides in case.get("variants", {"base": {}}).items():
        merged = {**case, **overrides}
        for kind in merged.get("engines", ENGINES):
            out[f"{name}/{kind}"] = train(kind, merged, world)
    torch.distributed.barrier()
    return out


def round_trip(rank: int, world: int, case: dict, root: str) -> dict:
    """For every (saver, loader) pair of engines (``cross`` false: each engine loads its own only):
    the saver trains ``steps`` steps saving after ``save_after``; a fresh loader loads that
    checkpoint and trains the remaining steps with the iterator restarted there. The loader must
    end where the saver did."""
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    steps, save_after = case.get("steps", 4), case.get("save_after", 2)
    out: dict = {}
    engines = case.get("engines", ENGINES)
    for saver in engines:
        save_dir = os.path.join(root, saver)
        full = train(saver, case, world, steps=steps, save_to=save_dir, save_after=save_after)
        out[f"{saver}-uninterrupted"] = full
        for loader in engines if case.get("cross", True) else [saver]:
            engine = make_engine(loader, case, world)
            out[f"{saver}->{loader}"] = train(loader, case, world, start=save_after, steps=steps - save_after,
                                               engine=engine, load_from=save_dir)
    torch.distributed.barrier()
    return out
