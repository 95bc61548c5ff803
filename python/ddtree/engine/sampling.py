"""The target's token at every verified node: argmax, or a sample of its own processed distribution.

Sample-then-walk (``ddtree.accept``) is lossless because every node's token
is an independent sample from exactly the distribution autoregressive
sampling would use at that context; so the processing here (temperature,
then top-k, then top-p) is the *whole* sampling rule and is applied the same
way in every mode, autoregressive included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def validate(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingSettings) -> torch.Tensor:
    """The distribution ``[N, V]`` (fp32) sampled from at each of ``N`` contexts ``logits [N, V]``.

    Order: divide by temperature, keep the top-k logits, then the smallest set
    of most probable tokens whose mass reaches top_p (the token that crosses
    top_p is kept), renormalise.
    """
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth_best = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = scores.softmax(dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """One independent sample per row of ``probs [N, V]`` -> int64 ``[N]``."""
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def target_tokens(logits: torch.Tensor, params: SamplingSettings, generator: Optional[torch.Generator]) -> torch.Tensor:
    """The target's token at each node from its logits ``[N, V]`` -> int64 ``[N]``."""
    if params.greedy:
        return logits.argmax(dim=-1)
    # Sampled on the CPU generator so results do not depend on the device.
    return sample_from_probs(processed_probs(logits, params).cpu(), generator)
