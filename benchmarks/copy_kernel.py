"""Device-to-host staging throughput of the copy kernels, and what they cost a concurrent matmul.

    python benchmarks/copy_kernel.py [--total-mb 4096] [--sub-buffer-mb 128] [--sub-buffers 4]
                                     [--repeats 5] [--matmul-n 8192] [--matmul-iters 200]
                                     [--max-blocks 0,16,32] [--quick] [--json FILE]

Needs a CUDA device. On a machine without one it says so and exits 0 without measuring anything.

What it measures, all in the same run (the checkpoint staging path of ARCHITECTURE.md, Gemini):

1. **D2H throughput.** A ``--total-mb`` GPU tensor is streamed, chunk by chunk, into
   ``--sub-buffers`` pinned host sub-buffers of ``--sub-buffer-mb`` each (round robin, a sub-buffer
   is reused only once its previous copy completed, as the staging pipeline does), on a side
   stream. Methods: ``copy_`` (``Tensor.copy_(non_blocking=True)``, the copy engine: the
   baseline), the ``csrc`` and ``triton`` kernels (SM-driven, 16-byte accesses) with and without
   the same-pass checksum, and the torch fallback's checksum (``copy_`` + a second read of the
   chunk). Methods are interleaved across ``--repeats`` rounds; the median is reported with the
   ratio to ``copy_`` (the issue's target: >= 90 %).
2. **Interference.** ``--matmul-iters`` bf16 ``N x N`` matmuls on the default stream, alone and
   while each method streams chunks on the side stream for as long as the matmuls run: the
   matmul slowdown, and the copy throughput reached meanwhile. ``--max-blocks`` sweeps the csrc
   kernel's grid cap (0 = one block per SM, the default), the knob that trades copy speed for
   SMs left to training.
3. **The staging pipeline itself** (``checkpoint.staging.StagingPipeline.write``, what a snapshot
   runs): the kernel copies each chunk into a device sub-buffer (checksum in the same pass) and the
   copy engine drains it into a pinned payload, chunk i's drain overlapping chunk i+1's copy. Its
   throughput alone (with and without the checksum, for each ``--max-blocks``, and into a payload
   that is not pinned, registered per call as the shared-memory store's is) and the matmul
   slowdown while snapshots run back to back.
4. **The in-memory store's snapshot** (``SnapshotStore.save`` into a ``/dev/shm`` file mapping, as
   the in-memory tier writes every iteration): with the payload file's mapping kept page-locked
   across the versions that recycle it (the default) against mapped and page-locked per snapshot
   (``keep_mapped=False``), interleaved; GB/s of the whole save (copy, checksum, commit).

Record the device, the date and the numbers in docs/benchmarks/ (gpu.md for a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MB = 1 << 20


def _no_cuda_exit() -> int:
    print(
        "benchmarks/copy_kernel.py needs a CUDA device: none is visible here "
        f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
        f"torch.cuda.is_available()={torch.cuda.is_available()}).\n"
        "Nothing was measured. Run it on a GPU machine; the CPU checks of the kernels are "
        "tests/dist/test_kernels.py (Triton under TRITON_INTERPRET=1) and tests/dist/test_csrc_compile.py (nvcc)."
    )
    return 0


def _methods(max_blocks: list[int]) -> tuple[dict, dict]:
    """(name -> fn(src_chunk, dst_buffer) -> checksum or None, backend -> why it is not measured)."""
    from ds_resilience.kernels import checksum_reference
    from ds_resilience.kernels import copy as copy_mod

    def engine_copy(src, dst):
        dst.copy_(src.view(-1).view(torch.uint8), non_blocking=True)

    def engine_copy_then_checksum(src, dst):
        engine_copy(src, dst)
        return checksum_reference(src)

    methods = {"copy_": engine_copy, "copy_ + checksum (2nd read)": engine_copy_then_checksum}
    skipped = {}
    for backend in ("csrc", "triton"):
        reason = copy_mod._why_unavailable(backend)
        if backend == "triton" and reason is None and os.environ.get("TRITON_INTERPRET", "0") != "0":
            reason = "TRITON_INTERPRET=1 is set: unset it to measure the compiled kernel"
        if reason is not None:
            skipped[backend] = reason
            continue
        if backend == "csrc":
            for blocks in max_blocks:
                tag = "" if blocks == 0 else f" [max_blocks={blocks}]"
                methods[f"csrc{tag}"] = lambda s, d, b=blocks: copy_mod._csrc_copy(s, d, False, max_blocks=b)
                methods[f"csrc + checksum{tag}"] = lambda s, d, b=blocks: copy_mod._csrc_copy(s, d, True, max_blocks=b)
        else:
            methods["triton"] = lambda s, d: copy_mod.copy_chunk_using("triton", s, d)
            methods["triton + checksum"] = lambda s, d: copy_mod.copy_chunk_using("triton", s, d, checksum=True)
    return methods, skipped


def _verify(methods: dict, chunk: torch.Tensor, buffer: torch.Tensor) -> dict:
    """Each method copies one chunk bit for bit; the checksum methods agree with the reference."""
    from ds_resilience.kernels import checksum_reference

    expected = checksum_reference(chunk)
    truth = chunk.view(-1).view(torch.uint8)
    status = {}
    for name, fn in methods.items():
        buffer.zero_()
        value = fn(chunk, buffer)
        torch.cuda.synchronize()
        ok = torch.equal(buffer.cuda(), truth)
        if value is not None:
            ok = ok and value == expected
        status[name] = ok
    return status


class Stager:
    """Round-robin pinned sub-buffers; a sub-buffer is reused only after its last copy completed."""

    def __init__(self, count: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.done = [None] * count
        self.stream = stream
        self.next = 0

    def copy(self, fn, chunk: torch.Tensor) -> None:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.done[i] is not None:
            self.done[i].synchronize()
        with torch.cuda.stream(self.stream):
            fn(chunk, self.buffers[i][: chunk.numel() * chunk.element_size()])
            event = torch.cuda.Event()
            event.record(self.stream)
        self.done[i] = event

    def drain(self) -> None:
        for event in self.done:
            if event is not None:
                event.synchronize()


def _throughput(fn, chunks: list[torch.Tensor], stager: Stager) -> float:
    """GB/s for streaming all chunks once through the sub-buffers (wall clock, host waits included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for chunk in chunks:
        stager.copy(fn, chunk)
    stager.drain()
    elapsed = time.perf_counter() - start
    return sum(c.numel() * c.element_size() for c in chunks) / elapsed / 1e9


def _matmul_time(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, iters: int, during=None) -> tuple[float, float]:
    """Seconds for ``iters`` matmuls on the default stream; ``during`` (a callable taking a
    done-predicate) streams copies meanwhile and returns bytes moved. Returns (seconds, GB/s copied)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b, out=out)
    end.record()
    t0 = time.perf_counter()
    moved = during(end.query) if during is not None else 0
    copy_wall = time.perf_counter() - t0
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return seconds, (moved / copy_wall / 1e9 if moved else 0.0)


def _staging(src: torch.Tensor, args, max_blocks: list[int], matmuls, alone: float) -> dict:
    """Section 3: the real snapshot path, ``StagingPipeline.write``, alone and under matmuls."""
    from ds_resilience.checkpoint.staging import StagingPipeline
    from ds_resilience.kernels import checksum_reference

    state = {"params": list(src.chunk(8))}
    variants = []
    for blocks in max_blocks:
        tag = "" if blocks == 0 else f" [max_blocks={blocks}]"
        variants.append((f"staging + checksum{tag}", blocks, True, True))
        variants.append((f"staging, no checksum{tag}", blocks, False, True))
    variants.append(("staging + checksum, unpinned payload", 0, True, False))
    before = os.environ.get("DSR_COPY_MAX_BLOCKS")
    rows, correct = {}, True
    torch.cuda.synchronize()
    ready = torch.cuda.Event()  # "the state was captured here": before the matmuls are queued, as at an
    ready.record()              # iteration's end (else the copy stream would wait for every matmul)
    try:
        pinned = None
        for name, blocks, checksum, pin in variants:
            os.environ["DSR_COPY_MAX_BLOCKS"] = str(blocks)
            pipe = StagingPipeline(gpu_buffer_mb=args.sub_buffer_mb * args.sub_buffers, num_sub_buffers=args.sub_buffers)
            layout, leaves = pipe.plan(state)
            if pin and pinned is None:
                pinned = torch.zeros(layout.nbytes, dtype=torch.uint8, pin_memory=True)
            payload = pinned if pin else torch.zeros(layout.nbytes, dtype=torch.uint8)
            value = pipe.write(layout, leaves, payload, checksum=checksum)  # warm-up and check
            if checksum:
                correct = correct and value == checksum_reference(payload)
            times = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pipe.write(layout, leaves, payload, checksum=checksum)
                times.append(time.perf_counter() - t0)
            row = {"gbps": layout.nbytes / statistics.median(times) / 1e9}
            if pin:
                def snapshots(done, pipe=pipe, layout=layout, leaves=leaves, payload=payload, checksum=checksum) -> int:
                    moved = 0
                    while not done():
                        pipe.write(layout, leaves, payload, checksum=checksum, ready=ready)
                        moved += layout.nbytes
                    return moved

                runs = [matmuls(snapshots) for _ in range(3)]
                row["slowdown"] = statistics.median(r[0] for r in runs) / alone - 1
                row["copy_gbps_during"] = statistics.median(r[1] for r in runs)
            rows[name] = row
    finally:
        if before is None:
            os.environ.pop("DSR_COPY_MAX_BLOCKS", None)
        else:
            os.environ["DSR_COPY_MAX_BLOCKS"] = before
    return {"rows": rows, "correct": correct}


def _store(src: torch.Tensor, repeats: int) -> dict:
    """Section 4: ``SnapshotStore.save`` of a device state, kept mapping against per-snapshot mapping."""
    import shutil
    import tempfile

    from ds_resilience.checkpoint.store import SnapshotStore

    state = {"params": list(src.chunk(8))}
    nbytes = src.numel() * src.element_size()
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 8 * nbytes else None
    root = Path(tempfile.mkdtemp(prefix="dsr-bench-", dir=base))
    try:
        stores = {"kept mapping (default)": SnapshotStore(root / "kept", keep=2),
                  "mapped per snapshot": SnapshotStore(root / "per", keep=2, keep_mapped=False)}
        samples: dict[str, list[float]] = {name: [] for name in stores}
        step = 0
        for k in range(repeats + 3):  # 3 warm-up rounds: the files and spares exist afterwards
            for name, store in stores.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                store.save("rank0", step, state)
                if k >= 3:
                    samples[name].append(time.perf_counter() - t0)
            step += 1
        exact = all(torch.equal(store.load("rank0")["params"][0], src.chunk(8)[0].cpu()) for store in stores.values())
        rows = {name: {"gbps": nbytes / statistics.median(v) / 1e9, "median_s": statistics.median(v),
                       "mappings": stores[name].mapped} for name, v in samples.items()}
        for store in stores.values():
            store.close()
        return {"root": str(root.parent), "rows": rows, "exact": exact}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=int, default=4096, help="bytes streamed per measurement")
    parser.add_argument("--sub-buffer-mb", type=int, default=128)
    parser.add_argument("--sub-buffers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--matmul-iters", type=int, default=200)
    parser.add_argument("--max-blocks", default="0,16,32", help="csrc grid caps to try (0 = one block per SM)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="1 GiB, 3 repeats, 50 matmuls")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        return _no_cuda_exit()
    if args.quick:
        args.total_mb, args.repeats, args.matmul_iters = 1024, 3, 50

    from ds_resilience.kernels import backend_name

    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); dispatch backend: {backend_name()}")
    max_blocks = [int(x) for x in args.max_blocks.split(",") if x.strip()]
    methods, skipped = _methods(max_blocks)
    for name, reason in skipped.items():
        print(f"  {name}: not measured ({reason})")

    dtype = getattr(torch, args.dtype)
    sub_bytes = args.sub_buffer_mb * MB
    elem = torch.empty((), dtype=dtype).element_size()
    src = torch.randn(args.total_mb * MB // elem, device="cuda", dtype=dtype)
    per_chunk = sub_bytes // elem
    chunks = [src[i : i + per_chunk] for i in range(0, src.numel(), per_chunk)]
    stream = torch.cuda.Stream()
    stager = Stager(args.sub_buffers, sub_bytes, stream)

    status = _verify(methods, chunks[0], stager.buffers[0])
    bad = [name for name, ok in status.items() if not ok]
    print("correctness on one chunk: " + ("all bitwise, checksums equal the reference" if not bad else f"FAILED: {bad}"))

    for fn in methods.values():  # warm-up: JIT, first-touch of pinned pages
        _throughput(fn, chunks[: args.sub_buffers], stager)
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, fn in methods.items():  # interleaved A/B/A/B
            samples[name].append(_throughput(fn, chunks, stager))
    gbps = {name: statistics.median(v) for name, v in samples.items()}

    n = args.matmul_n
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    _matmul_time(a, b, out, 10)

    def streaming(fn):
        def run(done) -> int:
            moved, i = 0, 0
            while not done():
                chunk = chunks[i % len(chunks)]
                stager.copy(fn, chunk)
                moved += chunk.numel() * chunk.element_size()
                i += 1
            stager.drain()
            return moved

        return run

    alone = statistics.median(_matmul_time(a, b, out, args.matmul_iters)[0] for _ in range(3))
    interference = {}
    for name, fn in methods.items():
        runs = [_matmul_time(a, b, out, args.matmul_iters, streaming(fn)) for _ in range(3)]
        seconds = statistics.median(r[0] for r in runs)
        interference[name] = {"matmul_s": seconds, "slowdown": seconds / alone - 1,
                              "copy_gbps_during": statistics.median(r[1] for r in runs)}

    staging = _staging(src, args, max_blocks, lambda during: _matmul_time(a, b, out, args.matmul_iters, during), alone)

    base = gbps["copy_"]
    print(f"\nD2H through {args.sub_buffers} x {args.sub_buffer_mb} MB pinned sub-buffers, {args.total_mb} MB of "
          f"{args.dtype} per run, median of {args.repeats}; {args.matmul_iters} bf16 {n}x{n} matmuls alone: "
          f"{alone * 1e3:.1f} ms")
    print(f"{'method':<34} {'GB/s':>7} {'vs copy_':>9} {'matmul slowdown':>16} {'GB/s during matmul':>19}")
    for name in methods:
        i = interference[name]
        print(f"{name:<34} {gbps[name]:7.2f} {gbps[name] / base:9.1%} {i['slowdown']:16.1%} {i['copy_gbps_during']:19.2f}")
    for name in ("csrc", "triton"):
        if name in gbps:
            ratio = gbps[name] / base
            print(f"target >= 90% of copy_: {name} {ratio:.1%} -> {'met' if ratio >= 0.9 else 'NOT met'}")

    print(f"\nThe staging pipeline (StagingPipeline.write, {args.sub_buffers} x {args.sub_buffer_mb} MB device "
          f"sub-buffers, {args.total_mb} MB state in 8 tensors), median of {args.repeats}; slowdown of the same matmuls")
    print(f"{'variant':<34} {'GB/s':>7} {'vs copy_':>9} {'matmul slowdown':>16} {'GB/s during matmul':>19}")
    for name, row in staging["rows"].items():
        during = row.get("slowdown")
        print(f"{name:<34} {row['gbps']:7.2f} {row['gbps'] / base:9.1%} "
              + (f"{during:16.1%} {row['copy_gbps_during']:19.2f}" if during is not None else f"{'-':>16} {'-':>19}"))
    print("staging checksums equal the reference: " + ("yes" if staging["correct"] else "NO"))
    bad = bad + ([] if staging["correct"] else ["staging"])

    store = _store(src, max(args.repeats, 5))
    print(f"\nThe in-memory store's snapshot (SnapshotStore.save under {store['root']}, {args.total_mb} MB device "
          f"state, keep=2, recycled files), median of {max(args.repeats, 5)}, interleaved")
    print(f"{'variant':<34} {'GB/s':>7} {'s per snapshot':>15} {'mappings made':>14}")
    for name, row in store["rows"].items():
        print(f"{name:<34} {row['gbps']:7.2f} {row['median_s']:15.4f} {row['mappings']:14d}")
    kept, per = (store["rows"][k]["gbps"] for k in ("kept mapping (default)", "mapped per snapshot"))
    print(f"kept / per snapshot: {kept / per:.2f}x; versions read back exact: {'yes' if store['exact'] else 'NO'}")
    bad = bad + ([] if store["exact"] else ["store"])

    if args.json:
        args.json.write_text(json.dumps({"staging": staging, "store": store,
            "device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "args": vars(args) | {"json": str(args.json)},
            "correct": status, "gbps": gbps, "samples": samples, "matmul_alone_s": alone,
            "interference": interference, "skipped": skipped,
        }, indent=2))
        print(f"wrote {args.json}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
