"""Tiny randomly initialised targets (fp32, CPU) for tests and demos.

``tiny_target("qwen3")`` is dense; ``"qwen3_next"`` (with a sparse MoE MLP)
and ``"qwen3_5"`` (the text-only ``Qwen3_5ForCausalLM``) alternate Gated
DeltaNet and full-attention layers, GDN first, as the real hybrids do.
"""

from __future__ import annotations

import torch

TARGET_KINDS = ("qwen3", "qwen3_next", "qwen3_5")
#: Also buildable: a dense Llama (no q/k norms), same attention interface as Qwen3.
EXTRA_KINDS = ("llama",)


def tiny_target_config(
    kind: str,
    vocab_size: int = 128,
    num_layers: int = 4,
    hidden_size: int = 32,
    max_position_embeddings: int = 512,
    **overrides,
):
    """The transformers config of a tiny target of ``kind`` (one of :data:`TARGET_KINDS`)."""
    common = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        intermediate_size=2 * hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    hybrid = dict(
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # grouped value heads, as in the real models
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**{**common, **overrides})
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**{**common, **overrides})
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        moe = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
        return Qwen3NextConfig(**{**common, **hybrid, **moe, **overrides})
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**{**common, **hybrid, **overrides})
    raise ValueError(f"kind must be one of {TARGET_KINDS + EXTRA_KINDS}, got {kind!r}")


def tiny_target(kind: str, seed: int = 0, **config_overrides):
    """A randomly initialised tiny causal LM in eval mode (fp32).

    GDN parameters that transformers initialises to constants (``dt_bias``
    1, gated-norm weight 1) are spread out so the tests exercise them.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_target_config(kind, **config_overrides)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "dt_bias") and hasattr(module, "A_log"):
                    module.dt_bias.uniform_(-1.0, 1.0)
                    module.norm.weight.uniform_(0.5, 1.5)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()
