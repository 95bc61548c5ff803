"""A request's grammar in the reference engine: which tokens each tree node may be followed by.

The engine masks each verified node's logits row with the grammar's mask after that node's root path
(:func:`ddtree.grammar.fill_tree_bitmask`) before taking the target's token there, and advances the grammar by the
tokens it emits. Every node then samples the grammar-masked distribution of its own history, so greedy output
equals greedy decoding under the grammar and sampled output has its distribution, as without a grammar.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ddtree.grammar import fill_tree_bitmask

from .validation import EngineInputError


class GrammarConstraint:
    """One request's grammar: a fresh matcher of an xgrammar ``CompiledGrammar``, whose tokenizer info must have
    the target's vocabulary size (its logits width: ``xgrammar.TokenizerInfo.from_huggingface(tokenizer,
    vocab_size=...)``)."""

    def __init__(self, compiled):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = int(compiled.tokenizer_info.vocab_size)
        self._words = (self.vocab_size + 31) // 32
        self._bits = torch.arange(32, dtype=torch.int64)

    def node_masks(self, parents: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """bool ``[n + 1, vocab_size]`` for a tree in pop order (``parents``, -1 for the root; ``tokens`` of nodes
        1..n, as :class:`ddtree.Tree` holds them): row ``j`` the tokens the grammar allows after node ``j``'s root
        path (every token where the path leaves the grammar or ends it: no accepted path reads such a row)."""
        n = len(parents)
        rows = torch.zeros((n, self._words), dtype=torch.int32)
        fill_tree_bitmask(self.matcher, np.asarray(parents), np.asarray(tokens), rows)
        bits = (rows.to(torch.int64).unsqueeze(-1) >> self._bits) & 1
        return bits.reshape(n, -1)[:, : self.vocab_size].bool()

    def advance(self, tokens: Sequence[int]) -> None:
        """The grammar after the request emitted ``tokens``; nothing after its end (a stop token ends it)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"the grammar refused the emitted token {int(token)} (a masking bug)")


def masked_logits(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``logits [n + 1, V]`` with every token a node's mask refuses at -inf (a copy)."""
    if masks.shape != logits.shape:
        raise EngineInputError(
            f"the grammar's masks are {tuple(masks.shape)} for logits {tuple(logits.shape)}: its tokenizer info's "
            "vocab_size must be the target's logits width"
        )
    return logits.masked_fill(~masks.to(logits.device), float("-inf"))
