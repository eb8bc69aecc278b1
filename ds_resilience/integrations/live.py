"""Live failures in the resilient engine: recover, roll back, replay, stop beyond tolerance.

A mixin of :class:`~ds_resilience.integrations.deepspeed.ResilientPipelineEngine`, active when the
worker runs under the agent (``ds-resilience run``). The protocol, after the agent publishes a new
epoch (see ``runtime/coordinator.py``):

1. the watcher latches the epoch and poisons the current groups: a blocked receive or collective
   fails within milliseconds, and the iteration is abandoned (its partial gradients dropped);
2. the survivors agree through the store on the iteration to resume from, K = the smallest number
   of optimizer steps any survivor has taken. A stage that already stepped iteration K (the
   staggered optimizer lets the last stages step first) restores its pre-step snapshot, so no
   stage steps twice and none skips;
3. the new generation's groups are built (original global ranks, fresh store prefix), the plan for
   the new failed set replaces the schedule, and iteration K is replayed from its micro-batches
   (``batch_source`` reloads any pipeline's micro-batch of any iteration);
4. if some stage lost every replica, the survivors agree on K the same way, write the surviving
   stages' layers in DeepSpeed's checkpoint layout (``layer_XX-model_states.pt``, loadable with
   ``PipelineModule.load_state_dir``) plus their optimizer states and a manifest, and
   ``train_batch`` raises :class:`BeyondTolerance` with a message naming the lost stage.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ResilienceError
from ..runtime.coordinator import Reconfigure
from ..runtime.groups import build_groups
from ..runtime.p2p import CommError
from ..runtime.snapshot import restore_snapshot, snapshot_from_bytes, snapshot_to_bytes, take_snapshot

__all__ = ["BeyondTolerance", "LiveFailureMixin", "is_failure"]

_STATE_TAG = 1 << 27


class BeyondTolerance(ResilienceError):
    """A stage lost every replica: training stopped cleanly after saving what survived.

    Attributes:
        checkpoint_dir: where the surviving stages were saved (``None`` with ``restart``).
        step: the optimizer step the checkpoint holds.
        lost_stages: the stages that could not be saved.
        restart: the agent restarts every worker from the in-memory snapshots; the script should
            just exit (status 0).
    """

    def __init__(self, message: str, *, checkpoint_dir: str | None, step: int, lost_stages: list[int],
                 restart: bool = False) -> None:
        super().__init__(message)
        self.checkpoint_dir = checkpoint_dir
        self.step = step
        self.lost_stages = lost_stages
        self.restart = restart


def is_failure(exc: BaseException) -> bool:
    """Errors that may mean a peer failed (they prompt an epoch check, nothing more)."""
    return isinstance(exc, (Reconfigure, CommError, RuntimeError))


class LiveFailureMixin:
    """Recovery for :class:`ResilientPipelineEngine` (see the module docstring)."""

    coordinator: Any
    recovery_log: list[dict[str, Any]]

    # --- the optimizer step keeps a pre-step snapshot while failures are live ----------------------
    def _snapshot_before_step(self) -> None:
        """Keep the pre-step state, unless the in-memory tier holds it already (its snapshot of
        the current step, taken after the previous optimizer step)."""
        self._pre_step = None
        if self.coordinator is not None and self._needs_pre_step_copy():
            self._pre_step = take_snapshot(self.worker.parameters, self.optimizer, self.lr_scheduler, self.global_steps)

    def _rollback_to(self, steps: int) -> None:
        snap = getattr(self, "_pre_step", None)
        if self.global_steps == steps:
            return
        if snap is None and self.global_steps == steps + 1 and self._rollback_from_snapshot(steps):
            return
        if snap is None or snap.steps != steps or self.global_steps != steps + 1:
            raise ResilienceError(
                f"rank {self.global_rank}: cannot roll back from step {self.global_steps} to {steps} "
                f"(snapshot holds step {None if snap is None else snap.steps})"
            )
        restore_snapshot(snap, self.worker.parameters, self.optimizer, self.lr_scheduler)
        self.global_steps = steps
        self.global_samples -= self.train_batch_size()

    # --- recovery --------------------------------------------------------------------------------
    def _recover(self, exc: BaseException) -> None:
        """Handle a failure signal: wait for the agent's epoch, then apply it (and any newer one)."""
        record = exc.record if isinstance(exc, Reconfigure) else None
        if record is None:
            grace = self.resilience.detector.heartbeat_timeout_s + 5.0
            record = self.coordinator.wait_pending(grace)
            if record is None:
                raise exc  # an error without a membership change is a real error
        while True:
            try:
                self._apply_epoch(record)
                return
            except Reconfigure as newer:
                record = newer.record

    def _apply_epoch(self, record) -> None:
        started = time.perf_counter()
        self.worker.reset()
        self.zero_grad()
        failed = {self.topology.coord(r)[0] for r in record.failed}
        target = self.topology.without(failed)
        joining = set(record.joining)
        voters = sorted(self.topology.rank(w) for w in target.alive_workers() if self.topology.rank(w) not in joining)
        resume = self.coordinator.agree_min(record.epoch, self.global_steps, voters)
        self._rollback_to(resume)
        if record.stop or target.uncovered_stages():
            self._stop_beyond_tolerance(record, target, resume)
        self._enter_generation(record, target)
        for rank in sorted(joining):
            newcomer = self.topology.coord(rank)[0]
            donors = [w for w in target.stage_peers(newcomer.stage) if self.topology.rank(w) not in joining]
            if newcomer.stage == self.stage_id and donors and self.me == donors[0]:
                self._send_state(rank, resume)
        self.coordinator.mark_applied(record)
        self.recovery_log.append({
            "epoch": record.epoch,
            "kind": record.kind,
            "failed": list(record.failed),
            "resume_step": resume,
            "apply_s": time.perf_counter() - started,
            # new epoch published by the agent -> ready for the first new step (same host clock)
            "recovery_s": time.time() - record.detected_at if record.detected_at else None,
        })

    def _enter_generation(self, record, target) -> None:
        """Adopt ``target`` as the membership: its plan and the epoch's new process groups."""
        self.current = target
        self.schedule = self._plan_for(target)
        groups = build_groups(
            target, self.me, session=self.session, generation=record.epoch,
            timeout_s=self.resilience.detector.pg_timeout_s, store=self.coordinator.store,
        )
        self._install_groups(groups)

    # --- re-join ---------------------------------------------------------------------------------
    def _send_state(self, rank: int, steps: int) -> None:
        """Hand this stage's parameters, optimizer and scheduler state to a re-joining worker."""
        snap = take_snapshot(self.worker.parameters, self.optimizer, self.lr_scheduler, steps)
        self.worker.messenger.send([snapshot_to_bytes(snap)], rank, _STATE_TAG, "state")
        self.worker.messenger.wait_sends()

    def _join(self) -> None:
        """A re-joining worker: wait for the agent's re-join epoch, join its groups, take a peer's state."""
        me = self.topology.rank(self.me)
        while True:
            record = self.coordinator.pending()
            if record is not None and me in record.joining:
                break
            if record is not None:
                self.coordinator.mark_applied(record)  # an epoch before ours: nothing to do yet
            time.sleep(0.01)
        failed = {self.topology.coord(r)[0] for r in record.failed}
        target = self.topology.without(failed)
        self._enter_generation(record, target)
        donor = [w for w in target.stage_peers(self.stage_id) if self.topology.rank(w) not in record.joining][0]
        data = self.worker.messenger.recv(self.topology.rank(donor), _STATE_TAG, "state")[0]
        snap = snapshot_from_bytes(data)
        restore_snapshot(snap, self.worker.parameters, self.optimizer, self.lr_scheduler)
        self.global_steps = snap.steps
        self.global_samples = snap.steps * self.train_batch_size()
        self.coordinator.mark_applied(record)
        self.recovery_log.append({"epoch": record.epoch, "kind": "joined", "resume_step": snap.steps,
                                  "recovery_s": time.time() - record.detected_at if record.detected_at else None})

    # --- beyond tolerance --------------------------------------------------------------------------
    def _stop_beyond_tolerance(self, record, target, step: int) -> None:
        lost = list(target.uncovered_stages())
        if getattr(record, "restart", False) and self.checkpointer is not None:
            ready = self._snapshots_ready_for_restart(step)
            self.coordinator.mark_applied(record)
            self.recovery_log.append({"epoch": record.epoch, "kind": "restart", "resume_step": step, **ready})
            raise BeyondTolerance(
                f"stage(s) {lost} lost every replica (failed ranks {list(record.failed)}); the agent restarts all "
                f"workers from the in-memory snapshots (this worker's step {step} is committed: "
                f"{ready['committed']}, replicated: {ready['replicated']})",
                checkpoint_dir=None, step=step, lost_stages=lost, restart=True,
            )
        base = self.resilience.checkpoint.persistent_dir or os.path.join(os.getcwd(), "checkpoints")
        ckpt_dir = os.path.join(base, f"global_step{step}")
        writers = {s: min(target.stage_peers(s)) for s in range(target.pp) if s not in lost}
        store = self.coordinator.store
        if writers.get(self.stage_id) == self.me:
            self._save_stage(ckpt_dir, step)
            store.set(f"dsr/saved/{record.epoch}/{self.stage_id}", "1")
        if self.me == min(target.alive_workers()):
            for s in writers:
                self.coordinator.wait_key(f"dsr/saved/{record.epoch}/{s}")
            manifest = {
                "step": step,
                "stages_saved": sorted(writers),
                "stages_lost": lost,
                "reason": record.reason or f"stage {lost} lost every replica",
                "dp": self.topology.dp,
                "pp": self.topology.pp,
                "format": "deepspeed layer files (layer_XX-model_states.pt) + stageN-optim_states.pt",
            }
            Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(ckpt_dir) / "manifest.json.tmp"
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, Path(ckpt_dir) / "manifest.json")
            store.set(f"dsr/saved/{record.epoch}/manifest", "1")
        else:
            self.coordinator.wait_key(f"dsr/saved/{record.epoch}/manifest")
        self.coordinator.mark_applied(record)
        raise BeyondTolerance(
            f"stage(s) {lost} lost every replica (failed ranks {list(record.failed)}): re-routing cannot cover this; "
            f"stopped cleanly after step {step}, surviving stages saved to {ckpt_dir} "
            f"(the lost stages must come from an earlier checkpoint)",
            checkpoint_dir=ckpt_dir,
            step=step,
            lost_stages=lost,
        )

    def _save_stage(self, ckpt_dir: str, step: int) -> None:
        """This stage's layers (DeepSpeed's file names) and optimizer state, written atomically."""
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        for idx, layer in enumerate(self.module.forward_funcs):
            if not hasattr(layer, "state_dict"):
                continue
            path = self.module.ckpt_layer_path(ckpt_dir, idx)
            tmp = f"{path}.tmp{os.getpid()}"
            torch.save({k: v.detach().clone() for k, v in layer.state_dict().items()}, tmp)
            os.replace(tmp, path)
        optim_path = os.path.join(ckpt_dir, f"stage{self.stage_id}-optim_states.pt")
        tmp = f"{optim_path}.tmp{os.getpid()}"
        torch.save({"step": step, "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}, tmp)
        os.replace(tmp, optim_path)
