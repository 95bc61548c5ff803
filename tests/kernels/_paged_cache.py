"""A random paged KV cache in vLLM's layout, shared by the paged tree-attention tests."""

import torch


def random_paged_cache(seq_lens, page, num_kv_heads, head_size, dtype, gen):
    """``(block_table, key_cache, value_cache)`` for sequences of ``seq_lens`` keys.

    Blocks are handed out in a random order (three spare blocks) so that a kernel reading the wrong block,
    or reading blocks in order instead of through the table, fails.
    """
    max_blocks = max((s + page - 1) // page for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).to(torch.int32)
    key_cache = torch.randn(num_blocks, page, num_kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, page, num_kv_heads, head_size, generator=gen).to(dtype)
    return block_table, key_cache, value_cache
