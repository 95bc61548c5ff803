"""Prefix caching for hybrid (Gated DeltaNet) targets: vLLM's mamba cache mode "align" beside tree steps.

In vLLM 0.25's align mode, column ``j`` of a request's state-block row holds, once hashed, the recurrent state after
exactly ``(j + 1) * block_size`` tokens; those blocks are what a later request with the same prefix starts from. The
running state of a step lives in column ``(c + n - 1) // block_size`` (``c`` computed tokens, ``n`` scheduled this
step, drafts included); before the forward vLLM copies it there from the previous step's column, and after a chain
step it copies the state at a crossed block boundary out of its per-draft columns. ddtree keeps one state per
request (no per-draft columns) and commits the accepted path into it, so four things change
(docs/prefix-caching.md):

1. Every row's accepted count stays 1 for vLLM's pre-step copy (the whole running state moves, not a per-draft
   column), and vLLM's post-step copies are not run (``DDTreeGPUModelRunner._update_states_after_model_execute``):
   ddtree writes boundary states itself.
2. *Boundary commits* (:func:`boundary_prefixes`): a tree row whose root lies in a block before its running column
   may reach that block's end, ``(c // block_size + 1) * block_size``, with its accepted path. That block's column
   gets the state after exactly that many tokens: the commit of the path's first ``prefix`` entries (root
   included), written there before the main commit overwrites the running state (``gdn.commit_boundaries``).
   Where the root's block is the running column, the main commit writes the boundary state itself when the path
   ends there.
3. The scheduler frees state blocks :func:`free_lag_tokens` later than vLLM would (``MambaManager
   .remove_skipped_blocks``): a boundary column is the one before the running column, which vLLM frees as soon as
   its optimistic count passes it, while the worker may still write it and before it is hashed.
4. The block size must hold a step's tokens (:func:`block_size_problem`): the scheduler's running column then moves
   at most one block a step, so every column from the request's first decode step on is given a real block, and the
   lag keeps those the worker may still read or write.

No vLLM or torch import: ``tests/vllm_adapter/test_hybrid_prefix_caching.py`` drives vLLM's own
``KVCacheManager`` through tree steps with these rules and checks every write and every hashed state block.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def boundary_prefixes(
    computed: np.ndarray, scheduled: np.ndarray, block_size: int, max_path: int
) -> Tuple[np.ndarray, np.ndarray]:
    """For tree rows with ``computed`` tokens in their state and ``scheduled`` tokens this step: how many entries of
    each accepted path (root included) end exactly at the end of the root's block (0: no boundary commit for the
    row), and the column of that block.

    A row gets a boundary commit when its root's block is not its running column (where the main commit writes)
    and a path of ``max_path`` entries (the root and the drafter's depth) can reach the block's end. On the device
    a row whose accepted path is shorter than its prefix writes nothing (``gdn.boundary_commit_plan``).
    """
    computed = np.asarray(computed, dtype=np.int64)
    running = (computed + np.asarray(scheduled, dtype=np.int64) - 1) // block_size
    column = computed // block_size
    prefix = (column + 1) * block_size - computed
    needed = (column != running) & (prefix <= max_path)
    return np.where(needed, prefix, 0).astype(np.int32), column


def free_lag_tokens(budget: int) -> int:
    """Tokens by which ddtree's scheduler holds back vLLM's count before freeing state blocks.

    vLLM frees every column before the one holding its count's last token. Under asynchronous scheduling its count
    runs up to ``budget`` tokens ahead of the worker's (the in-flight step's drafts, counted accepted), so the
    columns a step reads and writes (from the one holding the worker's last computed token) need a lag of
    ``budget``; the next step's ``budget + 1`` more are scheduled before the crossing step's output is hashed, so
    ``2 * (budget + 1)`` also keeps a boundary column until its state is hashed.
    """
    return 2 * (int(budget) + 1)


def block_size_problem(block_size: int, budget: int) -> Optional[str]:
    """Why ``block_size`` cannot serve prefix caching with trees of ``budget`` (None: it can).

    A step schedules ``budget + 1`` tokens; with at most a block of them, vLLM's running column advances at most one
    block a step, so it gives every column a real block in turn (a column it skipped would be a null block, where a
    boundary commit could not write).
    """
    needed = int(budget) + 1
    if int(block_size) < needed:
        return (
            f"prefix caching with a hybrid target needs a state block of at least budget + 1 = {needed} tokens for "
            f"ddtree_budget {budget}; vLLM chose block_size {block_size}. Set a larger --block-size (a multiple of "
            f"{block_size}) or a smaller ddtree_budget"
        )
    return None
