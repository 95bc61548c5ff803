"""Draft proposals: per-position logits from a drafter, turned into the tree to verify.

The engine talks to a drafter through :class:`DraftProposer`, so tests can
plug in a drafter with a known acceptance rate; :class:`DFlashDraftProposer` is
the real one.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Tuple

import numpy as np
import torch

import ddtree

from .drafter import DFlashDraftModel, DrafterContext
from .target import TargetModel

MODES = ("ar", "chain", "ddtree")


class DraftProposer(Protocol):
    """What the engine needs from a drafter."""

    #: L, the most positions one proposal covers (block_size - 1 for DFlash).
    num_draft_positions: int
    #: Target layers whose hidden states the drafter reads (may be empty).
    feature_layer_ids: Sequence[int]

    def new_request(self) -> object:
        """Fresh per-request drafter state."""

    def add_context(self, state: object, features: torch.Tensor) -> None:
        """Target features ``[C, F]`` of the next C committed tokens the target has run."""

    def draft_logits(self, state: object, committed_tokens: Sequence[int], depth: int) -> torch.Tensor:
        """Logits ``[depth, V]`` for the ``depth`` tokens after ``committed_tokens``.

        ``committed_tokens[-1]`` is the root (the bonus token of the last step).
        """


class DFlashDraftProposer:
    """A :class:`DFlashDraftModel` fed by the target's embedding, features and LM head."""

    def __init__(self, drafter: DFlashDraftModel, target: TargetModel):
        self.drafter = drafter
        self.target = target
        self.num_draft_positions = drafter.num_draft_positions
        self.feature_layer_ids = list(drafter.target_layer_ids)

    def new_request(self) -> DrafterContext:
        return DrafterContext()

    def add_context(self, state: DrafterContext, features: torch.Tensor) -> None:
        self.drafter.extend_context(state, features.to(self.drafter.fc.weight.dtype))

    @torch.no_grad()
    def draft_logits(self, state: DrafterContext, committed_tokens: Sequence[int], depth: int) -> torch.Tensor:
        """Always a full block ``[bonus, MASK x (block_size - 1)]``, cut to ``depth`` afterwards.

        The block attends to itself bidirectionally, so a shorter block (fewer masks) would change
        every slot's output: the drafter was trained on full blocks only.
        """
        if not 0 <= depth <= self.num_draft_positions:
            raise ValueError(f"depth {depth} outside [0, {self.num_draft_positions}]")
        block = torch.full(
            (self.num_draft_positions + 1,), self.drafter.mask_token_id, dtype=torch.int64, device=self.target.device
        )
        block[0] = committed_tokens[-1]
        embeddings = self.target.embed_tokens(block).to(self.drafter.fc.weight.dtype)
        hidden = self.drafter(embeddings, state)[1 : depth + 1]
        return self.target.lm_head(hidden.to(self.target.dtype)).float()


def empty_tree() -> ddtree.Tree:
    """A tree with only the root: one target step per token (autoregressive)."""
    return ddtree.build_tree(np.zeros((0, 1), np.float32), np.zeros((0, 1), np.int64), 0)


def draft_tree(mode: str, draft_logits: torch.Tensor, budget: int) -> ddtree.Tree:
    """The tree to verify from drafter logits ``[L, V]``.

    * ``chain``: the drafter's argmax at every position (DFlash's proposal);
    * ``ddtree``: the ``budget`` most probable prefixes under the drafter's
      factorized distribution, from its top-``min(budget, V)`` tokens per position.
    """
    return draft_tree_with_ranks(mode, draft_logits, budget)[0]


def draft_tree_with_ranks(mode: str, draft_logits: torch.Tensor, budget: int) -> Tuple[ddtree.Tree, np.ndarray]:
    """:func:`draft_tree` and each node's rank among the drafter's candidates at its depth (``[n + 1]``, the
    root 0): 0 is the drafter's top-1 token, so a path of rank-0 nodes is the DFlash chain's own proposal."""
    depth, vocab = draft_logits.shape
    if mode == "ar" or depth == 0:
        return empty_tree(), np.zeros(1, dtype=np.int64)
    log_probs = draft_logits.float().log_softmax(dim=-1)
    width = 1 if mode == "chain" else max(1, min(budget, vocab))
    top = log_probs.topk(width, dim=-1)  # sorted, as build_tree requires
    values = np.ascontiguousarray(top.values.cpu().numpy(), dtype=np.float32)
    ids = np.ascontiguousarray(top.indices.cpu().numpy(), dtype=np.int64)
    tree = ddtree.build_tree(values, ids, depth if mode == "chain" else budget)
    ranks = np.zeros(len(tree), dtype=np.int64)
    if len(tree) > 1:
        candidates = ids[tree.depths[1:].astype(np.int64) - 1]  # [n, width]: each node's depth's candidates
        ranks[1:] = (candidates == tree.tokens[:, None]).argmax(axis=1)
    return tree, ranks
