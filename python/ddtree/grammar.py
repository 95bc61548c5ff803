"""Grammar masks for a whole draft tree: one bitmask row per node, the grammar's mask after that node's root path.

Node ``j``'s row (the root ``j = 0``) is the grammar's mask after the committed text and the draft tokens on the
path root -> ``j`` (the root's own token is committed already). A tree verification samples node ``j``'s children
from that row, so a child whose token the grammar refuses there is never accepted, and every node samples the
grammar-masked distribution of its own history: the output is distributed as decoding under the grammar.

xgrammar's ``GrammarMatcher.traverse_draft_tree`` computes the rows in C++ with one accept/rollback walk (the
matcher is left as it was). It zeroes the row of a node refused at its parent's row or ending the grammar and leaves
a refused node's descendants untouched. Those rows are never read by an accepted path (a refused node is never
accepted; after the grammar's end only a stop token follows, which ends the request), but they reach the sampler's
logits, where an all-refusing row would turn into NaN: they are made all-allowed here, vLLM's rule for a request
whose grammar has ended.

Used by the vLLM adapter (``ddtree.vllm.grammar``, structured outputs) and the reference engine
(``ddtree.engine.constraints``). No vLLM import; xgrammar only through the matcher passed in.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

#: A bitmask word with every token allowed (xgrammar's rows are int32, one bit per token).
ALL_ALLOWED = -1


def first_child_next_sibling(parents: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The tree as first-child / next-sibling links (int64, -1 for none), from ``parents`` in pop order
    (``parents[0] = -1``, every other node's parent earlier): siblings linked in node order."""
    parents = np.asarray(parents, dtype=np.int64)
    n = parents.shape[0]
    if n == 0 or parents[0] != -1 or bool((parents[1:] < 0).any()) or bool((parents[1:] >= np.arange(1, n)).any()):
        raise ValueError("parents must be in pop order: parents[0] == -1 and 0 <= parents[j] < j for j >= 1")
    first_child = np.full(n, -1, dtype=np.int64)
    next_sibling = np.full(n, -1, dtype=np.int64)
    order = np.argsort(parents[1:], kind="stable") + 1  # the children grouped by parent, in node order
    grouped = parents[order]
    starts = np.ones(order.shape[0], dtype=bool)
    starts[1:] = grouped[1:] != grouped[:-1]
    first_child[grouped[starts]] = order[starts]
    same = ~starts[1:]  # order[k + 1] is order[k]'s next sibling where both share a parent
    next_sibling[order[:-1][same]] = order[1:][same]
    return first_child, next_sibling


def fill_tree_bitmask(matcher, parents: np.ndarray, tokens: np.ndarray, out) -> int:
    """Writes node ``j``'s grammar mask into row ``j`` of ``out`` for every node of one tree; returns how many rows
    the grammar gave no mask (made all-allowed: a node it refuses, one below such a node, one whose token ends it,
    or every node of a grammar that has ended).

    Args:
        matcher: the request's ``xgrammar.GrammarMatcher``, advanced through the committed text (left unchanged).
        parents: ``[n + 1]`` tree-local parents in pop order, ``-1`` for the root.
        tokens: ``[n]`` the draft tokens of nodes ``1 .. n`` (the root's is committed).
        out: ``[n + 1, words]`` int32 rows (a torch tensor or a numpy array, written in place), ``words`` the
            matcher's bitmask width.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    n = np.asarray(parents).shape[0]
    if tokens.shape != (n - 1,):
        raise ValueError(f"{tokens.shape[0]} draft tokens for a tree of {n} nodes (expected {n - 1})")
    rows = torch.from_numpy(out) if isinstance(out, np.ndarray) else out
    if rows.dtype != torch.int32 or rows.dim() != 2 or rows.shape[0] != n:
        raise ValueError(f"out must be int32 [{n}, words]; got {tuple(rows.shape)} {rows.dtype}")
    if matcher.is_terminated():  # the grammar has ended: nothing but the stop check reads these rows
        rows.fill_(ALL_ALLOWED)
        return n
    first_child, next_sibling = first_child_next_sibling(parents)
    draft_tokens = np.concatenate(([0], tokens))  # (the root's token is not read)
    rows.zero_()
    matcher.traverse_draft_tree(
        torch.from_numpy(first_child), torch.from_numpy(next_sibling), torch.from_numpy(draft_tokens), rows
    )
    # Zeroed (refused, or the grammar ended there) and untouched (below a refused node) rows: never on an accepted
    # path, all-allowed so that the logits stay finite. (Through numpy: torch's boolean reduction and masked
    # assignment took 0.6 ms of a 64-node tree's ~4 ms at a 152k vocabulary, numpy's 0.08 ms.)
    view = rows.numpy()
    unmasked = ~view.any(axis=1)
    view[unmasked] = ALL_ALLOWED
    return int(unmasked.sum())
