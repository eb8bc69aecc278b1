"""Staging pipeline and in-memory snapshot store: bitwise round trips, chunked checksums, corruption,
torn writes, retention, replicas, and survival of a SIGKILLed writer."""

from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch

from ds_resilience.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    SnapshotStore,
    StagingPipeline,
    unflatten,
)
from ds_resilience.checkpoint.store import MANIFEST, PAYLOAD
from ds_resilience.errors import ResilienceError
from ds_resilience.kernels.checksum import checksum_of_bytes, checksum_reference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def realistic_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model(torch.randn(5, 7)).pow(2).sum().backward()
    opt.step()
    sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "step": 17,
        "loss_scale": 65536.0,
        "tag": "run-a",
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "sampler": [3, (4, 5), None, True],
        "special": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def assert_bitwise(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert b.device.type == "cpu"
        assert torch.equal(a.detach().cpu().reshape(-1).view(torch.uint8) if a.numel() else a.new_empty(0, dtype=torch.uint8),
                           b.reshape(-1).view(torch.uint8) if b.numel() else b.new_empty(0, dtype=torch.uint8))
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a.keys()) == list(b.keys())
        for k in a:
            assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise(x, y)
    else:
        assert a == b


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "bf16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 333, generator=g).to(torch.float16),
        "i64": torch.randint(-2**62, 2**62, (257,), generator=g, dtype=torch.int64),
        "f64": torch.randn(129, generator=g, dtype=torch.float64),
        "u8": torch.randint(0, 255, (1023,), generator=g, dtype=torch.uint8),
        "odd": torch.randn(5, generator=g).to(torch.float16),  # 10 bytes: not word-aligned
        "strided": torch.randn(40, 30, generator=g).t()[::2],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "bool": torch.tensor([True, False, True]),
    }


# ------------------------------------------------------------------------------------- staging
def test_round_trip_bitwise_realistic_state():
    state = realistic_state()
    staged = StagingPipeline().flatten(state)
    layout = pickle.loads(pickle.dumps(staged.layout))  # the layout is picklable and small
    assert len(pickle.dumps(layout)) < 20_000
    assert_bitwise(state, unflatten(layout, staged.payload))
    assert staged.checksum == checksum_reference(staged.payload)


