"""Persistent checkpoint tier: asynchronous, atomic checkpoint files, completion markers, retention.

The DeepSpeed ``CheckpointEngine`` built on this module is
:class:`ds_resilience.integrations.ds_checkpoint_engine.AsyncPersistentCheckpointEngine` (with
:func:`~ds_resilience.integrations.ds_checkpoint_engine.install`); everything here is free of
deepspeed. :class:`AsyncCheckpointWriter` writes the files like this:

* ``save(state_dict, path)`` copies every tensor to host memory at once (a snapshot: training may
  go on and mutate the live tensors), then a background thread ``torch.save`` s it to
  ``path + ".tmp-<pid>"`` (counting its size and CRC-32 on the way), fsyncs it and ``os.replace``
  s it to ``path``: a reader never sees a torn file, and a crash leaves only a ``.tmp-*`` file that
  DeepSpeed's loaders never glob.
* Before a tag's first file, the background thread writes ``<tag>/.saving-rank<R>`` (durably):
  a tag with it and no marker is a save that never finished, not DeepSpeed's own files.
* ``commit(info)`` waits (bounded) for this rank's writes of that tag, fsyncs the directories they
  were renamed in (and the save directory, which holds the tag's entry), then writes the marker
  ``<save_dir>/<tag>/.complete-rank<R>`` durably (tmp, fsync, rename, directory fsync), naming the
  ranks expected to mark the tag (every rank, or after a failure the survivors:
  :attr:`AsyncCheckpointWriter.participants`) and each file's size and CRC-32; then it removes
  ``.saving-rank<R>``.
* The finalizer (global rank 0, or the first survivor once it died) writes ``<save_dir>/latest``
  (durably, the same way) only once every expected rank's marker of a tag exists and its files
  have the recorded sizes, and then deletes complete tags older than the newest ``keep_last``
  complete ones.

So the order on disk is data, data fsync, rename, directory fsync, marker, ``latest``: after a
machine crash ``latest`` never names files whose bytes did not reach the disk. A load of
``latest`` goes through :func:`~ds_resilience.checkpoint.tag_check.resolve_load_tag`, which falls
back to the newest complete tag when the one ``latest`` names is not (see :mod:`.tag_check`).
* :meth:`~AsyncCheckpointWriter.poll` commits what has finished without blocking;
  :meth:`~AsyncCheckpointWriter.flush` (collective) and ``wait()`` force the commits.

A tag's ``info`` is any object with ``tag``, ``save_dir`` and ``save_latest`` (DeepSpeed's
``CheckpointCommitInfo`` or :class:`CommitInfo`); :func:`complete_tags` and
:func:`latest_complete_tag` read the markers back.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import os
import shutil
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ResilienceError
from ..durable import fsync_dir
from .tag_check import MARKER_PREFIX, SAVING_PREFIX, complete_tags, latest_complete_tag, resolve_load_tag

__all__ = [
    "AsyncCheckpointWriter",
    "CheckpointWriteError",
    "CommitInfo",
    "complete_tags",
    "latest_complete_tag",
    "resolve_load_tag",
]

ENGINE_NAME = "AsyncPersistentCheckpointEngine"
DEFAULT_TIMEOUT_S = 600.0

# path -> future of the write in flight, shared by every engine of this process, so a load (by any
# engine instance) of a file still being written waits for it instead of reading nothing.
_INFLIGHT: dict[str, cf.Future] = {}
_INFLIGHT_LOCK = threading.Lock()


class CheckpointWriteError(ResilienceError):
    """A background checkpoint write failed or did not finish in time."""


@dataclass
class CommitInfo:
    """A tag being saved (the fields of DeepSpeed's ``CheckpointCommitInfo``, which works as well)."""

    tag: str
    save_dir: str
    save_latest: bool


def _is_commit_info(info: Any) -> bool:
    return hasattr(info, "tag") and hasattr(info, "save_dir")


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _snapshot(obj: Any, memo: dict[int, Any]) -> Any:
    """A copy of ``obj`` whose tensors are fresh CPU tensors and whose containers are new."""
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        out = t.to("cpu", copy=True)
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
    elif isinstance(obj, OrderedDict):
        out = OrderedDict((k, _snapshot(v, memo)) for k, v in obj.items())
    elif isinstance(obj, dict):
        out = {k: _snapshot(v, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        out = [_snapshot(v, memo) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(_snapshot(v, memo) for v in obj)
    elif obj is None or isinstance(obj, (str, bytes, int, float, bool, complex, torch.dtype, torch.device)):
        out = obj
    else:
        try:
            out = copy.deepcopy(obj)
        except Exception:  # noqa: BLE001 - an uncopyable object is stored as is, like torch.save would
            out = obj
    memo[key] = out
    return out


def _atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably: tmp file, fsync, rename, directory fsync."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fd:
        fd.write(text)
        fd.flush()
        os.fsync(fd.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


class _Counting:
    """A write-only file wrapper that counts the bytes and their CRC-32 as ``torch.save`` writes them."""

    def __init__(self, f) -> None:
        self._f = f
        self.size = 0
        self.crc32 = 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self.crc32 = zlib.crc32(data, self.crc32)
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()


class _PendingTag:
    __slots__ = ("info", "writes", "created_ns")

    def __init__(self, info: Any) -> None:
        self.info = info
        self.writes: list[tuple[str, cf.Future]] = []
        self.created_ns = time.time_ns()

    def done(self) -> bool:
        return all(f.done() for _, f in self.writes)


class AsyncCheckpointWriter:
    """Host snapshot in ``save``, background atomic write, markers on commit, ``latest`` and
    ``keep_last`` retention by global rank 0 once a tag is complete (see the module docstring)."""

    def __init__(self, *, keep_last: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
                 zipfile_serialization: bool = True) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.name = ENGINE_NAME
        self.keep_last = keep_last
        self.timeout_s = float(timeout_s)
        self.zipfile_serialization = zipfile_serialization
        self._executor = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds-ckpt-writer")
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, str], _PendingTag] = OrderedDict()
        self._current: _PendingTag | None = None
        self._latest_wanted: dict[str, tuple[int, str]] = {}  # save_dir -> (created_ns, tag), rank 0
        self._latest_written: dict[str, int] = {}
        self._save_dirs: set[str] = set()
        self.write_seconds: list[float] = []  # background time of each write (for benchmarks)
        # who takes part: the default is the whole world with rank 0 as finalizer; an engine that
        # survives failures points these at its survivors (and their barrier)
        self.participants: Callable[[], Sequence[int]] | None = None
        self.finalizer: Callable[[], bool] | None = None
        self.barrier: Callable[[], None] | None = None

    def _is_finalizer(self) -> bool:
        return self.finalizer() if self.finalizer is not None else _rank_world()[0] == 0

    def _expected(self) -> list[int]:
        if self.participants is not None:
            return sorted(int(r) for r in self.participants())
        return list(range(_rank_world()[1]))

    # --- the CheckpointEngine API (DeepSpeed's names) -------------------------------------------
    def create(self, info):
        entry = _PendingTag(info)
        with self._lock:
            self._pending[(info.save_dir, info.tag)] = entry
            self._current = entry
            self._save_dirs.add(info.save_dir)
        if info.save_latest and self._is_finalizer():
            self._latest_wanted[info.save_dir] = (entry.created_ns, info.tag)

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        path = os.fspath(path)
        snapshot = _snapshot(state_dict, {})  # synchronous: the live tensors may change after return
        # register while holding the lock: the writer's own cleanup takes it too, so a write that
        # finishes (or fails) at once cannot unregister before it is registered
        with self._lock:
            current = self._current
            if current is not None and not current.writes:  # the tag's first file: say a save began
                self._executor.submit(self._begin, os.path.join(current.info.save_dir, current.info.tag))
        with _INFLIGHT_LOCK:
            future = self._executor.submit(self._write, snapshot, path)
            _INFLIGHT[path] = future
        with self._lock:
            if self._current is not None:
                self._current.writes.append((path, future))
            else:  # save() outside save_checkpoint: tracked under its directory
                key = (os.path.dirname(path), os.path.basename(path))
                entry = self._pending.setdefault(
                    key, _PendingTag(CommitInfo(tag=key[1], save_dir=key[0], save_latest=False)))
                entry.writes.append((path, future))
        return None

    def load(self, path: str, map_location="cpu"):
        """Read a file this engine wrote. Tensors land in host memory unless ``map_location`` says
        otherwise (a file written from ``cuda:3`` loads on a node with fewer GPUs, or after the
        rank moved; ``load_state_dict`` copies them onto the module's device)."""
        path = os.fspath(path)
        with _INFLIGHT_LOCK:
            future = _INFLIGHT.get(path)
        if future is not None:
            try:
                self._result(path, future, self.timeout_s)
            except CheckpointWriteError:
                pass  # a failed write leaves no file: reported below as missing, never loaded
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file {path} does not exist (an interrupted write leaves only "
                                    f"'{os.path.basename(path)}.tmp-<pid>', which is never loaded)")
        return torch.load(path, map_location="cpu" if map_location is None else map_location, weights_only=False)

    def commit(self, info):
        """Wait for this rank's writes of ``info`` (a commit info or a tag), then write
        ``<save_dir>/<tag>/.complete-rank<R>``. Raises :class:`CheckpointWriteError` naming the file
        if a write failed or did not finish within ``timeout_s``."""
        entry = self._find(info)
        if entry is None:
            return True
        deadline = time.monotonic() + self.timeout_s
        for path, future in entry.writes:
            try:
                self._result(path, future, max(0.0, deadline - time.monotonic()))
            except CheckpointWriteError:
                if future.done():
                    # a failed write: the tag stays incomplete for good (no marker); report it once
                    with self._lock:
                        self._pending.pop((entry.info.save_dir, entry.info.tag), None)
                        if self._current is entry:
                            self._current = None
                raise  # a timed-out write stays pending: a later wait() may still commit it
        rank, world = _rank_world()
        tag_dir = os.path.join(entry.info.save_dir, entry.info.tag)
        os.makedirs(tag_dir, exist_ok=True)
        # the renames of the data files, and the tag's own entry, reach the disk before the marker
        for d in sorted({os.path.dirname(p) or "." for p, _ in entry.writes} | {tag_dir, entry.info.save_dir}):
            fsync_dir(d)
        checks = {os.path.basename(p): f.result() for p, f in entry.writes if isinstance(f.result(), dict)}
        marker = {"rank": rank, "world_size": world, "tag": entry.info.tag, "created_ns": entry.created_ns,
                  "files": [os.path.basename(p) for p, _ in entry.writes], "expected": self._expected(),
                  "checks": checks}
        self._write_marker(os.path.join(tag_dir, f"{MARKER_PREFIX}{rank}"), marker)
        try:
            os.unlink(os.path.join(tag_dir, f"{SAVING_PREFIX}{rank}"))  # the marker says it all now
        except OSError:
            pass
        with self._lock:
            self._pending.pop((entry.info.save_dir, entry.info.tag), None)
            if self._current is entry:
                self._current = None
        if self._is_finalizer():
            self._finalize(just_committed=(entry.info.save_dir, entry.info.tag))
        return True

    def cleanup(self):
        self.wait()

    # --- driving commits -----------------------------------------------------------------------
    def pending_tags(self) -> list[str]:
        with self._lock:
            return [tag for (_, tag) in self._pending]

    def poll(self) -> None:
        """Non-blocking: commit every tag whose writes have finished; rank 0 then updates ``latest``
        and retention. A failed write raises here, at the next step."""
        with self._lock:
            ready = [e for e in self._pending.values() if e.done()]
        for entry in ready:
            self.commit(entry.info)
        if self._is_finalizer() and self._save_dirs:
            self._finalize()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending write of this rank is written and committed."""
        with self._lock:
            entries = list(self._pending.values())
        saved, self.timeout_s = self.timeout_s, (self.timeout_s if timeout_s is None else float(timeout_s))
        try:
            for entry in entries:
                self.commit(entry.info)
        finally:
            self.timeout_s = saved

    def flush(self, timeout_s: float | None = None) -> None:
        """Collective (over the participants): every rank waits for its writes, then the finalizer
        writes ``latest`` and prunes."""
        self.wait(timeout_s)
        world = _rank_world()[1]
        barrier = self.barrier or (torch.distributed.barrier if world > 1 else (lambda: None))
        barrier()
        if self._is_finalizer():
            self._finalize()
        barrier()

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)

    def finish(self, timeout_s: float = 60.0) -> None:
        """At the end of the process (no collective): commit this rank's writes; the finalizer then
        waits (bounded) for the other participants' markers and writes ``latest``, so a checkpoint
        saved just before a script exits is complete for the next job."""
        try:
            self.wait()
        except CheckpointWriteError:
            return
        if not (self._is_finalizer() and self._latest_wanted):
            return
        deadline = time.monotonic() + timeout_s
        while True:
            self._finalize()
            done = all(self._latest_written.get(d, -1) >= wanted[0] for d, wanted in self._latest_wanted.items())
            if done or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def resolve_load_tag(self, load_dir: str, tag=None, *, checksums: bool = True):
        """The tag a load of ``load_dir`` should read (see
        :func:`~ds_resilience.checkpoint.tag_check.resolve_load_tag`): ``latest``'s tag, or the
        newest complete one when that is incomplete (logged); call after :meth:`flush`."""
        return resolve_load_tag(load_dir, tag, _rank_world()[1], checksums=checksums)

    # --- internals -----------------------------------------------------------------------------
    def _begin(self, tag_dir: str) -> None:
        """``<tag>/.saving-rank<R>``, durably, before the tag's data: a tag left with neither a
        marker nor this file is not ours (DeepSpeed's own files, an export), one with it is a save
        that never finished."""
        os.makedirs(tag_dir, exist_ok=True)
        _atomic_write_text(os.path.join(tag_dir, f"{SAVING_PREFIX}{_rank_world()[0]}"), "")
        fsync_dir(os.path.dirname(tag_dir) or ".")

    def _write_marker(self, path: str, marker: dict) -> None:
        """The commit point of a rank's part of a tag (after its data files are durable)."""
        _atomic_write_text(path, json.dumps(marker))

    def _find(self, info) -> _PendingTag | None:
        with self._lock:
            if _is_commit_info(info):
                entry = self._pending.get((info.save_dir, info.tag))
                return entry if entry is not None else _PendingTag(info)
            tag = str(info)
            for (_, t), entry in reversed(self._pending.items()):
                if t == tag:
                    return entry
        return None

    def _write(self, snapshot, path: str) -> dict:
        """Write ``path`` (tmp file, fsync, rename); returns its size and CRC-32 for the marker. The
        directory is fsynced by :meth:`commit`, once per tag, before the marker."""
        t0 = time.perf_counter()
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                out = _Counting(f)
                torch.save(snapshot, out, _use_new_zipfile_serialization=self.zipfile_serialization)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with _INFLIGHT_LOCK:
                _INFLIGHT.pop(path, None)
        self.write_seconds.append(time.perf_counter() - t0)
        return {"size": out.size, "crc32": out.crc32}

    @staticmethod
    def _result(path: str, future: cf.Future, timeout: float) -> None:
        try:
            future.result(timeout=timeout)
        except cf.TimeoutError:
            raise CheckpointWriteError(f"checkpoint write of {path} did not finish within {timeout:.1f}s") from None
        except Exception as exc:  # noqa: BLE001
            raise CheckpointWriteError(f"checkpoint write of {path} failed: {exc!r}") from exc

    def _finalize(self, just_committed: tuple[str, str] | None = None) -> None:
        """The finalizer: point ``latest`` at the newest complete tag; prune old complete tags."""
        _, world = _rank_world()
        for save_dir in list(self._save_dirs):
            complete = complete_tags(save_dir, world)
            if not complete:
                continue
            wanted = self._latest_wanted.get(save_dir)
            if wanted is not None and wanted[1] in complete and self._latest_written.get(save_dir, -1) < wanted[0]:
                _atomic_write_text(os.path.join(save_dir, "latest"), wanted[1])
                self._latest_written[save_dir] = wanted[0]
            with self._lock:
                busy = {tag for (d, tag) in self._pending if d == save_dir}
            protect = set(busy)
            if just_committed is not None and just_committed[0] == save_dir:
                protect.add(just_committed[1])
            try:
                with open(os.path.join(save_dir, "latest")) as fd:
                    protect.add(fd.read().strip())
            except OSError:
                pass
            for tag in complete[:-self.keep_last]:
                if tag in protect:
                    continue
                shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)

