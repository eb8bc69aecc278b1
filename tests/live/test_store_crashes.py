"""The snapshot store when its writer is SIGKILLed mid-save: a complete version or the previous one."""

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
from test_store import _child, assert_bitwise  # noqa: F401


def test_snapshot_survives_sigkilled_writer(tmp_path):
    root = tmp_path / "shm"
    proc = _child("""
        import os, signal, torch
        from ds_resilience.checkpoint import SnapshotStore
        torch.manual_seed(0)
        s = SnapshotStore({root!r})
        s.save("w1", 41, {{"w": torch.randn(300, 7), "step": 41, "opt": [torch.arange(9)]}})
        os.kill(os.getpid(), signal.SIGKILL)
    """, root)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    torch.manual_seed(0)
    expect = {"w": torch.randn(300, 7), "step": 41, "opt": [torch.arange(9)]}
    store = SnapshotStore(root)
    assert store.latest("w1").step == 41
    assert_bitwise(expect, store.load("w1"))


def test_sigkill_between_payload_and_manifest_keeps_previous(tmp_path):
    root = tmp_path / "shm"
    proc = _child("""
        import os, signal, torch
        from ds_resilience.checkpoint import SnapshotStore, store as st
        s = SnapshotStore({root!r})
        s.save("w1", 1, {{"x": torch.ones(50)}})
        st.SnapshotStore._commit = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        s.save("w1", 2, {{"x": torch.zeros(50)}})
    """, root)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (root / "w1" / "v000000000002" / PAYLOAD).exists()
    store = SnapshotStore(root)
    assert store.latest("w1").step == 1
    assert torch.equal(store.load("w1")["x"], torch.ones(50))
