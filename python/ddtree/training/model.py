"""The target's architecture (Qwen3.6-27B at small scale), its checkpoint format, the drafter's shape.

Qwen3.6-27B's text model, and what is kept here:

* Qwen3.5-family hybrid, layer pattern ``[GDN, GDN, GDN, attention] x n`` (``full_attention_interval`` 4);
* attention: gated output (``q_proj`` emits query and gate), q/k RMSNorm, GQA, partial rotary 0.25
  with interleaved M-RoPE sections (text-only: all three sections see the same position);
* GDN: grouped value heads (``linear_num_value_heads`` = 2 x key heads here; 3x in the 27B), conv 4;
* untied embeddings; RMSNorm ``(1 + w)``; SiLU MLP.

Checkpoint: ONE directory in the layout of the released Qwen3.5/3.6 checkpoints, which both loaders read:

* ``config.json``: ``Qwen3_5Config`` (``model_type: qwen3_5``, ``architectures:
  [Qwen3_5ForConditionalGeneration]``) with ``text_config`` and a small ``vision_config``
  (there are no vision weights; vLLM 0.25.1 registers Qwen3.5 only as this VL wrapper and runs it
  with ``language_model_only=True``, which builds no vision tower);
* ``model.safetensors``: ``model.language_model.*`` and ``lm_head.weight`` (vLLM's
  ``Qwen3VLForConditionalGeneration.hf_to_vllm_mapper`` maps exactly these prefixes;
  transformers' ``AutoModelForCausalLM`` maps ``qwen3_5`` to ``Qwen3_5ForCausalLM`` and strips
  ``language_model`` with its ``PrefixChange`` conversion);
* the tokenizer files.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

TARGET_PREFIX = "model.language_model."


@dataclass
class TargetShape:
    """Sizes of the small target. Defaults: ~10.5M parameters, 21 MB in bf16."""

    hidden_size: int = 256
    num_layers: int = 8  # 6 GDN + 2 attention
    intermediate_size: int = 1024
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    max_position_embeddings: int = 4096
    rope_theta: float = 1e7  # as in Qwen3.6-27B


@dataclass
class DrafterShape:
    """Sizes of the DFlash drafter (hidden size, heads and vocab follow the target)."""

    num_layers: int = 2
    block_size: int = 16
    # Spread up to the second-to-last layer, as the released drafters do ([1, 16, 31, 46, 61] of 64 layers):
    # the deepest features carry most of the next-token information.
    target_layer_ids: List[int] = field(default_factory=lambda: [1, 4, 6])
    rope_theta: float = 1e7


def target_text_config(shape: TargetShape, vocab_size: int, eos_id: int, pad_id: int):
    """The ``Qwen3_5TextConfig`` of the target."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    rotary_half = int(shape.head_dim * 0.25) // 2
    base, extra = divmod(rotary_half, 3)
    sections = [base + (i < extra) for i in range(3)]  # 27B (rotary half 32): [11, 11, 10]; here (8): [3, 3, 2]
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": shape.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": sections,
            "mrope_interleaved": True,
        },
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    config.mamba_ssm_dtype = "float32"  # as the released configs: GDN state kept in fp32 by vLLM
    expected = ["linear_attention"] * 3 + ["full_attention"]
    if config.layer_types != (expected * (shape.num_layers // 4 + 1))[: shape.num_layers]:
        raise AssertionError(f"unexpected layer pattern {config.layer_types}")
    return config


def new_target(text_config, seed: int):
    """A freshly initialised ``Qwen3_5ForCausalLM`` (fp32), reproducible from ``seed``."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    return Qwen3_5ForCausalLM(text_config)


def wrapper_config(text_config):
    """The ``Qwen3_5Config`` (VL wrapper) whose ``text_config`` is ``text_config``: what vLLM 0.25.1 loads."""
    from transformers import Qwen3_5Config

    hidden = text_config.hidden_size
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=hidden,
        num_position_embeddings=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    text = text_config.to_dict()
    text["mamba_ssm_dtype"] = "float32"
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    return config


def save_target(model, directory: str, tokenizer_json: Optional[str] = None, dtype=torch.bfloat16) -> Dict:
    """Write the target in the wrapper layout (module docstring); returns ``{file: bytes}``.

    Weights are stored in ``dtype`` (bf16: half the size; every evaluation uses the rounded weights).
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = wrapper_config(model.config)
    config.dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    config.save_pretrained(directory)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model."):
            name = TARGET_PREFIX + name[len("model.") :]
        elif name != "lm_head.weight":
            raise ValueError(f"unexpected target weight {name}")
        tensors[name] = tensor.detach().to("cpu", dtype).contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_json:
        save_tokenizer(tokenizer_json, directory, model.config)
    return {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


def save_tokenizer(tokenizer_json: str, directory: str, text_config=None) -> None:
    from .data import hf_tokenizer

    tokenizer = hf_tokenizer(tokenizer_json)
    tokenizer.save_pretrained(directory)


def load_target(directory: str, dtype=torch.float32, device="cpu"):
    """The saved target as ``Qwen3_5ForCausalLM`` through transformers' own loader (eval mode)."""
    from ddtree.engine.target import load_causal_lm

    return load_causal_lm(directory, dtype).to(device).eval()


def round_to_bf16_(model) -> None:
    """Round every parameter to bf16 in place (kept in its dtype): the weights that get shipped."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).to(parameter.dtype))


def new_drafter(text_config, shape: DrafterShape, mask_id: int, seed: int):
    """A fresh :class:`ddtree.engine.DFlashDraftModel` for the target (fp32, train mode).

    Attention shapes, MLP width and vocabulary follow the target, as the released drafters do.
    """
    from ddtree.engine import DFlashDraftModel

    model = DFlashDraftModel.random(
        text_config,
        num_layers=shape.num_layers,
        block_size=shape.block_size,
        target_layer_ids=shape.target_layer_ids,
        mask_token_id=mask_id,
        seed=seed,
        rope_theta=shape.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        num_target_layers=text_config.num_hidden_layers,
        tie_word_embeddings=False,
    )
    # transformers' usual init (normal(0, 0.02)); DFlashDraftModel.random leaves torch's default init.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.train()


def count_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def shapes_dict(target: TargetShape, drafter: DrafterShape) -> Dict:
    return {"target": asdict(target), "drafter": asdict(drafter)}


def read_json(path: str) -> Dict:
    with open(path) as handle:
        return json.load(handle)
