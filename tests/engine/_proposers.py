"""Test drafters with a controllable acceptance rate (the engine's DraftProposer protocol)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np
import torch


class NoisyOracleProposer:
    """Knows each request's reference continuation and proposes it with noise.

    At every position the reference token gets a large logit (the drafter's
    argmax) with probability ``p_top``, a moderate one (usually a lower-ranked
    candidate -- a sibling branch in a DDTree) with probability ``p_near``,
    and nothing otherwise. So chains accept a few tokens, trees accept more and
    often along non-first children, which exercises KV compaction and GDN
    commits of long, gappy paths. Correctness must never depend on it.
    """

    num_draft_positions: int
    feature_layer_ids: Sequence[int] = ()

    def __init__(
        self,
        references: Sequence[Sequence[int]],
        vocab_size: int,
        depth: int = 6,
        p_top: float = 0.6,
        p_near: float = 0.3,
        seed: int = 0,
    ):
        self.references = [list(r) for r in references]
        self.vocab_size = vocab_size
        self.num_draft_positions = depth
        self.p_top, self.p_near = p_top, p_near
        self.seed = seed

    def new_request(self) -> Dict:
        return {}

    def add_context(self, state, features) -> None:
        pass

    def draft_logits(self, state, committed_tokens: Sequence[int], depth: int) -> torch.Tensor:
        reference = next((r for r in self.references if r[: len(committed_tokens)] == list(committed_tokens)), None)
        rng = np.random.default_rng([self.seed, len(committed_tokens)])
        logits = rng.normal(size=(depth, self.vocab_size))
        for d in range(depth):
            position = len(committed_tokens) + d
            if reference is None or position >= len(reference):
                continue
            roll = rng.random()
            if roll < self.p_top:
                logits[d, reference[position]] += 8.0
            elif roll < self.p_top + self.p_near:
                logits[d, reference[position]] += 2.0
        return torch.tensor(logits, dtype=torch.float32)


class TargetMimicProposer:
    """Drafts from the target's own logits plus fixed noise, memoised per context.

    Depth 1 is the target's distribution after the committed tokens, depth d
    the target's after appending the drafted argmaxes; Gaussian noise (seeded
    by the context) keeps it imperfect. Trees from it are accepted deep and
    rejected often enough to exercise every branch of the walk. Only for
    small tests: it runs transformers' forward once per new context.
    """

    feature_layer_ids: Sequence[int] = ()

    def __init__(self, model, depth: int = 2, noise: float = 1.0):
        self.model = model
        self.num_draft_positions = depth
        self.noise = noise
        self._memo: Dict[tuple, torch.Tensor] = {}

    def new_request(self) -> Dict:
        return {}

    def add_context(self, state, features) -> None:
        pass

    @torch.no_grad()
    def draft_logits(self, state, committed_tokens: Sequence[int], depth: int) -> torch.Tensor:
        key = (tuple(committed_tokens), depth)
        if key not in self._memo:
            context: List[int] = list(committed_tokens)
            rows = []
            for d in range(depth):
                logits = self.model(torch.tensor([context])).logits[0, -1].float()
                rng = torch.Generator().manual_seed(hash(tuple(context)) % (2**31))
                logits = logits + self.noise * torch.randn(logits.shape, generator=rng)
                rows.append(logits)
                context.append(int(logits.argmax()))
            self._memo[key] = torch.stack(rows)
        return self._memo[key]
