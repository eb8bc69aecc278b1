"""The PNG Gantt chart: it is written, it is a PNG, and matplotlib stays out of plain imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ds_resilience.costs import CostModel
from ds_resilience.ir import validate
from ds_resilience.planning import decoupled, list_schedule, lower, one_f_one_b
from ds_resilience.ir import simulate

pytest.importorskip("matplotlib")

from ds_resilience.ir.gantt import render_gantt  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 2000  # not an empty canvas


def _rerouted(dp: int = 2, pp: int = 3, mbs: int = 4, failed_pipeline: int = 1, stage: int = 1):
    """Worker (failed_pipeline, stage) failed; its micro-batches run on pipeline 0's worker of that stage."""
    failed = stage * dp + failed_pipeline
    assignment = {
        (p, s, m): (s * dp + p) if s * dp + p != failed else s * dp
        for p in range(dp)
        for s in range(pp)
        for m in range(mbs)
    }
    cost = CostModel(activation_bytes=0.3, p2p_bandwidth=1.0, p2p_latency=0.1)
    result = list_schedule(
        dp=dp, pp=pp, microbatches=mbs, cost=cost, assignment=assignment, split_backward=True,
        act_caps=[pp * mbs] * (dp * pp), w_caps=[None] * (dp * pp),
    )
    schedule = validate(
        lower(result.orders, dp=dp, pp=pp, microbatches=mbs, failed=frozenset({failed}), name="rerouted")
    )
    return schedule, cost, failed


@pytest.mark.parametrize("make", [one_f_one_b, decoupled], ids=["1f1b", "decoupled"])
def test_png_written_fault_free(tmp_path: Path, make) -> None:
    schedule = make(2, 3, 4)
    out = tmp_path / f"{schedule.name}.png"
    render_gantt(schedule, simulate(schedule), out)
    _assert_png(out)


def test_png_with_failed_worker_and_rerouted_work(tmp_path: Path) -> None:
    schedule, cost, failed = _rerouted()
    assert schedule.failed == frozenset({failed}) and schedule.workers[failed] == ()
    peer = schedule.workers[failed - 1]  # pipeline 0, same stage
    assert any(a.pipeline == 1 for a in peer if a.kind.is_compute)  # really re-routed
    out = tmp_path / "rerouted.png"
    render_gantt(schedule, simulate(schedule, cost), out, title="re-routed", cost=cost)
    _assert_png(out)


def test_mismatched_timeline_is_an_error(tmp_path: Path) -> None:
    from ds_resilience.errors import ResilienceError

    with pytest.raises(ResilienceError, match="timeline does not match"):
        render_gantt(one_f_one_b(2, 3, 4), simulate(one_f_one_b(1, 3, 4)), tmp_path / "x.png")


def test_import_sim_does_not_import_matplotlib() -> None:
    code = (
        "import sys, ds_resilience.sim, ds_resilience.ir.gantt\n"
        "bad = sorted(m for m in ('matplotlib', 'torch') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
