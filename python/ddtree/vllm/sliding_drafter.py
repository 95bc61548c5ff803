"""A DFlash drafter with sliding-window and full-attention layers (``DDTREE_SLIDING_DRAFTER=1``, experimental).

The released Qwen3.6-27B DFlash drafter has four ``sliding_attention`` layers (window 2048, causal) and one
``full_attention`` layer (bidirectional over the block). vLLM 0.25.1 refuses such a drafter while building it: its
V1 proposer takes one KV-cache group and one causality for every draft layer. What this module does instead
(docs/sliding-window-drafter.md has the map of vLLM's code it rests on):

* every draft layer is built without a window of its own (:func:`resolve_in_one_kv_group`, the worker patch of
  ``qwen3_dflash._resolve_layer_attention``), so all five keep full-attention KV specs: one drafter KV-cache group,
  as for an all-full drafter, and every context position stays in the cache;
* each step, the drafter's attention metadata is vLLM's, and the sliding layers get a copy of it with their own
  causality and window (:func:`masked_metadata`): vLLM 0.25.1's FlashAttention takes both from the metadata
  object of each layer (``flash_attn.py:873-882``). Attention runs outside the drafter's (PIECEWISE) CUDA graphs
  and reads its metadata by layer name at run time, so no capture changes.
* vLLM 0.33's FlashAttention metadata has no window: its FlashAttention takes the window from the layer
  (``impl.sliding_window``, ``flash_attn.py:1316-1322``) and only the causality from the metadata. So the sliding
  layers' windows are also set on the layers once, at load (:func:`set_layer_windows`); on 0.25 the metadata's
  window, the same, wins over the layer's. Its V1 config check refuses a mixed drafter outright
  (``VllmConfig._dflash_needs_multi_kv_group``; patch 11's config half answers that one KV group serves a ddtree
  engine's, and ddtree's own check names this switch).

Only FlashAttention applies a window from the metadata: another drafter backend is refused at start-up
(:func:`check_backends`). The mask is the one ddtree's reference engine runs (``ddtree.engine.drafter.
layer_attention``): a sliding layer's block query sees the keys at most ``window - 1`` positions before its own and
none after. Exact on an H200 with the test pair's drafter made sliding (``gpu-h200-device-plan-9e8b443``); the
released drafter not yet run.

No vLLM import at module level: the CPU tests import it without vLLM's GPU parts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from ddtree.vllm.config import SLIDING_DRAFTER_ENV, env_switch, field_names

SLIDING = "sliding_attention"

#: The one drafter attention backend whose window and causality come from each layer's metadata in vLLM 0.25.1.
WINDOWED_BACKEND = "FLASH_ATTN"

#: A draft layer's attention as trained: (causal, window in positions, None for none).
LayerMask = Tuple[bool, Optional[int]]


class SlidingDrafterError(ValueError):
    """A sliding-window drafter that cannot run as trained."""


def sliding_drafter_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """``DDTREE_SLIDING_DRAFTER=1`` (experimental): a drafter that mixes sliding-window and full-attention layers
    runs; 0 (default) refuses it before loading; any other value is refused with both meanings."""
    meanings = {"0": "a sliding-window drafter refused", "1": "a sliding-window drafter run (experimental)"}
    return env_switch(environ, SLIDING_DRAFTER_ENV, "0", meanings)


def is_mixed(layer_types: Optional[Sequence[Any]]) -> bool:
    """Whether ``layer_types`` has sliding-window layers beside others (the drafters vLLM 0.25.1 refuses)."""
    kinds = list(layer_types or ())
    sliding = sum(kind == SLIDING for kind in kinds)
    return 0 < sliding < len(kinds)


def layer_mask(config: Any, layer_index: int) -> LayerMask:
    """``(causal, window)`` of draft layer ``layer_index`` of a mixed drafter, by vLLM's own rules
    (``qwen3_dflash._resolve_layer_attention``, which refuses mixed drafters before it gets there): a sliding layer
    is causal with the window ``dflash_config.swa_window_size`` or ``sliding_window``; a full layer is not causal;
    ``dflash_config.causal`` overrides causality for every layer."""
    dflash_config = getattr(config, "dflash_config", None) or {}
    sliding = config.layer_types[layer_index] == SLIDING
    window = None
    if sliding:
        window = dflash_config.get("swa_window_size", getattr(config, "sliding_window", None))
        if window is None:
            raise SlidingDrafterError(
                f"drafter layer {layer_index} is 'sliding_attention' but its config gives no window "
                "(dflash_config.swa_window_size or sliding_window; transformers drops sliding_window when "
                "use_sliding_window is not true)"
            )
    forced = dflash_config.get("causal", None)
    causal = sliding if forced is None else bool(forced)
    return causal, (int(window) if window is not None else None)


def check_drafter_config(config: Any) -> None:
    """Every layer of a mixed drafter has a mask ddtree can run (raises :class:`SlidingDrafterError`)."""
    for index in range(len(config.layer_types)):
        layer_mask(config, index)


def resolve_in_one_kv_group(original: Callable) -> Callable:
    """The worker patch of ``qwen3_dflash._resolve_layer_attention``: for a mixed drafter under the switch, every
    layer is built without a window of its own (``(None, causal)``: a full-attention KV spec, so the drafter keeps
    one KV-cache group); its window reaches it through its attention metadata (:func:`masked_metadata`). Every
    other drafter is vLLM's."""

    def resolve(config, layer_idx):
        if not (sliding_drafter_enabled() and is_mixed(getattr(config, "layer_types", None))):
            return original(config, layer_idx)
        causal, _ = layer_mask(config, layer_idx)
        return None, causal

    return resolve


