"""Gradient clipping and fp16 overflow checks without a barrier: speculate, validate, roll back.

Clipping by the global gradient norm (and fp16's skip on overflow) needs every stage's gradients
before any stage may step, which is a barrier at the end of every iteration: it removes the
staggered optimizer (each stage stepping as soon as its own gradients are reduced). Instead:

* after its gradient reduce every replica of a stage publishes the stage's squared norm (and its
  overflow flag) in the store under ``(iteration, stage)``: no one waits for it;
* a stage then *speculates*: when the last validated step needed no clipping and did not
  overflow, and its own share does not already exceed the limit, it steps at once as if the global
  coefficient were 1 (the executor keeps its reduced gradients and the pre-step state); otherwise
  it waits for every stage's value and steps exactly;
* at the end of its ``train_batch`` (and before any save or evaluation) the stage *validates*: it
  reads every stage's value of that iteration, waiting for the last ones in time it would spend
  idle anyway (its next forward needs an activation that follows the first stage's step, which
  follows the first stage's publication), and if the speculation was wrong (the norm needs
  clipping, or a stage overflowed) it rolls back to the pre-step state and redoes the step with the
  exact coefficient (or skips it). The result is exactly the globally clipped (or skipped) step.

:class:`Decision` is what a step does; :class:`StepValidator` keeps the publishing, the waiting and
the rollback counts. The store reads go through a ``wait`` function (the coordinator's, under the
agent, so a failure releases them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Decision", "StepValidator", "clip_coefficient"]


def clip_coefficient(norm: float, clip: float) -> float:
    """DeepSpeed's (and torch's) clip coefficient: ``clip / (norm + 1e-6)``, at most 1."""
    if clip <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, clip / (norm + 1e-6))


@dataclass(frozen=True)
class Decision:
    """The exact step of one iteration: ``skip`` (an overflow somewhere) or scale by ``coef``."""

    norm: float
    overflow: bool
    coef: float

    @property
    def speculation_holds(self) -> bool:
        """Whether stepping unscaled and not skipping was right."""
        return not self.overflow and self.coef >= 1.0


class StepValidator:
    """Agreement on the global gradient norm and overflow of each iteration, through the store.

    Args:
        clip: ``gradient_clipping`` (0: off).
        check_overflow: fp16: a non-finite gradient anywhere skips the step everywhere.
        num_stages: stages whose values make the global one.
        key: ``key(iteration, stage)`` -> the store key of a stage's value.
        publish: ``publish(key, text)`` sets a key.
        wait: ``wait(key) -> bytes`` blocks (bounded) until a key is set.
        delete: ``delete(key)`` drops a key no one reads any more (a stage's value of three
            iterations ago: every stage has validated it).
    """

    def __init__(self, *, clip: float, check_overflow: bool, num_stages: int, key: Callable[[int, int], str],
                 publish: Callable[[str, str], None], wait: Callable[[str], bytes],
                 delete: Callable[[str], None] | None = None) -> None:
        self.clip = clip
        self.check_overflow = check_overflow
        self.num_stages = num_stages
        self.key, self._publish, self._wait, self._delete = key, publish, wait, delete
        self.last: Decision | None = None
        self.speculated = 0
        self.rollbacks = 0
        self.waited = 0
        self.history: list[tuple[int, str]] = []  # (iteration, "speculated" | "rolled back" | "waited")

    @property
    def active(self) -> bool:
        """Whether steps need a global agreement at all."""
        return self.clip > 0 or self.check_overflow

    def publish(self, iteration: int, stage: int, sq_norm: float, overflow: bool) -> None:
        """This stage's squared gradient norm (of the parameters it counts) and overflow flag."""
        value = {"sq": sq_norm if math.isfinite(sq_norm) else None, "overflow": bool(overflow or not math.isfinite(sq_norm))}
        self._publish(self.key(iteration, stage), json.dumps(value))
        if self._delete is not None and iteration >= 3:
            self._delete(self.key(iteration - 3, stage))

    def should_speculate(self, own_sq_norm: float, own_overflow: bool) -> bool:
        """Speculate when the last step needed neither clipping nor a skip and this stage's own
        share cannot already decide against it."""
        if own_overflow and self.check_overflow:
            return False
        if self.clip > 0 and own_sq_norm > self.clip ** 2:
            return False
        return self.last is None or self.last.speculation_holds

    def decide(self, iteration: int, stages: Sequence[int] | None = None) -> Decision:
        """Every stage's value of ``iteration`` (waiting for the missing ones) -> the exact step."""
        total, overflow = 0.0, False
        for s in range(self.num_stages) if stages is None else stages:
            value = json.loads(self._wait(self.key(iteration, s)))
            overflow = overflow or bool(value["overflow"])
            total += float(value["sq"]) if value["sq"] is not None else math.inf
        overflow = self.check_overflow and (overflow or not math.isfinite(total))
        norm = math.sqrt(total) if math.isfinite(total) else math.inf
        decision = Decision(norm=norm, overflow=overflow, coef=clip_coefficient(norm, self.clip))
        self.last = decision
        return decision

    def record(self, iteration: int, what: str) -> None:
        if what == "speculated":
            self.speculated += 1
        elif what == "rolled back":
            self.rollbacks += 1
        elif what == "waited":
            self.waited += 1
        self.history.append((iteration, what))
        del self.history[:-1000]

    def rollbacks_per_100(self) -> float:
        """Rollbacks per 100 steps over the recent history."""
        return self._per_100("rolled back")

    def waits_per_100(self) -> float:
        """Steps that waited for every stage's norm (no speculation) per 100 steps, recent history:
        each costs what the barrier costs. A step that clips makes the next one wait, so with a
        norm above the limit at every step (early training, a small ``gradient_clipping``) this is
        100 and the staggered optimizer's overlap is gone until the norm falls below the limit."""
        return self._per_100("waited")

    def _per_100(self, what: str) -> float:
        steps = len(self.history)
        return 100.0 * sum(1 for _, w in self.history if w == what) / steps if steps else 0.0
