"""GPU test and benchmark helpers: tiny random checkpoints (Qwen3 and Qwen3-Next targets, a DFlash drafter),
the engine arguments a target needs, vLLM's spec-decode counters.

Written in the formats vLLM 0.25.1 reads (see the project's GPU notes): the
target is a ``Qwen3ForCausalLM`` with real (random, seeded) safetensors
weights, so every engine of a comparison loads the same model; the drafter is
``DFlashDraftModel`` (``model_type: qwen3``) with ``dflash_config`` and
weights named like a Qwen3Model without ``embed_tokens`` plus ``fc`` and
``hidden_norm``. No tokenizer: use ``skip_tokenizer_init=True`` and token-id
prompts.

Needs torch, safetensors and transformers (not a dependency of ddtree).
"""

from __future__ import annotations

import json
import os
from typing import Dict

import torch

TARGET = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
)
DRAFTER_LAYERS = 2
BLOCK_SIZE = 16


def _qwen3_config(**kw):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        **kw,
    )
    return cfg


def write_target(path: str, seed: int = 0, logit_scale: float = 4.0, **overrides) -> Dict:
    """A random Qwen3ForCausalLM; ``logit_scale`` sharpens the LM head so greedy argmax is rarely a near-tie."""
    from transformers import Qwen3ForCausalLM

    spec = dict(TARGET, **overrides)
    torch.manual_seed(seed)
    cfg = _qwen3_config(**spec)
    cfg.architectures = ["Qwen3ForCausalLM"]
    _save_sharpened(Qwen3ForCausalLM(cfg), path, logit_scale)
    return spec


def _save_sharpened(model, path: str, logit_scale: float) -> None:
    """Scales the LM head (fewer greedy near-ties) and saves bf16 safetensors."""
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    os.makedirs(path, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def write_qwen3_next_target(path: str, seed: int = 0, logit_scale: float = 4.0, experts_per_token: int = 2) -> Dict:
    """A random hybrid ``Qwen3NextForCausalLM``: 3 Gated-DeltaNet layers + 1 gated attention layer, MoE MLPs.

    vLLM 0.25.1 builds Qwen3-Next only with MoE layers (4 experts, ``experts_per_token`` per token). With 2,
    random router logits are near-tied, and bf16 noise that differs between batch shapes flips which experts
    a token uses: plain vLLM and any speculative engine then diverge well above a logit tolerance. With all 4
    the expert set cannot flip (only the continuous gate weights move), so greedy comparisons test the
    engine, not the router. Returns the fields :func:`write_drafter` needs.
    """
    if not 1 <= experts_per_token <= 4:
        raise ValueError(f"experts_per_token must be 1..4 (4 experts), got {experts_per_token}")
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    spec = dict(TARGET)
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    _save_sharpened(Qwen3NextForCausalLM(cfg), path, logit_scale)
    return spec


def write_drafter(path: str, target: Dict, seed: int = 1, target_layer_ids=(0, 1, 2), mask_token_id=None) -> Dict:
    """A random DFlash drafter for ``target`` (shares its vocabulary, embedding and LM head at run time)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Model

    torch.manual_seed(seed)
    hidden = target["hidden_size"]
    mask = target["vocab_size"] - 1 if mask_token_id is None else mask_token_id
    cfg = _qwen3_config(
        vocab_size=target["vocab_size"],
        hidden_size=hidden,
        intermediate_size=target["intermediate_size"],
        num_hidden_layers=DRAFTER_LAYERS,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        max_position_embeddings=target["max_position_embeddings"],
    )
    model = Qwen3Model(cfg).to(torch.bfloat16)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("embed_tokens")}
    ids = list(target_layer_ids)
    weights["fc.weight"] = (torch.randn(hidden, hidden * len(ids)) * (len(ids) * hidden) ** -0.5).to(torch.bfloat16)
    weights["hidden_norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        block_size=BLOCK_SIZE,
        num_target_layers=target["num_hidden_layers"],
        dflash_config={"mask_token_id": mask, "target_layer_ids": ids},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config


def engine_kwargs_for(target: str) -> Dict:
    """vLLM engine arguments a target needs on the lent H200, from its ``config.json``.

    GDN hybrids need the Triton GDN prefill kernels (the image has no flashinfer ones); Qwen3.5's
    multimodal wrapper is served text-only.
    """
    from ddtree.vllm.config import GDN_ARCHITECTURES

    with open(os.path.join(target, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    kw: Dict = {}
    if architecture in GDN_ARCHITECTURES:
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    if architecture.startswith("Qwen3_5"):
        kw["language_model_only"] = True
    return kw


def spec_metrics(llm) -> Dict:
    """vLLM's cumulative spec-decode counters (drafts, draft tokens, accepted, accepted per position), its
    preemption count and its prefix-cache queries and hits (tokens)."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": [], "preemptions": 0.0}
    out.update(prefix_cache_queries=0.0, prefix_cache_hits=0.0)
    try:
        for m in llm.get_metrics():
            name = m.name.replace("_total", "")
            if name == "vllm:spec_decode_num_drafts":
                out["drafts"] = float(m.value)
            elif name == "vllm:spec_decode_num_draft_tokens":
                out["draft_tokens"] = float(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens":
                out["accepted"] = float(m.value)
            elif name == "vllm:num_preemptions":
                out["preemptions"] = float(m.value)
            elif name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                out[name.split(":")[1]] = float(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                out["per_pos"] = [float(v) for v in getattr(m, "values", [])]
    except Exception as err:  # metrics are informative, never fatal
        out["error"] = repr(err)
    return out