def draft_decoder_layers(model: Any) -> list:
    """The drafter's decoder layers in order: the modules with a ``self_attn.attn`` (vLLM's ``Attention``), as
    ``modules()`` walks them (registration order, whatever wraps the model)."""
    return [module for module in model.modules() if hasattr(getattr(module, "self_attn", None), "attn")]


def layer_masks(layers: Sequence[Any], config: Any, base_causal: bool) -> Dict[str, LayerMask]:
    """By attention layer name, the masks of the drafter's ``layers`` (vLLM's decoder layers, in order) that differ
    from what vLLM's metadata gives every layer (``base_causal``, no window)."""
    if not is_mixed(getattr(config, "layer_types", None)):
        return {}
    if len(layers) != len(config.layer_types):
        raise SlidingDrafterError(
            f"the drafter has {len(layers)} attention layers and {len(config.layer_types)} layer_types"
        )
    masks = {}
    for index, layer in enumerate(layers):
        mask = layer_mask(config, index)
        if mask != (base_causal, None):
            masks[layer.self_attn.attn.layer_name] = mask
    return masks


def flash_window(causal: bool, window: Optional[int]) -> Tuple[int, int]:
    """FlashAttention's ``(left, right)`` window for a mask: ``window`` positions including the query's own, after
    it too when not causal; ``(-1, -1)`` for none."""
    if window is None:
        return (-1, -1)
    return (window - 1, 0) if causal else (window - 1, window - 1)


def masked_metadata(per_layer: Dict[str, Any], masks: Mapping[str, LayerMask]) -> Dict[str, Any]:
    """``per_layer`` (vLLM's drafter metadata by layer name) with each masked layer's replaced by a copy with its
    causality, and its window where the metadata has one (vLLM 0.25); layers of one mask share one copy, the rest
    keep vLLM's object."""
    copies: Dict[Tuple[int, LayerMask], Any] = {}
    for name, mask in masks.items():
        base = per_layer[name]
        key = (id(base), mask)
        copy = copies.get(key)
        if copy is None:
            causal, window = mask
            fields = {"causal": causal}
            if "sliding_window" in field_names(type(base)):
                fields["sliding_window"] = flash_window(causal, window)
            copy = copies[key] = dataclasses.replace(base, **fields)
        per_layer[name] = copy
    return per_layer


def set_layer_windows(layers: Sequence[Any], masks: Mapping[str, LayerMask]) -> None:
    """Each masked layer's attention (vLLM's decoder ``layers``) gets its window, FlashAttention's ``(left, right)``:
    where vLLM's FlashAttention reads the window from the layer (0.33), not from the metadata (0.25)."""
    for layer in layers:
        attention = layer.self_attn.attn
        mask = masks.get(attention.layer_name)
        if mask is not None:
            attention.impl.sliding_window = flash_window(*mask)


def check_backends(attn_groups: Sequence[Any], masks: Mapping[str, LayerMask]) -> None:
    """Every masked layer's attention backend applies its metadata's window (FlashAttention in vLLM 0.25.1)."""
    for group in attn_groups:
        name = group.backend.get_name()
        masked = [layer for layer in group.layer_names if layer in masks]
        if masked and name != WINDOWED_BACKEND:
            raise SlidingDrafterError(
                f"the drafter's sliding-window layers {masked} would run on the {name} attention backend, which "
                f"takes no window from the metadata in vLLM 0.25: only {WINDOWED_BACKEND} runs them as trained "
                "(leave speculative_config.attention_backend unset on a GPU that FlashAttention serves)"
            )
