"""Oracles computed with transformers' own forward, independent of the engine's code path."""

from __future__ import annotations

import copy
from typing import List, Sequence

import torch
from transformers import DynamicCache


@torch.no_grad()
def hf_prefill(model, tokens: Sequence[int]) -> DynamicCache:
    """transformers' cache after its own forward over ``tokens``."""
    cache = DynamicCache(config=model.config)
    model(torch.tensor([list(tokens)]), cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def hf_decode_tree(
    model, cached_tokens: Sequence[int], node_tokens: Sequence[int], parents: Sequence[int]
) -> torch.Tensor:
    """Logits ``[N, V]``: node i's row is what decoding its root path token by token gives.

    The root path of i is fed one token at a time with transformers' single-token
    decode after a prefill of ``cached_tokens``; a node's cache is its parent's
    cache (copied) after one more token, so every node costs one decode step.
    """
    base = hf_prefill(model, cached_tokens)
    caches: List[DynamicCache] = []
    rows = []
    for node, parent in enumerate(parents):
        cache = copy.deepcopy(base if parent < 0 else caches[parent])
        out = model(torch.tensor([[int(node_tokens[node])]]), cache=cache, use_cache=True)
        caches.append(cache)
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


@torch.no_grad()
def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
    """Greedy decoding with transformers' cache, one token per forward."""
    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([list(prompt)]), cache=cache, use_cache=True)
    generated = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
    return generated
