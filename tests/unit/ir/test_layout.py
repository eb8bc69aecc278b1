"""Layouts (ir/layout.py): holders per segment, reduce order, tied holders, sample numbering and
random streams independent of the layout; a layout's iteration time (planning/layout_time.py)."""

from __future__ import annotations

import itertools

import pytest

from ds_resilience.ir import iteration_time
from ds_resilience.ir.layout import PipelineGroup, PipelineLayout, PipelineLayoutError, rng_key
from ds_resilience.planning.generators import decoupled, one_f_one_b
from ds_resilience.planning.layers import LayerProfile
from ds_resilience.planning.layout_time import layout_iteration_time, layout_of
from ds_resilience.planning.regrid import plan_regrid, positions
from ds_resilience.planning.templates import Link, instantiate, plan_templates, stage_cost_model
from ds_resilience.errors import PlanningError


def mixed(tied=((0, 11),)):
    """12 layers: two 3-stage pipelines (cut at 4, 8) and one 2-stage pipeline (cut at 6)."""
    return PipelineLayout(layers=12, tied=tied, tolerance=2, groups=(
        PipelineGroup(bounds=(0, 4, 8, 12), pipelines=2, microbatches=3, ranks=((0, 1, 2), (3, 4, 5))),
        PipelineGroup(bounds=(0, 6, 12), pipelines=1, microbatches=4, ranks=((6, 7),)),
    ))


def test_segments_cut_at_every_boundary_and_have_one_holder_per_pipeline():
    layout = mixed()
    segs = layout.segments()
    assert [(s.first, s.last) for s in segs] == [(0, 4), (4, 6), (6, 8), (8, 12)]
    assert [s.holders for s in segs] == [(0, 3, 6), (1, 4, 6), (1, 4, 7), (2, 5, 7)]
    covered = sorted(i for s in segs for i in s.layers)
    assert covered == list(range(12))  # every layer reduced exactly once
    for rank in layout.ranks:  # a rank's segments are exactly its layers
        assert sorted(i for s in segs if rank in s.holders for i in s.layers) == list(layout.layers_of(rank))
    order = layout.reduce_order()
    assert [s.first for s in order] == [8, 6, 4, 0]  # descending: the backward's order
    assert [s.first for s in layout.reduce_order(7)] == [8, 6]
    assert layout.tied_holders(0) == (0, 2, 3, 5, 6, 7)  # holders of layer 0 and of layer 11
    assert layout.pipelines == 3 and layout.microbatches == 10


def test_samples_and_random_streams_do_not_depend_on_the_layout():
    layout = mixed()
    ids = [i for g in range(2) for q in range(layout.groups[g].pipelines) for i in layout.microbatch_ids(g, q)]
    assert ids == list(range(layout.microbatches))  # every sample once
    # the same (layer, sample) draws the same stream wherever it runs; any other key differs
    keys = {(layer, mb): rng_key(7, 3, layer, mb) for layer, mb in itertools.product(range(12), range(10))}
    assert len(set(keys.values())) == len(keys)
    assert rng_key(7, 3, 5, 2) == keys[(5, 2)] != rng_key(7, 4, 5, 2) != rng_key(8, 3, 5, 2)


@pytest.mark.parametrize("change, match", [
    (dict(bounds=(0, 8, 4, 12)), "must rise strictly from 0 to 12"),
    (dict(bounds=(0, 4, 8, 11)), "must rise strictly from 0 to 12"),
    (dict(ranks=((0, 1, 2), (3, 4, 6))), "rank 6 holds two positions"),
    (dict(ranks=((0, 1, 2),)), "ranks must be 2 pipelines x 3 stages"),
    (dict(microbatches=0), "must be >= 1"),
])
def test_bad_layouts_name_the_problem(change, match):
    first = dict(bounds=(0, 4, 8, 12), pipelines=2, microbatches=3, ranks=((0, 1, 2), (3, 4, 5)))
    first.update(change)
    with pytest.raises(PipelineLayoutError, match=match):
        PipelineLayout(layers=12, groups=(PipelineGroup(**first), PipelineGroup(bounds=(0, 6, 12), pipelines=1, microbatches=4, ranks=((6, 7),))))
    with pytest.raises(PipelineLayoutError, match="tolerance 3 needs at least 4"):
        PipelineLayout(layers=12, tolerance=3, groups=mixed().groups)
    with pytest.raises(PipelineLayoutError, match="tied layers"):
        PipelineLayout(layers=12, tied=((0, 12),), groups=mixed().groups)


