"""Build DeepSpeed's JIT ops the suite loads (on CPU: FusedAdam and the shm comm op) once, before
any test runs: a test that kills a worker then never kills a build, and no job waits for another's.
Run by tests/run.sh with the suite's TORCH_EXTENSIONS_DIR; prints what it built and how long it took."""

from __future__ import annotations

import time

import torch

from ds_resilience.runtime.build_locks import clear_stale_locks, extensions_root, guard_build_locks


def main() -> int:
    torch.set_num_threads(1)
    clear_stale_locks(extensions_root(), echo=print)
    guard_build_locks()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
        t0 = time.monotonic()
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(False):
            print(f"build_ops: {name} does not apply to the {accelerator.device_name()} accelerator")
            continue
        builder.load(verbose=False)
        print(f"build_ops: {builder.name} ready in {time.monotonic() - t0:.1f} s ({extensions_root()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
