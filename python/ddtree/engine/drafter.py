"""The DFlash block drafter, in the checkpoint format of the released drafters.

A DFlash drafter is a few Qwen3 decoder layers that predict a whole block of
``block_size`` tokens in one forward pass:

* block input: ``[bonus token, MASK x (block_size - 1)]`` embedded with the
  *target's* embedding, at positions ``cached_len .. cached_len + block_size - 1``
  (the bonus is the target's last committed token, not yet in its cache);
* context: the target's hidden states at ``target_layer_ids`` (HF
  ``hidden_states[l + 1]``) of every committed token, concatenated and
  projected by ``hidden_norm(fc(.))`` to one vector per token;
* every layer's attention lets each block token attend to the context tokens'
  keys/values -- ``k_proj``/``v_proj`` of the projected context, with ``k_norm``
  and RoPE at the context positions -- followed by the block's own keys/values:
  all of them in a ``full_attention`` layer (no causal mask), in a
  ``sliding_attention`` layer (``layer_types``; the released Qwen3.6-27B drafter
  has four) only earlier positions within ``sliding_window``;
* the output at block slot ``i >= 1`` goes through the target's ``lm_head`` to
  give the distribution of the token at ``cached_len + i``.

The context keys/values depend only on a token's features and position, so
:class:`DrafterContext` caches them per layer and each step only projects the
newly committed tokens.

Checkpoint: ``config.json`` (a Qwen3 config with ``architectures:
["DFlashDraftModel"]``, ``block_size``, ``dflash_config: {mask_token_id,
target_layer_ids}``) and ``model.safetensors`` with Qwen3Model-style names
minus ``embed_tokens`` (``layers.*``, ``norm.weight``) plus ``fc.weight``
``[H, H * len(target_layer_ids)]`` and ``hidden_norm.weight`` ``[H]``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [N, heads, D]`` with ``cos, sin [N, D]`` (HF's rotate-half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


@dataclass
class DrafterContext:
    """Per-request cache of the context keys/values of every drafter layer.

    keys[l], values[l]: ``[Hkv, C, D]`` for the C context tokens seen so far.
    """

    keys: List[torch.Tensor] = field(default_factory=list)
    values: List[torch.Tensor] = field(default_factory=list)
    length: int = 0


def layer_attention(config: Qwen3Config, layer_index: int):
    """``(causal, window)`` of drafter layer ``layer_index``, as the released drafters define them: a
    ``sliding_attention`` layer (``layer_types``) is causal and sees the last ``sliding_window`` positions; a
    ``full_attention`` layer sees every key, the block's later tokens included. A config-wide ``is_causal``
    overrides causality for every layer."""
    layer_types = getattr(config, "layer_types", None)
    sliding = bool(layer_types) and layer_types[layer_index] == "sliding_attention"
    forced = getattr(config, "is_causal", None)
    causal = sliding if forced is None else bool(forced)
    window = getattr(config, "sliding_window", None) if sliding else None
    return causal, window


def visible_keys(num_queries: int, num_keys: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    """``[N, C + N]`` bool: which keys each block query sees. Keys are the context's ``C`` positions then the
    block's, so key ``k`` and query ``i`` sit at positions ``k`` and ``C + i``."""
    queries = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    keys = torch.arange(num_keys, device=device)[None, :]
    visible = torch.ones((num_queries, num_keys), dtype=torch.bool, device=device)
    if causal:
        visible &= keys <= queries
    if window is not None:
        visible &= queries - keys < window
        if not causal:
            visible &= keys - queries < window
    return visible


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are ``[context, block]``: not causal (full-attention layers), or causal
    within a sliding window (``sliding_attention`` layers)."""

    def __init__(self, config: Qwen3Config, layer_index: int = 0):
        super().__init__()
        self.causal, self.window = layer_attention(config, layer_index)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (normed, rotated) and values ``[Hkv, N, D]`` of ``hidden [N, H]``."""
        num_tokens = hidden.shape[0]
        keys = self.k_norm(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim))
        keys = apply_rotary(keys, cos, sin)
        values = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def forward(self, hidden, cos, sin, context_keys, context_values) -> torch.Tensor:
        """``hidden [N, H]`` (the block) -> ``[N, H]``; a full layer's block tokens see every key."""
        num_tokens = hidden.shape[0]
        query = self.q_norm(self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim))
        query = apply_rotary(query, cos, sin).transpose(0, 1)  # [Hq, N, D]
        block_keys, block_values = self.keys_values(hidden, cos, sin)
        group = self.num_heads // self.num_kv_heads
        keys = torch.cat([context_keys, block_keys], dim=1).repeat_interleave(group, dim=0)
        values = torch.cat([context_values, block_values], dim=1).repeat_interleave(group, dim=0)
        scores = query @ keys.transpose(1, 2) * self.head_dim**-0.5
        if self.causal or self.window is not None:
            visible = visible_keys(num_tokens, keys.shape[1], self.causal, self.window, scores.device)
            scores = scores.masked_fill(~visible, float("-inf"))
        weights = scores.float().softmax(dim=-1).to(query.dtype)
        out = (weights @ values).transpose(0, 1).reshape(num_tokens, -1)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_index: int = 0):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_index)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, cos, sin, context_keys, context_values) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context_keys, context_values)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(nn.Module):
    """A DFlash drafter (no embedding, no LM head: both are the target's).

    Attributes:
        config: the Qwen3 config read from / written to ``config.json``.
        block_size: tokens per block (bonus + ``block_size - 1`` predictions).
        mask_token_id: the token id filling the predicted slots.
        target_layer_ids: target layers whose outputs form the context.
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        dflash = dict(getattr(config, "dflash_config", None) or {})
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("drafter config needs dflash_config.target_layer_ids and dflash_config.mask_token_id")
        self.config = config
        self.block_size = int(getattr(config, "block_size", dflash.get("block_size", 16)))
        self.mask_token_id = int(dflash["mask_token_id"])
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        hidden = config.hidden_size
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(hidden * len(self.target_layer_ids), hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)

    # ------------------------------------------------------------- shapes

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def num_draft_positions(self) -> int:
        """L = block_size - 1: the positions one forward predicts."""
        return self.block_size - 1

    def _rotary(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary_emb(like, positions[None])
        return cos[0], sin[0]

    # ------------------------------------------------------------- forward

    @torch.no_grad()
    def extend_context(self, context: DrafterContext, features: torch.Tensor) -> None:
        """Append committed tokens' target features ``[C, H * len(target_layer_ids)]``.

        They sit at positions ``context.length ..``: the context is every
        committed token the target has run, in order.
        """
        if features.shape[0] == 0:
            return
        projected = self.hidden_norm(self.fc(features))
        positions = torch.arange(context.length, context.length + features.shape[0], device=features.device)
        cos, sin = self._rotary(positions, projected)
        for index, layer in enumerate(self.layers):
            keys, values = layer.self_attn.keys_values(projected, cos, sin)
            if index < len(context.keys):
                context.keys[index] = torch.cat([context.keys[index], keys], dim=1)
                context.values[index] = torch.cat([context.values[index], values], dim=1)
            else:
                context.keys.append(keys)
                context.values.append(values)
        context.length += features.shape[0]

    @torch.no_grad()
    def forward(self, block_embeddings: torch.Tensor, context: DrafterContext) -> torch.Tensor:
        """Hidden states ``[N, H]`` of a block ``[N, H]`` placed right after the context.

        Slot 0 is the bonus token at position ``context.length``; the output of
        slot ``i`` predicts the token at ``context.length + i`` for ``i >= 1``.
        """
        if context.length == 0:
            raise ValueError("the drafter needs at least one context token (the prompt)")
        positions = torch.arange(
            context.length, context.length + block_embeddings.shape[0], device=block_embeddings.device
        )
        cos, sin = self._rotary(positions, block_embeddings)
        hidden = block_embeddings
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, context.keys[index], context.values[index])
        return self.norm(hidden)

    # ------------------------------------------------------------- checkpoint

    def save_pretrained(self, directory: str) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the released drafters' format."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        config = self.config.to_dict()
        config["architectures"] = [ARCHITECTURE]
        config["model_type"] = "qwen3"
        config["block_size"] = self.block_size
        config["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": self.target_layer_ids}
        with open(os.path.join(directory, CONFIG_NAME), "w") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
        tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(tensors, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str, dtype: Optional[torch.dtype] = None, device="cpu") -> "DFlashDraftModel":
        """Load a drafter saved by :meth:`save_pretrained` or released in that format."""
        from safetensors.torch import load_file

        config_path = os.path.join(directory, CONFIG_NAME)
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{directory}: no {CONFIG_NAME}")
        with open(config_path) as handle:
            raw = json.load(handle)
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise ValueError(f"{config_path}: architectures {architectures} does not name {ARCHITECTURE}")
        config = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        model = cls(config)
        weights = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(directory, name)))
        weights = {name: tensor for name, tensor in weights.items() if not name.startswith("embed_tokens")}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ValueError(f"{directory}: drafter weights do not match (missing {missing}, unexpected {unexpected})")
        model = model.to(device=device, dtype=dtype or weights["fc.weight"].dtype)
        return model.eval()

    @classmethod
    def random(
        cls,
        target_config,
        num_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: Optional[Sequence[int]] = None,
        mask_token_id: Optional[int] = None,
        seed: int = 0,
        **overrides,
    ) -> "DFlashDraftModel":
        """A randomly initialised drafter matching a target's hidden size and vocabulary.

        ``target_config``: the target's (text) config. Attention shapes and
        intermediate size follow the target unless overridden.
        """
        num_target_layers = int(target_config.num_hidden_layers)
        if target_layer_ids is None:  # spread over the target's depth, as the released drafters do
            target_layer_ids = sorted({round(x) for x in torch.linspace(0, num_target_layers - 1, 2).tolist()})
        fields = dict(
            hidden_size=target_config.hidden_size,
            vocab_size=target_config.vocab_size,
            num_hidden_layers=num_layers,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
            intermediate_size=target_config.intermediate_size,
            rms_norm_eps=target_config.rms_norm_eps,
            max_position_embeddings=target_config.max_position_embeddings,
            block_size=block_size,
            dflash_config={
                "mask_token_id": int(target_config.vocab_size - 1 if mask_token_id is None else mask_token_id),
                "target_layer_ids": [int(i) for i in target_layer_ids],
            },
        )
        fields.update(overrides)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = cls(Qwen3Config(**fields))
        finally:
            torch.random.set_rng_state(generator_state)
        return model.eval()
