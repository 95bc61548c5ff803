"""Paged tree attention, the torch oracle: vLLM's KV-cache layout, every sequence of a mixed batch.

Every sequence of the batch is either *plain* (causal over its own keys: prefills, chunked prefills, decodes
without a tree) or a *tree* (its queries are a draft tree's nodes: each attends to the whole committed prefix and
to its own ancestors-or-self). Different requests carry different trees.

The keys of a sequence are read from the paged cache, where vLLM has already written this step's K/V (node j of a
tree at the slot of flat position ``context_len + j``). A key at index ``k`` of sequence ``s`` is visible to its
query ``q`` (index within the step's queries) when::

    k <= context_len + q                                   (causal), and
    tree(s) is None or k < context_len or bit(q, k - context_len)

with ``bit(i, j)`` bit ``j % 32`` of word ``j // 32`` of row ``row_start[s] + i`` of ``ancestor_bits`` (the Rust
core's ``CompiledBatch.ancestor_bits``). Nodes are in pop order (parents first), so ancestors always precede and
the causal bound never hides one.

Layout (vLLM's Triton/FlashAttention backends): ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_size]`` views (``kv_cache.unbind(1)`` of ``[num_blocks, 2, block_size, H, D]``).

:func:`paged_tree_attention_reference` is the oracle of the Triton kernel in :mod:`.paged_attention_triton`.
"""

from __future__ import annotations

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
        kpos = torch.arange(seq_len, device=query.device)
        blocks = block_table[s, kpos // block_size].long()
        offs = kpos % block_size
        keys = key_cache[blocks, offs].float().repeat_interleave(group, dim=1)  # [S, H, D]
        values = value_cache[blocks, offs].float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        visible = kpos[None, :] <= (ctx + torch.arange(q_len, device=query.device))[:, None]
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
