"""Worker programs for tests/dist/test_multigpu.py: NCCL groups on real GPUs (one per rank)."""

from __future__ import annotations


def nccl_crossing_and_abort(rank: int, world: int) -> dict:
    """1F1B's crossing on one pair over an NCCL group (stage 0 sends activation 1 before it waits
    for gradient 0, stage 1 sends gradient 0 before it waits for activation 1), with the early post
    that makes it run; then a receive nobody answers, released by aborting the group."""
    import threading
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ds_resilience.comm.groups import CommError, new_group
    from ds_resilience.comm.p2p import Messenger

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", int(__import__("os").environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60))
    group = new_group([0, 1], name="crossing", timeout_s=30.0, store=store, me=rank, device=device)
    m = Messenger(group=group, timeout_s=30.0)
    big = 8 << 20  # 32 MB of fp32: past NCCL's eager buffers, a send waits for its receive
    out: dict = {"backend": group.backend, "matching": group.matching}
    if rank == 0:
        m.send([torch.full((big,), 0.0, device=device)], 1, 0, "act")
        got = m.recv(1, 0, "grad")  # learn the gradient channel's shape (first message)
        m.send([torch.full((big,), 1.0, device=device)], 1, 0, "act")
        posted = m.post(1, 0, "grad")  # early post: gradient 1 before activation 2 is sent
        m.send([torch.full((big,), 2.0, device=device)], 1, 0, "act")
        g1 = m.recv(1, 0, "grad", posted=posted)
        out["grads"] = [float(got[0][0]), float(g1[0][0])]
    else:
        a0 = m.recv(0, 0, "act")
        m.send([torch.full((big,), 10.0, device=device)], 0, 0, "grad")
        a1 = m.recv(0, 0, "act")
        m.send([torch.full((big,), 11.0, device=device)], 0, 0, "grad")
        a2 = m.recv(0, 0, "act")
        out["acts"] = [float(a0[0][0]), float(a1[0][0]), float(a2[0][0])]
    m.wait_sends()
    torch.cuda.synchronize()
    # abort: rank 1 waits for a message rank 0 never sends; a watcher aborts the group after 1 s
    if rank == 1:
        buf = torch.empty(4, device=device)
        work = group.irecv(buf, 0, 0)
        threading.Timer(1.0, group.poison).start()
        t0 = time.monotonic()
        try:
            group.wait(work, "never sent", timeout_s=20.0)
            out["released"] = None
        except CommError as exc:
            out["released"] = time.monotonic() - t0
            out["error"] = str(exc)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])
    return out
