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
* a stage that finds every stage's value published already when it publishes its own (the last
  stage to reduce: stage 0 of a healthy pipeline, whose backward ends the iteration) has nothing to
  wait for: it steps exactly at once (:meth:`StepValidator.ready`), with neither a pre-step copy
  nor a validation;
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
        peek: ``peek(key) -> bytes | None`` reads a key without waiting (``None``: not set).
    """

    def __init__(self, *, clip: float, check_overflow: bool, num_stages: int, key: Callable[[int, int], str],
                 publish: Callable[[str, str], None], wait: Callable[[str], bytes],
                 delete: Callable[[str], None] | None = None, peek: Callable[[str], bytes | None] | None = None) -> None:
        self.clip = clip
        self.check_overflow = check_overflow
        self.num_stages = num_stages
        self.key, self._publish, self._wait, self._delete, self._peek = key, publish, wait, delete, peek
        self.last: Decision | None = None
        self.last_iteration: int | None = None  # the iteration ``last`` decided
        self.speculated = 0
        self.rollbacks = 0
        self.waited = 0
        self.ready_steps = 0  # exact steps taken at once: every stage's value was in already
        self.clipped = 0  # steps taken with a clip coefficient below 1 (whichever way they were decided)
        self.history: list[tuple[int, str]] = []  # (iteration, "speculated" | "rolled back" | "waited" | "ready")

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

    def should_speculate(self, own_sq_norm: float, own_overflow: bool, iteration: int | None = None) -> bool:
        """Speculate when the previous step needed neither clipping nor a skip and this stage's own
        share cannot already decide against it.

        With ``iteration``, "the previous step" is iteration ``iteration - 1``'s decision, read from
        the store when this worker did not decide it itself (it re-joined, or a recovery moved it):
        every replica of a stage then makes the same choice, which ZeRO-1 needs (a speculative
        step that is rolled back gathers the shards twice)."""
        if own_overflow and self.check_overflow:
            return False
        if self.clip > 0 and own_sq_norm > self.clip ** 2:
            return False
        if iteration is not None and iteration >= 1 and self.last_iteration != iteration - 1:
            previous = self._published(iteration - 1)
            if previous is not None:
                self.last, self.last_iteration = previous, iteration - 1
            elif self.last_iteration is not None:
                self.decide(iteration - 1)
            else:  # a fresh process and a fresh store (a restart): every worker alike, no history
                self.last = None
        return self.last is None or self.last.speculation_holds

    def ready(self, iteration: int) -> Decision | None:
        """``iteration``'s exact decision if every stage's value is in the store already (this
        stage published last), else ``None``; a decision found becomes :attr:`last`."""
        if not self.active:
            return None
        decision = self._published(iteration)
        if decision is not None:
            self.last, self.last_iteration = decision, iteration
        return decision

    def _published(self, iteration: int) -> Decision | None:
        """``iteration``'s decision if every stage's value is in the store now, else ``None``."""
        if self._peek is None:
            return None
        values = []
        for s in range(self.num_stages):
            raw = self._peek(self.key(iteration, s))
            if raw is None:
                return None
            values.append(json.loads(raw))
        return self._combine(values)

    def forget_from(self, iteration: int, stage: int, span: int = 3) -> None:
        """Drop ``stage``'s values of iterations ``iteration`` .. ``iteration + span - 1``: a recovery
        replays them, and a value published before it (another schedule, other rounding) must
        not be read for the replay. Called by every survivor of the stage before the new
        generation's arrival barrier, so no replayed value is published yet."""
        if self._delete is None:
            return
        for i in range(iteration, iteration + span):
            self._delete(self.key(i, stage))

    def decide(self, iteration: int, stages: Sequence[int] | None = None) -> Decision:
        """Every stage's value of ``iteration`` (waiting for the missing ones) -> the exact step."""
        values = [json.loads(self._wait(self.key(iteration, s)))
                  for s in (range(self.num_stages) if stages is None else stages)]
        decision = self._combine(values)
        self.last, self.last_iteration = decision, iteration
        return decision

    def _combine(self, values: Sequence[dict]) -> Decision:
        total, overflow = 0.0, False
        for value in values:
            overflow = overflow or bool(value["overflow"])
            total += float(value["sq"]) if value["sq"] is not None else math.inf
        overflow = self.check_overflow and (overflow or not math.isfinite(total))
        norm = math.sqrt(total) if math.isfinite(total) else math.inf
        return Decision(norm=norm, overflow=overflow, coef=clip_coefficient(norm, self.clip))

    def record(self, iteration: int, what: str) -> None:
        if what == "speculated":
            self.speculated += 1
        elif what == "rolled back":
            self.rollbacks += 1
        elif what == "waited":
            self.waited += 1
        elif what == "ready":
            self.ready_steps += 1
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
