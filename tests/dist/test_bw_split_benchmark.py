"""benchmarks/bw_split.py runs end to end on tiny shapes: the split's gradients equal the fused ones
(its exit status) and --explain adds its decomposition. Figures are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]


def test_the_bw_split_benchmark_explains_its_figure(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bw_split.py"), "--device", "cpu",
                           "--shapes", "64:16:2:1", "--repeats", "2", "--warmup", "1", "--explain",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Where B + W exceeds the fused backward" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["equal"] is True
    assert row["input_only_ms"] > 0 and row["split_warm_w_W_ms"] > 0 and row["split_ratio"] > 0
