"""Durable checkpoint files (issue 43, item 5): the persistent tier's order on disk is data, data
fsync, rename, directory fsync, marker, ``latest``; and a load of ``latest`` never reads an
incomplete tag (a truncated or checksum-failing file, a missing marker): it falls back to the newest
complete one with a message naming what was wrong, or raises naming what exists.

One process: the fsyncs and renames are recorded by monkeypatching ``os.fsync`` / ``os.replace``;
crashes are simulated by truncating or corrupting files as a crash would leave them."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ds_resilience.checkpoint import persistent as P
from ds_resilience.checkpoint.persistent import AsyncCheckpointWriter, CommitInfo, complete_tags
from ds_resilience.checkpoint.tag_check import CheckpointIncomplete, resolve_load_tag

pytestmark = pytest.mark.timeout(60)

FILE = "mp_rank_00_model_states.pt"


@pytest.fixture
def writer():
    ce = AsyncCheckpointWriter(keep_last=5, timeout_s=30)
    yield ce
    ce.close()


def _save(ce, save_dir, tag, value, *, names=(FILE,), latest=True, commit=True):
    info = CommitInfo(tag=tag, save_dir=str(save_dir), save_latest=latest)
    ce.create(info)
    os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    for name in names:
        ce.save({"w": torch.full((64,), float(value)), "step": value}, os.path.join(save_dir, tag, name))
    if commit:
        ce.commit(info)
    return info


def _loaded(ce, save_dir, tag):
    return ce.load(os.path.join(save_dir, tag, FILE))["step"]


# --- order on disk ------------------------------------------------------------------------------
def test_data_is_fsynced_and_its_directory_synced_before_the_marker_and_latest(tmp_path, writer, monkeypatch):
    events: list[tuple] = []
    lock = threading.Lock()
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        with lock:
            events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        with lock:
            events.append(("rename", os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(P.os, "fsync", fsync)
    monkeypatch.setattr(P.os, "replace", replace)
    save_dir = os.path.realpath(tmp_path)
    tag_dir = os.path.join(save_dir, "global_step1")
    _save(writer, save_dir, "global_step1", 1, names=("layer_01-model_states.pt", FILE))
    monkeypatch.undo()

    def at(event):
        assert event in events, f"{event} not in {events}"
        return events.index(event)

    marker = os.path.join(tag_dir, ".complete-rank0")
    latest = os.path.join(save_dir, "latest")
    marker_renamed, latest_renamed = at(("rename", marker)), at(("rename", latest))
    tag_dir_synced = [i for i, e in enumerate(events) if e == ("fsync", tag_dir)]
    for name in ("layer_01-model_states.pt", FILE):
        path = os.path.join(tag_dir, name)
        data_synced = at(("fsync", f"{path}.tmp-{os.getpid()}"))
        data_renamed = at(("rename", path))
        assert data_synced < data_renamed, f"{name}: renamed before its data was fsynced: {events}"
        # the directory holding the rename is synced after it, before the marker is written
        assert any(data_renamed < i < marker_renamed for i in tag_dir_synced), events
    assert at(("fsync", f"{marker}.tmp-{os.getpid()}")) < marker_renamed
    assert any(i > marker_renamed for i in tag_dir_synced), "the marker's rename was not made durable"
    assert marker_renamed < at(("fsync", f"{latest}.tmp-{os.getpid()}")) < latest_renamed
    assert any(e == ("fsync", save_dir) for e in events[latest_renamed:]), "latest's rename was not made durable"


def test_marker_records_each_files_size_and_checksum(tmp_path, writer):
    import json
    import zlib

    _save(writer, tmp_path, "global_step1", 1)
    marker = json.loads((tmp_path / "global_step1" / ".complete-rank0").read_text())
    data = (tmp_path / "global_step1" / FILE).read_bytes()
    assert marker["checks"] == {FILE: {"size": len(data), "crc32": zlib.crc32(data)}}


# --- a torn write never becomes latest -----------------------------------------------------------
def test_file_truncated_before_the_commit_never_becomes_latest_nor_prunes_the_previous(tmp_path, monkeypatch):
    ce = AsyncCheckpointWriter(keep_last=1, timeout_s=30)
    try:
        _save(ce, tmp_path, "global_step1", 1)
        real_write = ce._write

        def torn_write(snapshot, path):  # the bytes written, then only half of them on the disk
            record = real_write(snapshot, path)
            os.truncate(path, record["size"] // 2)
            return record

        monkeypatch.setattr(ce, "_write", torn_write)
        _save(ce, tmp_path, "global_step2", 2)
        ce.poll()
    finally:
        ce.close()
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert (tmp_path / "global_step1" / FILE).exists(), "the only complete checkpoint was pruned"
    assert complete_tags(str(tmp_path), 1) == ["global_step1"]


# --- loading falls back -------------------------------------------------------------------------
def test_truncated_file_falls_back_to_the_previous_complete_tag(tmp_path, writer, capsys):
    for step in (1, 2, 3):
        _save(writer, tmp_path, f"global_step{step}", step)
    path = tmp_path / "global_step3" / FILE
    size = path.stat().st_size
    os.truncate(path, size - 10)  # as a machine crash leaves a file whose last blocks never reached the disk
    assert (tmp_path / "latest").read_text() == "global_step3"
    tag = writer.resolve_load_tag(str(tmp_path))
    assert tag == "global_step2" and _loaded(writer, tmp_path, tag) == 2
    err = capsys.readouterr().err
    assert "'global_step3' named by" in err and f"{FILE} (rank 0) has {size - 10} bytes" in err
    assert f"recorded {size}" in err and "'global_step2' instead" in err
    assert path.exists() and path.stat().st_size == size - 10, "nothing is deleted or repaired"


def test_checksum_failure_falls_back(tmp_path, writer, capsys):
    for step in (1, 2):
        _save(writer, tmp_path, f"global_step{step}", step)
    path = tmp_path / "global_step2" / FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    path.write_bytes(bytes(data))
    assert writer.resolve_load_tag(str(tmp_path)) == "global_step1"
    assert f"{FILE} (rank 0) fails its checksum" in capsys.readouterr().err
    assert writer.resolve_load_tag(str(tmp_path), checksums=False) == "global_step2"  # sizes alone agree


def test_missing_marker_never_becomes_latest_and_falls_back(tmp_path, writer, capsys):
    _save(writer, tmp_path, "global_step1", 1)
    writer.participants = lambda: [0, 1]  # rank 1 takes part in the next tag but never marks it
    _save(writer, tmp_path, "global_step2", 2)
    writer.poll()
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert complete_tags(str(tmp_path), 2) == ["global_step1"]
    (tmp_path / "latest").write_text("global_step2")  # e.g. left by a writer that did not check
    assert resolve_load_tag(str(tmp_path), None, 2) == "global_step1"
    err = capsys.readouterr().err
    assert "rank 1's marker .complete-rank1 is missing" in err and "'global_step1' instead" in err


def test_tag_without_markers_but_with_torn_writes_falls_back(tmp_path, writer, capsys):
    _save(writer, tmp_path, "global_step1", 1)
    torn = tmp_path / "global_step2"
    torn.mkdir()
    (torn / f"{FILE}.tmp-4242").write_bytes(b"half a file")
    (tmp_path / "latest").write_text("global_step2")
    assert resolve_load_tag(str(tmp_path), None, 1) == "global_step1"
    assert f"(left: {FILE}.tmp-4242)" in capsys.readouterr().err


def test_tags_without_markers_load_as_before(tmp_path):
    """DeepSpeed's own files (or a stop's export) carry no marker: loaded unchanged, as before."""
    (tmp_path / "global_step7").mkdir()
    torch.save({"step": 7}, tmp_path / "global_step7" / FILE)
    (tmp_path / "latest").write_text("global_step7")
    assert resolve_load_tag(str(tmp_path), None, 1) == "global_step7"
    assert resolve_load_tag(str(tmp_path / "nothing"), None, 1) is None  # no latest: DeepSpeed's warning


def test_nothing_complete_raises_naming_what_is_wrong_and_what_exists(tmp_path, writer):
    _save(writer, tmp_path, "global_step1", 1)
    _save(writer, tmp_path, "global_step2", 2)
    for step in (1, 2):
        os.truncate(tmp_path / f"global_step{step}" / FILE, 5)
    with pytest.raises(CheckpointIncomplete, match=r"'global_step2' named by .*latest is incomplete: "
                       rf"{FILE} \(rank 0\) has 5 bytes.*no complete checkpoint exists.*'global_step1': {FILE}"):
        resolve_load_tag(str(tmp_path), None, 1)


def test_an_incomplete_tag_asked_for_by_name_raises_listing_the_complete_ones(tmp_path, writer):
    _save(writer, tmp_path, "global_step1", 1)
    _save(writer, tmp_path, "global_step2", 2)
    (tmp_path / "global_step2" / FILE).unlink()
    with pytest.raises(CheckpointIncomplete, match=rf"'global_step2' in .* {FILE} \(rank 0\) is missing.*"
                       r"Complete tags there: \['global_step1'\]"):
        resolve_load_tag(str(tmp_path), "global_step2", 1)
    assert resolve_load_tag(str(tmp_path), "global_step1", 1) == "global_step1"


def test_engine_load_checkpoint_reads_the_previous_complete_tag(tmp_path, capsys):
    """``install`` wraps ``engine.load_checkpoint``: DeepSpeed's own reads ``latest`` with a plain
    ``open``, so the wrapper hands it the resolved tag."""
    from ds_resilience.integrations.ds_checkpoint_engine import install

    class Engine:  # the two methods install() wraps, recording what DeepSpeed's load would read
        def __init__(self):
            self.loaded = []

        def _take_model_step(self, *args, **kwargs):
            return None

        def load_checkpoint(self, load_dir, tag=None, load_module_strict=True):
            self.loaded.append((tag, load_module_strict))
            return os.path.join(load_dir, str(tag)), {}

    engine = Engine()
    ce = install(engine, keep_last=3)
    try:
        for step in (1, 2):
            _save(ce, tmp_path, f"global_step{step}", step)
        assert engine.load_checkpoint(str(tmp_path), load_module_strict=False)[0].endswith("global_step2")
        os.truncate(tmp_path / "global_step2" / FILE, 3)
        engine.load_checkpoint(str(tmp_path))
        engine.load_checkpoint(str(tmp_path), tag="global_step1")
        assert engine.loaded == [("global_step2", False), ("global_step1", True), ("global_step1", True)]
        assert "'global_step1' instead" in capsys.readouterr().err
        with pytest.raises(CheckpointIncomplete, match="global_step2"):
            engine.load_checkpoint(str(tmp_path), tag="global_step2")
    finally:
        ce.close()
