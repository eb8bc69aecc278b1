"""A core-attention submodule for megatron-core layer specs that also runs off CUDA.

megatron-core's local ``DotProductAttention`` takes its score buffer from
``parallel_state.get_global_memory_buffer()`` (allocated on ``torch.cuda.current_device()``) and
draws its attention dropout inside ``tensor_parallel.get_cuda_rng_tracker().fork()`` (CUDA RNG
states). :class:`DeviceSafeDotProductAttention` is that class: on CUDA tensors it *is* megatron-core's
forward (the production path is unchanged); on any other device it runs the same math with a
buffer on the tensors' device and the dropout drawn from the ambient generator (which the
resilient schedule seeds per micro-batch, so a re-routed micro-batch draws the same mask).

:func:`device_safe_layer_spec` swaps it into a layer spec (``get_gpt_layer_local_spec()``), which
is how megatron-core's spec system means submodules to be replaced.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["DeviceSafeDotProductAttention", "device_safe_layer_spec"]


class DeviceSafeDotProductAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention``, with a path for tensors that are not on CUDA."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if query.is_cuda:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need TEDotProductAttention")
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads // groups > 1:  # grouped-query attention: repeat keys and values per query head
            key = key.repeat_interleave(heads // groups, dim=2)
            value = value.repeat_interleave(heads // groups, dim=2)
        b, np_, sq, sk = query.size(1), query.size(2), query.size(0), key.size(0)
        q = query.reshape(sq, b * np_, -1)
        k = key.reshape(sk, b * np_, -1)
        scores = torch.baddbmm(torch.empty(b * np_, sq, sk, dtype=query.dtype, device=query.device),
                               q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2), beta=0.0,
                               alpha=self.softmax_scale).view(b, np_, sq, sk)
        probs = self.scale_mask_softmax(scores, attention_mask, self.softmax_offset)
        probs = self.attention_dropout(probs)
        v = value.reshape(sk, b * np_, -1)
        context = torch.bmm(probs.view(b * np_, sq, -1), v.transpose(0, 1)).view(b, np_, sq, -1)
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.size()[:-2], self.hidden_size_per_partition)


def device_safe_layer_spec(spec: Any) -> Any:
    """A copy of a transformer layer spec whose self-attention's core attention is
    :class:`DeviceSafeDotProductAttention` (anything else is left as it is)."""
    spec = copy.deepcopy(spec)
    attention = getattr(getattr(spec, "submodules", None), "self_attention", None)
    inner = getattr(attention, "submodules", None)
    if inner is None or not hasattr(inner, "core_attention"):
        raise ValueError("the layer spec has no self_attention.submodules.core_attention to replace")
    if inner.core_attention is DotProductAttention:
        inner.core_attention = DeviceSafeDotProductAttention
    return spec
