"""``SnapshotStore(durable=True)``, the form a disk tier of snapshots takes (issue 43, item 5): payload
and layout are fsynced, and their directory, before the manifest; a truncated payload is skipped
with a message and the previous version is the newest."""

from __future__ import annotations

import os

import pytest
import torch

from ds_resilience.checkpoint import store as S
from ds_resilience.checkpoint.store import SnapshotStore

pytestmark = pytest.mark.timeout(60)


def test_a_durable_store_syncs_the_data_and_its_directory_before_the_manifest(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(S.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                   real_fsync(fd))[1])
    monkeypatch.setattr(S.os, "replace", lambda src, dst: (events.append(("rename", os.fspath(dst))),
                                                           real_replace(src, dst))[1])
    root = os.path.realpath(tmp_path)
    store = SnapshotStore(root, keep=2, recycle=False, durable=True)
    store.save("rank0", 1, {"w": torch.arange(32.0)})
    monkeypatch.undo()
    vdir = os.path.join(root, "rank0", f"v{1:012d}")
    renamed = {e[1]: i for i, e in enumerate(events) if e[0] == "rename"}
    synced = [(i, e[1]) for i, e in enumerate(events) if e[0] == "fsync"]
    manifest = renamed[os.path.join(vdir, S.MANIFEST)]
    payload = renamed[os.path.join(vdir, S.PAYLOAD)]
    assert any(i < payload and ".payload.bin.tmp-" in p for i, p in synced), events  # data before its rename
    assert any(i < renamed[os.path.join(vdir, S.LAYOUT)] and ".layout.json.tmp-" in p for i, p in synced)
    assert any(payload < i < manifest and p == vdir for i, p in synced), "renames not synced before the manifest"
    assert any(i < manifest and ".MANIFEST.json.tmp-" in p for i, p in synced)
    assert any(i > manifest and p == vdir for i, p in synced), "the manifest's rename was not made durable"
    store.close()


def test_a_truncated_payload_is_skipped_and_the_previous_version_loads(tmp_path):
    store = SnapshotStore(tmp_path, keep=3, recycle=False, durable=True)
    for step in (1, 2):
        store.save("rank0", step, {"w": torch.full((64,), float(step))})
    os.truncate(tmp_path / "rank0" / f"v{2:012d}" / S.PAYLOAD, 10)
    fresh = SnapshotStore(tmp_path, keep=3, recycle=False, durable=True)  # as after a restart
    assert fresh.holdings() == {"rank0": [1]}
    assert torch.equal(fresh.load("rank0")["w"], torch.full((64,), 1.0))
    assert {(c.owner, c.step) for c in fresh.corrupt} == {("rank0", 2)}  # logged and recorded (at each read)
    assert "payload has 10 bytes, manifest says 256" in fresh.corrupt[0].reason
    store.close()
    fresh.close()
