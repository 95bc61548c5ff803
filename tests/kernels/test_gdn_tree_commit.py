"""Commit after acceptance: state and conv history equal running the chain along the accepted path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _gdn_testing import random_gdn_inputs, random_parents, reference_causal_conv, tree_parents
from ddtree.kernels.gdn_reference import (
    QWEN3_6_27B_GDN,
    GdnModelShape,
    chain_gated_delta_rule,
    commit_gdn_state,
    commit_gdn_state_batched,
    commit_recurrent_state,
    format_memory_table,
    replay_recurrent_state,
    tree_causal_conv1d,
    tree_causal_conv1d_batched,
    tree_gated_delta_rule,
    tree_gated_delta_rule_batched,
    verification_memory_bytes,
)
from ddtree.kernels.topology import root_path

GDN_ARGS = ("q", "k", "v", "g", "beta")


def random_accepted_path(parents, generator):
    """Walk down from the root, stopping at a random depth."""
    children = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path = [0]
    while path[-1] in children and torch.rand(1, generator=generator).item() < 0.8:
        options = children[path[-1]]
        path.append(options[int(torch.randint(0, len(options), (1,), generator=generator))])
    return path


@settings(max_examples=40, deadline=None)
@given(parents=tree_parents(max_nodes=48), seed=st.integers(0, 2**16))
def test_wy_commit_equals_chain_state_along_accepted_path(parents, seed):
    inputs = random_gdn_inputs(len(parents), seed=seed)
    _, cache = tree_gated_delta_rule(
        *(inputs[n] for n in GDN_ARGS), parents, inputs["initial_state"], return_cache=True
    )
    path = random_accepted_path(parents, torch.Generator().manual_seed(seed))
    _, expected = chain_gated_delta_rule(*(inputs[n][path] for n in GDN_ARGS), inputs["initial_state"])
    committed = commit_recurrent_state(cache, path, inputs["initial_state"])
    assert (committed - expected).abs().max() <= 1e-10
    replayed = replay_recurrent_state(*(inputs[n] for n in GDN_ARGS[1:]), parents, path, inputs["initial_state"])
    assert (replayed - expected).abs().max() <= 1e-10


def test_commit_fp32_every_root_path_of_a_64_node_tree():
    parents = random_parents(64, torch.Generator().manual_seed(4))
    inputs = random_gdn_inputs(64, head_k_dim=32, head_v_dim=32, dtype=torch.float32, seed=4)
    _, cache = tree_gated_delta_rule(
        *(inputs[n] for n in GDN_ARGS), parents, inputs["initial_state"], return_cache=True
    )
    for last in range(64):
        path = root_path(torch.tensor(parents), last)
        _, expected = chain_gated_delta_rule(*(inputs[n][path] for n in GDN_ARGS), inputs["initial_state"])
        assert (commit_recurrent_state(cache, path, inputs["initial_state"]) - expected).abs().max() <= 1e-4


def test_commit_rejects_a_path_that_is_not_a_root_path():
    inputs = random_gdn_inputs(4, seed=0)
    _, cache = tree_gated_delta_rule(
        *(inputs[n] for n in GDN_ARGS), [-1, 0, 0, 1], inputs["initial_state"], return_cache=True
    )
    with pytest.raises(ValueError, match="follow parent links"):
        commit_recurrent_state(cache, [0, 2, 3], inputs["initial_state"])


# ---------------------------------------------------------------------------
# Multi-step: conv + delta rule, several verify/commit rounds vs one sequential decode
# ---------------------------------------------------------------------------

NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, WIDTH = 2, 6, 8, 4, 4
KEY_DIM, VALUE_DIM = NUM_K_HEADS * HEAD_K_DIM, NUM_V_HEADS * HEAD_V_DIM
CHANNELS = 2 * KEY_DIM + VALUE_DIM


def split_conv_output(mixed):
    """[T, C] conv output -> q, k [T, Hk, Dk], v [T, Hv, Dv] (Qwen order: q | k | v)."""
    q, k, v = torch.split(mixed, [KEY_DIM, KEY_DIM, VALUE_DIM], dim=-1)
    return (
        q.reshape(-1, NUM_K_HEADS, HEAD_K_DIM),
        k.reshape(-1, NUM_K_HEADS, HEAD_K_DIM),
        v.reshape(-1, NUM_V_HEADS, HEAD_V_DIM),
    )


class Tokens:
    """Random per-token GDN inputs: conv input x [C], log decay g [Hv], beta [Hv]."""

    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def draw(self, count):
        x = torch.randn(count, CHANNELS, generator=self.gen, dtype=torch.float64)
        g = -torch.rand(count, NUM_V_HEADS, generator=self.gen, dtype=torch.float64) * 0.5
        beta = torch.rand(count, NUM_V_HEADS, generator=self.gen, dtype=torch.float64)
        return x, g, beta


def sequential_decode(x, g, beta, history, state, weight, bias):
    """Oracle: causal conv over history + sequence, then the chain rule; returns outputs, state, history."""
    conv = reference_causal_conv(torch.cat([history, x]), weight, bias, activation=True)[history.shape[0] :]
    q, k, v = split_conv_output(conv)
    out, final_state = chain_gated_delta_rule(q, k, v, g, beta, state)
    return out, final_state, torch.cat([history, x])[-(WIDTH - 1) :]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_round_verify_and_commit_equals_sequential_decode(seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = Tokens(seed)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen, dtype=torch.float64) * 0.5
    bias = torch.randn(CHANNELS, generator=gen, dtype=torch.float64) * 0.1
    history0 = torch.randn(WIDTH - 1, CHANNELS, generator=gen, dtype=torch.float64)
    state0 = torch.randn(NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, generator=gen, dtype=torch.float64) * 0.3

    history, state = history0, state0
    accepted_x, accepted_g, accepted_beta, accepted_out = [], [], [], []
    for _round in range(4):
        parents = random_parents(int(torch.randint(1, 20, (1,), generator=gen)), gen)
        x, g, beta = tokens.draw(len(parents))
        q, k, v = split_conv_output(tree_causal_conv1d(x, history, parents, weight, bias))
        out, cache = tree_gated_delta_rule(q, k, v, g, beta, parents, state, return_cache=True)
        path = random_accepted_path(parents, gen)
        state, history = commit_gdn_state(history, x, cache, state, path)
        accepted_x.append(x[path])
        accepted_g.append(g[path])
        accepted_beta.append(beta[path])
        accepted_out.append(out[path])

    expected_out, expected_state, expected_history = sequential_decode(
        torch.cat(accepted_x), torch.cat(accepted_g), torch.cat(accepted_beta), history0, state0, weight, bias
    )
    assert (torch.cat(accepted_out) - expected_out).abs().max() <= 1e-10
    assert (state - expected_state).abs().max() <= 1e-10
    assert torch.equal(history, expected_history)


def test_batched_verify_and_commit_equals_sequential_decode_per_request():
    gen = torch.Generator().manual_seed(42)
    tokens = Tokens(42)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen, dtype=torch.float64) * 0.5
    num_requests = 3
    histories0 = torch.randn(num_requests, WIDTH - 1, CHANNELS, generator=gen, dtype=torch.float64)
    states0 = torch.randn(num_requests, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, generator=gen, dtype=torch.float64)

    histories, states = histories0, states0
    accepted = [[] for _ in range(num_requests)]  # per request: list of (x, g, beta, out)
    for _round in range(3):
        trees = [random_parents(int(torch.randint(1, 12, (1,), generator=gen)), gen) for _ in range(num_requests)]
        sizes = torch.tensor([len(p) for p in trees])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        x, g, beta = tokens.draw(int(offsets[-1]))
        local_parents = sum(trees, [])
        q, k, v = split_conv_output(tree_causal_conv1d_batched(x, histories, local_parents, offsets, weight))
        out, cache = tree_gated_delta_rule_batched(q, k, v, g, beta, local_parents, offsets, states, return_cache=True)
        paths = [random_accepted_path(p, gen) for p in trees]
        states, histories = commit_gdn_state_batched(histories, x, cache, states, paths)
        for request, path in enumerate(paths):
            rows = int(offsets[request]) + torch.tensor(path)
            accepted[request].append((x[rows], g[rows], beta[rows], out[rows]))

    for request in range(num_requests):
        x, g, beta, out = (torch.cat(parts) for parts in zip(*accepted[request]))
        expected_out, expected_state, expected_history = sequential_decode(
            x, g, beta, histories0[request], states0[request], weight, None
        )
        assert (out - expected_out).abs().max() <= 1e-10
        assert (states[request] - expected_state).abs().max() <= 1e-10
        assert torch.equal(histories[request], expected_history)


def test_memory_figures_for_qwen3_6_27b():
    one_snapshot = 48 * 48 * 128 * 128 * 4  # 48 layers x [48, 128, 128] fp32
    assert verification_memory_bytes(16)["state_snapshot"] == one_snapshot == 150_994_944
    costs = verification_memory_bytes(64)
    assert costs["per_node_snapshots"] == 64 * one_snapshot
    # Per node and layer: keys 16x128 + deltas 48x128 + G 48 in fp32, conv inputs 10240 in bf16.
    assert costs["wy_commit_cache"] == 64 * 48 * ((16 * 128 + 48 * 128 + 48) * 4 + 10240 * 2)
    assert costs["replay_commit_cache"] == 64 * 48 * (10240 * 2 + 2 * 48 * 4)
    assert costs["wy_commit_cache"] * 50 < costs["per_node_snapshots"]
    assert QWEN3_6_27B_GDN.conv_channels == 10240
    table = format_memory_table()
    assert "9663.7" in table and "164.2" in table  # the numbers quoted in the docstring
    tiny = GdnModelShape(num_gdn_layers=1, num_k_heads=1, num_v_heads=1, head_k_dim=2, head_v_dim=2, conv_kernel=4)
    assert verification_memory_bytes(3, tiny, state_bytes=4, activation_bytes=4)["wy_commit_cache"] == 3 * (
        (2 + 2 + 1) * 4 + 6 * 4
    )
