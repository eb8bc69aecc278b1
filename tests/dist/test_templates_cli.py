"""`ds-resilience templates` as a user runs it (a process of its own)."""

from __future__ import annotations
import itertools
import json
import random
import subprocess
import sys
import pytest
from ds_resilience.errors import CostModelError, PlanningError
from ds_resilience.planning.layers import LayerProfile
from ds_resilience.planning.templates import Link, instantiate, partition, plan_templates


def test_the_templates_command_prints_the_choice(tmp_path):
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps(LayerProfile.uniform(16, t_f=1.0, t_b=1.0, t_w=1.0, param_bytes=1.0,
                                                      activation_bytes=0.5).to_dict()))
    out = subprocess.run([sys.executable, "-m", "ds_resilience.cli", "templates", "--layers", str(layers),
                          "--nodes", "11", "--microbatches", "16", "--tolerance", "1", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["instantiation"]["nodes"] == 11 and len(report["instantiation"]["pipelines"]) >= 2
    assert sum(p["microbatches"] for p in report["instantiation"]["pipelines"]) == 16
    assert {t["nodes"] for t in report["templates"]} == set(range(2, 12))
    segs = report["layout"]["segments"]  # every layer reduced once, over one holder per pipeline
    assert [i for a, b, _ in segs for i in range(a, b)] == list(range(16))
    assert all(len(h) == len(report["instantiation"]["pipelines"]) for _, _, h in segs)
    assert report["layout_iteration_time"]["adaptive"] == pytest.approx(report["replayed_iteration_time"])
    png = tmp_path / "choice.png"
    out = subprocess.run([sys.executable, "-m", "ds_resilience.cli", "templates", "--layers", "16", "--nodes", "11",
                          "--microbatches", "16", "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pipelines" in out.stdout and png.stat().st_size > 1000
