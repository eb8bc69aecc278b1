"""In-memory checkpoints (issue 6, Gemini-style): three figures, each against the real alternative.

    python benchmarks/inmemory_checkpoint.py [--quick] [--rounds 5] [--json FILE]

2 CPU processes (gloo over loopback, one torch thread each, ``DS_ACCELERATOR=cpu``) train a stack
of Linear layers through ``deepspeed.initialize`` (ZeRO-0, torch Adam; data parallel, so every
iteration ends in a gradient all-reduce). Checkpoint config: 2 replicas, 1 rank per machine, so
the two ranks form one placement group and each holds the other's replica; ``interleave: false``
(replication whenever ready, there is no pipeline schedule here).

1. Training stall per iteration. Blocks of iterations, interleaved A/B/C over several rounds:
   (A) no checkpoint; (B) ``InMemoryCheckpointer.capture(step, collect(...))`` after every
   optimizer step, and ``wait_copied()`` before the next one (the copy into /dev/shm runs on a
   background thread during forward and backward; checksum, commit and replication follow on
   background threads, so their cost shows only as B-A); (C) ``engine.save_checkpoint`` every iteration with
   DeepSpeed's default TorchCheckpointEngine (rank 0 torch.saves model + optimizer to disk).
   Stall = the training thread's wait (slowest rank, median over iterations); iteration time =
   block wall time / iterations between barriers (median over rounds). Reported as % of A.
2. Recovery, in a fresh pair of processes with a differently initialised model, interleaved over
   repetitions, slowest rank, medians: (a) peer memory: machine 1's host-memory directory is wiped,
   ``restore()`` fetches rank 1's snapshot from rank 0 over gloo, ``apply()`` loads it; (b) DeepSpeed
   ``load_checkpoint`` of the checkpoint written in (C), after fsync + POSIX_FADV_DONTNEED on its
   files (best-effort eviction from the page cache; residency is checked with ``fincore`` when
   installed), and (b') the same without eviction (page cache); (c) the persistent tier: every
   host-memory copy wiped, restore from ``persistent_dir`` (evicted likewise). Every restore is
   checked bitwise (sha256 of parameters and Adam moments) against the trained state.
3. Replication throughput: one version replicated alone (each direction in turn, training idle),
   bytes / send time from ``Replicator.stats``, against a raw ``dist.send``/``dist.recv`` of a
   uint8 tensor of the same size on a fresh 2-rank gloo group (whole, and in replication-sized
   chunks). The throughput during the B blocks (both directions, concurrent with training) is
   printed too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from dist_harness import run_workers  # noqa: E402

SHM = Path("/dev/shm/ds_resilience_bench")


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _engine(opts: dict, seed: int):
    import logging

    import deepspeed
    import torch

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(seed)
    w = opts["width"]
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU()) for _ in range(opts["layers"])])
    config = {"train_micro_batch_size_per_gpu": opts["batch"], "gradient_accumulation_steps": 1,
              "train_batch_size": 2 * opts["batch"], "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine


def _cfg(opts: dict, job_root: str, **extra):
    from ds_resilience.config import CheckpointConfig

    return CheckpointConfig.from_dict({"replicas": 2, "ranks_per_machine": 1, "host_dir": job_root, "interleave": False,
                                       "chunk_mb": opts["chunk_mb"], **extra})


def _state(engine, rank: int):
    from ds_resilience.checkpoint.state import collect

    return collect(params=list(engine.module.parameters()), optimizer=engine.optimizer, lr_scheduler=None,
                   steps=engine.global_steps, samples=engine.global_samples, stage=0, rank=rank)


def _digest(engine) -> str:
    h = hashlib.sha256()
    for p in engine.module.parameters():
        h.update(p.detach().numpy())
        for k in ("exp_avg", "exp_avg_sq"):
            h.update(engine.optimizer.state[p][k].numpy())
    return h.hexdigest()


def _drop_cache(root: Path) -> int:
    """fsync + POSIX_FADV_DONTNEED every file under ``root``; returns the bytes still resident
    (per ``fincore``; -1 when it is not installed)."""
    files = [f for f in sorted(Path(root).rglob("*")) if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not shutil.which("fincore") or not files:
        return -1
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, files)], capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split() if x.isdigit())


def train(rank: int, world: int, opts: dict) -> dict:
    """Figure 1 (A/B/C blocks), then the final state in all three forms, then figure 3."""
    import torch
    import torch.distributed as dist

    from ds_resilience.checkpoint.inmemory import InMemoryCheckpointer

    engine = _engine(opts, seed=1)
    ck = InMemoryCheckpointer(_cfg(opts, opts["host_dir"]), rank=rank, world=world, job_id=opts["job"],
                              local_world_size=1, name=f"{opts['job']}/train")
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(opts["batch"], opts["width"], generator=g) for _ in range(4)]
    ds_dir = opts["ds_dir"]

    def iteration(mode: str) -> dict:
        loss = engine(batches[engine.global_steps % len(batches)]).pow(2).mean()
        engine.backward(loss)
        rec = {}
        if mode == "B":  # the previous capture's background copy must be done before the step
            rec["wait_s"] = ck.wait_copied()
        engine.step()
        t1 = time.perf_counter()
        if mode == "B":
            rec["capture_s"] = ck.capture(engine.global_steps, _state(engine, rank))
        elif mode == "C":
            engine.save_checkpoint(ds_dir, tag=f"s{engine.global_steps}")
        if mode != "A":
            rec["stall_s"] = time.perf_counter() - t1 + rec.get("wait_s", 0.0)
        return rec

    def settle() -> None:  # background work of a B block must not leak into the next block
        step = engine.global_steps
        if ck.committed is not None and ck.captures and ck.captures[-1]["step"] == step:
            assert ck.wait_committed(step, 120) and ck.replicator.wait_replicated(step, 120)
        dist.barrier()

    for _ in range(opts["warmup"]):
        iteration("A")
    out: dict = {"blocks": {m: [] for m in "ABC"}, "iters": {m: [] for m in "ABC"}}
    for rnd in range(opts["rounds"]):
        for mode in "ABC":
            settle()
            t0 = time.perf_counter()
            recs = [iteration(mode) for _ in range(opts["iters"])]
            dist.barrier()
            out["blocks"][mode].append((time.perf_counter() - t0) / opts["iters"])
            out["iters"][mode].extend(recs)
            if mode == "C" and rank == 0:  # keep the disk bounded: only the newest DeepSpeed tag stays
                for d in Path(ds_dir).glob("s*"):
                    if d.name != f"s{engine.global_steps}":
                        shutil.rmtree(d, ignore_errors=True)
        log(rank, f"round {rnd + 1}/{opts['rounds']}: iteration A {out['blocks']['A'][-1] * 1e3:.0f} ms, "
                  f"B {out['blocks']['B'][-1] * 1e3:.0f} ms, C {out['blocks']['C'][-1] * 1e3:.0f} ms")
    settle()
    stats = ck.replicator.stats
    out["train_repl"] = {"bytes": stats.bytes_sent, "seconds": stats.send_seconds, "versions": stats.versions_sent,
                         "skipped": stats.versions_skipped}

    # the final state S, in all three forms: in memory (replicated), DeepSpeed checkpoint, persistent tier
    iteration("A")
    step = out["final_step"] = engine.global_steps
    state = _state(engine, rank)
    out["iso"] = {}
    for src in range(world):  # figure 3: one version replicated alone, one direction at a time
        dist.barrier()
        if rank == src:
            b0, s0 = stats.bytes_sent, stats.send_seconds
            ck.capture(step, state)
            assert ck.wait_committed(step, 120)
            alone = ck.captures[-1]["copy_s"]  # the background copy, training idle
            t0 = time.perf_counter()
            assert ck.replicator.wait_replicated(step, 300)
            out["iso"] = {"bytes": stats.bytes_sent - b0, "send_s": stats.send_seconds - s0, "capture_s": alone,
                          "offer_to_sent_s": time.perf_counter() - t0}
        else:
            manifest = ck.store.root / f"rank{src}" / f"v{step:012d}" / "MANIFEST.json"
            while not manifest.exists():  # the replica is checksummed and committed on this side
                time.sleep(0.01)
        dist.barrier()
    nbytes = ck.store.latest(f"rank{rank}").nbytes
    engine.save_checkpoint(ds_dir, tag=f"s{step}")
    ckp = InMemoryCheckpointer(_cfg(opts, opts["persist_host_dir"], replicas=1, persistent_dir=opts["persist_dir"],
                                    persistent_interval=1), rank=rank, world=world, job_id=opts["job"],
                               local_world_size=1, name=f"{opts['job']}/persist")
    ckp.capture(step, state)
    ckp.close()
    assert ckp.persisted == step and not ckp.errors, (ckp.persisted, ckp.errors)
    dist.barrier()
    ck.close()
    out["errors"] = ck.errors + stats.errors
    if rank == 0:
        for d in Path(ds_dir).glob("s*"):
            if d.name != f"s{step}":
                shutil.rmtree(d, ignore_errors=True)

    # figure 3, the raw alternative: the same bytes on a fresh 2-rank gloo group
    group = dist.new_group([0, 1], backend="gloo")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1)
    chunk = int(ck.cfg.chunk_mb * (1 << 20))
    raw = {"whole": [], "chunked": [], "shm": []}  # shm: chunked, received into a fresh /dev/shm file mapping
    fresh = Path(opts["host_dir"]) / opts["job"] / "raw.bin"
    for rep in range(opts["bw_reps"]):
        for how in raw:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dst = torch.from_file(str(fresh), shared=True, size=nbytes, dtype=torch.uint8) if how == "shm" and rank else buf
            pieces = [dst] if how == "whole" else [dst[i:i + chunk] for i in range(0, nbytes, chunk)]
            for piece in pieces:
                (dist.send if rank == 0 else dist.recv)(piece, 1 - rank, group=group)
            (dist.recv if rank == 0 else dist.send)(ack, 1 - rank, group=group)  # rank 0 stops when all arrived
            raw[how].append(time.perf_counter() - t0)
            del dst, pieces
            fresh.unlink(missing_ok=True)
    out.update(raw=raw, nbytes=nbytes, digest=_digest(engine))
    dist.barrier()
    return out


def recover(rank: int, world: int, opts: dict) -> dict:
    """Figure 2: restore the final state from peer memory, DeepSpeed's checkpoint, the persistent tier."""
    import torch
    import torch.distributed as dist

    from ds_resilience.checkpoint.inmemory import InMemoryCheckpointer
    from ds_resilience.checkpoint.restore_plan import PEER, PERSISTENT
    from ds_resilience.checkpoint.state import apply_tree as apply

    engine = _engine(opts, seed=2)  # other initial values: everything must come back
    loss = engine(torch.zeros(opts["batch"], opts["width"])).pow(2).mean()
    engine.backward(loss)
    engine.step()  # creates the Adam moments
    step = opts["final_step"]

    def scramble() -> None:
        with torch.no_grad():
            for p in engine.module.parameters():
                p.normal_()
                engine.optimizer.state[p]["exp_avg"].zero_()

    def in_memory(cfg, name: str, expect: str) -> dict:
        ck = InMemoryCheckpointer(cfg, rank=rank, world=world, job_id=opts["job"], local_world_size=1, name=name,
                                  replicate=False)
        state, plan, timings = ck.restore()
        engine.global_steps, engine.global_samples = apply(state, params=list(engine.module.parameters()),
                                                           optimizer=engine.optimizer, lr_scheduler=None, stage=0)
        ck.close()
        assert plan.step == step and plan.sources[1][0] == expect, (plan, expect)
        return timings

    methods = {
        "peer": ("peer memory (machine 1 wiped)", _cfg(opts, opts["host_dir"]), PEER),
        "ds_disk": ("DeepSpeed load_checkpoint (evicted)", None, True),
        "ds_cache": ("DeepSpeed load_checkpoint (page cache)", None, False),
        "persistent": ("persistent tier (all memory wiped)", _cfg(opts, opts["persist_host_dir"], replicas=1,
                       persistent_dir=opts["persist_dir"], persistent_interval=1), PERSISTENT),
    }
    out: dict = {m: [] for m in methods}
    out["resident"], out["breakdown"], out["ok"] = {}, [], True
    for rep in range(opts["reps"]):
        for key, (_, cfg, arg) in methods.items():
            scramble()
            dist.barrier()
            if key == "peer" and rank == 1:
                shutil.rmtree(Path(opts["host_dir"]) / opts["job"] / "machine1")
            elif key == "persistent" and rank == 0:
                shutil.rmtree(Path(opts["persist_host_dir"]) / opts["job"], ignore_errors=True)
            if key == "persistent":
                out["resident"][key] = _drop_cache(Path(opts["persist_dir"]) / "snapshots" / f"rank{rank}")
            elif key == "ds_disk" and rank == 0:
                out["resident"][key] = _drop_cache(Path(opts["ds_dir"]) / f"s{step}")
            dist.barrier()
            t0 = time.perf_counter()
            if cfg is None:
                engine.load_checkpoint(opts["ds_dir"], tag=f"s{step}")
            else:
                timings = in_memory(cfg, f"{opts['job']}/r{rep}{key}", arg)
                if key == "peer":
                    out["breakdown"].append(timings)
            out[key].append(time.perf_counter() - t0)
            out["ok"] &= _digest(engine) == opts["digest"] and engine.global_steps == step
        log(rank, f"recovery rep {rep + 1}/{opts['reps']}: " + ", ".join(f"{k} {out[k][-1]:.3f} s" for k in methods))
    out["names"] = {k: v[0] for k, v in methods.items()}
    dist.barrier()
    return out


