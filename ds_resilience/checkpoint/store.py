"""Versioned, checksummed, atomic snapshots in host memory (``/dev/shm`` by default).

On-disk form, one directory per version::

    <root>/<owner>/v<step:012d>/payload.bin    the flattened tensors (see staging.py)
                               /layout.json    the Layout as JSON (structure, dtypes, offsets, values)
                               /MANIFEST.json  owner, step, nbytes, checksum, layout sha256; written LAST

A version exists only once its ``MANIFEST.json`` is in place: payload and layout are written to
temporary names and ``os.replace``-d first, the manifest is written to a temporary name and
``os.replace``-d last. A writer killed at any point therefore leaves either the complete new version
or no new version; readers never see a torn snapshot. ``/dev/shm`` is tmpfs: the files live in RAM
and outlive the process that wrote them (a worker crash loses nothing; a machine loss does, which is
what replicas on peers are for). Every read verifies the payload checksum; a corrupt version is
logged, recorded in :attr:`SnapshotStore.corrupt` and skipped, so the previous one is used.
One writer per owner is assumed (the owner's worker, or the agent storing a peer's replica).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import ResilienceError
from ..kernels.checksum import checksum_reference
from ..accelerator import on_device
from ..durable import fsync_dir, fsync_file
from .layout import Layout, LayoutError, TensorMeta, unflatten
from .staging import StagingPipeline, register_host, unregister_host

__all__ = ["CheckpointCorrupt", "CheckpointError", "CorruptVersion", "PendingSnapshot", "ReplicaBytes", "SnapshotInfo", "SnapshotStore"]

logger = logging.getLogger("ds_resilience.checkpoint")

MANIFEST = "MANIFEST.json"
PAYLOAD = "payload.bin"
LAYOUT = "layout.json"
_OWNER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_VERSION = re.compile(r"^v(\d{12})$")


class CheckpointError(ResilienceError):
    """A snapshot is missing, or the store was used wrongly (bad owner name, negative step)."""


class CheckpointCorrupt(CheckpointError):
    """A snapshot's bytes do not match its checksum (or its size or layout do not match)."""


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed version: who, which step, where, how big, and its payload checksum."""

    owner: str
    step: int
    nbytes: int
    checksum: int
    path: Path


@dataclass(frozen=True)
class CorruptVersion:
    """A version that failed verification, and why."""

    owner: str
    step: int
    reason: str


@dataclass(frozen=True)
class PendingSnapshot:
    """A version copied by :meth:`SnapshotStore.begin_save` but not committed yet."""

    owner: str
    step: int
    vdir: Path
    tmp: Path
    layout: Layout
    checksum: int | None


@dataclass(frozen=True)
class ReplicaBytes:
    """What a peer needs to store a replica: payload, layout (JSON bytes) and checksum."""

    owner: str
    step: int
    payload: torch.Tensor
    layout: bytes
    checksum: int


class _Mapping:
    """A payload file's shared mapping, kept while the store holds the file (as a version, a
    pending one or the owner's spare) so that the next version written into the same file reuses
    it: no new mapping to fault in and, for a device state, no page-locking per snapshot
    (``cudaHostRegister`` of the whole payload costs about 4x the copy's own time on an H200: see
    docs/benchmarks/gpu.md). Page-locked at most once, for the first device that writes into
    it; unlocked and unmapped by :meth:`close`."""

    __slots__ = ("tensor", "locked", "inode")

    def __init__(self, tensor: torch.Tensor, inode: tuple[int, int]) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.locked: Any = None  # register_host's handle, False where the accelerator refused
        self.inode = inode  # (st_dev, st_ino) of the file mapped: reused only for that same file

    def lock_for(self, device: torch.device) -> None:
        if self.locked is None and self.tensor is not None:
            self.locked = register_host(self.tensor, device) or False

    def close(self) -> None:
        if self.locked:
            unregister_host(self.locked)
        self.locked, self.tensor = None, None


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _close(mapping: _Mapping | None) -> None:
    if mapping is not None:
        mapping.close()


def _parse_layout(data: bytes, owner: str, step: int) -> Layout:
    try:
        return Layout.from_json(data)
    except LayoutError as exc:
        raise CheckpointCorrupt(f"{owner}@{step}: {exc}") from None


def _write_atomic(path: Path, data: bytes | memoryview, durable: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


class SnapshotStore:
    """Snapshots of several owners (workers, or peers whose replicas this host holds) under ``root``.

    Args:
        root: directory; ``None`` means :meth:`default_root` of ``job_id`` (in ``/dev/shm``).
        keep: committed versions kept per owner; older ones are deleted after a new one commits.
        job_id: names the default root.
        pipeline: the staging pipeline used by :meth:`save` (default: 128 MB in 4 sub-buffers).
        recycle: reuse a pruned version's payload file for the next version of the same layout
            (saves tmpfs page allocation; off for a disk tier, where it only costs space).
        keep_mapped: keep each payload file's shared mapping while the store holds the file, and
            with it the page-locking a device state's copy needs (``cudaHostRegister``), so a
            recycled file costs neither again; ``False`` maps and page-locks per snapshot.
        durable: a disk tier: payload and layout are fsynced, and their directory, before the
            manifest is written (itself fsynced), so after a machine crash a manifest never names
            bytes that did not reach the disk (tmpfs has nothing to sync: off by default).
        keep_common: a tier every rank of a job writes into (the disk's): pruning never deletes
            the newest step that every owner under the root holds, so a restore that needs one
            step for every rank finds it even when some owners stopped writing (lost ranks) or
            lag behind (a slow disk), at the price of one older version per owner meanwhile.
    """

    def __init__(self, root: Path | str | None = None, *, keep: int = 2, job_id: str = "default",
                 pipeline: StagingPipeline | None = None, recycle: bool = True, keep_mapped: bool = True,
                 durable: bool = False, keep_common: bool = False) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.root = Path(root) if root is not None else self.default_root(job_id)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.pipeline = pipeline or StagingPipeline()
        self.corrupt: list[CorruptVersion] = []
        self._verified: dict[tuple[str, int], tuple[Any, ...]] = {}
        self._seq = itertools.count(1)  # makes every uncommitted payload's name unique
        # A pruned version's payload file is kept as its owner's spare and reused by the next
        # version with the same tensor layout: tmpfs pages already allocated, no zero-filling.
        self._spares: dict[str, tuple[Path, tuple[TensorMeta, ...], _Mapping | None]] = {}
        self.keep_mapped = keep_mapped
        self._mappings: dict[tuple[str, int], _Mapping] = {}  # the payload files this store holds, by version
        self.mapped = 0  # payload mappings created (a counter for tests and benchmarks)
        self._metas: dict[tuple[str, int], tuple[TensorMeta, ...]] = {}
        self.reused = 0
        self.recycle = recycle
        self.durable = durable
        self.keep_common = keep_common
        self._pins: dict[tuple[str, int], int] = {}  # versions mapped by open_version: never recycled

    @staticmethod
    def default_root(job_id: str) -> Path:
        """``/dev/shm/ds_resilience/<job_id>``: tmpfs, survives the writer's crash."""
        if not _OWNER.match(job_id):
            raise CheckpointError(f"job id {job_id!r} must match {_OWNER.pattern}")
        return Path("/dev/shm") / "ds_resilience" / job_id

    # ------------------------------------------------------------------------------------ writing
    def _version_dir(self, owner: str, step: int) -> Path:
        if not _OWNER.match(owner):
            raise CheckpointError(f"owner {owner!r} must match {_OWNER.pattern}")
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        return self.root / owner / f"v{step:012d}"

    def _begin(self, owner: str, step: int) -> Path:
        vdir = self._version_dir(owner, step)
        vdir.mkdir(parents=True, exist_ok=True)
        (vdir / MANIFEST).unlink(missing_ok=True)  # re-saving a step: the old version stops existing first
        self._verified.pop((owner, step), None)
        return vdir

    def _commit(self, vdir: Path, owner: str, step: int, nbytes: int, checksum: int, layout_bytes: bytes) -> SnapshotInfo:
        manifest = {"format": 1, "owner": owner, "step": step, "nbytes": nbytes, "checksum": checksum,
                    "layout_sha256": hashlib.sha256(layout_bytes).hexdigest()}
        if self.durable:  # the payload's and layout's renames reach the disk before the manifest
            fsync_dir(vdir)
            fsync_dir(vdir.parent)
        _write_atomic(vdir / MANIFEST, json.dumps(manifest, sort_keys=True).encode(), self.durable)
        info = SnapshotInfo(owner, step, nbytes, checksum, vdir)
        self._verified[(owner, step)] = self._stats(vdir)  # we just wrote and checksummed these bytes
        self._prune(owner, step)
        return info

    def save(self, owner: str, step: int, state: Any) -> SnapshotInfo:
        """Flatten ``state`` straight into a new payload file and commit it as version ``step``."""
        return self.finish_save(self.begin_save(owner, step, state, checksum=True))

    def begin_save(self, owner: str, step: int, state: Any, *, checksum: bool = True) -> "PendingSnapshot":
        """Copy ``state`` into an uncommitted payload file of version ``step`` (the part of a save
        that must finish before the training state changes again); :meth:`finish_save` commits it.

        With ``checksum=False`` the copy is a plain copy and the checksum is computed by
        :meth:`finish_save`, e.g. on a background thread; on GPU the copy kernel computes it in the
        same pass, so pass ``True`` there. Until :meth:`finish_save` the version does not exist.
        """
        vdir = self._begin(owner, step)
        layout, leaves = self.pipeline.plan(state)
        tmp, mapping = self._new_payload(owner, vdir, layout.tensors)
        value: int | None = 0
        if layout.nbytes:
            try:
                mapping = mapping or self._mapping(tmp, layout.nbytes)  # zero-filled or a spare
                device = next((t.device for t in leaves if on_device(t)), None)
                if device is not None and self.keep_mapped:
                    mapping.lock_for(device)
                value = self.pipeline.write(layout, leaves, mapping.tensor, checksum=checksum)
            except BaseException:
                _close(mapping)
                raise
            self._hold(owner, step, mapping)
        else:
            _close(mapping)
            tmp.write_bytes(b"")
        return PendingSnapshot(owner, step, vdir, tmp, layout, value)

    def _mapping(self, path: Path, nbytes: int) -> _Mapping:
        self.mapped += 1
        tensor = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        return _Mapping(tensor, _inode(path))

    def _hold(self, owner: str, step: int, mapping: _Mapping) -> None:
        """Keep ``mapping`` as the one of version ``step``'s payload file (or drop it: ``keep_mapped=False``)."""
        _close(self._mappings.pop((owner, step), None))  # a re-saved step's old file
        if self.keep_mapped:
            self._mappings[(owner, step)] = mapping
        else:
            mapping.close()

    def finish_save(self, pending: "PendingSnapshot") -> SnapshotInfo:
        """Checksum (if not yet done) and commit a :meth:`begin_save`; the version exists after this."""
        checksum = pending.checksum
        if checksum is None:
            checksum = checksum_reference(
                torch.from_file(str(pending.tmp), shared=False, size=pending.layout.nbytes, dtype=torch.uint8))
        if self.durable:
            fsync_file(pending.tmp)
        os.replace(pending.tmp, pending.vdir / PAYLOAD)
        self._metas[(pending.owner, pending.step)] = pending.layout.tensors
        layout_bytes = pending.layout.to_json()
        _write_atomic(pending.vdir / LAYOUT, layout_bytes, self.durable)
        return self._commit(pending.vdir, pending.owner, pending.step, pending.layout.nbytes, checksum, layout_bytes)

    def receive(self, owner: str, step: int, nbytes: int, layout_bytes: bytes, checksum: int,
                fill: Callable[[torch.Tensor], None]) -> SnapshotInfo:
        """Store a replica that arrives in pieces: ``fill`` writes the payload into the (shared,
        uncommitted) mapping it is given; the result is verified before it is committed.

        Raises:
            CheckpointCorrupt: the layout is malformed (JSON checked field by field, never
                unpickled) or the received bytes do not match ``checksum`` (nothing is committed,
                and a version ``step`` held before stays as it was).
            Whatever ``fill`` raises (a peer died mid-transfer): nothing is committed either, and
            the previous version stays the newest.
        """
        vdir = self._version_dir(owner, step)
        try:  # JSON, checked field by field; never unpickled
            layout = _parse_layout(layout_bytes, owner, step)
            if layout.nbytes != nbytes:
                raise CheckpointCorrupt(f"replica {owner}@{step}: {nbytes} bytes sent, its layout says {layout.nbytes}")
        except CheckpointCorrupt:
            if nbytes:
                fill(torch.empty(nbytes, dtype=torch.uint8))  # take the bytes off the wire: the stream stays in step
            raise
        metas = layout.tensors
        vdir.mkdir(parents=True, exist_ok=True)
        tmp, mapping = self._new_payload(owner, vdir, metas)
        try:
            if nbytes:
                mapping = mapping or self._mapping(tmp, nbytes)
                fill(mapping.tensor)
                actual = checksum_reference(mapping.tensor)
            else:
                _close(mapping)
                mapping = None
                tmp.write_bytes(b"")
                actual = 0
            if actual != checksum:
                raise CheckpointCorrupt(f"replica {owner}@{step}: received checksum {actual:#018x} != sent {checksum:#018x}")
        except BaseException:
            _close(mapping)
            tmp.unlink(missing_ok=True)
            for d in (vdir, vdir.parent):  # directories this call created (rmdir leaves non-empty ones)
                try:
                    d.rmdir()
                except OSError:
                    break
            raise
        if self.durable:
            fsync_file(tmp)
        self._begin(owner, step)  # verified: only now does a held version of this step stop existing
        os.replace(tmp, vdir / PAYLOAD)
        if mapping is not None:
            self._hold(owner, step, mapping)
        _write_atomic(vdir / LAYOUT, bytes(layout_bytes), self.durable)
        self._metas[(owner, step)] = metas
        return self._commit(vdir, owner, step, nbytes, checksum, bytes(layout_bytes))

    def _new_payload(self, owner: str, vdir: Path, metas: tuple[TensorMeta, ...]) -> tuple[Path, _Mapping | None]:
        """A fresh uncommitted payload path in ``vdir``: the owner's spare file when its tensor
        layout matches (padding stays zero: the same tensor ranges are overwritten), with the
        spare's mapping when it kept one, else no file yet."""
        tmp = vdir / f".{PAYLOAD}.tmp-{os.getpid()}-{next(self._seq)}"
        spare = self._spares.pop(owner, None)
        if spare is not None:
            path, spare_metas, mapping = spare
            if spare_metas == metas:
                try:
                    os.replace(path, tmp)
                    self.reused += 1
                    if mapping is not None and mapping.inode != _inode(tmp):
                        _close(mapping)  # another process replaced the file: its mapping is of another file
                        mapping = None
                    return tmp, mapping
                except FileNotFoundError:
                    pass
            else:
                path.unlink(missing_ok=True)
            _close(mapping)
        return tmp, None

    def open_version(self, owner: str, step: int, *, verify: bool = True) -> tuple[SnapshotInfo, bytes, torch.Tensor]:
        """A verified version's info, layout (JSON bytes) and a read-only-in-effect payload mapping
        (what a sender streams to a peer without copying it first). The version stays pinned, so
        pruning never recycles its file under the mapping, until :meth:`release`.

        ``verify=False`` checks sizes and the layout hash but not the payload checksum: for a sender
        whose receiver checks the bytes against the manifest's checksum anyway."""
        key = (owner, step)
        self._pins[key] = self._pins.get(key, 0) + 1
        try:
            info = self._verify(owner, step, payload=verify)
            try:
                return info, (info.path / LAYOUT).read_bytes(), self._map(info)
            except (OSError, RuntimeError) as exc:  # torch.from_file: RuntimeError for a missing file
                if (info.path / MANIFEST).exists():
                    raise
                # pruned by the training thread between the check and the mapping: the version is
                # gone as if it had been pruned before (a newer one exists), not an I/O failure
                raise CheckpointError(f"{owner}@{step} was pruned while being opened") from exc
        except BaseException:
            self.release(owner, step)
            raise

    def release(self, owner: str, step: int) -> None:
        """Undo one :meth:`open_version`."""
        key = (owner, step)
        left = self._pins.get(key, 0) - 1
        if left > 0:
            self._pins[key] = left
        else:
            self._pins.pop(key, None)

    def holdings(self, *, verify: bool = True) -> dict[str, list[int]]:
        """Every owner's committed steps, newest first; verified (corrupt versions reported and
        left out) unless ``verify=False``, which only reads the manifests' presence."""
        if verify:
            return {owner: steps for owner in self.owners() if (steps := [i.step for i in self.versions(owner)])}
        return {owner: steps for owner in self.owners() if (steps := self._committed_steps(owner))}

    def verify(self, owner: str, step: int) -> bool:
        """Re-read and check a version; a corrupt one is reported (and ``False`` returned)."""
        try:
            self._verify(owner, step, cached=False)
            return True
        except CheckpointCorrupt as exc:
            self._report(owner, step, exc)
            return False
        except CheckpointError:
            return False

    def discard_after(self, owner: str, step: int) -> list[int]:
        """Delete ``owner``'s versions newer than ``step`` (training went back to ``step`` and takes
        another course from it: those versions are of a past that will not be); returns their steps."""
        gone = [s for s in self._all_steps(owner) if s > step]
        for s in gone:
            self._delete(owner, s)
        return gone

    def wipe(self) -> None:
        """Delete everything under the root (what losing this machine's memory does)."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self._verified.clear()

    def close(self) -> None:
        """Drop every payload mapping this store keeps (and its page-locking); the files stay."""
        for mapping in self._mappings.values():
            mapping.close()
        self._mappings.clear()
        for owner, (path, metas, mapping) in list(self._spares.items()):
            _close(mapping)
            self._spares[owner] = (path, metas, None)

    def put_bytes(self, owner: str, step: int, payload: bytes | bytearray | torch.Tensor,
                  layout: Layout | bytes, checksum: int) -> SnapshotInfo:
        """Store a replica held whole in memory (:meth:`receive` with a single copy).

        Raises:
            CheckpointCorrupt: the payload's checksum or size does not match (nothing is committed).
        """
        if isinstance(payload, torch.Tensor):
            raw = payload.detach().reshape(-1).view(torch.uint8).cpu().contiguous()
        else:
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        layout_bytes = bytes(layout) if isinstance(layout, (bytes, bytearray)) else layout.to_json()
        layout_obj = _parse_layout(layout_bytes, owner, step)
        if raw.numel() != layout_obj.nbytes:
            raise CheckpointCorrupt(f"replica {owner}@{step}: {raw.numel()} bytes, layout says {layout_obj.nbytes}")
        return self.receive(owner, step, raw.numel(), bytes(layout_bytes), checksum, lambda buf: buf.copy_(raw))

    def _prune(self, owner: str, new_step: int) -> None:
        committed = self._committed_steps(owner)
        common = self._newest_common_committed() if self.keep_common and len(committed) > self.keep else None
        for step in committed[self.keep:]:
            if step != new_step and step != common:  # an older version just committed (a restore's) is wanted
                self._delete(owner, step)
        for step in self._all_steps(owner):  # leftovers of writers killed before their manifest
            if step < new_step and step not in committed:
                self._delete(owner, step)

    def _newest_common_committed(self) -> int | None:
        """The newest step with a committed version (manifest) for every owner under the root."""
        common: set[int] | None = None
        for owner in self.owners():
            steps = set(self._committed_steps(owner))
            common = steps if common is None else common & steps
            if not common:
                return None
        return max(common) if common else None

    def _delete(self, owner: str, step: int) -> None:
        vdir = self._version_dir(owner, step)
        (vdir / MANIFEST).unlink(missing_ok=True)  # un-exist first, then free the memory
        metas = self._metas.pop((owner, step), None)
        mapping = self._mappings.pop((owner, step), None)
        if self.recycle and metas is not None and owner not in self._spares and not self._pins.get((owner, step)):
            spare = self.root / owner / f".spare-{os.getpid()}"
            try:
                os.replace(vdir / PAYLOAD, spare)
                self._spares[owner] = (spare, metas, mapping)
                mapping = None
            except FileNotFoundError:
                pass
        _close(mapping)
        shutil.rmtree(vdir, ignore_errors=True)
        self._verified.pop((owner, step), None)

    # ------------------------------------------------------------------------------------ reading
    def owners(self) -> list[str]:
        """Owners with at least a directory under the root."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _OWNER.match(p.name))

    def _all_steps(self, owner: str) -> list[int]:
        odir = self.root / owner
        if not odir.is_dir():
            return []
        return sorted((int(m.group(1)) for p in odir.iterdir() if (m := _VERSION.match(p.name))), reverse=True)

    def _committed_steps(self, owner: str) -> list[int]:
        """Steps with a manifest, newest first (not yet verified)."""
        return [s for s in self._all_steps(owner) if (self._version_dir(owner, s) / MANIFEST).is_file()]

    @staticmethod
    def _stats(vdir: Path) -> tuple[Any, ...]:
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in (os.stat(vdir / n) for n in (MANIFEST, PAYLOAD, LAYOUT)))

    def _verify(self, owner: str, step: int, *, cached: bool = True, payload: bool = True) -> SnapshotInfo:
        """The version's info after checking size, payload checksum and layout hash.

        With ``cached``, a version this store already verified (or wrote) is not re-read while its
        files keep their inode, mtime and size; :meth:`load` and :meth:`read_bytes` always re-read.
        """
        vdir = self._version_dir(owner, step)
        try:
            manifest = json.loads((vdir / MANIFEST).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no snapshot {owner}@{step} under {self.root}") from None
        except ValueError as exc:
            raise CheckpointCorrupt(f"{owner}@{step}: unreadable manifest ({exc})") from None
        info = SnapshotInfo(owner, step, int(manifest["nbytes"]), int(manifest["checksum"]), vdir)
        try:
            stats = self._stats(vdir)
        except FileNotFoundError as exc:
            raise CheckpointCorrupt(f"{owner}@{step}: missing file {exc.filename}") from None
        if cached and self._verified.get((owner, step)) == stats:
            return info
        if stats[1][2] != info.nbytes:
            raise CheckpointCorrupt(f"{owner}@{step}: payload has {stats[1][2]} bytes, manifest says {info.nbytes}")
        if hashlib.sha256((vdir / LAYOUT).read_bytes()).hexdigest() != manifest["layout_sha256"]:
            raise CheckpointCorrupt(f"{owner}@{step}: layout does not match its hash")
        if not payload:
            return info
        actual = checksum_reference(self._map(info)) if info.nbytes else 0
        if actual != info.checksum:
            raise CheckpointCorrupt(f"{owner}@{step}: payload checksum {actual:#018x} != manifest {info.checksum:#018x}")
        self._verified[(owner, step)] = stats
        return info

    @staticmethod
    def _map(info: SnapshotInfo) -> torch.Tensor:
        """A private read-only-in-effect mapping of the payload (copy-on-write: never alters the file)."""
        if not info.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(str(info.path / PAYLOAD), shared=False, size=info.nbytes, dtype=torch.uint8)

    def _report(self, owner: str, step: int, exc: CheckpointError) -> None:
        logger.warning("snapshot %s@%d is corrupt, skipped: %s", owner, step, exc)
        self.corrupt.append(CorruptVersion(owner, step, str(exc)))

    def versions(self, owner: str) -> list[SnapshotInfo]:
        """Verified committed versions, newest first; corrupt ones are reported and left out."""
        good: list[SnapshotInfo] = []
        for step in self._committed_steps(owner):
            try:
                good.append(self._verify(owner, step))
            except CheckpointCorrupt as exc:
                self._report(owner, step, exc)
            except CheckpointError:
                continue  # deleted meanwhile
        return good

    def latest(self, owner: str, *, cached: bool = True) -> SnapshotInfo | None:
        """The newest committed version whose checksum verifies, or ``None``."""
        for step in self._committed_steps(owner):
            try:
                return self._verify(owner, step, cached=cached)
            except CheckpointCorrupt as exc:
                self._report(owner, step, exc)
            except CheckpointError:
                continue
        return None

    def _layout(self, info: SnapshotInfo) -> Layout:
        return _parse_layout((info.path / LAYOUT).read_bytes(), info.owner, info.step)

    def load(self, owner: str, step: int | None = None, *, cached: bool = False) -> Any:
        """The state of version ``step`` (default: :meth:`latest`), verified, as CPU tensors.

        ``cached=True`` skips re-reading a version this store verified or wrote itself (unchanged).

        Raises:
            CheckpointError: no such (or no verifiable) version.
            CheckpointCorrupt: the requested ``step`` fails verification.
        """
        info = self.latest(owner, cached=cached) if step is None else self._verify(owner, step, cached=cached)
        if info is None:
            raise CheckpointError(f"no verifiable snapshot of {owner} under {self.root}")
        return unflatten(self._layout(info), self._map(info))

    def read_bytes(self, owner: str, step: int) -> ReplicaBytes:
        """The verified payload, layout (JSON bytes) and checksum of a version, to send to a peer."""
        info = self._verify(owner, step, cached=False)
        payload = self._map(info).clone()
        return ReplicaBytes(owner, step, payload, (info.path / LAYOUT).read_bytes(), info.checksum)

    def newest_common_step(self, owners: Iterable[str]) -> int | None:
        """The newest step that every one of ``owners`` has committed and verified, or ``None``."""
        common: set[int] | None = None
        for owner in owners:
            steps = {info.step for info in self.versions(owner)}
            common = steps if common is None else common & steps
        return max(common) if common else None
