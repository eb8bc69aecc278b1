"""examples/deepspeed_pipe/train.py: DeepSpeed's own pipeline example as its users write it (a CNN
with a lambda layer and dropout, ``training_data``, ``deepspeed.add_config_arguments``, the
example's ``"type": "Adam"`` config with DeepSpeed's default clipping), with only
``ds_resilience.initialize`` swapped in, under ``ds-resilience run``.

Its ``--eval`` loop is the one users write: ``eval_batch(data_iter)`` after every step with no
``eval_source`` and ``save_checkpoint`` every other step. Through a SIGKILL mid-backward, every
survivor prints the fault-free run's training and evaluation losses at every step: the dead
worker's training micro-batches come from ``training_data`` (addressable), its evaluation
micro-batches from the other end of its pipeline, which reads the same ``data_iter`` items.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "deepspeed_pipe"
STEPS = 6
# no anchors: a worker's stdout is unbuffered (``python -u``), so ``print`` writes the line and its
# newline apart, and output from another thread of the process (gloo's C++ warnings, a logger) can
# land between them; the line's own text is written whole
LINE = re.compile(r"\[rank (\d+)\] step (\d+) loss (\d+\.\d{6}) eval_loss (\d+\.\d{6})")


def _run(tmp: Path, name: str, faults=(), *, extra=(), agent=(), steps=STEPS, config=None
         ) -> tuple[int, str, dict[int, dict[int, tuple[str, str]]]]:
    resilience = config or {}
    config = json.loads((EXAMPLE / "ds_config.json").read_text())
    # the user's config, plus what a test needs: its failure, and a detector fast enough for CI
    # heartbeat timeout 8 s: these tests inject crashes (seen at once from the exit code), never hangs,
    # and fresh-clone runs 1 and 3 of this session each lost a healthy rank to a 4 s silence under
    # the suite's load (at start-up, and right after adopting a recovery plan): a survivor taken
    # for dead turns the run into a restart and the test's continuous loss lines break
    config["resilience"] = {"fault_injection": list(faults),
                            "detector": {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 8.0}, **resilience}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "ds_resilience.cli", "run", "--num_workers", "4", "--log_dir", str(tmp / f"{name}-logs"),
           *agent, str(EXAMPLE / "train.py"), "--deepspeed_config", str(path), "-p", "2", "--steps", str(steps),
           "--eval", "--save-dir", str(tmp / f"{name}-ckpt"), *extra]
    out = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    for log in sorted((tmp / f"{name}-logs").glob("*.log")):
        text += f"\n--- {log.name}\n" + log.read_text()
    lines: dict[int, dict[int, tuple[str, str]]] = {}
    for rank, step, loss, eval_loss in LINE.findall(text):
        assert lines.setdefault(int(rank), {}).setdefault(int(step), (loss, eval_loss)) == (loss, eval_loss)
    return out.returncode, text, lines


def _unlike(text: str, rank: int, got: dict | None, want: dict) -> tuple:
    """An assertion message: the steps where ``rank`` differs from ``want``, with every output line
    that mentions them (a line mangled by another writer shows here)."""
    got = got or {}
    steps = sorted(s for s in set(got) | set(want) if got.get(s) != want.get(s))
    near = [ln for ln in text.splitlines() if any(f"step {s} " in ln for s in steps)]
    return rank, steps, {s: (got.get(s), want.get(s)) for s in steps}, near[:20]


def _fault_free(tmp, extra=(), steps=STEPS):
    code, text, lines = _run(tmp, "ref", extra=extra, steps=steps)
    assert code == 0, text[-4000:]
    assert set(lines) == {0, 1, 2, 3} and all(len(v) == steps for v in lines.values()), text[-4000:]
    per_step = {s: {lines[r][s] for r in lines} for s in range(1, steps + 1)}
    assert all(len(v) == 1 for v in per_step.values()), per_step  # every rank prints the global losses
    return {s: v.pop() for s, v in per_step.items()}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    return _fault_free(tmp_path_factory.mktemp("ref"))


REJOIN_STEPS = 24  # paced: a relaunched process joins seconds after its death, the job must still be running


@pytest.fixture(scope="module")
def data_iter_fault_free(tmp_path_factory):
    return _fault_free(tmp_path_factory.mktemp("ref_it"), ["--data-iter"], steps=REJOIN_STEPS)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank, step", [(1, 2), (2, 3)])
def test_the_deepspeed_example_prints_the_fault_free_losses_through_a_sigkill(tmp_path, fault_free, rank, step):
    """Rank 1 is pipeline 1's first stage (its evaluation inputs come from rank 3, that pipeline's
    last stage), rank 2 pipeline 0's last stage (its labels come from rank 0)."""
    faults = [{"rank": rank, "step": step, "point": "mid_backward", "kind": "sigkill"}]
    code, text, lines = _run(tmp_path, "job", faults)
    assert code == 0, text[-6000:]
    assert re.search(rf"rank {rank} crashed \(killed by SIGKILL\)", text), text[-3000:]
    survivors = sorted(set(range(4)) - {rank})
    for r in survivors:
        assert lines.get(r) == fault_free, _unlike(text, r, lines.get(r), fault_free)
    # (the fault's step counts iterations from 0: the rank printed steps 1..step before it died)
    assert set(lines.get(rank, {})) == set(range(1, step + 1)), sorted(lines.get(rank, {}))
    # save_checkpoint every other step went on after the failure: the last tag is the last even step
    latest = (tmp_path / "job-ckpt" / "latest").read_text().strip()
    assert latest == f"global_step{STEPS}", latest


