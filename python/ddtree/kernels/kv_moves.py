"""KV commit after a tree verification: the accepted path's K/V moved to consecutive slots.

After verification, node ``a_i`` of the accepted path ``[0, a_1, ..., a_m]`` must sit at the slot of position
``start + i``; the engine then commits exactly ``m + 1`` tokens and later steps overwrite the rest. The Rust core's
move plan lists ``(a_i, i)`` for ``a_i != i``; ``a_i >= i`` and all sources are read before any write, so the plan
is safe in one gather/scatter. Two cache layouts: a flat slot-major cache (:func:`kv_compaction_plan`,
:func:`apply_kv_moves`, the transformers reference engine) and vLLM's paged cache (:func:`apply_kv_moves_paged`,
:func:`kv_move_index`, :func:`apply_kv_moves_indexed`).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .topology import IndexLike, as_index_tensor, validate_accepted_path, validate_parents


def kv_compaction_plan(
    accepted_path: IndexLike, node_slots: IndexLike, parents: IndexLike
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Moves ``(src, dst)`` that put the accepted path's K/V at consecutive positions.

    Args:
        accepted_path: ``[0, a1, ..., am]``.
        node_slots: ``[N]`` cache slot each tree node's K/V was written to;
            node ``i`` was written at position ``P + i`` so ``node_slots[j]``
            is also the slot of position ``P + j`` (works for paged caches).
        parents: ``[N]``, to check the path.

    Returns:
        ``src, dst`` int64 ``[M]`` with ``M <= m``: accepted node ``a_j`` moves
        from ``node_slots[a_j]`` to ``node_slots[j]``; no-op moves are dropped.
        A move may read a slot a later move writes (path ``[0, 2, ...]``:
        ``2 -> 1`` then ``a_2 -> 2``), so all reads must happen before any
        write -- or moves must run in ascending order, since ``a_j >= j``
        means a slot is only overwritten after it has been read.
    """
    parents = validate_parents(parents)
    path = validate_accepted_path(accepted_path, parents)
    slots = as_index_tensor(node_slots, "node_slots")
    if slots.numel() != parents.numel():
        raise ValueError(f"node_slots must have shape [N] = [{parents.numel()}], got {list(slots.shape)}")
    src = slots[path]
    dst = slots[: path.numel()]
    moved = src != dst
    return src[moved], dst[moved]


def apply_kv_moves(cache: torch.Tensor, src: IndexLike, dst: IndexLike) -> torch.Tensor:
    """Apply a move plan in place on a flat slot-major cache ``[num_slots, ...]`` and return it.

    Gathers every source first, then scatters, so overlapping plans are safe.
    """
    src = as_index_tensor(src, "src", device=cache.device)
    dst = as_index_tensor(dst, "dst", device=cache.device)
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must both have shape [M], got {list(src.shape)} and {list(dst.shape)}")
    if src.numel() == 0:
        return cache
    if int(torch.cat([src, dst]).min()) < 0 or int(torch.cat([src, dst]).max()) >= cache.shape[0]:
        raise ValueError(
            f"src and dst must be slot indices in [0, {cache.shape[0]}), got src={src.tolist()} dst={dst.tolist()}"
        )
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"dst must not repeat a slot, got {dst.tolist()}")
    cache[dst] = cache[src]  # advanced indexing copies the sources before the scatter
    return cache


def apply_kv_moves_paged(kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copies K and V of ``src_slots`` onto ``dst_slots`` in place.

    ``kv_cache`` is one layer's ``[num_blocks, 2, block_size, num_kv_heads,
    head_size]`` tensor (vLLM 0.25) or ``[num_blocks, num_kv_heads,
    block_size, 2 * head_size]`` (0.33): in both a token's K and V are
    ``kv_cache[block, :, offset]`` (any stride order: indexing is logical);
    slots are ``block * block_size + offset`` as in vLLM's slot mapping.
    """
    if src_slots.numel() == 0:
        return
    apply_kv_moves_indexed(kv_cache, kv_move_index(src_slots, dst_slots, kv_cache.shape[2]))


def kv_move_index(src_slots: torch.Tensor, dst_slots: torch.Tensor, block_size: int) -> tuple:
    """``(src_block, src_offset, dst_block, dst_offset)`` of a move plan, computed once for every layer that
    shares the slot mapping and block size (a step moves the same slots in each attention layer)."""
    src_slots = src_slots.to(torch.int64)
    dst_slots = dst_slots.to(torch.int64)
    return src_slots // block_size, src_slots % block_size, dst_slots // block_size, dst_slots % block_size


def apply_kv_moves_indexed(kv_cache: torch.Tensor, index: tuple) -> None:
    """:func:`apply_kv_moves_paged` with the block/offset index of :func:`kv_move_index`: one gather and one
    scatter."""
    src_block, src_off, dst_block, dst_off = index
    # Advanced indexing on dims 0 and 2 gathers [M, 2, H, D] (0.33: [M, H, 2D]) before the scatter.
    kv_cache[dst_block, :, dst_off] = kv_cache[src_block, :, src_off]
