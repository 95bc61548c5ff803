"""What the vLLM adapter checks in a DFlash drafter's ``config.json`` before vLLM builds it.

Sliding-window layers: the released Qwen3.6-27B DFlash drafter has ``layer_types`` = four ``sliding_attention``
layers (window 2048, causal among the block's tokens in z-lab's reference code) and one ``full_attention`` layer.
vLLM 0.25's DFlash drafter refuses mixed sliding/full drafters when it builds them (after the target has loaded),
and its V1 proposer assumes one KV-cache group and one causality for every draft layer, so the adapter refuses such
a drafter up front, with the reason. The reference engine runs these layers as trained
(:func:`ddtree.engine.drafter.layer_attention`). What running them in vLLM would take: docs/sliding-window-drafter.md.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ddtree.errors import DDTreeError


class UnsupportedDrafterError(DDTreeError, ValueError):
    """A drafter whose layers ddtree cannot run as they were trained."""


def sliding_window_layers(layer_types: Optional[Sequence[Any]], use_sliding_window: Optional[bool] = None) -> List[int]:
    """Indices of the layers ``layer_types`` marks ``sliding_attention`` (none when ``use_sliding_window`` is False,
    the Qwen switch that keeps a window size with the feature off)."""
    if use_sliding_window is False or not layer_types:
        return []
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def check_drafter_layers(where: str, layer_types: Optional[Sequence[Any]], use_sliding_window: Optional[bool]) -> None:
    """Refuses a drafter with sliding-window layers (``where`` names it in the message).

    vLLM 0.25's DFlash drafter reads ``layer_types`` alone: it refuses a mixed drafter while building it (after the
    target has loaded) and windows every ``sliding_attention`` layer, whatever ``use_sliding_window`` says. So the
    layer kinds decide here too; transformers loads a config without ``use_sliding_window: true`` with the switch
    off, and checking the switch let such a drafter through to vLLM's late refusal."""
    sliding = sliding_window_layers(layer_types)
    if sliding:
        switch = (
            " (use_sliding_window is off in its config, but vLLM's DFlash drafter reads layer_types alone)"
            if use_sliding_window is False
            else ""
        )
        raise UnsupportedDrafterError(
            f"{where}: the drafter has sliding-window attention layers ({sliding} of {len(layer_types)} are "
            f"'sliding_attention' in layer_types){switch}, which vLLM 0.25's DFlash drafter cannot build and ddtree's "
            "vLLM adapter runs only beside full-attention layers, with DDTREE_SLIDING_DRAFTER=1 (experimental; run as "
            "full attention they would draft unlike the trained drafter). Otherwise use a "
            "drafter whose layers are all full attention; ddtree's reference engine (ddtree generate) runs this one "
            "(docs/sliding-window-drafter.md)."
        )
