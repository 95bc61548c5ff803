"""Paged tree attention: vLLM's KV-cache layout, one launch for a mixed batch.

Every sequence of the batch is either *plain* (causal over its own keys:
prefills, chunked prefills, decodes without a tree) or a *tree* (its queries
are a draft tree's nodes: each attends to the whole committed prefix and to
its own ancestors-or-self). Different requests carry different trees.

The keys of a sequence are read from the paged cache, where vLLM has already
written this step's K/V (node j of a tree at the slot of flat position
``context_len + j``). A key at index ``k`` of sequence ``s`` is visible to its
query ``q`` (index within the step's queries) when::

    k <= context_len + q                                   (causal), and
    tree(s) is None or k < context_len or bit(q, k - context_len)

with ``bit(i, j)`` bit ``j % 32`` of word ``j // 32`` of row
``row_start[s] + i`` of ``ancestor_bits`` (the Rust core's
``CompiledBatch.ancestor_bits``). Nodes are in pop order (parents first), so
ancestors always precede and the causal bound never hides one.

Layout (vLLM's Triton/FlashAttention backends): ``key_cache`` and
``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]``
views (``kv_cache.unbind(1)`` of ``[num_blocks, 2, block_size, H, D]``).

:func:`paged_tree_attention_reference` is the torch oracle;
:func:`paged_tree_attention` the Triton kernel (runs on CPU under
``TRITON_INTERPRET=1``, set before import); :func:`apply_kv_moves_paged`
commits an accepted path's K/V in the same cache layout. No vLLM import: the
vLLM adapter (``ddtree.vllm.attention``) calls these.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def _bit_visible(ancestor_bits: torch.Tensor, row: int, j: torch.Tensor) -> torch.Tensor:
    words = ancestor_bits[row].to(torch.int64) & 0xFFFFFFFF
    word = words[j // 32]
    return ((word >> (j % 32)) & 1).bool()


def paged_tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    row_start: torch.Tensor,
    ancestor_bits: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Torch reference: ``[num_tokens, num_heads, head_size]`` in ``query.dtype``."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    for s in range(len(qsl) - 1):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        seq_len = int(seq_lens[s])
        ctx = seq_len - q_len
        kpos = torch.arange(seq_len)
        blocks = block_table[s, kpos // block_size].long()
        offs = kpos % block_size
        keys = key_cache[blocks, offs].float().repeat_interleave(group, dim=1)  # [S, H, D]
        values = value_cache[blocks, offs].float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        visible = kpos[None, :] <= (ctx + torch.arange(q_len))[:, None]
        start = int(row_start[s])
        if start >= 0:
            assert ancestor_bits is not None
            j = (kpos - ctx).clamp(min=0)
            in_tree = kpos >= ctx
            for i in range(q_len):
                bits = _bit_visible(ancestor_bits, start + i, j)
                visible[i] &= ~in_tree | bits
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
    return out


try:  # Triton is optional for the CPU parts of the adapter.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _paged_tree_attention_kernel(
        out_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        query_start_ptr,
        seq_lens_ptr,
        row_start_ptr,
        bits_ptr,
        scale,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_k_blk,
        stride_k_slot,
        stride_k_head,
        stride_v_blk,
        stride_v_slot,
        stride_v_head,
        stride_bt,
        stride_bits,
        NUM_HEADS: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TILE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)

        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        if q_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        row0 = tl.load(row_start_ptr + seq)
        is_tree = row0 >= 0

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_t = tl.arange(0, TILE)
        q_local = offs_m // QUERIES_PER_KV
        q_pos = q_block * BLOCK_Q + q_local
        head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
        row_ok = (q_local < BLOCK_Q) & (q_pos < q_len) & (head < NUM_HEADS)
        d_ok = offs_d < HEAD_SIZE

        q_off = (q_begin + q_pos).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

        # Keys past the block's last query are masked for every row.
        kv_end = tl.minimum(seq_len, ctx + (q_block + 1) * BLOCK_Q)
        bits_row = (row0 + q_pos).to(tl.int64) * stride_bits
        for start in range(0, kv_end, TILE):
            k_pos = start + offs_t
            k_ok = k_pos < kv_end
            blk = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
            slot = k_pos % PAGE
            k_off = blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None]
            k = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE]
            s = tl.dot(q, k.to(q.dtype)) * scale  # [BLOCK_M, TILE]

            visible = k_pos[None, :] <= (ctx + q_pos)[:, None]
            tree_j = k_pos - ctx
            in_tree = tree_j >= 0
            bit_mask = row_ok[:, None] & (in_tree & k_ok)[None, :] & is_tree
            word = tl.load(
                bits_ptr + bits_row[:, None] + (tl.maximum(tree_j, 0) // 32)[None, :],
                mask=bit_mask,
                other=0,
            )
            bit = (word >> (tl.maximum(tree_j, 0) % 32)[None, :]) & 1
            visible = visible & ((~is_tree) | (~in_tree)[None, :] | (bit != 0))
            visible = visible & row_ok[:, None] & k_ok[None, :]
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]

            v_off = blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :]
            v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, HEAD_PAD]
            acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        acc = acc / l_safe[:, None]
        o_off = (q_begin + q_pos).to(tl.int64)[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def paged_tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    row_start: torch.Tensor,
    ancestor_bits: Optional[torch.Tensor],
    scale: float,
    max_query_len: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton paged tree attention. Arguments as the reference, plus ``max_query_len``.

    ``ancestor_bits`` is ``[T, words]`` int32 (uint32 bit patterns); ``row_start``
    ``[num_seqs]`` int32 with -1 for plain causal sequences.
    """
    if triton is None:
        raise RuntimeError("paged_tree_attention needs triton")
    num_tokens, num_heads, head_size = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("the head dimension of query, key_cache and value_cache must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else _next_pow2(group)
    block_q = max(1, block_m // group)
    head_pad = max(16, _next_pow2(head_size))
    tile = 32 if head_pad <= 128 else 16
    if ancestor_bits is None or ancestor_bits.numel() == 0:
        ancestor_bits = torch.zeros((1, 1), dtype=torch.int32, device=query.device)
    grid = (num_seqs, triton.cdiv(max(1, max_query_len), block_q), num_kv_heads)
    _paged_tree_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        row_start,
        ancestor_bits,
        float(scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        ancestor_bits.stride(0),
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE=tile,
    )
    return out


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)

# --------------------------------------------------------------- KV commit
# After verification, node ``a_i`` of the accepted path ``[0, a_1, ..., a_m]``
# must sit at the slot of position ``start + i``; vLLM's scheduler then commits
# exactly ``m + 1`` tokens (``num_computed_tokens -= num_rejected``) and later
# steps overwrite the rest. The Rust core's move plan lists ``(a_i, i)`` for
# ``a_i != i``; ``a_i >= i`` and all sources are read before any write, so the
# plan is safe in one gather/scatter.


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
