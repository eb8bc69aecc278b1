"""A restart's workers meet under their attempt's prefix of the agent's store (runtime/attempt_scope.py,
membership.attempt_view): torch's env:// rendezvous and ds_resilience's own keys alike."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401

from ds_resilience import store_keys as keys
from ds_resilience.runtime.attempt_scope import restart_of, scope_rendezvous
from ds_resilience.runtime.membership import attempt_view
from ds_resilience.runtime.rejoin_boot import needs_boot

RDZV = sys.modules["torch.distributed.rendezvous"]


def _env(port: int, restart: str) -> dict[str, str]:
    return {"DSR_AGENT": "1", "DSR_RESTART": restart, "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0",
            "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_restart_of_reads_the_attempt_only_under_the_agent():
    assert restart_of({"DSR_AGENT": "1", "DSR_RESTART": "2"}) == 2
    assert restart_of({"DSR_AGENT": "1"}) == 0
    assert restart_of({"DSR_RESTART": "2"}) == 0  # not launched by the agent
    assert needs_boot({"DSR_AGENT": "1", "DSR_RESTART": "1"}) and needs_boot({"DSR_REJOIN": "1"})
    assert not needs_boot({"DSR_AGENT": "1", "DSR_RESTART": "0", "DSR_REJOIN": "0"})


def test_attempt_prefix_is_for_restarts_only():
    assert keys.attempt_prefix(3) == "dsr/attempt/3"
    with pytest.raises(ValueError, match="attempt 0 has no prefix"):
        keys.attempt_prefix(0)


def test_a_restarts_rendezvous_and_keys_live_under_its_prefix(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setattr(RDZV, "_create_c10d_store", RDZV._create_c10d_store)  # restored after the test
    for name, value in _env(server.port, "0").items():
        monkeypatch.setenv(name, value)
    assert not scope_rendezvous()  # the first attempt writes at the root
    store, _, _ = next(dist.rendezvous("env://"))
    store.set("k", "first")
    monkeypatch.setenv("DSR_RESTART", "2")
    assert scope_rendezvous() and scope_rendezvous()  # idempotent: one prefix, not two
    store, rank, world = next(dist.rendezvous("env://"))
    assert (rank, world) == (0, 1)
    assert not store.check(["k"])  # the first attempt's keys are not seen
    store.set("k", "second")
    assert server.get("k") == b"first" and server.get("dsr/attempt/2/k") == b"second"
    # ds_resilience's own keys, through the view every worker and agent of the attempt uses
    assert attempt_view(server, 0) is server
    attempt_view(server, 2).set(keys.LATEST_EPOCH, "7")
    assert server.get(f"dsr/attempt/2/{keys.LATEST_EPOCH}") == b"7" and not server.check([keys.LATEST_EPOCH])
