"""Shared pytest setup: the tiers by directory, the unit tier's one-process rule, GPU skips.

The tiers (``tests/README.md``), marked here from where a test lives, so ``-m`` selects them:

* ``tests/unit/<package>/test_<module>.py``: one process. No marker. A unit test that starts a
  worker (a multiprocessing process, or a Python program other than a ``python -c`` import check)
  fails with a message saying where it belongs.
* ``tests/dist/``: starts worker processes (gloo ranks, a training or benchmark program): ``dist``.
* ``tests/live/``: runs the agent or kills a process on purpose: ``live`` (and ``dist``).
* ``gpu`` / ``multigpu(n)`` (set on the test): skipped where the CUDA devices are missing.

``bash tests/run.sh -m "not dist and not live"`` is the contributor's loop.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

# The engine profiles itself at start when no cost model is given (resilience.profile_steps null):
# every test job would spend its first 5 iterations on it and plan with timings of a loaded machine.
# Tests run with unit costs unless they ask for a profile (tests/unit/planning/test_profile.py does, both ways).
os.environ.setdefault("DSR_SELF_PROFILE", "0")
# A worker found slow switches the job's schedule (a slow epoch) by default: on this shared 2-core
# machine the detector's default margin finds noise slow now and then, and the switches would add
# epochs, replayed iterations and log lines to tests that count them. Tests of the switch ask for it
# (detector.straggler_replan: tests/live/test_stragglers_live.py).
os.environ.setdefault("DSR_STRAGGLER_REPLAN", "0")
# Point-to-point messages match as NCCL matches them (tags ignored, FIFO per pair) in every test job,
# so the whole suite runs under NCCL's rules on gloo; tests/dist/test_engine.py also runs gloo's tags.
os.environ.setdefault("DSR_P2P_MATCHING", "fifo")
# Start-up is paid once: agents fork their workers from a server that imported these modules
# (ds_resilience/supervisor/spawn.py), and tests/dist_harness.py forks its ranks from the same list.
# A 4-rank job under the agent starts in ~1 s instead of 5-15 s of imports per process. Tests of
# the default path (a fresh interpreter per worker) set DSR_PRELOAD="" for their agent.
# ds_resilience.integrations.warm: what engine construction would import and probe in each process
# (torch._dynamo, fsdp, DeepSpeed's op probe: ~12 s of a core per rank, more than the training of
# most dist tests), done once in the server.
os.environ.setdefault(
    "DSR_PRELOAD", "torch,torch.distributed,deepspeed,ds_resilience,ds_resilience.integrations.deepspeed,"
                   "ds_resilience.integrations.warm")

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
# the repository, the harness (tests/) and every test directory: helper programs and shared test
# helpers import by module name wherever they live (their names are unique across the tree)
for _dir in [REPO, TESTS, *sorted(os.path.join(root, d) for root, dirs, _ in os.walk(TESTS) for d in dirs
                                  if d not in ("__pycache__", "tools"))]:
    if _dir not in sys.path:
        sys.path.insert(1 if sys.path and sys.path[0] == REPO else 0, _dir)
if sys.path[0] != REPO:
    sys.path.remove(REPO)
    sys.path.insert(0, REPO)

TIERS = {"dist": ("dist",), "live": ("dist", "live")}
# run by tests/run.sh after the live tier, with the machine to themselves: the Megatron example's
# TP=2 SIGKILL recovery fails now and then under a second job's load (ranks exit 1 after a store
# wait for the agreement), a timing window left open (see PRELOAD in tests/live/test_megatron_example.py)
ALONE = ("live/test_megatron_tp_live.py", "live/test_stragglers_live.py")


# each test file's measured seconds (``tests/tools/durations.py .test-reports/*.xml --write
# tests/durations.json``): the suite orders files longest first, and tests/run.sh has pytest-xdist
# keep that order (--no-loadscope-reorder; its default puts files with the most tests first), so a
# long file never starts last and leaves the other workers idle while it runs. A file not in the
# table counts as UNMEASURED_S.
DURATIONS = os.path.join(TESTS, "durations.json")
UNMEASURED_S = 10.0


def measured_seconds() -> dict[str, float]:
    try:
        with open(DURATIONS) as f:
            return {str(k): float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def required_gpus(item) -> int:
    """``@pytest.mark.gpu``: 1; ``@pytest.mark.multigpu(n)``: n (2 when not given)."""
    marker = item.get_closest_marker("multigpu")
    if marker is None:
        return 1
    need = marker.args[0] if marker.args else marker.kwargs.get("gpus", 2)
    if not isinstance(need, int) or need < 2:
        raise pytest.UsageError(f"{item.nodeid}: multigpu(n) needs an integer n >= 2, got {need!r}")
    return need


def tier(path) -> str:
    """``unit``, ``dist`` or ``live``: the first directory of ``path`` under tests/."""
    rel = os.path.relpath(str(path), TESTS).split(os.sep)
    return rel[0] if len(rel) > 1 and rel[0] in ("unit", "dist", "live") else "unit"


def pytest_collection_modifyitems(config, items):
    seconds = measured_seconds()
    # stable: a file's tests keep their order (and their module fixtures with them)
    items.sort(key=lambda item: -seconds.get(os.path.relpath(str(item.path), TESTS).replace(os.sep, "/"),
                                             UNMEASURED_S))
    gpus = None
    for item in items:
        for name in TIERS.get(tier(item.path), ()):
            item.add_marker(getattr(pytest.mark, name))
        if os.path.relpath(str(item.path), TESTS).replace(os.sep, "/") in ALONE:
            item.add_marker(pytest.mark.alone)
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if gpus is None:
                gpus = _cuda_devices()
            need = required_gpus(item)
            if gpus < need:
                item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {gpus}"))


def _starts_a_program(argv) -> bool:
    """A Python interpreter running a file or a module (``python -c`` is allowed: an import check)."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = [argv]
    argv = [os.fsdecode(a) for a in argv]
    if not argv:
        return False
    exe = os.path.basename(argv[0])
    if exe in ("deepspeed", "torchrun", "ds-resilience", "mpirun", "srun"):
        return True
    return exe.startswith("python") and "-c" not in argv[1:3]


@pytest.fixture(autouse=True)
def _no_build_lock_left_by_a_killed_process(request):
    """Before a test that starts processes: a JIT op build lock that a process killed by an earlier
    test left behind (torch takes it for every new process's ninja check) is removed; it would
    hang every rank that loads DeepSpeed's ops (fresh-clone run P: a plain DeepSpeed script's rank
    waited on one). The agent's workers and ours are guarded (runtime/build_locks.py); a test's
    own vanilla DeepSpeed program is not."""
    if tier(request.node.path) != "unit":
        from ds_resilience.runtime.build_locks import clear_stale_locks

        clear_stale_locks(echo=print)
    yield


@pytest.fixture(autouse=True)
def _one_process_in_the_unit_tier(request, monkeypatch):
    """A unit test runs in one process: starting a worker makes it fail, naming the tier it needs."""
    if tier(request.node.path) != "unit":
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(what: str):
        pytest.fail(f"{request.node.nodeid} {what}: the unit tier runs in one process; a test that starts "
                    "workers belongs in tests/dist/, one that runs the agent or kills a process in tests/live/",
                    pytrace=False)

    def start(self):
        refuse("starts a multiprocessing worker")

    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        if _starts_a_program(args):
            refuse(f"runs {args!r:.120}")
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    yield
