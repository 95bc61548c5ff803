"""Moving accepted tree nodes' K/V into consecutive slots of vLLM's paged cache.

After verification, node ``a_i`` of the accepted path ``[0, a_1, ..., a_m]``
must sit at the slot of position ``start + i``; vLLM's scheduler then commits
exactly ``m + 1`` tokens (``num_computed_tokens -= num_rejected``) and later
steps overwrite the rest. The Rust core's move plan lists ``(a_i, i)`` for
``a_i != i``; ``a_i >= i`` and all sources are read before any write, so the
plan is safe in one gather/scatter.

Torch only (no vLLM import).
"""

from __future__ import annotations

import torch


def apply_kv_moves_paged(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copies K and V of ``src_slots`` onto ``dst_slots`` in place.

    ``kv_cache`` is one layer's ``[num_blocks, 2, block_size, num_kv_heads,
    head_size]`` tensor (any stride order: indexing is logical); slots are
    ``block * block_size + offset`` as in vLLM's slot mapping.
    """
    if src_slots.numel() == 0:
        return
    block_size = kv_cache.shape[2]
    src_slots = src_slots.to(torch.int64)
    dst_slots = dst_slots.to(torch.int64)
    src_block, src_off = src_slots // block_size, src_slots % block_size
    dst_block, dst_off = dst_slots // block_size, dst_slots % block_size
    # Advanced indexing on dims 0 and 2 gathers [M, 2, H, D] before the scatter.
    kv_cache[dst_block, :, dst_off] = kv_cache[src_block, :, src_off]
