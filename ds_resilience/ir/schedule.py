"""A schedule is data: one tuple of :class:`Action` per worker, plus the shape it was made for.

Workers are indexed as in :meth:`ds_resilience.topology.Topology.worker_index` (``stage * dp +
pipeline``, DeepSpeed's rank order). A failed worker has an empty action list and is listed in
``failed``. Text and JSON forms round-trip exactly. Pure Python.

Tied groups (``tied``): DeepSpeed pipelines may tie a module across stages (``TiedLayerSpec``, e.g.
the token embedding of the first stage reused as the output projection of the last). Each group is
the sorted tuple of >= 2 stages that hold copies of one tied module, e.g. ``(0, 3)`` for a 4-stage
GPT with tied embeddings; several tie keys on one set of stages are one group, groups on different
sets are separate (and may overlap, e.g. ``(0, 3)`` and ``(0, 2)``). A group's index ``g`` is what
the ``TIED_REDUCE`` action (``s3TR0``) names: every surviving worker of a stage of group ``g`` runs
one ``TIED_REDUCE(g)`` per iteration, after all its compute and its REDUCE_GRAD and before its
OPT_STEP, a collective over the surviving workers of all the group's stages that sums the tied
parameters' gradients (the runtime leaves them out of REDUCE_GRAD).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from ..errors import ScheduleError
from ..topology import Topology, Worker
from .action import Action, parse_action

__all__ = ["Schedule", "OPTIMIZER_MODES", "TiedGroups", "check_tied", "format_tied", "parse_tied"]

OPTIMIZER_MODES = ("global", "staggered")
"""``global``: every OPT_STEP of an iteration waits for all workers (one barrier, as DeepSpeed);
``staggered``: each stage steps as soon as its own gradients are reduced."""

_HEADER = "# ds_resilience schedule"

TiedGroups = tuple[tuple[int, ...], ...]
"""Tied groups: one sorted tuple of >= 2 stages per tied module set (see the module docstring)."""


def check_tied(tied: Any, pp: int) -> TiedGroups:
    """``tied`` as a tuple of tuples, checked against ``pp`` stages.

    Raises:
        ScheduleError: a group is not a sorted tuple of >= 2 distinct stages in ``0..pp-1``, or a
            group is listed twice.
    """
    try:
        groups = tuple(tuple(g) for g in tied)
    except TypeError as exc:
        raise ScheduleError(f"tied groups must be a sequence of stage sequences, got {tied!r}") from exc
    seen: set[tuple[int, ...]] = set()
    for g, group in enumerate(groups):
        if any(isinstance(s, bool) or not isinstance(s, int) for s in group):
            raise ScheduleError(f"tied group {g} {group!r}: stages must be integers")
        if len(set(group)) < 2:
            raise ScheduleError(f"tied group {g} {group!r}: needs at least 2 distinct stages")
        if list(group) != sorted(set(group)):
            fixed = tuple(sorted(set(group)))
            raise ScheduleError(f"tied group {g} {group!r}: stages must be sorted and distinct, e.g. {fixed}")
        if group[0] < 0 or group[-1] >= pp:
            raise ScheduleError(f"tied group {g} {group!r}: stages must lie in 0..{pp - 1}")
        if group in seen:
            raise ScheduleError(f"tied group {g} {group!r} is listed twice; one group per set of stages")
        seen.add(group)
    return groups


def format_tied(tied: TiedGroups) -> str:
    """Text form of tied groups: ``0,3;0,2`` (``-`` for none), as in the schedule header."""
    return ";".join(",".join(str(s) for s in group) for group in tied) or "-"


def parse_tied(text: str) -> TiedGroups:
    """Inverse of :func:`format_tied` (not checked against a pipeline depth: see :func:`check_tied`).

    Raises:
        ScheduleError: not a ``;``-separated list of ``,``-separated integers.
    """
    text = text.strip()
    if text in ("", "-"):
        return ()
    try:
        return tuple(tuple(int(s) for s in group.split(",")) for group in text.split(";"))
    except ValueError as exc:
        raise ScheduleError(f"tied groups {text!r}: expected e.g. '0,3' or '0,3;0,2'") from exc


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Per-worker action lists for ``iterations`` training iterations.

    Args:
        dp: number of pipelines.
        pp: number of stages.
        microbatches: micro-batches per pipeline per iteration.
        workers: one tuple of actions per worker index; ``len(workers) == dp * pp``.
        failed: worker indices that run nothing.
        optimizer: one of :data:`OPTIMIZER_MODES`.
        iterations: how many iterations the action lists cover (>1 for steady-state replays).
        name: a label for humans (``"1f1b"``, ``"decoupled"``, ...).
        tied: the tied groups (see the module docstring); group ``g`` is what ``TIED_REDUCE(g)``
            names. Each a sorted tuple of >= 2 distinct stages below ``pp``, no group twice.
    """

    dp: int
    pp: int
    microbatches: int
    workers: tuple[tuple[Action, ...], ...]
    failed: frozenset[int] = field(default_factory=frozenset)
    optimizer: str = "global"
    iterations: int = 1
    name: str = ""
    tied: TiedGroups = ()

    def __post_init__(self) -> None:
        for attr in ("dp", "pp", "microbatches", "iterations"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"schedule {attr} must be an integer >= 1, got {value!r}")
        workers = tuple(tuple(actions) for actions in self.workers)
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "failed", frozenset(self.failed))
        if len(workers) != self.dp * self.pp:
            raise ScheduleError(
                f"schedule has {len(workers)} worker lists, expected dp*pp = {self.dp * self.pp}"
            )
        object.__setattr__(self, "tied", check_tied(self.tied, self.pp))
        if self.optimizer not in OPTIMIZER_MODES:
            raise ScheduleError(f"optimizer {self.optimizer!r} not one of {OPTIMIZER_MODES}")
        for index in self.failed:
            if not 0 <= index < len(workers):
                raise ScheduleError(f"failed worker {index} out of range 0..{len(workers) - 1}")
            if workers[index]:
                raise ScheduleError(f"failed worker {index} has {len(workers[index])} actions; it must have none")

    # --- topology views --------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        """The topology this schedule runs on (failed workers included)."""
        failed = {Worker(pipeline=i % self.dp, stage=i // self.dp) for i in self.failed}
        return Topology(dp=self.dp, pp=self.pp, failed=frozenset(failed))

    def worker_of(self, index: int) -> Worker:
        stage, pipeline = divmod(index, self.dp)
        return Worker(pipeline=pipeline, stage=stage)

    def index_of(self, pipeline: int, stage: int) -> int:
        return stage * self.dp + pipeline

    def alive(self) -> Iterator[int]:
        """Indices of workers that are not failed."""
        return (i for i in range(len(self.workers)) if i not in self.failed)

    def with_name(self, name: str) -> "Schedule":
        return replace(self, name=name)

    def tied_groups_of(self, stage: int) -> tuple[int, ...]:
        """Indices of the tied groups that hold ``stage`` (in order): its TIED_REDUCEs."""
        return tuple(g for g, group in enumerate(self.tied) if stage in group)

    # --- text form -------------------------------------------------------------------------
    def to_text(self) -> str:
        """One header line and one line per worker: ``w5: p1s2F0 p1s2SA0>8 ...``."""
        head = (
            f"{_HEADER} dp={self.dp} pp={self.pp} microbatches={self.microbatches} "
            f"optimizer={self.optimizer} iterations={self.iterations} tied={format_tied(self.tied)} "
            f"name={self.name or '-'}"
        )
        lines = [head]
        for index, actions in enumerate(self.workers):
            body = "(failed)" if index in self.failed else " ".join(str(a) for a in actions)
            lines.append(f"w{index}: {body}".rstrip())
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse :meth:`to_text` output.

        Raises:
            ScheduleError: a malformed header, worker line or action.
        """
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if not lines or not lines[0].startswith(_HEADER):
            raise ScheduleError(f"schedule text must start with {_HEADER!r}")
        meta: dict[str, str] = {}
        for item in lines[0][len(_HEADER):].split():
            key, _, value = item.partition("=")
            meta[key] = value
        try:
            dp, pp, mbs = int(meta["dp"]), int(meta["pp"]), int(meta["microbatches"])
            iterations = int(meta.get("iterations", "1"))
            tied = parse_tied(meta.get("tied", "-"))
        except (KeyError, ValueError) as exc:
            raise ScheduleError(f"schedule header {lines[0]!r} lacks dp/pp/microbatches: {exc}") from exc
        workers: list[tuple[Action, ...]] = [()] * (dp * pp)
        failed: set[int] = set()
        seen: set[int] = set()
        for line in lines[1:]:
            label, _, body = line.partition(":")
            if not label.startswith("w") or not label[1:].isdigit():
                raise ScheduleError(f"schedule line {line!r} does not start with 'w<index>:'")
            index = int(label[1:])
            if not 0 <= index < dp * pp or index in seen:
                raise ScheduleError(f"schedule line {line!r}: worker index out of range or repeated")
            seen.add(index)
            if body.strip() == "(failed)":
                failed.add(index)
            else:
                workers[index] = tuple(parse_action(tok) for tok in body.split())
        name = meta.get("name", "")
        return cls(
            dp=dp,
            pp=pp,
            microbatches=mbs,
            workers=tuple(workers),
            failed=frozenset(failed),
            optimizer=meta.get("optimizer", "global"),
            iterations=iterations,
            name="" if name == "-" else name,
            tied=tied,
        )

    # --- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "optimizer": self.optimizer,
            "iterations": self.iterations,
            "name": self.name,
            "tied": [list(group) for group in self.tied],
            "failed": sorted(self.failed),
            "workers": [[str(a) for a in actions] for actions in self.workers],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Schedule":
        try:
            return cls(
                dp=int(data["dp"]),
                pp=int(data["pp"]),
                microbatches=int(data["microbatches"]),
                optimizer=str(data.get("optimizer", "global")),
                iterations=int(data.get("iterations", 1)),
                name=str(data.get("name", "")),
                tied=tuple(tuple(int(s) for s in group) for group in data.get("tied", ())),
                failed=frozenset(int(i) for i in data.get("failed", ())),
                workers=tuple(tuple(parse_action(t) for t in actions) for actions in data["workers"]),
            )
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"schedule JSON is missing or mistypes a field: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        return cls.from_dict(json.loads(text))
