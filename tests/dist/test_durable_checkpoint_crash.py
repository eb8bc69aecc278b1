"""Durable checkpoint files (issue 43, item 5), with a real crash: a writer process saves
``global_step1`` through the persistent tier, starts ``global_step2`` and is SIGKILLed in the middle
of it (during a data file's write, or between the data and its completion marker). ``latest`` still
names ``global_step1``, nothing of ``global_step2`` is taken for complete, and a load gets
``global_step1``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from ds_resilience.checkpoint.persistent import AsyncCheckpointWriter, complete_tags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROGRAM = os.path.join(HERE, "durable_writer_program.py")
FILE = "mp_rank_00_model_states.pt"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["data", "marker"])
def test_sigkill_during_a_save_leaves_latest_on_the_previous_complete_checkpoint(tmp_path, point):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, PROGRAM, str(tmp_path), point], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:  # bounded by the test's timeout (the program pauses at most 120 s)
            lines.append(line)
            if line.startswith("PAUSED"):
                break
        assert lines and lines[-1].strip() == f"PAUSED {point}", "".join(lines)[-3000:]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()

    assert (tmp_path / "latest").read_text() == "global_step1"
    assert complete_tags(str(tmp_path), 1) == ["global_step1"]
    step2 = tmp_path / "global_step2"
    assert step2.is_dir() and not (step2 / ".complete-rank0").exists()
    assert (step2 / ".saving-rank0").exists()  # begun, never finished: not mistaken for DeepSpeed's own files
    if point == "data":
        assert any(".tmp-" in n for n in os.listdir(step2)), os.listdir(step2)  # the torn write is left as it was
    else:
        assert (step2 / FILE).exists()  # the data reached its name; without the marker it is not a checkpoint

    ce = AsyncCheckpointWriter()
    try:
        tag = ce.resolve_load_tag(str(tmp_path))
        assert tag == "global_step1"
        state = ce.load(os.path.join(tmp_path, tag, FILE))
        assert state["step"] == 1 and torch.equal(state["w"], torch.full((1 << 20,), 1.0))
        # even a `latest` pointed at the killed save by hand does not make it load
        (tmp_path / "latest").write_text("global_step2")
        assert ce.resolve_load_tag(str(tmp_path)) == "global_step1"
    finally:
        ce.close()
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "global_step2", "latest"]  # nothing deleted
