"""ZeRO stage 1 inside a stage's surviving replicas: the optimizer state, sharded and re-sharded.

Every replica of a stage holds the full parameters (and, under mixed precision, the full fp32
masters) and the full reduced gradients, as with ZeRO-0; what is sharded is the optimizer state
(Adam's moments, SGD's momentum), the part that is twice the fp32 weights for Adam:

* each parameter group is one flat index space (its parameters in order), cut into contiguous,
  balanced ranges over the stage's surviving replicas sorted by pipeline id (:class:`Partition`:
  member ``i`` of ``n`` owns ``[N*i//n, N*(i+1)//n)``, the same on every member with no message);
* :meth:`ShardedOptimizer.step`: the wrapped torch optimizer steps one flat fp32 tensor per group,
  this replica's range of the (full, already reduced and clipped) parameters and gradients, then
  the updated ranges are gathered over the stage group (one flat sum where every other range is
  zero, exact) into every replica's full parameters. The optimizers allowed are elementwise
  (Adam, AdamW, SGD, ...): stepping a range is stepping its elements, so the result equals the
  unsharded step;
* a step whose gather fails (a peer died) puts the shard's state back, so the stage is never torn
  between the old and the new step;
* :meth:`state_dict` is the shard (the wrapped optimizer's state of this range) plus the partition it
  belongs to, what the pre-step copy, the in-memory snapshots and a re-join handover carry;
  :meth:`load_state_dict` takes any member's state (its own, or a peer's copy after a re-join or a
  restart) and remembers whose range it is;
* :meth:`reshard`: a collective over the stage's new members. Each announces the ranges it holds
  (its own, a peer's copy, or a dead member's shard read from the snapshot tier); every range of
  the old partition is taken from exactly one holder (the first), summed into full buffers and cut
  again over the new members. A range nobody holds is an error that names it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..checkpoint.state import StateMismatch, clone_tree
from ..errors import ConfigError, ResilienceError

__all__ = ["ELEMENTWISE_OPTIMIZERS", "Partition", "ShardedOptimizer"]

ELEMENTWISE_OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop",
    "FusedAdam", "DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "Lion", "FusedLion", "DeepSpeedCPULion",
})
"""Optimizers whose update of an element depends on that element only: a shard steps alone."""


@dataclass(frozen=True)
class Partition:
    """Contiguous balanced ranges of each parameter group's flat index space over ``members``."""

    members: tuple[int, ...]
    numels: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.members or list(self.members) != sorted(set(self.members)):
            raise ResilienceError(f"a ZeRO-1 partition needs distinct sorted members, got {list(self.members)}")

    def index(self, member: int) -> int:
        try:
            return self.members.index(member)
        except ValueError:
            raise ResilienceError(f"pipeline {member} is not a member of the ZeRO-1 partition over "
                                  f"{list(self.members)}") from None

    def bounds(self, group: int, index: int) -> tuple[int, int]:
        n, total = len(self.members), self.numels[group]
        return total * index // n, total * (index + 1) // n

    def to_json(self) -> dict[str, list[int]]:
        return {"members": list(self.members), "numels": list(self.numels)}

    @classmethod
    def from_json(cls, value: Any) -> "Partition":
        return cls(tuple(int(m) for m in value["members"]), tuple(int(n) for n in value["numels"]))


def _pieces(params: Sequence[torch.Tensor], lo: int, hi: int):
    """(tensor, start, end) slices of the flat concatenation of ``params`` within ``[lo, hi)``."""
    offset = 0
    for p in params:
        n = p.numel()
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            yield p, a - offset, b - offset
        offset += n


