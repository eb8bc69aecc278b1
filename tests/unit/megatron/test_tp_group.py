"""megatron/tp_group.py: a renewed tensor-parallel group replaces the old one wherever megatron-core
keeps it (the live renewal itself runs in tests/live/test_megatron_example.py's TP=2 tests)."""

from __future__ import annotations

import types

import torch

from ds_resilience.megatron.tp_group import swap_group


def test_every_reference_to_the_old_group_is_replaced_and_nothing_else():
    old, new, other = object(), object(), object()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tp_group = old
            self.dp_group = other
            self.pg_collection = types.SimpleNamespace(tp=old, pp=other)  # a collection of groups, one level down
            self.inner = torch.nn.Linear(2, 2)
            self.inner.tp_group = old

    model = torch.nn.Sequential(Layer(), Layer())
    state = types.SimpleNamespace(_TENSOR_MODEL_PARALLEL_GROUP=old, _MODEL_PARALLEL_GROUP=other)
    assert swap_group(model, [state], old, new) == 7  # 2 x (layer, its collection, its linear) + the global
    for layer in model:
        assert layer.tp_group is new and layer.inner.tp_group is new and layer.pg_collection.tp is new
        assert layer.dp_group is other and layer.pg_collection.pp is other
    assert state._TENSOR_MODEL_PARALLEL_GROUP is new and state._MODEL_PARALLEL_GROUP is other


def test_the_group_is_poisoned_once_per_interrupting_epoch_and_never_after_its_renewal():
    from ds_resilience.epochs import EpochRecord
    from ds_resilience.megatron.tp_group import TensorParallelGroup

    class Pg:
        def __init__(self):
            self.recvs = []

        def recv(self, tensors, peer, tag):
            self.recvs.append(peer)
            return types.SimpleNamespace(wait=lambda timeout: (_ for _ in ()).throw(RuntimeError("timed out")))

    tp = TensorParallelGroup.__new__(TensorParallelGroup)
    tp.ranks, tp.me, tp.backend, tp.current = (4, 5), 5, "gloo", Pg()
    tp.poisoned, tp.epoch, tp._lock = False, 0, __import__("threading").Lock()
    crash = EpochRecord(epoch=2, failed=(3,), alive=(0, 1, 2, 4, 5), kind="crash")
    tp.release(EpochRecord(epoch=2, failed=(), alive=(0, 1, 2, 3, 4, 5), joining=(3,), kind="rejoin"))
    assert tp.current.recvs == [] and not tp.poisoned  # a re-join interrupts nothing
    tp.release(crash)
    assert tp.current.recvs == [0] and tp.poisoned  # the pair to the partner (group rank 0) is closed
    tp.current, tp.poisoned, tp.epoch = Pg(), False, 2  # renewed for epoch 2 by the main thread
    tp.release(crash)  # the watcher, starved, comes late with the same record: the new group stays
    assert tp.current.recvs == [] and not tp.poisoned
