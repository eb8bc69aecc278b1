"""Worker programs of the state-transport tests (module level: pickled by reference).

Rank 0 plays the sender (honest or rogue), rank 1 the receiver; both use the one transport of
``ds_resilience.comm.transport`` over a two-rank group on the default store.
"""

from __future__ import annotations

import os
import pickle
import time

import torch
import torch.distributed as dist

from ds_resilience.checkpoint.handover import recv_state, send_state
from ds_resilience.checkpoint.state import StageState, capture
from ds_resilience.checkpoint.store import CheckpointCorrupt, SnapshotStore
from ds_resilience.comm.groups import CommError, new_group
from ds_resilience.comm.transport import TransportError, recv_header, recv_payload, send_message

TAG = 5


def _init(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)


class _Boom:
    """Unpickling this object runs ``os.system(command)``: what a rogue peer would send."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def malicious_pickle(sentinel: str) -> bytes:
    return pickle.dumps(_Boom(f"touch {sentinel}"))


class _Host:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        self.parameters = list(self.model.parameters())
        self.optimizer = torch.optim.Adam(self.parameters, lr=1e-2)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.steps, self.samples = 0, 0

    def train(self, n: int) -> None:
        for _ in range(n):
            self.model(torch.randn(4, 6)).pow(2).sum().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.lr_scheduler.step()
            self.steps += 1
            self.samples += 4

    def counters(self):
        return self.steps, self.samples

    def set_counters(self, steps, samples):
        self.steps, self.samples = steps, samples


def handover(rank: int, world: int) -> dict:
    """Rank 0 trains 3 steps and hands its state to rank 1 (another init): bitwise equal after."""
    _init(rank, world)
    group = new_group([0, 1], name="handover", timeout_s=30)
    host = _Host(seed=rank)
    if rank == 0:
        host.train(3)
        send_state(group, 1, capture(host, stage=0, rank=0))
        state = capture(host, stage=0, rank=0)
    else:
        state = recv_state(group, 0)
        from ds_resilience.checkpoint.state import apply

        apply(state, host, stage=0)
    params = [p.detach().clone() for p in host.parameters]
    opt = host.optimizer.state_dict()
    dist.barrier()
    return {"params": params, "exp_avg": [opt["state"][i]["exp_avg"].clone() for i in sorted(opt["state"])],
            "lr": host.optimizer.param_groups[0]["lr"], "steps": host.counters(), "state_steps": state.steps}


def rogue_sender(rank: int, world: int, sentinel: str, store_dir: str) -> dict:
    """Rank 0 sends, one after the other: (a) a frame whose header is a pickle; (b) a JSON header
    whose layout is a pickle, with a payload; (c) a stage state whose layout is a pickle; (d) an
    honest snapshot with a wrong checksum; (e) an honest one. Rank 1 must refuse (a)-(d) without
    running anything and keep the stream in step to accept (e)."""
    _init(rank, world)
    group = new_group([0, 1], name="rogue", timeout_s=30)
    bomb = malicious_pickle(sentinel)
    out: dict = {}
    if rank == 0:
        raw = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
        group.wait(group.isend(torch.tensor([0x44535254, 1, raw.numel(), 0], dtype=torch.int64), 1, TAG), "frame")
        group.wait(group.isend(raw, 1, TAG), "pickle header")
        payload = torch.arange(64, dtype=torch.uint8)
        send_message(group, 1, tag=TAG + 1, fields={"owner": "w0", "step": 3, "layout": bomb.decode("latin-1")},
                     payload=payload, checksum=0)
        send_message(group, 1, tag=TAG + 2, fields={"what": "stage_state", "steps": 0, "layout": bomb.decode("latin-1")},
                     payload=payload, checksum=0)
        src = SnapshotStore(os.path.join(store_dir, "src"))
        src.save("w0", 4, {"x": torch.arange(100, dtype=torch.float32)})
        info, layout, data = src.open_version("w0", 4)
        send_message(group, 1, tag=TAG + 1, fields={"owner": "w0", "step": 4, "layout": layout.decode()},
                     payload=data, checksum=info.checksum ^ 1)
        send_message(group, 1, tag=TAG + 1, fields={"owner": "w0", "step": 5, "layout": layout.decode()},
                     payload=data, checksum=info.checksum)
    else:
        dst = SnapshotStore(os.path.join(store_dir, "dst"))
        try:
            recv_header(group, 0, tag=TAG)
            out["a"] = "accepted"
        except TransportError as exc:
            out["a"] = str(exc)
        results = []
        for _ in range(3):  # (b), (d), (e) on the snapshot stream
            m = recv_header(group, 0, tag=TAG + 1)

            def fill(buf, m=m):
                recv_payload(group, m, buf, tag=TAG + 1, verify=False)

            try:
                dst.receive("w0", m.fields["step"], m.nbytes, m.fields["layout"].encode("latin-1"), m.checksum, fill)
                results.append("committed")
            except CheckpointCorrupt as exc:
                results.append(f"refused: {exc}")
            if len(results) == 1:  # (c) sits on its own stream between (b) and (d)
                try:
                    recv_state(group, 0, tag=TAG + 2)
                    out["c"] = "accepted"
                except TransportError as exc:
                    out["c"] = str(exc)
        out["b"], out["d"], out["e"] = results
        out["held"] = dst.holdings()
        out["e_value"] = dst.load("w0", 5)["x"].tolist()
        time.sleep(0.2)
        out["sentinel_exists"] = os.path.exists(sentinel)
    dist.barrier()
    return out


def silent_peer(rank: int, world: int) -> dict:
    """Rank 1 waits for a message rank 0 never sends: the wait ends at its timeout with a CommError
    that names what it waited for."""
    _init(rank, world)
    group = new_group([0, 1], name="silent", timeout_s=30)
    out: dict = {}
    if rank == 1:
        t0 = time.monotonic()
        try:
            recv_header(group, 0, tag=TAG, timeout_s=1.0)
            out["error"] = None
        except CommError as exc:
            out["error"] = str(exc)
        out["waited_s"] = time.monotonic() - t0
    dist.barrier()
    return out


def json_collectives(rank: int, world: int) -> dict:
    _init(rank, world)
    group = new_group(list(range(world)), name="json", timeout_s=30)
    gathered = group.all_gather_json({"rank": rank, "steps": [rank] * rank, "name": "é" * rank})
    told = group.broadcast_json({"from": 2, "x": [1.5, None]} if rank == 2 else None, src=2)
    dist.barrier()
    return {"gathered": gathered, "told": told}
