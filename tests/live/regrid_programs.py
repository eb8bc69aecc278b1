"""Worker programs for tests/live/test_layer_transfer.py (run by dist_harness.run_workers).

A PP=4 x DP=2 job over 8 layers (2 per stage; rank = stage * 2 + pipeline; layer 0 costs twice the
others) loses both replicas of stage 1 (ranks 2 and 3 die at start). The 6 survivors re-grid onto the
template grid the planner picks (3 pipelines x 2 stages, layers [0, 4) and [4, 8)) and move layer
state with ``transfer``: layers 2 and 3 only from the snapshots, the others from surviving holders
(ranks 6 and 7 change places entirely).
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from ds_resilience.checkpoint.layer_transfer import transfer
from ds_resilience.comm.groups import CommError, new_group
from ds_resilience.planning.layers import LayerProfile
from ds_resilience.planning.regrid import plan_regrid, positions
from ds_resilience.planning.templates import instantiate, plan_templates

LAYERS, DP, PP = 8, 2, 4
DEAD = (2, 3)


def layer_state(layer: int) -> dict:
    """A layer after 3 Adam steps on seeded data: what every replica of it holds (bitwise)."""
    torch.manual_seed(1000 + layer)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2)
    for _ in range(3):
        lin(torch.randn(8, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"params": lin.state_dict(), "optimizer": opt.state_dict()["state"]}


def stage_layers(rank: int) -> range:
    stage = rank // DP
    per = LAYERS // PP
    return range(stage * per, (stage + 1) * per)


def the_plan(survivors: list[int]):
    profile = LayerProfile.from_rows([dict(t_f=2.0 if i == 0 else 1.0, t_b=1.0, t_w=1.0, param_bytes=80.0,
                                           optimizer_bytes=160.0, activation_bytes=0.0, output_bytes=0.0)
                                      for i in range(LAYERS)])
    temps = plan_templates(profile, 2, len(survivors))
    choice = instantiate(temps, len(survivors), 8, tolerance=1)
    held = {r: stage_layers(r) for r in survivors}
    return plan_regrid(held, positions(choice, temps), profile.param_bytes)


def regrid(rank: int, world: int, die_during: int | None = None) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()  # every pair connected before anyone dies
    if rank in DEAD:
        os.kill(os.getpid(), signal.SIGKILL)
    survivors = [r for r in range(world) if r not in DEAD]
    group = new_group(survivors, name="regrid", timeout_s=30)
    group.barrier()  # the group's pairs all connected
    plan = the_plan(survivors)
    if rank == die_during:
        os.kill(os.getpid(), signal.SIGKILL)
    restored = []

    def from_snapshot(layer: int) -> dict:
        restored.append(layer)
        return layer_state(layer)

    held = {layer: layer_state(layer) for layer in stage_layers(rank)}
    try:
        out, report = transfer(plan, rank, group=group, rank_of={r: r for r in survivors}, held=held,
                               from_snapshot=from_snapshot, timeout_s=10 if die_during is not None else 60)
    except CommError as exc:
        return {"error": str(exc)}
    same = {}
    for layer, state in out.items():
        ref = layer_state(layer)
        same[layer] = (all(torch.equal(state["params"][k], v) for k, v in ref["params"].items())
                       and all(torch.equal(state["optimizer"][i][k], v) for i, s in ref["optimizer"].items()
                               for k, v in s.items()))
    position = plan.assignment[rank]
    return {"position": (position.pipeline, position.stage, position.first, position.last), "layers": sorted(out),
            "same": same, "restored": restored, "sent": report.sent_bytes, "received": report.received_bytes,
            "kept": list(report.kept), "moves": len(plan.moves)}


# --- one step on a template layout (tests/dist/test_layout_reduce.py) ------------------------------

WIDTH = 4


def mixed_layout():
    """12 layers with layers 0 and 11 tied: two 3-stage pipelines (cut at 4, 8) and one 2-stage
    pipeline (cut at 6): 8 ranks, 10 micro-batches."""
    from ds_resilience.ir.layout import PipelineGroup, PipelineLayout

    return PipelineLayout(layers=12, tied=((0, 11),), tolerance=2, groups=(
        PipelineGroup(bounds=(0, 4, 8, 12), pipelines=2, microbatches=3, ranks=((0, 1, 2), (3, 4, 5))),
        PipelineGroup(bounds=(0, 6, 12), pipelines=1, microbatches=4, ranks=((6, 7),)),
    ))


def initial_weights():
    torch.manual_seed(0)
    ws = [torch.randn(WIDTH, WIDTH) * 0.5 for _ in range(12)]
    bs = [torch.randn(WIDTH) * 0.1 for _ in range(12)]
    return ws, bs


def sample(mb: int):
    g = torch.Generator().manual_seed(500 + mb)
    return torch.randn(2, WIDTH, generator=g), torch.randn(2, WIDTH, generator=g)


def loss_over(ws, bs, microbatches, total):
    out = 0.0
    for mb in microbatches:
        x, y = sample(mb)
        for i in range(12):
            x = torch.tanh(x @ ws[i].T + bs[i])
        out = out + (x - y).pow(2).mean()
    return out / total


def layout_step(rank: int, world: int) -> dict:
    """Each rank computes its pipeline's micro-batches' gradients (the whole model run locally, as
    its pipeline would), keeps its own layers' (its copy of the tied weight separate), reduces them
    with the SegmentReducer and takes one SGD step on its layers."""
    from ds_resilience.runtime.layout_reduce import SegmentReducer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = mixed_layout()
    w0, b0 = initial_weights()
    ws = [torch.nn.Parameter(w.clone()) for w in w0]
    ws[11] = torch.nn.Parameter(w0[0].clone())  # this rank's copy of the tied weight, if it holds layer 11
    bs = [torch.nn.Parameter(b.clone()) for b in b0]
    mine = list(layout.layers_of(rank))
    params = {i: ([bs[i]] if i in (0, 11) else [ws[i], bs[i]]) for i in mine}
    tied = {0: [ws[i] for i in mine if i in (0, 11)]} if any(i in (0, 11) for i in mine) else {}
    reducer = SegmentReducer(layout, rank, params, tied=tied, name="step",
                             make_group=lambda ranks, name: new_group(ranks, name=name, timeout_s=60))
    g, q, _ = layout.position(rank)
    loss_over(ws, bs, layout.microbatch_ids(g, q), layout.microbatches).backward()
    reducer.reduce()
    with torch.no_grad():
        for i in mine:
            for p in (ws[i], bs[i]):
                p -= 0.1 * p.grad
    dist.barrier()
    return {"layers": mine, "w": {i: ws[i].detach().clone() for i in mine}, "b": {i: bs[i].detach().clone() for i in mine}}
