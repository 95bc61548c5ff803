"""The reference drafter's sliding-window layers: causal within the block, and only the last ``sliding_window``
positions; full-attention layers see every key. Checked by what an output can depend on, not by the mask."""

import pytest
import torch
from transformers import Qwen3Config

from ddtree.engine.drafter import DFlashAttention, layer_attention, visible_keys


def config(kinds, window):
    return Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(kinds),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=kinds,
        use_sliding_window=window is not None,
        sliding_window=window,
    )


def test_visible_keys_follow_the_rule_position_by_position():
    context, block = 7, 4
    for causal in (False, True):
        for window in (None, 1, 3, 100):
            visible = visible_keys(block, context + block, causal, window, "cpu")
            for i in range(block):
                q = context + i
                for k in range(context + block):
                    expected = (not causal or k <= q) and (
                        window is None or (q - k < window and (causal or k - q < window))
                    )
                    assert bool(visible[i, k]) == expected, (causal, window, i, k)


def layer_output(attention, hidden, context_hidden):
    positions = torch.arange(context_hidden.shape[0] + hidden.shape[0], dtype=torch.float32)
    cos = torch.cos(positions[:, None] * torch.linspace(0.1, 1.0, 8))
    sin = torch.sin(positions[:, None] * torch.linspace(0.1, 1.0, 8))
    c = context_hidden.shape[0]
    keys, values = attention.keys_values(context_hidden, cos[:c], sin[:c])
    return attention(hidden, cos[c:], sin[c:], keys, values)


@pytest.mark.parametrize("window", [3, None])
def test_a_sliding_layer_sees_earlier_positions_within_its_window_only(window):
    torch.manual_seed(0)
    cfg = config(["sliding_attention", "full_attention"], window)
    sliding, full = DFlashAttention(cfg, 0), DFlashAttention(cfg, 1)
    assert (sliding.causal, sliding.window) == (True, window) and (full.causal, full.window) == (False, None)
    context, block = torch.randn(6, 32), torch.randn(4, 32)
    base_sliding, base_full = layer_output(sliding, block, context), layer_output(full, block, context)
    later = block.clone()
    later[3] += 1.0  # the block's last token
    assert torch.equal(layer_output(sliding, later, context)[:3], base_sliding[:3])  # earlier queries never see it
    assert not torch.allclose(layer_output(full, later, context)[0], base_full[0])  # a full layer does
    early = context.clone()
    early[0] += 1.0  # position 0: outside a window of 3 for every block query (positions 6..9)
    moved = layer_output(sliding, block, early)
    if window is None:
        assert not torch.allclose(moved, base_sliding)  # causal only: every query sees position 0
    else:
        assert torch.equal(moved, base_sliding)
    near = context.clone()
    near[5] += 1.0  # position 5: inside the window of query 0 (position 6)
    assert not torch.allclose(layer_output(sliding, block, near)[0], base_sliding[0])


def test_a_config_wide_is_causal_overrides_every_layer():
    cfg = config(["full_attention", "sliding_attention"], 16)
    cfg.is_causal = True
    assert layer_attention(cfg, 0) == (True, None) and layer_attention(cfg, 1) == (True, 16)
    cfg.is_causal = False
    assert layer_attention(cfg, 1) == (False, 16)
