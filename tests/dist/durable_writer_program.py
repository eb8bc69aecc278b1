"""A writer process for test_durable_checkpoint.py: saves ``global_step1`` completely through the
persistent tier's real code, then ``global_step2`` with a pause injected at ``sys.argv[2]``:

* ``data``: in the middle of writing the data file (after its first bytes),
* ``marker``: after the data files are written and synced, before this rank's completion marker.

It prints ``PAUSED <point>`` when it gets there and sleeps (bounded) for the test to SIGKILL it."""

from __future__ import annotations

import os
import sys
import time

import torch

from ds_resilience.checkpoint import persistent as P

PAUSE_S = 120.0
FILES = ("layer_01-model_states.pt", "mp_rank_00_model_states.pt")


def _pause(point: str) -> None:
    print(f"PAUSED {point}", flush=True)
    time.sleep(PAUSE_S)
    raise SystemExit(f"not killed within {PAUSE_S}s at {point}")


def _save(ce: P.AsyncCheckpointWriter, save_dir: str, step: int) -> None:
    tag = f"global_step{step}"
    info = P.CommitInfo(tag=tag, save_dir=save_dir, save_latest=True)
    ce.create(info)
    os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
    for name in FILES:  # 4 MB each: written in several pieces
        ce.save({"w": torch.full((1 << 20,), float(step)), "step": step}, os.path.join(save_dir, tag, name))
    ce.commit(info)


def main() -> None:
    save_dir, point = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    ce = P.AsyncCheckpointWriter(keep_last=3, timeout_s=60)
    _save(ce, save_dir, 1)
    if point == "data":
        real_write = P._Counting.write

        def write(self, data):
            n = real_write(self, data)
            if self.size > (1 << 20):  # part of the file is written, the rest is not
                self.flush()
                _pause(point)
            return n

        P._Counting.write = write
    elif point == "marker":
        P.AsyncCheckpointWriter._write_marker = lambda self, path, marker: _pause(point)
    else:
        raise SystemExit(f"unknown pause point {point!r}: expected 'data' or 'marker'")
    _save(ce, save_dir, 2)


if __name__ == "__main__":
    main()
