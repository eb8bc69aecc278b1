"""The stand-in default group of a relaunched worker (``comm/standin.py``): every operation
completes at once and moves nothing, so DeepSpeed builds its engine locally; and no production
module leans on torch's internal test helpers for it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "ds_resilience"


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_collectives_complete_at_once_and_leave_tensors_alone():
    out = _run("""
        import torch, torch.distributed as dist
        from ds_resilience.comm.standin import init_stand_in, BACKEND
        assert init_stand_in(2, 4) and not init_stand_in(0, 4)  # an initialized default group is kept
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (2, 4, BACKEND)
        t = torch.arange(3.0)
        dist.all_reduce(t); dist.broadcast(t, src=0); dist.barrier()
        work = dist.all_reduce(t, async_op=True)
        assert work.is_completed() and work.wait()
        g = dist.new_group([0, 2])  # DeepSpeed's topology builds every pipe and data group
        assert dist.get_rank(g) == 1
        dist.all_reduce(t, group=g)
        out = torch.zeros(12); dist.all_gather_into_tensor(out, t)
        assert t.tolist() == [0.0, 1.0, 2.0] and out.abs().sum() == 0
        dist.destroy_process_group()
        assert init_stand_in(1, 2) and dist.get_rank() == 1  # a re-grid re-initializes it
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_deepspeeds_init_distributed_goes_on_over_it():
    out = _run("""
        import torch.distributed as dist, deepspeed
        from ds_resilience.runtime.rejoin_boot import stand_in_if_rejoining
        assert not stand_in_if_rejoining({"RANK": "3", "WORLD_SIZE": "4"})  # not a re-join
        assert stand_in_if_rejoining({"DSR_REJOIN": "1", "RANK": "3", "WORLD_SIZE": "4"})
        deepspeed.init_distributed(dist_backend="gloo")  # waits for nobody
        print(dist.get_rank(), dist.get_world_size())
    """)
    assert out.split()[-2:] == ["3", "4"]


def test_no_production_module_imports_torchs_test_helpers():
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if "torch.testing" in p.read_text()]
    assert offenders == []
