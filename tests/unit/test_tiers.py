"""The tiers are enforced, not just named: in tests/unit/ a test that starts a worker fails (the
conftest's one-process rule), and the markers follow the directory."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest

from conftest import _starts_a_program, tier


def _noop() -> None:
    pass


def test_a_unit_test_cannot_start_a_worker_process():
    with pytest.raises(pytest.fail.Exception, match="belongs in tests/dist/"):
        multiprocessing.get_context("fork").Process(target=_noop).start()
    with pytest.raises(pytest.fail.Exception, match="runs"):
        subprocess.run([sys.executable, "examples/train_gpt.py"], check=False)
    with pytest.raises(pytest.fail.Exception):
        subprocess.run([sys.executable, "-m", "ds_resilience.cli", "run", "x.py"], check=False)
    # an import check in a fresh interpreter is allowed
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"


def test_what_counts_as_starting_a_program():
    assert _starts_a_program(["python3", "script.py"]) and _starts_a_program(["deepspeed", "train.py"])
    assert _starts_a_program([sys.executable, "-m", "pytest"])
    assert not _starts_a_program([sys.executable, "-c", "import ds_resilience"])
    assert not _starts_a_program(["cc", "-shared", "x.c"]) and not _starts_a_program([])


def test_the_tier_is_the_directory(request):
    assert tier(request.node.path) == "unit"
    assert tier("/x/tests/dist/test_engine.py".replace("/x/tests", request.config.rootpath.as_posix())) == "dist"
    assert tier(request.config.rootpath / "live" / "test_live.py") == "live"
    marks = {m.name for m in request.node.iter_markers()}
    assert not {"dist", "live"} & marks
