"""Attention-layer tree verification and KV compaction."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from _gdn_testing import random_parents, tree_parents
from ddtree.kernels.attention_reference import (
    tree_attention,
    tree_attention_batched,
    tree_attention_mask,
    tree_positions,
)
from ddtree.kernels.kv_moves import apply_kv_moves, kv_compaction_plan
from ddtree.kernels.topology import root_path

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def random_qkv(num_nodes, prefix_len, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q": randn(num_nodes, NUM_Q_HEADS, HEAD_DIM),
        "k": randn(num_nodes, NUM_KV_HEADS, HEAD_DIM),
        "v": randn(num_nodes, NUM_KV_HEADS, HEAD_DIM),
        "prefix_keys": randn(prefix_len, NUM_KV_HEADS, HEAD_DIM),
        "prefix_values": randn(prefix_len, NUM_KV_HEADS, HEAD_DIM),
    }


def causal_attention_last_token(q, keys, values):
    """Oracle: SDPA with a causal mask over a whole sequence; return the last token's output [Hq, D]."""
    group = q.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.repeat_interleave(group, 1).transpose(0, 1)[None],
        values.repeat_interleave(group, 1).transpose(0, 1)[None],
        is_causal=False,
    )
    return out[0, :, -1]


def path_oracle(inputs, parents, node):
    """Causal attention of the last token of prefix + root path (earlier queries do not matter)."""
    path = root_path(torch.tensor(parents), node)
    keys = torch.cat([inputs["prefix_keys"], inputs["k"][path]])
    values = torch.cat([inputs["prefix_values"], inputs["v"][path]])
    return causal_attention_last_token(inputs["q"][node][None], keys, values)


@settings(max_examples=30, deadline=None)
@given(parents=tree_parents(max_nodes=32), prefix_len=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_tree_attention_equals_causal_attention_along_root_paths(parents, prefix_len, seed):
    inputs = random_qkv(len(parents), prefix_len, seed)
    out = tree_attention(**inputs, parents=parents)
    for node in range(len(parents)):
        torch.testing.assert_close(out[node], path_oracle(inputs, parents, node), rtol=0, atol=1e-12)


def test_tree_positions_and_mask():
    parents = [-1, 0, 0, 1, 3]
    assert tree_positions(parents, prefix_len=10).tolist() == [10, 11, 11, 12, 13]
    mask = tree_attention_mask(parents, prefix_len=2)
    assert mask[:, :2].all()
    assert mask[4, 2:].tolist() == [True, True, False, True, True]
    assert mask[2, 2:].tolist() == [True, False, True, False, False]


@torch.no_grad()
def test_rope_at_start_plus_depth_matches_sequential_positions():
    """With the model's RoPE (Qwen3-Next, partial rotary) applied at tree_positions, every node equals a
    sequential decode of its root path at positions P, P + 1, ..."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=48,
        num_attention_heads=NUM_Q_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
    )
    rotary = qwen3_next.Qwen3NextRotaryEmbedding(config)

    def rotate(q, k, positions):
        cos, sin = rotary(q, positions[None])
        q_rot, k_rot = qwen3_next.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)

    prefix_len = 5
    parents = random_parents(12, torch.Generator().manual_seed(3))
    raw = random_qkv(12, prefix_len, seed=3, dtype=torch.float32)
    prefix_q = torch.zeros(prefix_len, NUM_Q_HEADS, HEAD_DIM)
    _, prefix_keys = rotate(prefix_q, raw["prefix_keys"], torch.arange(prefix_len))
    q, k = rotate(raw["q"], raw["k"], tree_positions(parents, prefix_len))
    out = tree_attention(q, k, raw["v"], prefix_keys, raw["prefix_values"], parents)
    for node in range(12):
        path = root_path(torch.tensor(parents), node)
        q_seq, k_seq = rotate(raw["q"][path], raw["k"][path], prefix_len + torch.arange(len(path)))
        expected = causal_attention_last_token(
            q_seq[-1:], torch.cat([prefix_keys, k_seq]), torch.cat([raw["prefix_values"], raw["v"][path]])
        )
        torch.testing.assert_close(out[node], expected, rtol=1e-5, atol=1e-5)


def test_batched_tree_attention_equals_per_request():
    gen = torch.Generator().manual_seed(5)
    trees = [random_parents(n, gen) for n in (4, 1, 7)]
    requests = [random_qkv(len(p), prefix_len=3 + i, seed=i) for i, p in enumerate(trees)]
    out = tree_attention_batched(
        torch.cat([r["q"] for r in requests]),
        torch.cat([r["k"] for r in requests]),
        torch.cat([r["v"] for r in requests]),
        [r["prefix_keys"] for r in requests],
        [r["prefix_values"] for r in requests],
        sum(trees, []),
        [0, 4, 5, 12],
    )
    for request, (rows, parents) in enumerate(zip([slice(0, 4), slice(4, 5), slice(5, 12)], trees)):
        torch.testing.assert_close(out[rows], tree_attention(**requests[request], parents=parents), rtol=0, atol=0)


@pytest.mark.parametrize("path", [[0], [0, 1], [0, 2, 5], [0, 2, 5, 7, 8]])
def test_kv_compaction_puts_the_accepted_path_at_consecutive_positions(path):
    parents = [-1, 0, 0, 1, 2, 2, 4, 5, 7]
    num_nodes, prefix_len, num_slots = len(parents), 4, 32
    gen = torch.Generator().manual_seed(len(path))
    slot_order = torch.randperm(num_slots, generator=gen)  # a paged cache: positions scattered over slots
    prefix_slots, node_slots = slot_order[:prefix_len], slot_order[prefix_len : prefix_len + num_nodes]
    cache = torch.randn(num_slots, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    before = cache.clone()

    src, dst = kv_compaction_plan(path, node_slots, parents)
    assert src.numel() == sum(1 for j, node in enumerate(path) if node != j)  # no-op moves dropped
    apply_kv_moves(cache, src, dst)

    committed = torch.cat([prefix_slots, node_slots[: len(path)]])
    expected = torch.cat([before[prefix_slots], before[node_slots[torch.tensor(path)]]])
    assert torch.equal(cache[committed], expected)

    # Running the moves one by one in plan (ascending) order gives the same cache: a_j >= j.
    sequential = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        sequential[d] = sequential[s]
    assert torch.equal(sequential[committed], expected)


def test_bad_attention_inputs_raise_value_error():
    inputs = random_qkv(3, 2, seed=0)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hkv = 2"):
        tree_attention(**dict(inputs, q=inputs["q"][:, :5]), parents=[-1, 0, 0])
    with pytest.raises(ValueError, match=r"prefix_values must have shape \[P, Hkv, Dv\]"):
        tree_attention(**dict(inputs, prefix_values=inputs["prefix_values"][:1]), parents=[-1, 0, 0])
    with pytest.raises(ValueError, match=r"parents\[i\] must satisfy"):
        tree_attention(**inputs, parents=[-1, 2, 0])
    with pytest.raises(ValueError, match="dst must not repeat a slot"):
        apply_kv_moves(torch.zeros(4, 1), [0, 1], [2, 2])
    with pytest.raises(ValueError, match=r"slot indices in \[0, 4\)"):
        apply_kv_moves(torch.zeros(4, 1), [5], [0])
    with pytest.raises(ValueError, match=r"node_slots must have shape \[N\] = \[3\]"):
        kv_compaction_plan([0, 1], [7, 8], [-1, 0, 0])
