"""Torch reference kernels for exact DDTree verification (needs torch)."""

from .gdn_tree import (
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
from .tree_topology import ancestor_or_self_mask, root_path, tree_depths, validate_parents

__all__ = [
    "QWEN3_6_27B_GDN",
    "GdnModelShape",
    "TreeDeltaRuleCache",
    "ancestor_or_self_mask",
    "chain_gated_delta_rule",
    "commit_conv_history",
    "commit_gdn_state",
    "commit_gdn_state_batched",
    "commit_recurrent_state",
    "format_memory_table",
    "l2_normalize",
    "replay_recurrent_state",
    "root_path",
    "tree_causal_conv1d",
    "tree_causal_conv1d_batched",
    "tree_depths",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_batched",
    "validate_parents",
    "verification_memory_bytes",
]
