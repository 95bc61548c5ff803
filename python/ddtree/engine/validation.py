"""Checks that run before any compute, with errors that say what to change."""

from __future__ import annotations

from typing import Optional, Sequence

from ddtree.errors import DDTreeError

from .drafter import DFlashDraftModel
from .drafting import MODES
from .target import TargetModel


class EngineInputError(DDTreeError, ValueError):
    """Bad models, prompts or settings, found before any compute."""


def check_drafter_matches_target(drafter: DFlashDraftModel, target: TargetModel) -> None:
    """The drafter shares the target's embedding and LM head and reads its layers."""
    if drafter.vocab_size != target.vocab_size:
        raise EngineInputError(
            f"drafter vocab_size {drafter.vocab_size} != target vocab size {target.vocab_size}: "
            "the drafter shares the target's embedding and LM head"
        )
    if drafter.hidden_size != target.hidden_size:
        raise EngineInputError(
            f"drafter hidden_size {drafter.hidden_size} != target hidden_size {target.hidden_size}: "
            "the drafter embeds with the target's embedding and reads its hidden states"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_layers]
    if bad or not drafter.target_layer_ids:
        raise EngineInputError(
            f"drafter target_layer_ids {drafter.target_layer_ids} must be non-empty and in "
            f"[0, {target.num_layers}) (the target has {target.num_layers} layers); out of range: {bad}"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise EngineInputError(
            f"drafter mask_token_id {drafter.mask_token_id} is not a token id of the target "
            f"(vocab size {target.vocab_size})"
        )
    if drafter.block_size < 1:
        raise EngineInputError(f"drafter block_size must be >= 1, got {drafter.block_size}")


def check_settings(mode: str, budget: int, max_new_tokens: int, has_drafter: bool) -> None:
    if mode not in MODES:
        raise EngineInputError(f"mode must be one of {MODES}, got {mode!r}")
    if budget < 0:
        raise EngineInputError(f"budget must be >= 0 (draft tree nodes per step), got {budget}")
    if max_new_tokens < 1:
        raise EngineInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if mode != "ar" and not has_drafter:
        raise EngineInputError(f"mode {mode!r} needs a drafter")


def check_prompts(prompts: Sequence[Sequence[int]], target: TargetModel, max_positions: Optional[int] = None) -> None:
    """Non-empty, valid token ids, and room for at least one new token within max_position_embeddings."""
    limit = target.max_positions if max_positions is None else max_positions
    if not prompts:
        raise EngineInputError("no prompts given")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise EngineInputError(f"prompt {index} is empty")
        if len(prompt) >= limit:
            raise EngineInputError(
                f"prompt {index} has {len(prompt)} tokens; the target allows {limit} positions "
                f"(max_position_embeddings), so prompts must be shorter than {limit} tokens"
            )
        bad = [t for t in prompt if not 0 <= int(t) < target.vocab_size]
        if bad:
            raise EngineInputError(f"prompt {index} has token ids outside [0, {target.vocab_size}): {bad[:5]}")
