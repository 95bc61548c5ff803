"""DDTree's model runner: the parts that need no GPU."""

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")


def test_drafting_continues_near_max_model_len_while_the_drafters_depth_fits():
    """vLLM skips the drafter for the whole batch when a request's ``seq_len + num_speculative_tokens + 1``
    passes max_model_len; for ddtree that count is the budget, so requests within budget + 1 tokens of the end
    verified no tree. The drafter queries depth + 1 positions: it drafts while those fit."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=None)
    runner.effective_drafter_max_model_len = 1024
    fits = runner._input_fits_in_drafter
    assert fits(SimpleNamespace(max_seq_len=1024 - 16)) is True  # 16 queries end exactly at max_model_len
    assert fits(SimpleNamespace(max_seq_len=1024 - 15)) is False
    assert fits(SimpleNamespace(max_seq_len=1024 - 40)) is True  # vLLM's own rule (budget 64) said no here
    assert fits(None) is False


def test_kv_moves_share_one_index_across_the_layers_of_a_group():
    """The runner moves the accepted nodes' K/V in every target attention layer with one block/offset index
    per KV-cache group; each layer ends as a move of its own would leave it."""
    from ddtree.kernels.kv_moves import apply_kv_moves_paged
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(6, 2, 4, 2, 8, generator=gen) for _ in range(3)]  # [blocks, K/V, page, heads, dim]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([17, 18, 19, 20, 21, 22, 23, 4, 5])  # flat scheduled token -> slot
    src, dst = torch.tensor([3, 6]), torch.tensor([1, 2])  # accepted nodes 3 and 6 to positions 1 and 2
    for c in expected:
        apply_kv_moves_paged(c, mapping[src], mapping[dst])
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_kv_layers = [(0, caches[0]), (0, caches[1]), (1, caches[2])]
    table = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=mapping))
    runner.input_batch = SimpleNamespace(block_table=[table, table])
    runner._ddtree_move_kv(src, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    assert not torch.equal(caches[0], caches[1])  # the layers really differ