def _gather_range(params: Sequence[torch.Tensor], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(hi - lo, dtype=dtype)
    at = 0
    for p, a, b in _pieces(params, lo, hi):
        out[at: at + b - a] = p.detach().reshape(-1)[a:b]
        at += b - a
    return out


class ShardedOptimizer:
    """A stage's optimizer with its state sharded over the stage's replicas (see the module docstring).

    Args:
        optimizer: the wrapped optimizer, built over the full parameters (fp32 parameters, or the
            fp32 masters under mixed precision); its ``param_groups`` are re-pointed at one flat
            shard per group here.
        me: this replica's pipeline id; ``members``: the stage's replicas (pipeline ids).
        group: ``group() -> comm.groups.Group`` of the stage's replicas now (``None``: alone).

    Raises:
        ConfigError: an optimizer that is not elementwise (sharding would change its math).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, me: int = 0, members: Sequence[int] = (0,),
                 group: Callable[[], Any] | None = None) -> None:
        name = type(optimizer).__name__
        if name not in ELEMENTWISE_OPTIMIZERS:
            raise ConfigError("zero_optimization.stage", f"1 shards the optimizer state element by element, which is "
                              f"exact only for elementwise optimizers; {name} is not one of "
                              f"{sorted(ELEMENTWISE_OPTIMIZERS)}: use one of them or stage 0")
        self.optimizer = optimizer
        self.full = [list(g["params"]) for g in optimizer.param_groups]
        dtypes = {p.dtype for ps in self.full for p in ps}
        if len(dtypes) > 1:
            raise ConfigError("zero_optimization.stage", f"1 needs one parameter dtype, the optimizer holds {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.numels = tuple(sum(p.numel() for p in ps) for ps in self.full)
        self.group = group
        self.me = me
        self.saving: dict[str, Any] | None = None
        optimizer.state.clear()
        self._adopt(Partition(tuple(sorted(members)), self.numels), Partition(tuple(sorted(members)), self.numels).index(me))

    # --- what the engine, the LR scheduler and the checkpoint tier read --------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def shard_numel(self) -> int:
        """Elements of the optimizer's parameters this replica steps (its shard, every group)."""
        return sum(p.numel() for g in self.optimizer.param_groups for p in g["params"])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this replica holds."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    def bind(self, *, me: int, members: Sequence[int], group: Callable[[], Any] | None) -> None:
        """Place this replica before its first step (no state to move yet)."""
        if self.optimizer.state:
            raise ResilienceError("ShardedOptimizer.bind after a step: re-shard instead")
        self.me, self.group = me, group
        part = Partition(tuple(sorted(members)), self.numels)
        self._adopt(part, part.index(me))

    def _adopt(self, partition: Partition, index: int | None, members: tuple[int, ...] | None = None) -> None:
        """Hold ``partition``'s range ``index`` (fresh flat tensors; the state is loaded by the caller)."""
        self.partition, self.held = partition, index
        self.members = partition.members if members is None else members
        for g, group in enumerate(self.optimizer.param_groups):
            lo, hi = partition.bounds(g, index) if index is not None else (0, 0)
            group["params"] = [torch.zeros(hi - lo, dtype=self.dtype, requires_grad=True)]
        self.optimizer.state.clear()

    @property
    def stale(self) -> bool:
        """The state held is not this replica's own range of its current membership (re-shard first)."""
        return (self.partition.members != self.members or self.me not in self.members
                or self.held != self.partition.index(self.me))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for ps in self.full:
            for p in ps:
                p.grad = None
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                p.grad = None

    # --- the step --------------------------------------------------------------------------------------
    def step(self, closure=None) -> None:
        if self.stale:
            raise ResilienceError(f"pipeline {self.me}: the ZeRO-1 optimizer state held is range {self.held} of "
                                  f"{list(self.partition.members)}, the stage's replicas are {list(self.members)}: "
                                  f"re-shard before stepping")
        flats = []
        for g, group in enumerate(self.optimizer.param_groups):
            lo, hi = self.partition.bounds(g, self.held)
            flat = group["params"][0]
            with torch.no_grad():
                flat.copy_(_gather_range(self.full[g], lo, hi, self.dtype))
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.full[g]]
            flat.grad = _gather_range(grads, lo, hi, self.dtype)
            flats.append(flat)
        saved = {id(f): clone_tree(self.optimizer.state[f]) for f in flats if f in self.optimizer.state}
        self.optimizer.step()
        try:
            self._gather()
        except BaseException:  # a peer died: this shard goes back to its pre-step state
            for f in flats:
                if id(f) in saved:
                    self.optimizer.state[f] = saved[id(f)]
                else:
                    self.optimizer.state.pop(f, None)
            raise
        finally:
            for f in flats:
                f.grad = None

    def _gather(self) -> None:
        """Every replica's updated range into the full parameters (one exact flat sum)."""
        total = sum(self.numels)
        buf = torch.zeros(total, dtype=self.dtype)
        base = 0
        for g, group in enumerate(self.optimizer.param_groups):
            lo, hi = self.partition.bounds(g, self.held)
            buf[base + lo: base + hi] = group["params"][0].detach()
            base += self.numels[g]
        grp = self.group() if self.group is not None else None
        if len(self.members) > 1:
            if grp is None or len(grp) != len(self.members):
                raise ResilienceError(f"pipeline {self.me}: ZeRO-1 over {list(self.members)} needs their stage group, "
                                      f"have {grp}")
            grp.all_reduce(buf)
        base = 0
        with torch.no_grad():
            for g, ps in enumerate(self.full):
                offset = base
                for p in ps:
                    n = p.numel()
                    p.copy_(buf[offset: offset + n].view_as(p))
                    offset += n
                base += self.numels[g]

    # --- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.saving is not None:  # a checkpoint file being written: the stage's whole state
            return self.saving
        return {"zero_stage": 1, "partition": self.partition.to_json(), "index": self.held,
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a member's state (this replica's own, or a peer's copy: then re-shard before stepping)."""
        if not isinstance(state, dict) or state.get("zero_stage") != 1:
            got = state.get("zero_stage", "no zero_stage") if isinstance(state, dict) else type(state).__name__
            raise StateMismatch(f"a ZeRO-1 optimizer loads a ZeRO-1 shard, this state is {got!r} (saved with another "
                                f"zero_optimization.stage?)")
        part = Partition.from_json(state["partition"])
        if part.numels != self.numels:
            raise StateMismatch(f"ZeRO-1 shard of parameter groups of {list(part.numels)} elements, this stage's are "
                                f"{list(self.numels)}")
        self._adopt(part, state["index"], members=self.members)
        self.optimizer.load_state_dict(state["optimizer"])

    # --- membership changes ------------------------------------------------------------------------------
    def _assemble(self, group: Any, extra: Sequence[dict[str, Any]], cut: Callable[[int], tuple[int, int]]):
        """Collective over ``group``: every range of the old partition, taken once from a holder,
        summed into full buffers; returns ``(old partition, {group: {key: cut range}}, moved bytes)``."""
        entries = ([(self.partition, self.held, self.optimizer.state_dict())] if self.held is not None else [])
        entries += [(Partition.from_json(sd["partition"]), int(sd["index"]), sd["optimizer"]) for sd in extra]
        keys: dict[str, str] = {}
        scalars: dict[str, Any] = {}
        for _, _, inner in entries:
            for g, st in inner["state"].items():
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        keys[f"{g}/{k}"] = str(v.dtype).removeprefix("torch.")
                    else:
                        scalars.setdefault(f"{g}/{k}", [str(v.dtype).removeprefix("torch."), float(v)]
                                           if torch.is_tensor(v) else ["", v])
        mine = {"partition": entries[0][0].to_json() if entries else None,
                "indices": [i for _, i, _ in entries], "keys": keys, "scalars": scalars}
        alone = group is None or len(group) <= 1
        gathered = [mine] if alone else group.all_gather_json(mine)
        parts = {json.dumps(a["partition"], sort_keys=True) for a in gathered if a["partition"] is not None}
        if len(parts) != 1:
            raise ResilienceError(f"ZeRO-1 re-shard: the members hold shards of {len(parts)} different partitions "
                                  f"({sorted(parts)}); they must come from one step")
        old = Partition.from_json(next(a["partition"] for a in gathered if a["partition"] is not None))
        source: dict[int, int] = {}
        for pos, a in enumerate(gathered):
            for i in a["indices"]:
                source.setdefault(int(i), pos)
        missing = [old.members[i] for i in range(len(old.members)) if i not in source]
        if missing:
            raise ResilienceError(f"ZeRO-1 re-shard: the optimizer state of pipeline(s) {missing} (ranges of the "
                                  f"partition over {list(old.members)}) is held by no member and by no snapshot; it "
                                  f"cannot be rebuilt")
        me_pos = 0 if alone else group.index[group.me]
        state: dict[int, dict[str, Any]] = {}
        moved = 0
        for key, dtype in sorted({k: v for a in gathered for k, v in a["keys"].items()}.items()):
            g_text, k = key.split("/", 1)
            g = int(g_text)
            buf = torch.zeros(self.numels[g], dtype=getattr(torch, dtype))
            for part, i, inner in entries:
                if source.get(i) != me_pos or g not in inner["state"] or k not in inner["state"][g]:
                    continue
                lo, hi = part.bounds(g, i)
                buf[lo:hi] = inner["state"][g][k]
            if not alone:
                group.all_reduce(buf)
            lo, hi = cut(g)
            state.setdefault(g, {})[k] = buf[lo:hi].clone()
            moved += buf.numel() * buf.element_size()
        for key, (dtype, value) in {k: v for a in reversed(gathered) for k, v in a["scalars"].items()}.items():
            g_text, k = key.split("/", 1)
            state.setdefault(int(g_text), {})[k] = torch.tensor(value, dtype=getattr(torch, dtype)) if dtype else value
        return old, state, moved

    def _inner_state(self, state: dict[int, dict[str, Any]]) -> dict[str, Any]:
        groups = [{**{k: v for k, v in pg.items() if k != "params"}, "params": [g]}
                  for g, pg in enumerate(self.optimizer.param_groups)]
        return {"state": state, "param_groups": groups}

    def reshard(self, members: Sequence[int], group: Any, extra: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """Cut the optimizer state again over ``members`` (collective over ``group``, the stage's new
        replicas). ``extra``: shards this replica brings for members that are gone (their
        :meth:`state_dict` from the snapshot tier). Returns what moved."""
        new = Partition(tuple(sorted(members)), self.numels)
        index = new.index(self.me)
        old, state, moved = self._assemble(group, extra, lambda g: new.bounds(g, index))
        self._adopt(new, index, members=new.members)
        self.optimizer.load_state_dict(self._inner_state(state))
        return {"from": list(old.members), "to": list(new.members), "bytes": moved}

    def consolidated_state_dict(self, group: Any) -> dict[str, Any]:
        """The whole stage's optimizer state as one unsharded shard (a partition of one member, 0):
        what a checkpoint file holds, loadable with any number of replicas (collective over
        ``group``, the stage's replicas)."""
        _, state, _ = self._assemble(group, (), lambda g: (0, self.numels[g]))
        return {"zero_stage": 1, "partition": Partition((0,), self.numels).to_json(), "index": 0,
                "optimizer": self._inner_state(state)}

    def __repr__(self) -> str:
        return (f"ShardedOptimizer({type(self.optimizer).__name__}, ZeRO-1 range {self.held} of "
                f"{list(self.partition.members)}, {self.shard_numel} of {sum(self.numels)} elements)")