@pytest.mark.timeout(600)
def test_its_own_data_iter_through_a_sigkill_and_a_rejoin(tmp_path, data_iter_fault_free):
    """``train_batch(data_iter)`` from each rank's own DeepSpeed loader, nothing addressable: rank 1
    (pipeline 1's first stage) is SIGKILLed, rank 3 (that pipeline's last stage) hands its training
    and evaluation items to rank 0 while it is gone, and the agent relaunches it: its script builds
    its iterator from the start, and the engine skips the items its pipeline ran meanwhile. Every
    rank prints the fault-free losses at every step, the relaunched one from its join on."""
    steps, reference = REJOIN_STEPS, data_iter_fault_free
    faults = [{"rank": 1, "step": 2, "point": "mid_backward", "kind": "sigkill"}]
    code, text, lines = _run(tmp_path, "job", faults, extra=["--data-iter", "--min-step-seconds", "0.6"],
                             agent=["--rejoin_after", "0.5"], steps=steps)
    assert code == 0, text[-6000:]
    assert "rank 1 re-joins" in text, text[-3000:]
    for r in (0, 2, 3):
        assert lines.get(r) == reference, _unlike(text, r, lines.get(r), reference)
    assert lines[1] == {s: reference[s] for s in lines[1]} and steps in lines[1], lines[1]
    skipped = re.search(r"relaunched at iteration (\d+): skipped the first (\d+) items", text)
    assert skipped and int(skipped.group(2)) == int(skipped.group(1)) * 4 > 0, text[-3000:]  # 4 micro-batches a step


@pytest.mark.timeout(600)
def test_a_pipeline_losing_both_ends_of_its_data_iter_stops_with_every_stage_saved_and_restarts(tmp_path,
                                                                                                data_iter_fault_free):
    """``train_batch(data_iter)`` alone, and pipeline 1 loses rank 1 (its first stage), then rank 3
    (its last): nobody reads its data any more. The survivors do not crash on a missing
    micro-batch: they stop cleanly with every stage saved, naming why, and the agent restarts all
    workers from the in-memory snapshots (each relaunched script's data_iter skips what the job
    ran). Every step's loss is the fault-free run's."""
    steps = 8
    faults = [{"rank": 1, "step": 2, "point": "mid_backward", "kind": "sigkill"},
              {"rank": 3, "step": 4, "point": "before_forward", "kind": "sigkill"}]
    code, text, lines = _run(tmp_path, "job", faults, extra=["--data-iter"], steps=steps,
                             config={"checkpoint": {"persistent_dir": str(tmp_path / "ck")}})
    assert code == 0, text[-6000:]
    assert "pipeline(s) [1] lost both their first and last stage workers" in text, text[-4000:]
    saved = re.search(r"stopped cleanly after step (\d+), surviving stages saved to (\S+) \(every stage\)", text)
    assert saved, text[-4000:]
    files = {p.name for p in Path(saved.group(2)).iterdir()}
    # the whole model in DeepSpeed's layout: all 15 layers but the lambda (layer 9), and both stages'
    # model states (optimizer, scheduler, counters), named by `latest`
    assert files >= {f"layer_{i:02d}-model_states.pt" for i in range(15) if i != 9} | \
           {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "manifest.json"}, sorted(files)
    assert (Path(saved.group(2)).parent / "latest").read_text() == Path(saved.group(2)).name
    assert "restart 1 from the in-memory snapshots" in text, text[-3000:]
    assert lines[0] == {s: data_iter_fault_free[s] for s in range(1, steps + 1)}, lines[0]