def report(opts: dict, params: int, tr: list[dict], rec: list[dict], wall: float, json_path: str | None) -> None:
    med = statistics.median

    def per_rank_max(rows: list[list[float]]) -> list[float]:
        return [max(xs) for xs in zip(*rows)]

    block = {m: med(per_rank_max([r["blocks"][m] for r in tr])) for m in "ABC"}
    stall = {m: med(per_rank_max([[i["stall_s"] for i in r["iters"][m]] for r in tr])) for m in "BC"}
    capture = med(per_rank_max([[i["capture_s"] for i in r["iters"]["B"]] for r in tr]))
    a = block["A"]
    fig1 = {"iteration_s": block, "stall_s": stall, "capture_return_s": capture,
            "stall_pct_of_iteration": {m: 100 * stall[m] / a for m in "BC"},
            "slowdown_pct": {m: 100 * (block[m] - a) / a for m in "BC"}, "stall_ratio_C_over_B": stall["C"] / stall["B"]}
    rtimes = {k: med(per_rank_max([r[k] for r in rec])) for k in rec[0]["names"]}
    bd = {k: med(t[k] for t in rec[1]["breakdown"]) for k in ("plan_s", "transfer_s", "load_s", "total_s")}
    fig2 = {"seconds": rtimes, "ratio_over_peer": {k: rtimes[k] / rtimes["peer"] for k in rtimes},
            "peer_breakdown_rank1_s": bd, "bitwise_ok": all(r["ok"] for r in rec),
            "resident_bytes_after_fadvise": {k: sum(r["resident"].get(k, 0) for r in rec) for k in rec[0]["resident"]}}
    nbytes = tr[0]["nbytes"]
    iso = [r["iso"]["bytes"] / r["iso"]["send_s"] for r in tr]
    e2e = [r["iso"]["bytes"] / r["iso"]["offer_to_sent_s"] for r in tr]
    during = [r["train_repl"]["bytes"] / r["train_repl"]["seconds"] for r in tr if r["train_repl"]["seconds"]]
    raw = {how: nbytes / med(tr[0]["raw"][how]) for how in tr[0]["raw"]}
    fig3 = {"payload_bytes": nbytes, "replication_Bps": med(iso), "replication_commit_to_sent_Bps": med(e2e),
            "replication_during_training_Bps": med(during) if during else None, "raw_gloo_Bps": raw,
            "ratio_replication_over_raw": med(iso) / raw["whole"],
            "versions_sent_skipped": [(r["train_repl"]["versions"], r["train_repl"]["skipped"]) for r in tr]}
    errors = [e for r in tr for e in r["errors"]]

    print(f"in-memory checkpoints vs the alternatives: 2 ranks (gloo, 1 thread each), {opts['layers']} x Linear "
          f"{opts['width']}, batch {opts['batch']}/rank, {params / 1e6:.2f} M params, snapshot {nbytes / 1e6:.1f} MB/rank; "
          f"{opts['rounds']} rounds x {opts['iters']} iterations per mode, {opts['reps']} recovery reps; {wall:.0f} s")
    print("\n1. training stall per iteration (slowest rank, medians)")
    print(f"   iteration time   A no checkpoint {a * 1e3:8.1f} ms | B in-memory {block['B'] * 1e3:8.1f} ms "
          f"({fig1['slowdown_pct']['B']:+.1f}%) | C torch.save {block['C'] * 1e3:8.1f} ms ({fig1['slowdown_pct']['C']:+.1f}%)")
    print(f"   B capture(collect(...)) {stall['B'] * 1e3:8.2f} ms = {fig1['stall_pct_of_iteration']['B']:6.2f}% of A"
          f"   (capture() returned in {capture * 1e3:.2f} ms, the rest is the wait before the next step for the "
          f"background copy; the copy alone, training idle: {med(r['iso']['capture_s'] for r in tr) * 1e3:.2f} ms; "
          f"target <= 2%)")
    print(f"   C save_checkpoint       {stall['C'] * 1e3:8.2f} ms = {fig1['stall_pct_of_iteration']['C']:6.2f}% of A")
    print(f"   stall ratio C / B       {fig1['stall_ratio_C_over_B']:8.1f}x")
    print("\n2. recovery of the final state (fresh processes, slowest rank, medians; all bitwise "
          f"{'OK' if fig2['bitwise_ok'] else 'MISMATCH'})")
    for k, name in rec[0]["names"].items():
        print(f"   {name:<40} {rtimes[k]:8.3f} s  {rtimes[k] / rtimes['peer']:6.1f}x peer memory")
    print(f"   peer restore on rank 1: plan {bd['plan_s']:.3f} s, transfer {bd['transfer_s']:.3f} s, "
          f"load {bd['load_s']:.3f} s, + apply {rtimes['peer'] - bd['total_s']:.3f} s")
    res = fig2["resident_bytes_after_fadvise"]
    print("   eviction: fsync + POSIX_FADV_DONTNEED (best-effort); bytes still in page cache per fincore: "
          + ", ".join(f"{k} {v / 1e6:.1f} MB" if v >= 0 else f"{k} unknown" for k, v in res.items()))
    print("\n3. replication throughput vs raw gloo (loopback, one direction at a time)")
    print(f"   replication of one {nbytes / 1e6:.1f} MB version, bytes/send time {med(iso) / 1e9:6.2f} GB/s "
          f"(commit -> sent {med(e2e) / 1e9:.2f} GB/s)")
    print(f"   raw dist.send, whole tensor      {raw['whole'] / 1e9:6.2f} GB/s;  in {opts['chunk_mb']:g} MiB chunks "
          f"{raw['chunked'] / 1e9:.2f} GB/s, the same into a fresh /dev/shm mapping {raw['shm'] / 1e9:.2f} GB/s")
    print(f"   ratio replication / raw          {fig3['ratio_replication_over_raw']:6.2f}")
    if during:
        print(f"   during the B blocks (both directions, concurrent with training) {med(during) / 1e9:.2f} GB/s; "
              f"versions sent/skipped per rank {fig3['versions_sent_skipped']}")
    print("\nsummary")
    print(f"   {'figure':<44} {'ours':>12} {'alternative':>12} {'ratio':>8}")
    print(f"   {'stall per iteration, % of iteration':<44} {fig1['stall_pct_of_iteration']['B']:11.2f}% "
          f"{fig1['stall_pct_of_iteration']['C']:11.2f}% {fig1['stall_ratio_C_over_B']:7.1f}x")
    print(f"   {'recovery s (peer memory vs DS disk, evicted)':<44} {rtimes['peer']:12.3f} {rtimes['ds_disk']:12.3f} "
          f"{rtimes['ds_disk'] / rtimes['peer']:7.1f}x")
    print(f"   {'recovery s (peer memory vs our persistent)':<44} {rtimes['peer']:12.3f} {rtimes['persistent']:12.3f} "
          f"{rtimes['persistent'] / rtimes['peer']:7.1f}x")
    print(f"   {'replication GB/s vs raw gloo send':<44} {med(iso) / 1e9:12.2f} {raw['whole'] / 1e9:12.2f} "
          f"{fig3['ratio_replication_over_raw']:7.2f}")
    if errors:
        print(f"   snapshot/replication errors: {errors}")
    if json_path:
        Path(json_path).write_text(json.dumps({"opts": {k: v for k, v in opts.items() if k != "digest"}, "params": params,
                                               "stall": fig1, "recovery": fig2, "replication": fig3, "errors": errors,
                                               "wall_s": wall}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, few rounds (well under a minute)")
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--iters", type=int, help="iterations per A/B/C block")
    parser.add_argument("--reps", type=int, help="recovery repetitions")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    preset = (dict(width=512, layers=4, batch=256, rounds=2, iters=3, reps=2) if args.quick
              else dict(width=1024, layers=6, batch=1024, rounds=5, iters=5, reps=5))
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in preset.items()}
    opts.update(warmup=2, bw_reps=3, chunk_mb=4.0)
    os.environ["DS_ACCELERATOR"] = "cpu"
    job = f"bench{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="dsr_bench_"))  # on the root filesystem (ext4 here), not tmpfs
    opts.update(job=job, host_dir=str(SHM / job / "mem"), persist_host_dir=str(SHM / job / "persist"),
                ds_dir=str(tmp / "deepspeed"), persist_dir=str(tmp / "persistent"))
    env = {"DS_ACCELERATOR": "cpu"}
    params = opts["layers"] * (opts["width"] ** 2 + opts["width"])
    started = time.perf_counter()
    try:
        log(0, f"training phase: {params / 1e6:.2f} M params, state ~{12 * params / 1e6:.0f} MB per rank, batch {opts['batch']}")
        tr = run_workers(train, 2, args=(opts,), timeout_s=3000, env=env)
        assert tr[0]["digest"] == tr[1]["digest"], "data-parallel ranks diverged"
        log(0, "recovery phase (fresh processes)")
        rec = run_workers(recover, 2, args=(dict(opts, final_step=tr[0]["final_step"], digest=tr[0]["digest"]),),
                          timeout_s=3000, env=env)
    finally:
        shutil.rmtree(SHM / job, ignore_errors=True)
        if SHM.is_dir() and not any(SHM.iterdir()):
            SHM.rmdir()
        shutil.rmtree(tmp, ignore_errors=True)
    report(opts, params, tr, rec, time.perf_counter() - started, args.json)


if __name__ == "__main__":
    main()
