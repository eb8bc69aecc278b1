"""A JIT op build lock whose holder died is removed; one a live process holds is kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ds_resilience.runtime import build_locks as bl

# creates the lock as torch's FileBaton does (O_CREAT | O_EXCL, the descriptor kept open), then waits
_HOLDER = ("import os, sys, time\n"
           "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\n"
           "print('held', flush=True)\n"
           "time.sleep(120)\n")


def _hold(lock):
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _killed_holder(lock):
    proc = _hold(lock)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    return lock


@pytest.fixture
def root(tmp_path):
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "py311_cpu" / "deepspeed_shm_comm").mkdir(parents=True)
    return tmp_path


def test_a_lock_held_by_a_live_process_is_kept_and_its_holder_named(root):
    lock = root / "fused_adam" / "lock"
    proc = _hold(lock)
    try:
        assert proc.pid in bl.holders(lock)
        assert not bl.is_stale(lock, recheck_s=0.05)
        assert bl.clear_stale_locks(root, recheck_s=0.05, echo=lambda m: None) == []
        assert lock.exists()
    finally:
        proc.kill()
        proc.wait(10)


def test_a_lock_left_by_a_killed_holder_is_removed_at_either_depth(root):
    said = []
    locks = [_killed_holder(root / "fused_adam" / "lock"),
             _killed_holder(root / "py311_cpu" / "deepspeed_shm_comm" / "lock")]
    assert all(lock.exists() and bl.holders(lock) == [] for lock in locks)
    assert bl.clear_stale_locks(root, recheck_s=0.05, echo=said.append) == sorted(locks)
    assert not any(lock.exists() for lock in locks)
    assert len(said) == 2 and "died holding it" in said[0]


def test_a_lock_on_a_network_filesystem_is_named_and_kept(root, monkeypatch):
    lock = _killed_holder(root / "fused_adam" / "lock")
    monkeypatch.setattr(bl, "on_network_filesystem", lambda path: True)
    said = []
    assert bl.clear_stale_locks(root, recheck_s=0.05, echo=said.append) == []
    assert lock.exists() and "network filesystem" in said[0]


def test_the_mount_table_tells_a_local_folder_from_a_network_one(tmp_path, monkeypatch):
    assert not bl.on_network_filesystem(tmp_path)
    real_open = open

    def mounts(path, *args, **kwargs):
        if path == "/proc/self/mounts":
            import io
            return io.StringIO(f"server:/export {tmp_path} nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", mounts)
    assert bl.on_network_filesystem(tmp_path / "fused_adam" / "lock")
    assert not bl.on_network_filesystem("/usr")


def test_extensions_root_is_torchs_choice(monkeypatch):
    assert bl.extensions_root({"TORCH_EXTENSIONS_DIR": "/x/ext"}) == bl.Path("/x/ext")
    assert bl.extensions_root({"HOME": "/home/u"}) == bl.Path("/home/u/.cache/torch_extensions")
    assert bl.extensions_root({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == bl.Path("/c/torch_extensions")


def test_a_guarded_filebaton_wait_gives_up_on_a_dead_holder_but_not_on_a_live_one(root, monkeypatch):
    from torch.utils import cpp_extension, file_baton

    monkeypatch.setattr(file_baton.FileBaton, "wait", file_baton.FileBaton.wait)  # undone after the test
    assert bl.guard_build_locks()
    assert cpp_extension.FileBaton is file_baton.FileBaton  # the class torch's JIT build takes its lock with
    lock = root / "fused_adam" / "lock"

    # a live holder: the wait goes on until the holder releases
    proc = _hold(lock)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (file_baton.FileBaton(str(lock)).wait(), done.set()), daemon=True)
    waiter.start()
    try:
        assert not done.wait(3.5)  # two staleness checks passed: the holder is alive
        assert lock.exists()
    finally:
        proc.kill()
        proc.wait(10)
    # the holder died without releasing: the wait removes the lock and returns
    assert done.wait(15)
    assert not lock.exists()

    # and a lock whose holder is already dead when the wait starts
    _killed_holder(lock)
    t0 = time.monotonic()
    file_baton.FileBaton(str(lock)).wait()
    assert not lock.exists() and time.monotonic() - t0 < 15


def test_without_the_guard_torchs_wait_never_gives_up(root):
    """The hazard itself: torch's own wait on a dead holder's lock does not return."""
    from torch.utils import file_baton

    lock = _killed_holder(root / "fused_adam" / "lock")
    original = bl._TORCH_WAIT or file_baton.FileBaton.wait  # torch's, whether or not this process is guarded
    assert original is not bl._stale_aware_wait
    done = threading.Event()
    baton = file_baton.FileBaton(str(lock))
    threading.Thread(target=lambda: (original(baton), done.set()), daemon=True).start()
    assert not done.wait(3.0)
    os.remove(lock)  # let the daemon thread end
    assert done.wait(5)
