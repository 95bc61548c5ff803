"""Exact DDTree verification kernels (needs torch), one concern per module, ``*_reference`` (torch, the oracles)
and ``*_triton`` (the GPU kernels, also run on CPU under ``TRITON_INTERPRET=1``):

* ``topology``: parents, depths, root paths, ancestor masks of a flattened tree;
* ``attention_reference``: tree attention over a dense prefix (the engine's layout);
* ``paged_attention_reference`` / ``paged_attention_triton``: tree attention in vLLM's paged KV cache;
* ``gdn_reference`` / ``gdn_triton``: Gated DeltaNet verification and state commit of trees;
* ``kv_moves``: the accepted path's K/V moved to consecutive slots (dense and paged caches).

This package re-exports the torch references; the Triton modules are imported where they run."""

from .gdn_reference import (
    QWEN3_6_27B_GDN,
    GdnModelShape,
    TreeDeltaRuleCache,
    chain_gated_delta_rule,
    commit_conv_history,
    commit_gdn_state,
    commit_gdn_state_batched,
    commit_recurrent_state,
    format_memory_table,
    l2_normalize,
    replay_recurrent_state,
    tree_causal_conv1d,
    tree_causal_conv1d_batched,
    tree_gated_delta_rule,
    tree_gated_delta_rule_batched,
    verification_memory_bytes,
)
from .attention_reference import (
    tree_attention,
    tree_attention_batched,
    tree_attention_mask,
    tree_positions,
)
from .kv_moves import apply_kv_moves, kv_compaction_plan
from .topology import ancestor_or_self_mask, root_path, tree_depths, validate_parents

__all__ = [
    "QWEN3_6_27B_GDN",
    "GdnModelShape",
    "TreeDeltaRuleCache",
    "ancestor_or_self_mask",
    "apply_kv_moves",
    "chain_gated_delta_rule",
    "commit_conv_history",
    "commit_gdn_state",
    "commit_gdn_state_batched",
    "commit_recurrent_state",
    "format_memory_table",
    "kv_compaction_plan",
    "l2_normalize",
    "replay_recurrent_state",
    "root_path",
    "tree_attention",
    "tree_attention_batched",
    "tree_attention_mask",
    "tree_causal_conv1d",
    "tree_causal_conv1d_batched",
    "tree_depths",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_batched",
    "tree_positions",
    "validate_parents",
    "verification_memory_bytes",
]
