"""DFlash drafter training: random anchors, one block per anchor, position-weighted cross-entropy.

For a training sequence ``x [T]`` with frozen-target features ``f [T, F]`` (outputs of the
target layers ``target_layer_ids``, concatenated) and an anchor ``a``:

* the block is ``[x_a, MASK x (bs - 1)]`` at positions ``a .. a + bs - 1``, embedded with the
  target's (frozen) embedding;
* its context is the features of ``x_0 .. x_{a-1}`` (the committed prefix at inference: the
  anchor token is the bonus token, not yet run by the target);
* slot ``k`` (1..bs-1) predicts ``x_{a+k}`` through the target's (frozen) LM head, with weight
  ``exp(-(k - 1) / gamma)``: early slots matter more, since a chain is accepted only up to its
  first miss.

Anchors satisfy ``1 <= a`` (at least one context token) and ``a + bs - 1 <= T - 1`` (every label
inside the sequence): blocks never cross the sequence end. Many anchors share one pass: block
tokens attend to the context keys before their own anchor and to their own block only, which is
exactly what :class:`ddtree.engine.DFlashDraftModel` computes at inference, so the trained
weights are used as they were trained.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """``[bs - 1]`` loss weights of slots k = 1..bs-1: ``exp(-(k - 1) / gamma)``."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def default_gamma(block_size: int) -> float:
    """DFlash's decay: 7 for block size 16 (and 5 for 10, 4 for 8)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, (block_size - 1) / 2))


def sample_anchors(batch: int, seq_len: int, num_anchors: int, block_size: int, generator) -> torch.Tensor:
    """``[batch, num_anchors]`` sorted anchors, distinct per row, in ``[1, seq_len - block_size]``.

    Raises if the sequence is too short to hold ``num_anchors`` distinct blocks.
    """
    low, high = 1, seq_len - block_size  # inclusive
    count = high - low + 1
    if count < num_anchors or count <= 0:
        raise ValueError(
            f"sequence of {seq_len} tokens has {max(count, 0)} anchor positions for block "
            f"{block_size}; asked for {num_anchors}"
        )
    keys = torch.rand(batch, count, generator=generator)
    anchors = keys.argsort(dim=1)[:, :num_anchors] + low
    return anchors.sort(dim=1).values


def block_layout(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int):
    """Block inputs and labels for ``tokens [B, T]`` and ``anchors [B, N]``.

    Returns ``block_ids [B, N * bs]`` (``[x_a, MASK, ...]`` per anchor), ``positions [B, N * bs]``
    (``a + slot``) and ``labels [B, N, bs - 1]`` (``x_{a+1} .. x_{a+bs-1}``).
    """
    batch, num_anchors = anchors.shape
    offsets = torch.arange(block_size, device=tokens.device)
    positions = anchors[:, :, None] + offsets  # [B, N, bs]
    if int(positions.max()) >= tokens.shape[1] or int(anchors.min()) < 1:
        raise ValueError("a block crosses the sequence end or has no context")
    labels = torch.gather(tokens, 1, positions[:, :, 1:].reshape(batch, -1)).view(batch, num_anchors, block_size - 1)
    block_ids = torch.full_like(positions, mask_id)
    block_ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    return block_ids.view(batch, -1), positions.view(batch, -1), labels


def attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Boolean ``[B, 1, N * bs, T + N * bs]``: True where a block query may attend.

    Context key ``t`` is visible to the queries of the block anchored at ``a`` iff ``t < a``;
    block keys only within the same block (bidirectionally, as DFlash does).
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, M]
    context = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[:, :, None]  # [B, M, T]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [M]
    same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, M, M]
    return torch.cat([context, same_block], dim=2)[:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, N, heads, D]``, ``cos, sin [B, N, D]`` (HF rotate-half convention, as the engine)."""
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