@pytest.mark.parametrize("stage_cpu", [False, True])
def test_tiny_sub_buffers_match_one_shot_reference(stage_cpu):
    state = mixed_state()
    one_shot = StagingPipeline(gpu_buffer_mb=64, num_sub_buffers=1).flatten(state)
    tiny = StagingPipeline(gpu_buffer_mb=4 / 1024, num_sub_buffers=4, stage_cpu=stage_cpu)  # 1 KB buffers
    assert tiny.sub_buffer_bytes == 1024
    staged = tiny.flatten(state)
    expected_chunks = sum(-(-m.nbytes // 1024) for m in staged.layout.tensors)
    assert tiny.chunks_copied == expected_chunks > len(staged.layout.tensors)  # really chunked
    assert torch.equal(staged.payload, one_shot.payload)
    assert staged.checksum == one_shot.checksum == checksum_reference(staged.payload)
    assert staged.checksum == checksum_of_bytes(staged.payload.numpy().tobytes())
    assert_bitwise(state, unflatten(staged.layout, staged.payload))


# --------------------------------------------------------------------------------------- store
def test_store_round_trip_and_info(tmp_path):
    store = SnapshotStore(tmp_path, pipeline=StagingPipeline(gpu_buffer_mb=1 / 64))
    state = realistic_state()
    info = store.save("w0", 5, state)
    assert info.step == 5 and info.nbytes == os.path.getsize(info.path / PAYLOAD)
    assert store.latest("w0") == info
    assert_bitwise(state, store.load("w0"))
    assert_bitwise(state, store.load("w0", 5))
    assert store.latest("nobody") is None
    with pytest.raises(CheckpointError):
        store.load("w0", 6)
    with pytest.raises(CheckpointError):
        store.save("../evil", 1, state)
    assert issubclass(CheckpointCorrupt, CheckpointError) and issubclass(CheckpointError, ResilienceError)


def test_flipped_byte_detected_previous_used(tmp_path, caplog):
    store = SnapshotStore(tmp_path)
    old, new = realistic_state(0), realistic_state(1)
    store.save("w0", 1, old)
    info = store.save("w0", 2, new)
    with open(info.path / PAYLOAD, "r+b") as f:
        f.seek(info.nbytes // 2)
        b = f.read(1)
        f.seek(info.nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    assert store.load("w0", 1) is not None and store.latest("w0", cached=False).step == 1  # full re-read
    store = SnapshotStore(tmp_path)  # a recovering process: nothing cached
    assert store.latest("w0").step == 1
    assert {(c.owner, c.step) for c in store.corrupt} == {("w0", 2)}
    assert "corrupt" in caplog.text
    assert_bitwise(old, store.load("w0"))
    with pytest.raises(CheckpointCorrupt):
        store.load("w0", 2)
    with pytest.raises(CheckpointCorrupt):
        store.read_bytes("w0", 2)


def test_truncated_payload_skipped(tmp_path):
    store = SnapshotStore(tmp_path)
    store.save("w0", 1, {"x": torch.arange(100)})
    info = store.save("w0", 2, {"x": torch.arange(200)})
    os.truncate(info.path / PAYLOAD, info.nbytes - 8)
    assert store.latest("w0").step == 1
    assert store.newest_common_step(["w0"]) == 1


def test_crash_before_manifest_keeps_previous(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path)
    store.save("w0", 1, {"x": torch.ones(10)})
    real_replace = os.replace

    def crash_on_manifest(src, dst):
        if str(dst).endswith(MANIFEST):
            raise OSError("killed before the manifest")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_manifest)
    with pytest.raises(OSError):
        store.save("w0", 2, {"x": torch.zeros(10)})
    monkeypatch.undo()
    assert (tmp_path / "w0" / "v000000000002" / PAYLOAD).exists()  # the payload made it, the manifest not
    assert store.latest("w0").step == 1
    assert torch.equal(store.load("w0")["x"], torch.ones(10))
    store.save("w0", 3, {"x": torch.full((10,), 3.0)})  # the torn leftover is cleaned up
    assert not (tmp_path / "w0" / "v000000000002").exists()


def test_keep_deletes_older_versions(tmp_path):
    store = SnapshotStore(tmp_path, keep=2)
    for step in range(1, 6):
        store.save("w0", step, {"x": torch.full((4,), float(step))})
    assert [i.step for i in store.versions("w0")] == [5, 4]
    assert sorted(p.name for p in (tmp_path / "w0").iterdir() if not p.name.startswith(".")) == [
        "v000000000004", "v000000000005"]
    assert torch.equal(store.load("w0", 4)["x"], torch.full((4,), 4.0))
    assert store.reused == 2  # versions 4 and 5 were written into the files of pruned 2 and 3


def test_a_shared_tier_keeps_the_newest_step_every_owner_holds(tmp_path):
    """CI saw a restart find no step on disk for every rank: two ranks lost at steps 2 and 4 had
    written [1, 2], the survivors' keep 2 had pruned everything but [3, 4]. With keep_common the
    survivors keep step 2, the newest step all four hold, until every owner holds a newer one."""
    disk = SnapshotStore(tmp_path, keep=2, recycle=False, keep_common=True)
    for step in (1, 2):
        for owner in ("w0", "w1", "w2", "w3"):
            disk.save(owner, step, {"x": torch.full((2,), float(step))})
    for step in (3, 4, 5):  # w2 and w3 are gone
        for owner in ("w0", "w1"):
            disk.save(owner, step, {"x": torch.full((2,), float(step))})
    assert [i.step for i in disk.versions("w0")] == [5, 4, 2] == [i.step for i in disk.versions("w1")]
    assert disk.newest_common_step(["w0", "w1", "w2", "w3"]) == 2
    for step in (3, 4, 5):  # relaunched, they catch up: step 2 is no longer needed
        for owner in ("w2", "w3"):
            disk.save(owner, step, {"x": torch.full((2,), float(step))})
    disk.save("w0", 6, {"x": torch.zeros(2)})
    assert [i.step for i in disk.versions("w0")] == [6, 5]
    plain = SnapshotStore(tmp_path / "plain", keep=2, recycle=False)  # without: the common step goes
    for step in (1, 2):
        for owner in ("w0", "w1"):
            plain.save(owner, step, {"x": torch.zeros(2)})
    for step in (3, 4):
        plain.save("w0", step, {"x": torch.zeros(2)})
    assert plain.newest_common_step(["w0", "w1"]) is None


def test_recycled_payloads_keep_every_version_exact(tmp_path):
    """A recycled file holds the new version's bytes only: no byte of the old one survives, and a
    version still mapped by a reader (open_version) is never recycled under it."""
    store = SnapshotStore(tmp_path, keep=1)
    store.save("w0", 0, {"x": torch.arange(1000, dtype=torch.float32)})
    info, _, mapped = store.open_version("w0", 0)
    before = mapped.clone()
    for step in range(1, 5):
        store.save("w0", step, {"x": torch.full((1000,), float(step))})
        assert torch.equal(store.load("w0", step)["x"], torch.full((1000,), float(step)))
    assert torch.equal(mapped, before)  # the pinned version 0 was unlinked, not overwritten
    store.release("w0", 0)
    assert store.reused == 2  # steps 3 and 4 reused the files of 1 and 2; step 2 could not reuse 0
    store.save("w0", 5, {"y": torch.zeros(7, dtype=torch.int64)})  # another layout: a new file
    assert store.reused == 2 and torch.equal(store.load("w0")["y"], torch.zeros(7, dtype=torch.int64))


@pytest.mark.parametrize("keep_mapped", [True, False])
def test_a_recycled_file_keeps_its_mapping_and_every_version_reads_back(tmp_path, keep_mapped):
    """Versions written into recycled files reuse the file's mapping (keep + 1 mappings for any
    number of snapshots), and every version reads back exact; keep_mapped=False maps per snapshot."""
    store = SnapshotStore(tmp_path, keep=2, keep_mapped=keep_mapped)
    for step in range(1, 8):
        store.save("w0", step, {"x": torch.full((1000,), float(step)), "s": step})
        got = store.load("w0", step)
        assert torch.equal(got["x"], torch.full((1000,), float(step))) and got["s"] == step
    assert store.reused == 4
    assert store.mapped == (3 if keep_mapped else 7)
    rep = store.read_bytes("w0", 7)  # a replica received by another store recycles its files too
    other = SnapshotStore(tmp_path / "peer", keep=1, keep_mapped=keep_mapped)
    for step in range(3):
        other.put_bytes("w0", step, rep.payload, rep.layout, rep.checksum)
        assert torch.equal(other.load("w0", step)["x"], torch.full((1000,), 7.0))
    assert other.mapped == (2 if keep_mapped else 3)


def test_a_spare_file_replaced_behind_the_store_gets_a_new_mapping(tmp_path):
    """If another process replaces the spare file, the kept mapping (of the old file) is not
    reused: the next version goes into the new file and reads back exact, not corrupt."""
    store = SnapshotStore(tmp_path, keep=1)
    for step in range(2):
        store.save("w0", step, {"x": torch.full((256,), float(step))})
    (spare,) = [p for p in (tmp_path / "w0").iterdir() if p.name.startswith(".spare")]
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(bytes(spare.stat().st_size))
    os.replace(foreign, spare)
    mapped = store.mapped
    store.save("w0", 2, {"x": torch.full((256,), 2.0)})
    assert store.mapped == mapped + 1
    assert torch.equal(store.load("w0", 2)["x"], torch.full((256,), 2.0))
    assert store.corrupt == []


def test_a_device_state_page_locks_each_kept_mapping_once(tmp_path, monkeypatch):
    """For a device state the store page-locks a payload file's mapping once, keeps it locked while
    the file is recycled, and unlocks it when the file is dropped (another layout, close, wipe);
    keep_mapped=False leaves the locking to the staging pipeline, per snapshot."""
    from ds_resilience.checkpoint import store as store_mod

    calls = {"lock": [], "unlock": []}
    monkeypatch.setattr(store_mod, "on_device", lambda t: True)  # these CPU tensors stand for a GPU's
    monkeypatch.setattr(store_mod, "register_host", lambda out, device: calls["lock"].append(out.data_ptr()) or ("h", out.data_ptr()))
    monkeypatch.setattr(store_mod, "unregister_host", lambda handle: calls["unlock"].append(handle[1]))
    store = SnapshotStore(tmp_path / "a", keep=2)
    for step in range(1, 7):
        store.save("w0", step, {"x": torch.full((512,), float(step))})
    assert len(calls["lock"]) == 3 and len(set(calls["lock"])) == 3 and calls["unlock"] == []
    store.save("w0", 7, {"y": torch.zeros(9)})  # another layout: the spare's mapping is dropped
    assert len(calls["lock"]) == 4 and len(calls["unlock"]) == 1
    store.close()
    assert sorted(calls["unlock"]) == sorted(calls["lock"])
    assert torch.equal(store.load("w0", 6)["x"], torch.full((512,), 6.0))
    calls["lock"].clear()
    calls["unlock"].clear()
    plain = SnapshotStore(tmp_path / "b", keep=2, keep_mapped=False)
    for step in range(1, 4):
        plain.save("w0", step, {"x": torch.full((512,), float(step))})
    assert calls["lock"] == []
    store2 = SnapshotStore(tmp_path / "c", keep=2)
    for step in range(1, 5):
        store2.save("w0", step, {"x": torch.full((512,), float(step))})
    store2.wipe()
    assert len(calls["unlock"]) == len(calls["lock"]) == 3


def test_put_bytes_replica(tmp_path):
    src = SnapshotStore(tmp_path / "a")
    dst = SnapshotStore(tmp_path / "b")
    state = realistic_state()
    src.save("w3", 7, state)
    rep = src.read_bytes("w3", 7)
    with pytest.raises(CheckpointCorrupt):
        dst.put_bytes("w3", 7, rep.payload, rep.layout, rep.checksum ^ 1)
    bad = rep.payload.clone()
    bad[3] ^= 1
    with pytest.raises(CheckpointCorrupt):
        dst.put_bytes("w3", 7, bad, rep.layout, rep.checksum)
    with pytest.raises(CheckpointCorrupt):
        dst.put_bytes("w3", 7, rep.payload[:-1], rep.layout, rep.checksum)
    assert dst.latest("w3") is None and not (tmp_path / "b" / "w3").exists()  # nothing committed
    dst.put_bytes("w3", 7, bytes(rep.payload.numpy()), rep.layout, rep.checksum)
    assert dst.latest("w3").checksum == rep.checksum
    assert_bitwise(state, dst.load("w3"))


def test_newest_common_step(tmp_path):
    store = SnapshotStore(tmp_path, keep=3)
    for step in (1, 2, 3):
        store.save("a", step, {"s": step})
    for step in (1, 2):
        store.save("b", step, {"s": step})
    store.save("c", 2, {"s": 2})
    assert store.newest_common_step(["a", "b", "c"]) == 2
    assert store.newest_common_step(["a"]) == 3
    assert store.newest_common_step(["a", "nobody"]) is None
    (tmp_path / "c" / "v000000000002" / MANIFEST).unlink()
    assert store.newest_common_step(["a", "b", "c"]) is None


def _child(script: str, root) -> subprocess.CompletedProcess:
    code = textwrap.dedent(script).format(root=str(root))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_default_root_is_shm():
    assert str(SnapshotStore.default_root("job-7")) == "/dev/shm/ds_resilience/job-7"
    with pytest.raises(CheckpointError):
        SnapshotStore.default_root("a/b")


def test_ordered_dict_and_namedtuple_preserved():
    from collections import namedtuple

    P = namedtuple("P", "a b")
    state = OrderedDict(z=torch.arange(3), a=P(torch.ones(2), 5))
    staged = StagingPipeline().flatten(state)
    assert_bitwise(state, unflatten(staged.layout, staged.payload))


def test_a_corrupt_replica_of_a_held_step_leaves_the_held_version_intact(tmp_path):
    src = SnapshotStore(tmp_path / "a")
    dst = SnapshotStore(tmp_path / "b")
    src.save("w3", 7, {"x": torch.arange(100, dtype=torch.float32)})
    rep = src.read_bytes("w3", 7)
    dst.put_bytes("w3", 7, rep.payload, rep.layout, rep.checksum)
    bad = rep.payload.clone()
    bad[5] ^= 1
    with pytest.raises(CheckpointCorrupt):
        dst.put_bytes("w3", 7, bad, rep.layout, rep.checksum)  # the same step again, corrupted in transit
    assert dst.latest("w3", cached=False).step == 7
    assert torch.equal(dst.load("w3", 7)["x"], torch.arange(100, dtype=torch.float32))


def test_an_older_version_committed_after_newer_ones_is_not_pruned_at_once(tmp_path):
    """A restart may restore a step older than the two its rank holds (its peers lagged): the
    replica received for it must survive its own commit, or the restore finds nothing to load."""
    src, dst = SnapshotStore(tmp_path / "a"), SnapshotStore(tmp_path / "b", keep=2)
    for step in (3, 4):
        dst.save("w0", step, {"x": torch.full((5,), float(step))})
    src.save("w0", 1, {"x": torch.ones(5)})
    rep = src.read_bytes("w0", 1)
    dst.put_bytes("w0", 1, rep.payload, rep.layout, rep.checksum)
    assert torch.equal(dst.load("w0", 1)["x"], torch.ones(5))


def test_a_version_pruned_while_being_opened_reads_as_pruned(tmp_path):
    """The replication thread opens a version while the training thread prunes it (keep reached):
    open_version then says the version is gone (CheckpointError, which the sender skips), not an
    I/O error, and leaves no pin behind. Seen in CI as 'unable to open file ... payload.bin'."""
    from ds_resilience.checkpoint.store import CheckpointError

    store = SnapshotStore(tmp_path, keep=1)
    store.save("w0", 0, {"x": torch.arange(64, dtype=torch.float32)})
    verify = store._verify

    def verify_then_prune(owner, step, **kw):
        info = verify(owner, step, **kw)
        store._delete(owner, step)  # what a commit of a newer version does on the other thread
        return info

    store._verify = verify_then_prune
    with pytest.raises(CheckpointError, match=r"w0@0 was pruned while being opened"):
        store.open_version("w0", 0)
    assert store._pins == {}


def test_discard_after_deletes_the_newer_versions_only(tmp_path):
    store = SnapshotStore(tmp_path, keep=3)
    for step in range(1, 5):
        store.save("w0", step, {"x": torch.full((8,), float(step))})
    assert store.discard_after("w0", 2) == [4, 3]
    assert [i.step for i in store.versions("w0")] == [2]
    assert torch.equal(store.load("w0")["x"], torch.full((8,), 2.0))
    store.save("w0", 3, {"x": torch.full((8,), 30.0)})  # the other course from step 2
    assert torch.equal(store.load("w0", 3)["x"], torch.full((8,), 30.0))
