"""The profile: the job's first iterations, measured, become the cost model JSON.

``ds-resilience profile --out cost.json -- <launcher arguments>`` (or ``DSR_PROFILE_OUT`` and
``DSR_PROFILE_STEPS`` in a worker's environment) makes the engine run its first iterations as a
profile. They are real training steps (every schedule the engine runs gives the same update), on
the user's model, data, precision and ranks:

1. one fused 1F1B iteration with a saved-tensor hook around each forward: the bytes one micro-batch's
   activations keep alive from F to B (parameters excluded; under activation checkpointing, what
   the checkpoint keeps) and the bytes its output sends to the next stage;
2. ``steps`` fused 1F1B iterations: the fused backward (B+W in one pass), the reduce and the step;
3. ``steps`` decoupled iterations: F, B and W apart, and the bytes a pending W keeps alive;
   the two kinds alternate (fused, decoupled, fused, ...), so a drift over the job's first
   iterations (allocator and cache warm-up, a neighbour's load) falls on both and not on the
   fused one alone: (B + W) / fused is what decides where the split runs;
4. a ping-pong between each pair of neighbouring stages of a pipeline: latency (small messages)
   and bandwidth (activation-sized ones).

Every rank sends its row to rank 0 (``all_gather_object``), which writes the cost model with a
``measured`` section (:func:`~ds_resilience.planning.profile.profile_summary`). Then the job goes
on training with its own schedule, or, under ``ds-resilience profile``, every rank exits 0. A
failure during the profile abandons it (the job keeps training). Plans read the file through
``resilience.cost_model``. Without a cost model (``cost_model`` null) the engine profiles itself by
default (``resilience.profile_steps``, 2) and re-plans with what it measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..ir import ActionKind
from ..planning.generators import decoupled, one_f_one_b
from ..planning.profile import cost_from_profile, profile_summary
from ..planning.stage_mix import split_margin
from ..costs import CostModel
from ..logs import get_logger
from ..topology import Worker

__all__ = ["Profiler", "from_environ", "from_engine", "requested"]

log = get_logger(__name__)

ENV_OUT, ENV_STEPS, ENV_EXIT = "DSR_PROFILE_OUT", "DSR_PROFILE_STEPS", "DSR_PROFILE_EXIT"


def requested() -> bool:
    """Whether the environment asks for a profile (``ds-resilience profile``)."""
    return bool(os.environ.get(ENV_OUT))


def from_environ(engine) -> "Profiler | None":
    """The profiler the environment asks for (``DSR_PROFILE_OUT``), or ``None``."""
    out = os.environ.get(ENV_OUT)
    if not out:
        return None
    steps = int(os.environ.get(ENV_STEPS, "3"))
    return Profiler(engine, out=Path(out), steps=steps, exit_after=os.environ.get(ENV_EXIT) == "1")


def from_engine(engine, on_done=None) -> "Profiler | None":
    """The environment's profiler, else the config's (with ``cost_model`` null: ``profile_steps``,
    2 by default): then ``on_done(cost)`` runs on every rank once the model is known (the engine
    re-plans with it)."""
    profiler = from_environ(engine)
    if profiler is not None and not profiler.exit_after:
        profiler.on_done = on_done  # the job trains on: with what was measured
    cfg = engine.resilience
    steps = cfg.self_profile_steps()
    if profiler is None and steps:
        out = Path(cfg.profile_out) if cfg.profile_out else None
        profiler = Profiler(engine, out=out, steps=steps, on_done=on_done)
    return profiler


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


class Profiler:
    """Drives the engine's first ``2 * steps + 1`` iterations as the profile (module docstring)."""

    def __init__(self, engine, *, out: Path | None, steps: int = 3, exit_after: bool = False, on_done=None) -> None:
        if steps < 1:
            raise ValueError(f"{ENV_STEPS} must be >= 1, got {steps}")
        self.engine, self.out, self.steps, self.exit_after = engine, out, steps, exit_after
        self.on_done = on_done
        self.cost: CostModel | None = None
        self.iteration = 0
        self.done = False
        self.row: dict[str, Any] = {"rank": dist.get_rank(), "stage": engine.stage_id, "durations": {}}
        self._state: list[int] = []
        self._acts: list[int] = []
        self._pending: list[float] = []
        self._saved = None  # the generation to restore
        self._forward = None  # the executor's own F handler while the memory hook is in

    # --- the iterations --------------------------------------------------------------------------------
    def before(self) -> None:
        """Pick this iteration's schedule (and the memory hook for the first)."""
        if self.done:
            return
        engine = self.engine
        generation = engine.generation
        if self._saved is None:
            if generation.topology.failed or generation.epoch:
                self._abandon("the job is not fault-free")
                return
            self._saved = generation
        elif generation.epoch != self._saved.epoch:
            self._abandon("the membership changed during the profile")
            return
        topo, tied = engine.topology, engine.tied_groups
        fused = self.iteration % 2 == 1  # 1, 3, ...: fused; 2, 4, ...: decoupled (module docstring)
        schedule = (one_f_one_b(topo.dp, topo.pp, engine.micro_batches, tied=tied) if fused else
                    decoupled(topo.dp, topo.pp, engine.micro_batches, CostModel.unit(), tied=tied))
        engine.generation = replace(generation, schedule=schedule)
        engine.executor.count_w_bytes = True  # the pending-W bytes per micro-batch (off outside the profile)
        if self.iteration == 0:
            self._hook_forward()

    def after(self) -> None:
        """Keep what this iteration measured; after the last one, finish."""
        if self.done:
            return
        engine = self.engine
        stats = engine.executor.stats
        if self.iteration == 0:
            self._unhook_forward()
        else:
            durations = stats.durations
            for kind, values in durations.items():
                self.row["durations"].setdefault(kind, []).extend(values)
            # per iteration too: how far (B + W) / fused moves between them is the profile's noise
            if self.iteration % 2 == 1 and durations.get("BW"):
                self.row.setdefault("fused_iters", []).append(statistics.median(durations["BW"]))
            elif self.iteration % 2 == 0 and durations.get("B") and durations.get("W"):
                self.row.setdefault("split_iters", []).append(statistics.median(durations["B"])
                                                              + statistics.median(durations["W"]))
            if stats.peak_pending_w:
                self._pending.append(stats.peak_pending_w_bytes / stats.peak_pending_w)
        self.iteration += 1
        if self.iteration > 2 * self.steps:
            self._finish()

    # --- measuring ---------------------------------------------------------------------------------------
    def _hook_forward(self) -> None:
        executor = self.engine.executor
        inner = executor.handlers[ActionKind.F]
        params = {p.untyped_storage().data_ptr() for p in executor.parameters}

        def forward(action) -> None:
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    seen[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                inner(action)
            self._state.append(sum(seen.values()))
            if not executor.is_last:
                self._acts.append(_nbytes(executor._outputs.get((action.pipeline, action.microbatch))))

        self._forward = inner
        executor.handlers[ActionKind.F] = forward

    def _unhook_forward(self) -> None:
        if self._forward is not None:
            self.engine.executor.handlers[ActionKind.F] = self._forward
            self._forward = None

    def _ping(self) -> None:
        """Latency and bandwidth to the next stage of this rank's pipeline, pair by pair (pairs of
        even boundaries first, then odd ones, so that every rank is in one pair at a time)."""
        topo = self.engine.topology
        me = Worker(pipeline=self.engine.topology.coord(dist.get_rank())[0].pipeline, stage=self.engine.stage_id)
        # 16 MiB at least: a message whose transfer (milliseconds on loopback) stands above a loaded
        # machine's scheduling noise; a model's activations when larger
        size = max(16 << 20, int(statistics.median(self._acts)) if self._acts else 0)
        for parity in (0, 1):
            dist.barrier()
            peer, first = None, False
            if me.stage % 2 == parity and me.stage + 1 < topo.pp:
                peer, first = topo.rank(Worker(pipeline=me.pipeline, stage=me.stage + 1)), True
            elif me.stage % 2 != parity and me.stage >= 1:
                peer = topo.rank(Worker(pipeline=me.pipeline, stage=me.stage - 1))
            if peer is None:
                continue
            small, large = torch.zeros(8), torch.zeros(size // 4)
            rtt_small = self._round_trips(small, peer, first, 21)
            rtt_large = self._round_trips(large, peer, first, 7)
            if first:
                self.row["p2p_latency"] = rtt_small / 2
                # the size difference over the time difference; no figure when the noise hides it
                extra = (rtt_large - rtt_small) / 2
                if extra > 0.2 * rtt_small / 2:
                    self.row["p2p_bandwidth"] = (large.numel() - small.numel()) * 4 / extra

    @staticmethod
    def _round_trips(buf: torch.Tensor, peer: int, first: bool, n: int) -> float:
        """The fastest of ``n`` round trips (the first rank's view; the other only echoes): noise
        on a shared machine only ever adds time, so the minimum is the link's own figure."""
        trips = []
        for _ in range(n):
            t0 = time.perf_counter()
            if first:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            trips.append(time.perf_counter() - t0)
        return min(trips)

    # --- the end -------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        self._unhook_forward()
        self.engine.executor.count_w_bytes = False
        if self._saved is not None and self.engine.generation.epoch == self._saved.epoch:
            self.engine.generation = self._saved

    def _abandon(self, why: str) -> None:
        self._restore()
        self.done = True
        log.warning("rank %s: profile abandoned: %s", dist.get_rank(), why)

    def _finish(self) -> None:
        self._restore()
        self.done = True
        row = self.row
        row["state_bytes"] = statistics.median(self._state) if self._state else 0
        row["activation_bytes"] = statistics.median(self._acts) if self._acts else 0
        row["pending_w_bytes"] = statistics.median(self._pending) if self._pending else 0
        self._ping()
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        pp = self.engine.topology.pp
        # every rank holds every row, so every rank derives the same model (the engine re-plans with it)
        name = f"profile-{self.out.stem}" if self.out is not None else "profile"
        cost = self.cost = cost_from_profile(rows, pp, name=name)
        if dist.get_rank() == 0:
            summary = profile_summary(rows, pp, cost)
            where = "kept in memory"
            if self.out is not None:
                self.out.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.out.with_suffix(self.out.suffix + ".tmp")
                tmp.write_text(json.dumps(summary, indent=1))
                tmp.replace(self.out)
                where = f"written to {self.out}"
            ratio = ", ".join("n/a" if r is None else f"{r:.2f}" for r in summary["measured"]["split_over_fused"])
            log.info(f"profile of {len(rows)} ranks ({2 * self.steps + 1} iterations) {where}; "
                     f"per stage t_F {_ms(cost.t_f)}, t_B {_ms(cost.t_b)}, t_W {_ms(cost.t_w)}, fused "
                     f"{_ms(summary['measured']['fused_backward'])}; (B+W)/fused {ratio}{_noise(cost)}")
        dist.barrier()
        if self.on_done is not None:
            self.on_done(cost)
        if self.exit_after:
            self.engine.close_snapshots()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # every rank at once: the agent sees a clean finish


def _ms(values) -> str:
    return "[" + ", ".join(f"{1e3 * v:.2f} ms" for v in values) + "]"


def _noise(cost: CostModel) -> str:
    if cost.split_noise is None:
        return ""
    return f", moving +-{100 * cost.split_noise:.1f}% between iterations (split margin {100 * split_margin(cost):.1f}%)"
