"""The gradient reduce on a template layout (runtime/layout_reduce.py), in 8 real processes over
gloo: pipelines cut at different layers, a tied weight at layers 0 and 11. One step ends at the
single-process full-batch step, every copy of the tied weight equal."""

from __future__ import annotations

import pytest
import torch

import regrid_programs as prog
from dist_harness import run_workers
from ds_resilience.errors import ResilienceError
from ds_resilience.runtime.layout_reduce import SegmentReducer


def reference():
    w0, b0 = prog.initial_weights()
    ws = [torch.nn.Parameter(w.clone()) for w in w0]
    ws[11] = ws[0]  # one tensor, used twice
    bs = [torch.nn.Parameter(b.clone()) for b in b0]
    layout = prog.mixed_layout()
    prog.loss_over(ws, bs, range(layout.microbatches), layout.microbatches).backward()
    with torch.no_grad():
        return [w - 0.1 * w.grad for w in ws], [b - 0.1 * b.grad for b in bs]


@pytest.mark.timeout(180)
def test_one_step_on_a_template_layout_equals_the_full_batch_step():
    results = run_workers(prog.layout_step, 8, timeout_s=150)
    ref_w, ref_b = reference()
    seen = set()
    for res in results:
        for i in res["layers"]:
            seen.add(i)
            torch.testing.assert_close(res["w"][i], ref_w[i], rtol=0, atol=1e-6)
            torch.testing.assert_close(res["b"][i], ref_b[i], rtol=0, atol=1e-6)
    assert seen == set(range(12))
    copies = [res["w"][i] for res in results for i in res["layers"] if i in (0, 11)]
    assert len(copies) == 6 and all(torch.equal(c, copies[0]) for c in copies)  # the tied copies stay one weight
    w0, _ = prog.initial_weights()
    assert (ref_w[5] - w0[5]).abs().max() > 1e-3  # the step moved the weights (the check is not vacuous)


def test_the_reducer_refuses_parameters_of_layers_it_does_not_hold():
    layout = prog.mixed_layout()
    with pytest.raises(ResilienceError, match="holds layers \\[6, 7, 8, 9, 10, 11\\]"):
        SegmentReducer(layout, 7, {0: []}, make_group=lambda r, n: None)
    with pytest.raises(ResilienceError, match="no copy of tied group 0"):
        SegmentReducer(layout, 1, {i: [] for i in range(4, 8)}, tied={0: []}, make_group=lambda r, n: None)
