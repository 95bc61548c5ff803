"""DDTree speculative decoding: draft trees from a DFlash drafter's per-position
distributions, verified in one target pass, accepted losslessly.

The tree logic is the Rust extension ``ddtree._core``; ``ddtree.reference`` is
a pure-Python oracle of the same algorithm. One decoding step:

    tree = build_tree(log_probs, token_ids, budget)       # drafter -> tree
    compiled = compile_tree(tree, start, window)          # -> positions, masks
    path, bonus = accept(tree, target_tokens)             # target -> accepted
    src, dst = kv_move_plan(path)                         # -> KV commit

The batched forms (``build_trees``, ``compile_trees``, ``accept_trees``) do the
same for every request of a step in one call each; ``verify_layout_into`` and
``acceptance_layout_into`` lay a step's trees out as an engine's flat batch needs
them, into the caller's (reused, pinned) arrays.
"""

from ddtree._core import (
    MAX_BATCH_NODES,
    MAX_BIT_WORDS,
    MAX_BUDGET,
    MAX_DENSE_NODES,
    MAX_THREADS,
    MAX_WINDOW,
    AcceptedBatch,
    CompiledBatch,
    CompiledTree,
    Executor,
    Tree,
    TreeBatch,
    __version__,
    accept,
    accept_trees,
    acceptance_layout_into,
    build_tree,
    build_trees,
    compile_tree,
    compile_trees,
    kv_move_plan,
    verify_layout_into,
)
from ddtree.errors import DDTreeError

__all__ = [
    "DDTreeError",
    "MAX_BATCH_NODES",
    "MAX_BIT_WORDS",
    "MAX_BUDGET",
    "MAX_DENSE_NODES",
    "MAX_THREADS",
    "MAX_WINDOW",
    "AcceptedBatch",
    "CompiledBatch",
    "CompiledTree",
    "Executor",
    "Tree",
    "TreeBatch",
    "__version__",
    "accept",
    "accept_trees",
    "acceptance_layout_into",
    "build_tree",
    "build_trees",
    "compile_tree",
    "compile_trees",
    "kv_move_plan",
    "verify_layout_into",
]
