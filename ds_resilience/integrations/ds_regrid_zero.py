"""ZeRO-1 in a live re-grid: a stage's sharded optimizer state made whole, cut into layers, and
sharded again over the new grid's replicas of each new stage (issue 46).

The layer cut (``checkpoint/layer_state.py``) needs a torch optimizer ``state_dict`` with one state
per parameter. Under ZeRO-1 (``runtime/zero.py``) each replica of a stage holds only its range of
each parameter group's flat index space, and a dead replica's range is in its snapshot. So:

1. :func:`assemble`: one collective over the survivors. Every survivor brings the shards it holds
   (its own, and the dead ranks' from the snapshot tier); each old stage's ranges are summed into
   full flat buffers (each range taken from one holder), kept by the survivors that cut that stage;
2. :func:`unshard`: a stage's state with those buffers laid out per parameter (the parameters of
   each group in the order the sharded optimizer flattened them, ``extra["zero_groups"]`` of the
   snapshot: :func:`zero_groups`), as the unsharded optimizer of the stage would hold it;
3. after the moves, the new stage's unsharded state (``layer_state.stage_state`` over
   :func:`unsharded_param_groups`) is cut again to this replica's range of the new partition
   (:func:`reshard_state`), which its ``ShardedOptimizer`` (bound to the new replicas) loads.

Mixed precision keeps its wrapper (``{"optimizer", "masters", ...}``) around each form.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..runtime.precision import MixedPrecisionOptimizer
from ..runtime.zero import Partition, ShardedOptimizer

__all__ = ["assemble", "reshard_state", "shard_of", "unshard", "unsharded_param_groups", "zero_groups"]


def _mixed(optimizer: Any) -> bool:
    return isinstance(optimizer, Mapping) and "masters" in optimizer and "optimizer" in optimizer


def shard_of(optimizer_state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ZeRO-1 shard (``{"zero_stage": 1, "partition", "index", "optimizer"}``) of an engine optimizer's state."""
    return optimizer_state["optimizer"] if _mixed(optimizer_state) else optimizer_state