def drafter_block_hidden(
    drafter, block_embeddings: torch.Tensor, block_positions: torch.Tensor, features: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Differentiable, batched DFlash forward: the final-normed hidden states ``[B, M, H]`` of the blocks.

    ``block_embeddings [B, M, H]``; ``block_positions [B, M]``; ``features [B, T, F]`` (target
    features of every sequence position; the mask decides which each block sees); ``mask`` from
    :func:`attention_mask`. Uses the drafter's own modules, mirroring
    ``DFlashDraftModel.extend_context`` + ``forward``: context keys/values are
    ``k_proj/v_proj(hidden_norm(fc(features)))`` (no per-layer input norm), block keys/values come
    from the layer's normed input.
    """
    masked = [i for i, layer in enumerate(drafter.layers) if layer.self_attn.causal or layer.self_attn.window]
    if masked:
        raise ValueError(
            f"training drafters with causal or sliding-window layers is not supported (layers {masked}): the "
            "training mask is DFlash's full, bidirectional block attention; train a drafter whose layer_types "
            "are all full_attention"
        )
    batch, seq_len, _ = features.shape
    context = drafter.hidden_norm(drafter.fc(features))  # [B, T, H]
    context_positions = torch.arange(seq_len, device=features.device)[None].expand(batch, -1)
    cos_c, sin_c = drafter.rotary_emb(context, context_positions)
    cos_b, sin_b = drafter.rotary_emb(block_embeddings, block_positions)
    hidden = block_embeddings
    num_blocks = hidden.shape[1]
    for layer in drafter.layers:
        attn = layer.self_attn
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        normed = layer.input_layernorm(hidden)
        query = _rope(attn.q_norm(attn.q_proj(normed).view(batch, num_blocks, heads, dim)), cos_b, sin_b)
        key_b = _rope(attn.k_norm(attn.k_proj(normed).view(batch, num_blocks, kv_heads, dim)), cos_b, sin_b)
        value_b = attn.v_proj(normed).view(batch, num_blocks, kv_heads, dim)
        key_c = _rope(attn.k_norm(attn.k_proj(context).view(batch, seq_len, kv_heads, dim)), cos_c, sin_c)
        value_c = attn.v_proj(context).view(batch, seq_len, kv_heads, dim)
        keys = torch.cat([key_c, key_b], dim=1).transpose(1, 2)
        values = torch.cat([value_c, value_b], dim=1).transpose(1, 2)
        if kv_heads != heads:
            keys = keys.repeat_interleave(heads // kv_heads, dim=1)
            values = values.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=mask)
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, num_blocks, heads * dim))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, Dict]:
    """Weighted cross-entropy over block slots.

    ``logits [B, N, bs - 1, V]``, ``labels [B, N, bs - 1]``, ``weights [bs - 1]``. Loss =
    ``sum(w_k * CE) / sum(w_k)`` averaged over blocks. Also returns per-slot top-1 accuracy and the
    expected chain acceptance length under teacher forcing, ``1 + sum_k prod_{j<=k} correct_j``.
    """
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
    w = weights.to(ce.device)
    loss = (ce * w).sum(-1).mean() / w.sum()
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels).float()  # [B, N, L]
        accuracy = correct.mean(dim=(0, 1))
        chain = 1.0 + correct.cumprod(-1).sum(-1).mean()
    return loss, {"accuracy": accuracy, "chain_tau": float(chain)}


class TargetFeatures:
    """Captures the outputs of chosen decoder layers of a (frozen) HF target during its forward.

    Layer ``l``'s output is what the engine's ``TargetModel`` concatenates as drafter context
    (HF ``hidden_states[l + 1]``; never the final-normed last layer, which is not used here).
    """

    def __init__(self, target, layer_ids: Sequence[int]):
        self.layer_ids = list(layer_ids)
        layers = target.get_decoder().layers
        if max(self.layer_ids) >= len(layers) - 1:
            raise ValueError("feature layers must exclude the last layer (its HF hidden state is normed)")
        self.captured: Dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, index):
        def hook(module, args, output):
            self.captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def take(self) -> torch.Tensor:
        """``[B, T, H * len(layer_ids)]`` from the last forward."""
        features = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return features

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def target_greedy_labels(tokens: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` label tokens: at ``t >= 1`` the target's argmax after ``tokens[:, :t]``; ``t = 0`` keeps the token.

    Self-distillation labels: what the target's greedy decoding emits next after the real prefix, the
    token a drafted slot must equal to be accepted. Inside a greedy continuation they equal the tokens.
    """
    labels = tokens.clone()
    labels[:, 1:] = target_logits[:, :-1].argmax(-1)
    return labels


def dflash_step_logits(
    drafter,
    target,
    tokens: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
    label_tokens: Optional[torch.Tensor] = None,
):
    """Drafter logits ``[B, N, bs - 1, V]`` and labels ``[B, N, bs - 1]`` for one batch.

    ``target``: the HF causal LM whose embedding and LM head the drafter shares (frozen).
    ``label_tokens [B, T]``: where labels come from (default ``tokens``; e.g. :func:`target_greedy_labels`).
    """
    bs = drafter.block_size
    block_ids, positions, labels = block_layout(tokens, anchors, bs, drafter.mask_token_id)
    if label_tokens is not None:
        labels = block_layout(label_tokens, anchors, bs, drafter.mask_token_id)[2]
    embeddings = target.get_input_embeddings()(block_ids).detach()
    mask = attention_mask(anchors, tokens.shape[1], bs)
    hidden = drafter_block_hidden(drafter, embeddings, positions, features, mask)
    batch, num_anchors = anchors.shape
    hidden = hidden.view(batch, num_anchors, bs, -1)[:, :, 1:]  # slot 0 (the anchor token) predicts nothing
    logits = target.get_output_embeddings()(hidden)
    return logits, labels


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup to ``peak``, cosine down to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------- engine-equivalent teacher forcing


def walk_chain(correct: torch.Tensor, first_anchor: int, last_anchor: int) -> list:
    """Acceptance lengths of the DFlash chain walking a sequence, as the engine's greedy steps do.

    ``correct [A, bs - 1]`` (bool): row ``i`` is the drafter's per-slot hits for the block anchored
    at ``first_anchor + i`` (teacher-forced on the target's own greedy output, so a hit is exactly a
    verified acceptance). The first step's bonus sits at ``first_anchor``; each step accepts the
    leading hits (at most ``last_anchor - a`` of them: the engine never drafts past the last token)
    and the next bonus follows them. Returns one length (accepted + 1) per step.

    Unlike the mean over *all* anchors (:func:`dflash_loss`'s ``chain_tau``), this visits only the
    anchors the engine visits: a run of easy tokens is covered by few steps, so it weighs little.
    """
    lengths = []
    anchor = first_anchor
    while anchor <= last_anchor:
        depth = min(correct.shape[1], last_anchor - anchor)
        hits = correct[anchor - first_anchor, :depth].long().cumprod(0)
        accepted = int(hits.sum())
        lengths.append(accepted + 1)
        anchor += accepted + 1
    return lengths


@torch.no_grad()
def teacher_forced_chain(
    drafter, target, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], rows_per_batch: int = 4
) -> Dict:
    """The engine's greedy DFlash chain tau, computed by teacher forcing (one target + one drafter forward).

    ``continuations[i]``: the target's greedy output after ``prompts[i]`` (as the engine's ``ar``
    mode produces it, ``max_new_tokens = len(continuations[i])``). At temperature 0 the engine's
    chain accepts exactly the drafter's leading hits against that output, so walking it
    (:func:`walk_chain`) reproduces the engine's acceptance lengths, up to floating-point ties and
    the engine's shorter blocks in the last 15 tokens. Returns ``{"tau", "steps", "lengths"}``
    (lengths per prompt), tau pooled over all steps like the engine evaluation.
    """
    device = next(target.parameters()).device
    bs = drafter.block_size
    hook = TargetFeatures(target, drafter.target_layer_ids)
    per_prompt = []
    try:
        rows = [(list(p), list(c)) for p, c in zip(prompts, continuations)]
        for start in range(0, len(rows), rows_per_batch):
            group = rows[start : start + rows_per_batch]
            # group rows of equal shape; otherwise one by one
            if len({(len(p), len(c)) for p, c in group}) != 1:
                chunks = [[row] for row in group]
            else:
                chunks = [group]
            for chunk in chunks:
                prompt_len, new = len(chunk[0][0]), len(chunk[0][1])
                # pad with the mask token so every block fits; padded positions are never context
                # (context < anchor <= last token) and their labels are never counted (depth cap)
                tokens = torch.tensor([p + c + [drafter.mask_token_id] * bs for p, c in chunk], device=device)
                target(input_ids=tokens)
                features = hook.take()
                first, last = prompt_len, prompt_len + new - 2  # bonus positions of the engine's steps
                if last < first:
                    per_prompt.extend([[] for _ in chunk])
                    continue
                anchors = torch.arange(first, last + 1, device=device)[None].expand(len(chunk), -1)
                logits, labels = dflash_step_logits(
                    drafter, target, tokens, features.to(drafter.fc.weight.dtype), anchors
                )
                correct = (logits.argmax(-1) == labels).cpu()
                per_prompt.extend(walk_chain(correct[i], first, last) for i in range(len(chunk)))
    finally:
        hook.remove()
    flat = [length for lengths in per_prompt for length in lengths]
    return {"tau": float(sum(flat) / len(flat)) if flat else 0.0, "steps": len(flat), "lengths": per_prompt}
