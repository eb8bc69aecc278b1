"""The persistent checkpoint tier as a DeepSpeed ``CheckpointEngine``: asynchronous and atomic.

``engine.save_checkpoint(dir, tag)`` and ``engine.load_checkpoint(dir, tag)`` keep working
unchanged; with :func:`install` the files are written by
:class:`~ds_resilience.checkpoint.persistent.AsyncCheckpointWriter` (host snapshot, background
atomic write, completion markers, ``latest`` and ``keep_last`` by global rank 0; see
:mod:`ds_resilience.checkpoint.persistent`). This module only adapts it to DeepSpeed.

How it hooks into DeepSpeed 0.19.8 (``runtime/engine.py``):

* ``save_checkpoint`` calls ``commit`` itself and writes ``latest`` right after, unless the engine
  ``is_decoupled()``. A blocking ``commit`` there would make the save synchronous again, and a
  ``latest`` written there would point at files still being written. So this engine reports
  ``is_decoupled() == True``: DeepSpeed neither commits nor writes ``latest``; its own decoupled
  commit at ``step()`` gets ``get_commit_info() == None`` and does nothing.
* Commits happen in :meth:`AsyncPersistentCheckpointEngine.poll`, which :func:`install` runs
  before every optimizer step (a wrapper around ``engine._take_model_step``, the method that both
  ``DeepSpeedEngine.step`` and ``PipelineEngine._exec_optimizer_step`` call); it never blocks.
  :meth:`~AsyncPersistentCheckpointEngine.flush` (collective) and ``wait()`` force them.
* ``preserves_storage_sharing()`` is False: DeepSpeed then skips its own on-device clone
  (``clone_tensors_for_torch_save``) and hands ``save()`` live tensors, which ``save()`` copies
  (research note pitfall 4), so there is exactly one copy.
* ``is_data_parallel_writer`` is the base rule (DP rank 0), so ``save_non_zero_checkpoint``,
  derived from it once at engine init, stays right when the engine is swapped in later.
* ``load_checkpoint`` reads ``latest`` with a plain ``open``, so :func:`install` also wraps
  ``engine.load_checkpoint``: it flushes this engine's saves (collective, as the load is), then
  passes the tag :meth:`~AsyncPersistentCheckpointEngine.resolve_load_tag` picks: ``latest``'s, or
  the newest complete tag when that one is incomplete (a truncated file, a missing marker; logged
  with what was wrong), and a clear error when no complete tag exists.
"""

from __future__ import annotations

import atexit
import weakref

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from ..checkpoint.persistent import DEFAULT_TIMEOUT_S, AsyncCheckpointWriter

__all__ = ["AsyncPersistentCheckpointEngine", "install"]


class AsyncPersistentCheckpointEngine(AsyncCheckpointWriter, CheckpointEngine):
    """DeepSpeed checkpoint engine: host snapshot in ``save``, background atomic write, markers on
    commit, ``latest`` and ``keep_last`` retention by global rank 0 once a tag is complete."""

    def __init__(self, config_params=None, *, keep_last: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        CheckpointEngine.__init__(self, config_params)
        zipfile_serialization = True
        if config_params is not None:
            try:
                from deepspeed.runtime.model_checkpointing import CHECKPOINT_SERIALIZATION

                zipfile_serialization = config_params.checkpoint_config[CHECKPOINT_SERIALIZATION]
            except Exception:  # noqa: BLE001 - any config without the key keeps the default
                pass
        AsyncCheckpointWriter.__init__(
            self, keep_last=keep_last, timeout_s=timeout_s, zipfile_serialization=zipfile_serialization
        )

    def is_decoupled(self):
        return True  # DeepSpeed must neither commit (blocking) nor write `latest` in save_checkpoint

    def get_commit_info(self):
        return None  # commits are driven by poll(); DeepSpeed's step-time decoupled commit is a no-op

    def preserves_storage_sharing(self):
        return False  # save() copies to host itself; no second on-device clone by DeepSpeed


def install(engine, *, keep_last: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S) -> AsyncPersistentCheckpointEngine:
    """Make ``engine`` (a ``DeepSpeedEngine`` or ``PipelineEngine``) save checkpoints asynchronously
    and atomically; ``save_checkpoint`` / ``load_checkpoint`` are called as before. Returns the
    checkpoint engine (``flush()`` it before reading the checkpoint from another process)."""
    old = getattr(engine, "checkpoint_engine", None)
    if isinstance(old, AsyncPersistentCheckpointEngine):
        old.wait()
    elif old is not None and old.is_decoupled():
        old.cleanup()
    ce = AsyncPersistentCheckpointEngine(getattr(engine, "_config", None), keep_last=keep_last, timeout_s=timeout_s)
    engine.checkpoint_engine = ce
    atexit.register(_finish_at_exit, weakref.ref(ce))
    take_step = getattr(engine, "_take_model_step", None)
    if take_step is not None:
        orig = getattr(take_step, "__ds_resilience_orig__", take_step)

        def _take_model_step(*args, **kwargs):
            if isinstance(engine.checkpoint_engine, AsyncPersistentCheckpointEngine):
                engine.checkpoint_engine.poll()
            return orig(*args, **kwargs)

        _take_model_step.__ds_resilience_orig__ = orig
        engine._take_model_step = _take_model_step
    load = getattr(engine, "load_checkpoint", None)
    if load is not None:
        engine.load_checkpoint = _checked_load(engine, getattr(load, "__ds_resilience_orig__", load))
    return ce


def _checked_load(engine, orig):
    """``engine.load_checkpoint`` that never reads an incomplete tag through ``latest``."""

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        ce = engine.checkpoint_engine
        universal = getattr(engine, "load_universal_checkpoint", lambda: False)()
        if isinstance(ce, AsyncPersistentCheckpointEngine) and not universal:
            ce.flush()  # this job's own saves are committed and `latest` is current
            tag = ce.resolve_load_tag(load_dir, tag)
        return orig(load_dir, tag, *args, **kwargs)

    load_checkpoint.__ds_resilience_orig__ = orig
    return load_checkpoint


def _finish_at_exit(ref: "weakref.ref[AsyncPersistentCheckpointEngine]") -> None:
    """A script that saves and exits leaves a complete checkpoint: markers and ``latest`` written."""
    ce = ref()
    if ce is not None:
        try:
            ce.finish()
        except Exception:  # noqa: BLE001 - never fail the interpreter's exit
            pass

