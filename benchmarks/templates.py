"""Pipeline-template planning time against Oobleck's planner, and instantiation optimality.

    python benchmarks/templates.py [--json FILE]

Planning: the template for every node count of a range (the best memory-feasible stage partition,
``planning/templates.py``) for a GPT-shaped layer profile (an embedding layer, L - 2 transformer
layers with +-10% jitter, an LM head; 24 GiB per node), at the sizes Oobleck's C++ planner was
timed at on this 2-core machine (``../shared/research``: 26.5 s for 32 layers x 2-16 nodes, 143 s
for 48 layers, more than 300 s for 64 layers) and at the issue's goal, 128 layers x 2-64 nodes in
< 2 s. Each row also instantiates the templates on the largest node count minus 3 (tolerance 1)
and compares the planner's predicted iteration time with the schedule replay of the slowest chosen
pipeline. Optimality: random small cases against brute force (partitions and instantiations).
Re-grid plan: 128 layers on 4 pipelines x 16 stages (64 nodes), 3 nodes of stage 5 lost (one
replica left) or all 4 (the stage lost): the 61 or 60 survivors' positions on the instantiated
template grid by minimum-cost matching, the bytes they receive, how much of it no survivor holds
(from the snapshots), and the busiest sender.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_resilience.planning.layers import LayerProfile  # noqa: E402
from ds_resilience.planning.regrid import plan_regrid, positions  # noqa: E402
from ds_resilience.planning.templates import Link, instantiate, partition, plan_templates  # noqa: E402

OOBLECK_S = {(32, 16): 26.5, (48, 16): 143.0, (64, 16): 300.0}  # measured here; 64 layers: > 300 s (killed)
GIB = 2**30


def gpt_profile(layers: int, seed: int = 0) -> LayerProfile:
    """Embedding, transformer layers (hidden 2048, seq 2048, micro-batch 1, bf16 + Adam), LM head."""
    rng = random.Random(seed)
    hidden, seq, vocab = 2048, 2048, 50304
    block_params = 12 * hidden * hidden
    rows = []
    for i in range(layers):
        if i == 0 or i == layers - 1:  # embedding / LM head: vocab x hidden, cheap forward
            params = vocab * hidden
            t = 0.6 if i == layers - 1 else 0.1
            act = seq * hidden * 2 * (4 if i == layers - 1 else 1)
        else:
            params = block_params
            t = 1.0 * rng.uniform(0.9, 1.1)
            act = seq * hidden * 2 * 17  # what a block keeps from F to B, bf16
        rows.append({"t_f": t, "t_b": t, "t_w": t, "param_bytes": 2 * params, "optimizer_bytes": 12 * params,
                     "activation_bytes": act, "output_bytes": seq * hidden * 2})
    return LayerProfile.from_rows(rows, name=f"gpt{layers}")


def timing(layers: int, nodes: int, cap: float) -> dict:
    profile = gpt_profile(layers)
    link = Link(latency=5e-5, bandwidth=2.5e10 / 1e3)  # 25 GB/s, times in ms
    started = time.perf_counter()
    templates = plan_templates(profile, 2, nodes, memory_cap=cap, link=link)
    planned = time.perf_counter() - started
    survivors = nodes - 3
    started = time.perf_counter()
    choice = instantiate(templates, survivors, 4 * survivors, tolerance=1)
    chosen = time.perf_counter() - started
    slowest = max(choice.pipelines, key=lambda p: p.time)
    replayed = templates[slowest.nodes].replayed_time(slowest.microbatches, profile, link)
    ref = OOBLECK_S.get((layers, nodes))
    return {"layers": layers, "nodes": f"2-{nodes}", "templates": len(templates), "smallest": min(templates),
            "planning_s": planned, "instantiation_s": chosen, "oobleck_s": ref,
            "speedup": (ref / planned) if ref else None, "survivors": survivors,
            "counts": {str(k): v for k, v in sorted(choice.counts.items())},
            "predicted": choice.iteration_time, "replayed": replayed}


def optimality(trials: int = 200, seed: int = 3) -> dict:
    """Random small cases: partition bottleneck and instantiation time equal brute force."""
    rng = random.Random(seed)
    part = inst = 0
    for _ in range(trials):
        L = rng.randint(2, 7)
        prof = LayerProfile(t_f=tuple(rng.choice([0.5, 1, 2]) for _ in range(L)),
                            t_b=tuple(rng.choice([0.5, 1, 2]) for _ in range(L)), t_w=(0.5,) * L,
                            param_bytes=tuple(rng.choice([1, 2]) for _ in range(L)), optimizer_bytes=(1.0,) * L,
                            activation_bytes=tuple(rng.choice([0.5, 1]) for _ in range(L)), output_bytes=(1.0,) * L)
        cap = rng.choice([None, 10.0, 20.0])
        for n in range(1, min(L, 4) + 1):
            got = partition(prof, n, memory_cap=cap)
            best = None
            for cuts in itertools.combinations(range(1, L), n - 1):
                b = (0, *cuts, L)
                mems = [sum(prof.param_bytes[i] + prof.optimizer_bytes[i] + (n - k) * prof.activation_bytes[i]
                            for i in range(b[k], b[k + 1])) for k in range(n)]
                if cap is not None and max(mems) > cap:
                    continue
                w = max(sum(prof.t_f[i] + prof.t_b[i] + prof.t_w[i] for i in range(b[k], b[k + 1])) for k in range(n))
                best = w if best is None else min(best, w)
            assert (got is None) == (best is None) and (got is None or abs(got.bottleneck - best) < 1e-9)
            part += 1
        try:
            temps = plan_templates(prof, 1, 3, memory_cap=cap)
        except Exception:  # noqa: BLE001 - nothing fits this cap
            continue
        nodes, mb = rng.randint(min(temps), 6), rng.randint(2, 5)
        best = None
        for count in range(1, nodes // min(temps) + 1):
            for combo in itertools.combinations_with_replacement(sorted(temps), count):
                if sum(combo) > nodes or count > mb:
                    continue
                for split in itertools.product(range(1, mb + 1), repeat=count):
                    if sum(split) == mb:
                        t = max(temps[n].iteration_time(m) for n, m in zip(combo, split))
                        best = t if best is None else min(best, t)
        if best is not None:
            assert abs(instantiate(temps, nodes, mb).iteration_time - best) < 1e-9
            inst += 1
    return {"partitions": part, "instantiations": inst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = [timing(L, n, 24 * GIB) for L, n in ((32, 16), (48, 16), (64, 16), (128, 64))]
    print("== Template planning (GPT-shaped layers, 24 GiB per node), 2 cores")
    print(f"{'layers':>6} {'nodes':>6} {'fit':>4} {'min':>4} {'plan s':>8} {'Oobleck s':>10} {'speedup':>8}  "
          f"{'inst s':>7} {'survivors':>9} {'chosen pipelines':<24} {'pred/replay':>11}")
    for r in rows:
        ref = f"{r['oobleck_s']:.1f}" + ("+" if r["layers"] == 64 else "") if r["oobleck_s"] else "-"
        speed = f"{r['speedup']:.0f}x" + ("+" if r["layers"] == 64 else "") if r["speedup"] else "-"
        chosen = ", ".join(f"{v} x {k}" for k, v in r["counts"].items())
        print(f"{r['layers']:>6} {r['nodes']:>6} {r['templates']:>4} {r['smallest']:>4} {r['planning_s']:>8.3f} "
              f"{ref:>10} {speed:>8}  {r['instantiation_s']:>7.3f} {r['survivors']:>9} {chosen:<24} "
              f"{r['predicted'] / r['replayed']:>11.3f}")
    print("\n== Re-grid plan: 128 layers, 4 x 16 grid (64 nodes), survivors onto the template grid")
    profile = gpt_profile(128)
    state = [profile.param_bytes[i] + profile.optimizer_bytes[i] for i in range(128)]
    home = plan_templates(profile, 16, 16, memory_cap=24 * GIB)[16]
    old = {(p, k): list(range(home.bounds[k], home.bounds[k + 1])) for p in range(4) for k in range(16)}
    regrids = []
    for lost in (3, 4):
        held = {w: layers for w, layers in old.items() if not (w[1] == 5 and w[0] < lost)}
        started = time.perf_counter()
        templates = plan_templates(profile, 2, len(held), memory_cap=24 * GIB)
        choice = instantiate(templates, len(held), 4 * 16, tolerance=1)
        plan = plan_regrid(held, positions(choice, templates), state)
        took = time.perf_counter() - started
        total = sum(state) * len(choice.pipelines)
        row = {"lost": lost, "survivors": len(held), "plan_s": took, "pipelines": len(choice.pipelines),
               "moved_gib": plan.bytes_moved / GIB, "moved_fraction": plan.bytes_moved / total,
               "from_snapshots_gib": plan.bytes_from_snapshots / GIB, "busiest_sender_gib": plan.busiest_sender() / GIB}
        regrids.append(row)
        print(f"  stage 5 lost {lost} of 4 replicas: {len(held)} survivors -> {row['pipelines']} pipelines "
              f"({', '.join(f'{v} x {k}' for k, v in sorted(choice.counts.items()))}); planned in {took:.3f} s; "
              f"{row['moved_gib']:.1f} GiB received ({100 * row['moved_fraction']:.0f}% of the new grid's state), "
              f"{row['from_snapshots_gib']:.1f} GiB of it from the snapshots, busiest sender "
              f"{row['busiest_sender_gib']:.1f} GiB")
    opt = optimality()
    print(f"\n== Optimality: {opt['partitions']} partitions and {opt['instantiations']} instantiations equal "
          f"brute force")
    if args.json:
        Path(args.json).write_text(json.dumps({"timing": rows, "optimality": opt, "regrid": regrids}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
