"""The device-generic comm layer on CPU: what NCCL groups do differently (bounded polling waits,
abort as poison, staging of tensors on another device, FIFO matching), checked with a stand-in
backend; and which errors end a process instead of prompting recovery. The real NCCL paths run in
the multigpu tests (skipped without GPUs)."""

from __future__ import annotations

import time

import pytest
import torch

from ds_resilience.comm.groups import CommError, Group, new_group
from ds_resilience.runtime.recovery import is_failure, is_fatal


class FakeWork:
    def __init__(self, done_after_s: float = 0.0, error: str | None = None, on_wait=None) -> None:
        self.t = time.monotonic() + done_after_s
        self.error, self.on_wait, self.waited = error, on_wait, False

    def is_completed(self) -> bool:
        return time.monotonic() >= self.t

    def wait(self, timeout=None) -> bool:
        self.waited = True
        if self.error:
            raise RuntimeError(self.error)
        if self.on_wait:
            self.on_wait()
        return True


class FakeNccl:
    """Records what the Group asks of an NCCL backend."""

    dsr_device = "cpu"  # a stand-in device: staging is exercised with a meta tensor below

    def __init__(self) -> None:
        self.calls, self.aborted = [], False

    def send(self, tensors, dst, tag):
        self.calls.append(("send", dst, tag, tensors[0]))
        return FakeWork()

    def recv(self, tensors, src, tag):
        self.calls.append(("recv", src, tag, tensors[0]))
        return FakeWork(on_wait=lambda: tensors[0].fill_(7))

    def allreduce(self, tensors):
        self.calls.append(("allreduce", tensors[0]))
        return FakeWork(on_wait=lambda: tensors[0].mul_(2))

    def abort(self):
        self.aborted = True


def test_nccl_groups_ignore_tags_poll_their_waits_and_abort_as_poison():
    pg = FakeNccl()
    g = Group(pg, [3, 5], 0.2, 3, "fake", backend="nccl")
    assert g.matching == "fifo"
    g.isend(torch.ones(2), 5, tag=99)
    assert pg.calls[-1][:3] == ("send", 1, 0)  # peer by group rank; the tag is not NCCL's business
    g.wait(FakeWork(done_after_s=0.01), "quick")
    t0 = time.monotonic()
    with pytest.raises(CommError, match=r"fake: stuck receive: not completed within 0s"):
        g.wait(FakeWork(done_after_s=60), "stuck receive", timeout_s=0.05)
    assert time.monotonic() - t0 < 5  # bounded by the deadline, not by the peer
    with pytest.raises(CommError, match="aborted"):
        g.wait(FakeWork(error="NCCL communicator was aborted"), "aborted one")
    g.poison()
    assert pg.aborted


def test_tensors_on_another_device_are_staged_and_copied_back():
    pg = FakeNccl()
    g = Group(pg, [0, 1], 1.0, 0, "fake", backend="nccl")
    g.device = torch.device("meta")  # stand-in for the GPU: anything not the CPU is staged
    # all_reduce of a CPU tensor: the backend sees a tensor on the group's device
    with pytest.raises((NotImplementedError, RuntimeError)):
        g.all_reduce(torch.ones(3))  # a meta tensor cannot be copied back; the staging was attempted
    assert pg.calls[-1][0] == "allreduce" and pg.calls[-1][1].device.type == "meta"


def test_gloo_groups_keep_the_cpu_path():
    pg = FakeNccl()
    g = Group(pg, [0, 1], 1.0, 0, "fake")  # backend gloo: tags kept (unless DSR_P2P_MATCHING says fifo)
    assert g.device == torch.device("cpu") and g.backend == "gloo"
    t = torch.ones(2)
    g.all_reduce(t)
    assert pg.calls[-1][1] is t  # no staging, no copy
    assert torch.equal(t, torch.full((2,), 2.0))


def test_a_cuda_group_without_nccl_is_a_clear_error(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)

    with pytest.raises(CommError, match=r"group g: the engine's device is cuda:1 but this torch has no NCCL backend"):
        new_group([0, 1], name="g", timeout_s=1.0, store=dist.HashStore(), me=0, device="cuda:1")


def test_sticky_cuda_errors_end_the_process_instead_of_prompting_recovery():
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert is_fatal(sticky) and not is_failure(sticky)
    assert is_fatal(RuntimeError("CUDA error: device-side assert triggered"))
    transient = RuntimeError("Connection closed by peer")
    assert not is_fatal(transient) and is_failure(transient)
    assert is_failure(CommError("timeout"))


def test_fifo_headers_go_through_the_store_so_a_receive_can_be_posted_before_the_first_message():
    """Under NCCL's matching the channel header is not on the pair's stream: the sender puts it in
    the group's store, the receiver can post (allocate and irecv) as soon as it is there."""
    import torch.distributed as dist

    from ds_resilience.comm.p2p import Messenger

    store = dist.HashStore()
    pg = FakeNccl()
    sender = Group(pg, [0, 1], 1.0, 0, "pair", matching="fifo")
    receiver = Group(pg, [0, 1], 1.0, 1, "pair", matching="fifo")
    sender.meta_store = receiver.meta_store = store
    m_recv = Messenger(group=receiver, timeout_s=1.0)
    assert m_recv.post(0, 5, "act0") is None  # nothing published yet: post at the wait
    Messenger(group=sender, timeout_s=1.0).send([torch.ones(3, 4)], 1, 5, "act0")
    assert [c[0] for c in pg.calls] == ["send"]  # the payload only: no header frame
    posted = m_recv.post(0, 6, "act0")
    assert posted is not None and pg.calls[-1][0] == "recv" and pg.calls[-1][3].shape == (3, 4)
    got = m_recv.recv(0, 6, "act0", posted=posted)
    assert torch.equal(got[0], torch.full((3, 4), 7.0))  # what the fake backend delivered
    receiver.poison()
    with pytest.raises(CommError, match="released while waiting for the header"):
        m_recv.recv(0, 7, "grad1")
