"""Per-node target tokens: the "sample" half of DDTree's sample-then-match acceptance.

Every verified node gets one token drawn from the target's distribution at
that node (its logits row), with the request's own temperature, min-p, top-k,
top-p and seed, in vLLM's order: argmax at temperature 0, an independent
sample per node otherwise.
Walking the tree with these tokens (the Rust core's ``accept_trees``) is then
exactly lossless: the accepted path plus bonus is distributed as if the target
had sampled it token by token, because along any root path each depth uses
one fresh sample of the right conditional distribution.

Torch only (no vLLM import): CI tests it on CPU.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from ddtree.vllm.seeded_noise import fill_seeded_noise

GREEDY_EPS = 1e-5


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Masks ``logits [N, V]`` in place outside each row's top-k / nucleus top-p; returns it.

    ``top_k`` values <= 0 or >= V and ``top_p`` values >= 1 disable the filter
    for that row (vLLM's conventions).
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = top_k.to(torch.int64).clamp(min=0)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop |= ranks >= k[:, None]
    if top_p is not None:
        masked = sorted_logits.masked_fill(drop, float("-inf"))
        probs = masked.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches p (always the top token).
        before = probs.cumsum(dim=-1) - probs
        p = top_p.to(probs.dtype)[:, None]
        drop |= (before >= p) & (p < 1.0)
        drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Masks ``logits [N, V]`` in place where a token's probability is below ``min_p`` times the row's largest
    (vLLM's min-p, applied after temperature); ``min_p`` 0 leaves a row as it is. Returns it."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype)[:, None]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def sample_rows(
    logits: torch.Tensor,
    temperature: Optional[torch.Tensor],
    top_k: Optional[torch.Tensor],
    top_p: Optional[torch.Tensor],
    generators: Optional[Dict[int, torch.Generator]] = None,
    row_ranges: Optional[Sequence[tuple]] = None,
    all_greedy: bool = False,
    min_p: Optional[torch.Tensor] = None,
    row_positions: Optional[torch.Tensor] = None,
    max_depth: Optional[int] = None,
    greedy_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per row of ``logits [N, V]`` (int64 ``[N]``).

    Args:
        temperature, top_k, top_p, min_p: per row ``[N]`` (None: not used).
            Rows with temperature < 1e-5 are greedy (min-p never changes an argmax).
        generators: request index -> seeded generator; ``row_ranges[i]`` is
            ``(first_row, num_rows)`` of request ``i``. With ``row_positions``
            (``[N]``: the absolute position each row samples), a seeded
            request's noise is a function of its seed (the generator's
            ``initial_seed``) and that position alone
            (:mod:`ddtree.vllm.seeded_noise`): its samples repeat whatever its
            trees. Without, it comes from its generator in row order (its
            samples depend on its seed and its trees' sizes). ``max_depth``:
            the trees' deepest possible node (the drafter's depth), which
            bounds the noise vectors made per request.
        greedy_out: int64 ``[N]``, for an all-greedy step only: the argmax is written there and returned (the
            walk graph's own target buffer: the walk then copies nothing).
    """
    if all_greedy or temperature is None:
        return logits.argmax(dim=-1) if greedy_out is None else torch.argmax(logits, dim=-1, out=greedy_out)
    if greedy_out is not None:
        raise ValueError("sample_rows: greedy_out is for all-greedy steps (all_greedy=True or no temperature)")
    greedy_tokens = logits.argmax(dim=-1)
    # No ``greedy.all()`` shortcut: reading it would wait for the GPU (vLLM's ``all_greedy``, from the host, is it).
    greedy = temperature < GREEDY_EPS
    scaled = logits.to(torch.float32) / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None].to(
        torch.float32
    )
    scaled = apply_top_k_top_p(apply_min_p(scaled, min_p), top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    if generators:
        if row_ranges is None:
            raise ValueError("seeded sampling needs row_ranges")
        if row_positions is not None:
            seeded = [(gen.initial_seed(), *row_ranges[req]) for req, gen in generators.items()]
            fill_seeded_noise(noise, row_positions, seeded, max_depth)
        else:
            for req, gen in generators.items():
                first, count = row_ranges[req]
                if count:
                    noise[first : first + count] = torch.empty(
                        (count, probs.shape[1]), dtype=probs.dtype, device=probs.device
                    ).exponential_(generator=gen)
    # Exponential race: argmax p / E is a sample of p (Gumbel-max in disguise).
    random_tokens = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, random_tokens)
