"""Persistent tier: training stall of save_checkpoint, async engine vs DeepSpeed's default.

    python benchmarks/checkpoint.py [--reps 5] [--d-model 256]

4 CPU processes (PP=2 x DP=2), the example GPT, vanilla DeepSpeed PipelineEngine; the same run
times save_checkpoint with DeepSpeed's TorchCheckpointEngine and with
ds_resilience.checkpoint.persistent.AsyncPersistentCheckpointEngine, interleaved. The stall of a
repetition is its slowest rank's; the ratio is of the medians.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from dist_harness import run_workers  # noqa: E402
from test_persistent_checkpoint import pipeline_checkpoint_program  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_workers(pipeline_checkpoint_program, 4, args=(tmp, args.d_model, args.reps), timeout_s=600)
    torch_s = [max(r["times"]["torch"][i] for r in results) for i in range(args.reps)]
    async_s = [max(r["times"]["async"][i] for r in results) for i in range(args.reps)]
    step_s = sorted(s for r in results for s in r["times"]["step"])
    write_s = max(sum(r["write_s"]) / max(1, len(r["write_s"])) for r in results)

    def med(xs):
        return sorted(xs)[len(xs) // 2]

    print(f"save_checkpoint stall, 4 ranks, GPT d_model={args.d_model}:")
    print(f"  DeepSpeed TorchCheckpointEngine  {[round(x * 1e3, 1) for x in torch_s]} ms")
    print(f"  async persistent engine          {[round(x * 1e3, 1) for x in async_s]} ms")
    print(f"  ratio async / torch (medians)    {med(async_s) / med(torch_s):.2f}")
    print(f"  background write per save {write_s * 1e3:.1f} ms; median training step {med(step_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