def test_layout_of_an_instantiation_and_of_a_regrid():
    profile = LayerProfile.uniform(24, param_bytes=10.0)
    temps = plan_templates(profile, 2, 12)
    choice = instantiate(temps, 13, 32, tolerance=1)
    layout = layout_of(choice, temps)
    assert layout.pipelines == len(choice.pipelines) and layout.microbatches == 32
    assert sorted(layout.ranks) == list(range(sum(p.nodes for p in choice.pipelines)))
    assert all(len(s.holders) == layout.pipelines for s in layout.segments())
    # after a re-grid: the survivors' new positions from the matching
    held = {f"w{i}": range(2 * (i % 12), 2 * (i % 12) + 2) for i in range(13)}
    plan = plan_regrid(held, positions(choice, temps), profile.param_bytes)
    moved = layout_of(choice, temps, assignment=plan.assignment)
    for rank, pos in plan.assignment.items():
        assert moved.layers_of(rank) == pos.layers()
    with pytest.raises(PlanningError, match="empty"):
        layout_of(choice, temps, assignment=dict(list(plan.assignment.items())[1:]))


def test_one_group_is_rated_as_the_planner_rates_its_grid():
    """A rectangular layout is one group: its time equals the replay of the grid's own schedule
    (no reduce cost), fused and decoupled, with uneven stages and link costs."""
    profile = LayerProfile.from_rows([dict(t_f=1 + i % 3, t_b=1 + i % 2, t_w=0.5 + i % 4, param_bytes=0, optimizer_bytes=0,
                                           activation_bytes=0, output_bytes=100) for i in range(9)])
    bounds, link = (0, 2, 5, 9), Link(latency=0.2, bandwidth=500.0)
    cost = stage_cost_model(profile, bounds, link)
    layout = PipelineLayout(layers=9, groups=(PipelineGroup(bounds=bounds, pipelines=2, microbatches=5, ranks=((0, 1, 2), (3, 4, 5))),))
    assert layout_iteration_time(layout, profile, link=link) == pytest.approx(iteration_time(one_f_one_b(2, 3, 5), cost, "adaptive"))
    assert layout_iteration_time(layout, profile, link=link, variant="decoupled") == pytest.approx(
        iteration_time(decoupled(2, 3, 5, cost), cost, "decoupled"))
    with pytest.raises(PlanningError, match="allowed: adaptive, decoupled"):
        layout_iteration_time(layout, profile, variant="recycle")


def test_segment_reduces_couple_the_groups():
    """Heterogeneous groups: with free reduces the layout takes its slowest group; a reduce cost
    adds the reduces that follow the last ready rank, in descending layer order."""
    profile = LayerProfile.uniform(12, param_bytes=1000.0)
    layout = mixed(tied=())
    per_group = [layout_iteration_time(PipelineLayout(layers=12, groups=(g,)), profile) for g in layout.groups]
    free = layout_iteration_time(layout, profile)
    assert free == pytest.approx(max(per_group))
    bw = 1000.0
    costly = layout_iteration_time(layout, profile, reduce_link=Link(bandwidth=bw))
    # each segment all-reduces over 3 holders: 2 * 2/3 of its bytes; the last reduce to finish
    # follows the earlier-issued ones on the ranks they share, so at least the layers 0-3
    # reduce lies after the slowest group's last backward
    assert costly > free + 2 * (2 / 3) * 4 * 1000.0 / bw - 1e-9
    tied = layout_iteration_time(mixed(), profile, reduce_link=Link(bandwidth=bw))
    assert tied > costly  # the tied reduce over six ranks comes last
