"""A real transformers GDN layer, decoded token by token along each root path, matches the tree path.

This pins the conventions (qkv split order, conv window, l2 norm and scale, gates, head grouping, cache
layout) to the model code rather than to our reading of it. Both layer variants are covered:
Qwen3-Next (interleaved in_proj_qkvz / in_proj_ba) and Qwen3.5 / Qwen3.6 (separate projections).
"""

import pytest
import torch
import torch.nn.functional as F

from _gdn_testing import leaves, random_parents, skip_below_reference_transformers
from ddtree.kernels.gdn_reference import commit_gdn_state, tree_causal_conv1d, tree_gated_delta_rule
from ddtree.kernels.topology import root_path

transformers = pytest.importorskip("transformers")
skip_below_reference_transformers()
from transformers import DynamicCache  # noqa: E402

TINY = dict(
    hidden_size=32,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # GQA ratio 3, like Qwen3.6-27B's 16 / 48
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    vocab_size=64,
)


def build_layer(variant: str, seed: int):
    torch.manual_seed(seed)
    if variant == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        config = Qwen3NextConfig(**TINY, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1)
        layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        config = Qwen3_5TextConfig(**TINY)
        layer = Qwen3_5GatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # move the identity-like inits away from 1 so they are actually exercised
        layer.dt_bias.uniform_(-1.0, 1.0)
        layer.norm.weight.uniform_(0.5, 1.5)
    return config, layer.eval()


def project(layer, hidden):
    """The layer's own input projections for hidden ``[N, hidden]``: conv inputs ``[N, C]``, z, b, a."""
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next: heads interleaved per key-head group
        query, key, value, z, b, a = layer.fix_query_key_value_ordering(
            layer.in_proj_qkvz(hidden[None]), layer.in_proj_ba(hidden[None])
        )
        mixed = torch.cat([t.reshape(1, hidden.shape[0], -1) for t in (query, key, value)], dim=-1)
        return mixed[0], z[0], b[0], a[0]
    z = layer.in_proj_z(hidden).reshape(hidden.shape[0], -1, layer.head_v_dim)
    return layer.in_proj_qkv(hidden), z, layer.in_proj_b(hidden), layer.in_proj_a(hidden)


def tree_layer_forward(layer, hidden, parents, conv_history, state):
    """The layer on a draft tree, via ddtree.kernels; returns output [N, hidden] and what commit needs."""
    num_nodes = hidden.shape[0]
    mixed, z, b, a = project(layer, hidden)
    conv = tree_causal_conv1d(
        mixed, conv_history, parents, layer.conv1d.weight.squeeze(1), layer.conv1d.bias, activation=layer.activation
    )
    query, key, value = torch.split(conv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(num_nodes, -1, layer.head_k_dim)
    key = key.reshape(num_nodes, -1, layer.head_k_dim)
    value = value.reshape(num_nodes, -1, layer.head_v_dim)
    beta = b.sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
    core, cache = tree_gated_delta_rule(query, key, value, g, beta, parents, state, return_cache=True)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(num_nodes, -1)), mixed, cache


def prefilled_cache(config, layer, prefix):
    """A fresh transformers cache after the layer's own (chunked) prefill of ``prefix [P, hidden]``."""
    cache = DynamicCache(config=config)
    layer(prefix[None], cache=cache)
    return cache


def committed_state_of(cache, layer):
    """transformers keeps a conv state of W inputs [B, C, W]; the newest W - 1 are the history."""
    conv_state = cache.get_conv_state(layer.layer_idx)
    history = conv_state[0, :, -(layer.conv_kernel_size - 1) :].T
    return history, cache.get_recurrent_state(layer.layer_idx)[0]


@pytest.mark.parametrize("variant", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("prefix_len, seed", [(6, 0), (2, 1)])  # 2 < W - 1: zero-padded conv history
@torch.no_grad()
def test_layer_token_by_token_along_root_paths_equals_tree_path(variant, prefix_len, seed):
    config, layer = build_layer(variant, seed)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randn(prefix_len, config.hidden_size, generator=gen)
    parents = random_parents(14, gen)
    hidden = torch.randn(len(parents), config.hidden_size, generator=gen)

    conv_history, state = committed_state_of(prefilled_cache(config, layer, prefix), layer)
    tree_out, mixed, tree_cache = tree_layer_forward(layer, hidden, parents, conv_history, state)

    parents_tensor = torch.tensor(parents)
    checked = torch.zeros(len(parents), dtype=torch.bool)
    for leaf in leaves(parents):
        path = root_path(parents_tensor, leaf)
        cache = prefilled_cache(config, layer, prefix)
        for depth, node in enumerate(path):
            step_out = layer(hidden[node][None, None], cache=cache)[0, 0]  # single-token decode kernels
            assert (tree_out[node] - step_out).abs().max() <= 1e-4, f"node {node} on path {path}"
            checked[node] = True
            # Commit after accepting the path up to this node == the layer's cache after decoding it.
            accepted = path[: depth + 1]
            new_state, new_history = commit_gdn_state(conv_history, mixed, tree_cache, state, accepted)
            expected_history, expected_state = committed_state_of(cache, layer)
            assert (new_state - expected_state).abs().max() <= 1e-4
            assert (new_history - expected_history).abs().max() <= 1e-6
    assert bool(checked.all())
    assert tree_out.abs().max() > 1e-3  # the outputs compared are not trivially tiny
