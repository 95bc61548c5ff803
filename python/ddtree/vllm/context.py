"""The one channel through which a step's trees reach vLLM's layers.

vLLM builds the attention metadata and runs the model's layers with its own arguments only; nothing of the
runner's reaches them. So the runner publishes the step's tree layout here (:func:`publish`, after the
verification plan and before vLLM builds the metadata) and withdraws it once the forward is done
(:func:`withdraw`). One object per step, :class:`PublishedStep`: what the tree-attention metadata builder attaches
to its metadata and what the GDN layers (patch 5d) verify with. Both hold views of the runner's fixed-address
buffers (:class:`ddtree.vllm.graphs.TreeStepBuffers`), so eager, PIECEWISE and FULL steps read the same addresses.

No vLLM import: CI tests it on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ddtree.vllm.gdn import GdnTreeStep


@dataclasses.dataclass
class TreeAttentionInputs:
    """The tree-attention side of one step's layout."""

    row_start: torch.Tensor  # [num_reqs] int32, -1 for sequences without a tree
    ancestor_bits: torch.Tensor  # [T, words] int32
    num_reqs: int
    num_tokens: int


@dataclasses.dataclass
class PublishedStep:
    """One step's trees as the layers see them."""

    attention: TreeAttentionInputs
    gdn: Optional["GdnTreeStep"] = None  # None: the target has no GDN layers


_PUBLISHED: Optional[PublishedStep] = None


def publish(step: PublishedStep) -> None:
    global _PUBLISHED
    _PUBLISHED = step


def withdraw() -> None:
    global _PUBLISHED
    _PUBLISHED = None


def published() -> Optional[PublishedStep]:
    """The step being run (None: no tree in this step, or outside a step)."""
    return _PUBLISHED