def zero_groups(sharded: ShardedOptimizer, optimizer: Any, parameters: Sequence[torch.Tensor]) -> list[list[int]]:
    """Each parameter group's parameters as stage parameter indices, in the order ``sharded``
    flattens them (under mixed precision its parameters are the fp32 masters of ``parameters``)."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        index = {id(m): i for i, m in enumerate(optimizer.masters)}
    else:
        index = {id(p): i for i, p in enumerate(parameters)}
    return [[index[id(p)] for p in ps] for ps in sharded.full]


def assemble(world: Any, entries: Sequence[tuple[int, Mapping[str, Any]]], need: set[int]) -> dict[int, dict]:
    """Collective over ``world`` (the survivors): ``entries`` are ``(old stage, ZeRO-1 shard)`` this
    rank holds; returns ``{stage: {group: {key: full tensor or scalar}}}`` for the stages in ``need``.

    Raises:
        RuntimeError: a stage's shards come from different partitions, or a range is held by no one.
    """
    mine = []
    for stage, shard in entries:
        keys, scalars = {}, {}
        for g, st in shard["optimizer"]["state"].items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    keys[f"{g}/{k}"] = str(v.dtype).removeprefix("torch.")
                else:
                    scalars[f"{g}/{k}"] = ([str(v.dtype).removeprefix("torch."), float(v)] if torch.is_tensor(v)
                                           else ["", v])
        mine.append({"stage": stage, "partition": shard["partition"], "index": int(shard["index"]),
                     "keys": keys, "scalars": scalars})
    gathered = world.all_gather_json(mine)
    me = world.index[world.me]
    out: dict[int, dict] = {}
    for stage in sorted({e["stage"] for part in gathered for e in part}):
        held = [(pos, e) for pos, part in enumerate(gathered) for e in part if e["stage"] == stage]
        partitions = {repr(sorted(e["partition"].items())) for _, e in held}
        if len(partitions) != 1:
            raise RuntimeError(f"ZeRO-1 re-grid: stage {stage}'s shards come from {len(partitions)} partitions")
        partition = Partition.from_json(held[0][1]["partition"])
        source: dict[int, int] = {}
        for pos, e in held:
            source.setdefault(e["index"], pos)
        missing = [partition.members[i] for i in range(len(partition.members)) if i not in source]
        if missing:
            raise RuntimeError(f"ZeRO-1 re-grid: the optimizer ranges of stage {stage}'s pipelines {missing} are "
                               f"held by no survivor and no snapshot")
        keys = sorted({k: d for _, e in held for k, d in e["keys"].items()}.items())
        state: dict[int, dict[str, Any]] = {}
        for key, dtype in keys:
            g_text, k = key.split("/", 1)
            g = int(g_text)
            buf = torch.zeros(partition.numels[g], dtype=getattr(torch, dtype))
            for s, shard in entries:
                i = int(shard["index"])
                if s != stage or source.get(i) != me:
                    continue
                value = shard["optimizer"]["state"].get(g, shard["optimizer"]["state"].get(str(g), {})).get(k)
                if value is not None:
                    lo, hi = partition.bounds(g, i)
                    buf[lo:hi] = value
            world.all_reduce(buf)
            state.setdefault(g, {})[k] = buf
        for _, e in held:
            for key, (dtype, value) in e["scalars"].items():
                g_text, k = key.split("/", 1)
                state.setdefault(int(g_text), {}).setdefault(
                    k, torch.tensor(value, dtype=getattr(torch, dtype)) if dtype else value)
        if stage in need:
            out[stage] = state
    return out


def unshard(optimizer_state: Mapping[str, Any], full: Mapping[int, Mapping[str, Any]], groups: Sequence[Sequence[int]],
            params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The unsharded optimizer state of a stage (mixed-precision wrapper kept) from its shard's
    hyperparameters, its full flat buffers ``full`` (:func:`assemble`) and ``groups`` (:func:`zero_groups`)."""
    shard = shard_of(optimizer_state)
    hyper = [{k: v for k, v in pg.items() if k != "params"} for pg in shard["optimizer"]["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for g, indices in enumerate(groups):
        flat = full.get(g, {})
        offset = 0
        for i in indices:
            n = params[i].numel()
            entry = {}
            for k, v in flat.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    entry[k] = v[offset: offset + n].view(params[i].shape).clone()
                else:
                    entry[k] = v.clone() if torch.is_tensor(v) else v
            if entry:
                state[i] = entry
            offset += n
    inner = {"state": state, "param_groups": [{**h, "params": list(idx)} for h, idx in zip(hyper, groups)]}
    if _mixed(optimizer_state):
        return {**optimizer_state, "optimizer": inner}
    return inner


def unsharded_param_groups(engine: Any) -> list[dict[str, Any]]:
    """The new stage's parameter groups as its unsharded optimizer would list them (stage
    parameter indices), for ``layer_state.stage_state``."""
    sharded = engine.sharded_optimizer
    groups = zero_groups(sharded, engine.optimizer, engine.stage_host.parameters)
    return [{**{k: v for k, v in pg.items() if k != "params"}, "params": idx}
            for pg, idx in zip(sharded.optimizer.param_groups, groups)]


def reshard_state(optimizer_state: Mapping[str, Any], engine: Any) -> dict[str, Any]:
    """The unsharded optimizer state of the new stage (``stage_state``'s, over
    :func:`unsharded_param_groups`) as this replica's ZeRO-1 shard of its bound partition."""
    sharded = engine.sharded_optimizer
    inner = optimizer_state["optimizer"] if _mixed(optimizer_state) else optimizer_state
    groups = [list(pg["params"]) for pg in inner["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for g, indices in enumerate(groups):
        lo, hi = sharded.partition.bounds(g, sharded.held)
        keys = {k for i in indices for k in inner["state"].get(i, {})}
        for k in sorted(keys):
            values = [inner["state"].get(i, {}).get(k) for i in indices]
            if all(torch.is_tensor(v) and v.dim() > 0 for v in values):
                state.setdefault(g, {})[k] = torch.cat([v.reshape(-1) for v in values])[lo:hi].clone()
            else:  # a per-parameter scalar (the step): the group's largest
                known = [v for v in values if v is not None]
                top = max(known, key=lambda v: float(v))
                state.setdefault(g, {})[k] = top.clone() if torch.is_tensor(top) else top
    shard = {"zero_stage": 1, "partition": sharded.partition.to_json(), "index": sharded.held,
             "optimizer": {"state": state,
                           "param_groups": [{**{k: v for k, v in pg.items() if k != "params"}, "params": [g]}
                                            for g, pg in enumerate(inner["param_groups"])]}}
    if _mixed(optimizer_state):
        return {**optimizer_state, "optimizer": shard}
    return shard
