"""Worker programs for tests/dist/test_nccl_rules.py (module-level: the harness pickles them by reference)."""

from __future__ import annotations


def matching_probe(rank: int, world: int, matching: str) -> list[float]:
    """Rank 0 sends 1.0 under tag 5, then 2.0 under tag 7; rank 1 receives under tag 7 first.
    With tags it gets 2.0; matched as NCCL matches (FIFO, tags ignored) it gets 1.0."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ds_resilience.comm.groups import Group

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    group = Group(dist.distributed_c10d._get_default_group(), range(world), 30.0, rank, "probe", matching=matching)
    got = []
    if rank == 0:
        works = [group.isend(torch.tensor([1.0]), 1, 5), group.isend(torch.tensor([2.0]), 1, 7)]
        for w in works:
            group.wait(w, "probe send")
    else:
        for tag in (7, 5):
            buf = torch.zeros(1)
            group.wait(group.irecv(buf, 0, tag), f"probe receive tag {tag}")
            got.append(float(buf))
    dist.barrier()
    dist.destroy_process_group()
    return got
