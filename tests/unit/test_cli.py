"""The CLI's figures and options (run in-process through main(); no torch involved)."""

import json

import pytest

from ds_resilience.cli import main


def run_json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_reference_figures(capsys):
    a = run_json(capsys, "plan", "--dp", "3", "--pp", "4", "--microbatches", "6", "--schedule", "1f1b", "--json")
    assert abs(a["bubble_ratio"] - 0.333) <= 0.001
    assert a["peak_activations"] == [4, 3, 2, 1]
    assert a["makespan"] == 27 and len(a["schedule"]) == 12
    b = run_json(capsys, "plan", "--dp", "3", "--pp", "4", "--microbatches", "6", "--schedule", "decoupled", "--json")
    assert b["bubble_ratio"] <= 0.143


def test_plan_with_failure_reports_planner_keys(capsys):
    d = run_json(capsys, "plan", "--dp", "3", "--pp", "4", "-m", "6", "--fail", "1:3", "--variant", "decoupled", "--json")
    for key in ("fault_free_iteration_time", "iteration_time", "degradation", "lower_bound", "gap_to_bound", "solver"):
        assert key in d
    assert set(d["solver"]) >= {"name", "status", "gap", "seconds"}
    assert d["iteration_time"] == 30 and d["failed"] == ["1:3"]


def test_grid_output_and_png(capsys, tmp_path):
    png = tmp_path / "g.png"
    assert main(["plan", "--dp", "2", "--pp", "2", "-m", "2", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "bubble_ratio=" in out and "w0 (p0,s0)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_table_command(capsys, tmp_path):
    summary = run_json(capsys, "plan-table", "--dp", "2", "--pp", "3", "-m", "3", "--max-failures", "2", "--out", str(tmp_path), "--json", "--workers", "1")
    assert summary["plans"] > 0 and not summary["cached"]
    again = run_json(capsys, "plan-table", "--dp", "2", "--pp", "3", "-m", "3", "--max-failures", "2", "--out", str(tmp_path), "--json")
    assert again["cached"] and again["plans"] == summary["plans"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", "--dp", "2", "--pp", "2", "-m", "2", "--fail", "0:1,1:1"], "stage 1 lost every replica"),
        (["plan", "--dp", "2", "--pp", "2", "-m", "2", "--fail", "3:0"], "pipeline 3 out of range"),
        (["plan", "--dp", "2", "--pp", "2", "-m", "2", "--fail", "x"], "pipeline:stage"),
        (["plan", "--dp", "2", "--pp", "2", "-m", "2", "--cost", "/nonexistent.json"], "does not exist"),
    ],
)
def test_errors_are_clear(capsys, argv, fragment):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_bad_grid_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--dp", "0", "--pp", "2", "-m", "2"])
    assert "expected an integer >= 1" in capsys.readouterr().err
