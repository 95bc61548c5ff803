"""Pure-Python DDTree, written from the algorithm's description.

Slow and obvious on purpose: the tests use it as the oracle for the Rust core
(`ddtree._core`), and the benchmarks measure the core against it. It follows
the same conventions as the core:

- a prefix is a tuple of ranks ``(r_1, ..., r_d)``; its score is the sum, in
  depth order and in double precision, of ``log_probs[j, r_j]``;
- the tree holds the ``budget`` best prefixes, popped from a heap keyed by
  ``(-score, rank_tuple)``, so equal scores go to the lexicographically
  smallest rank tuple;
- node 0 is the root; node i's token is ``tokens[i - 1]``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReferenceTree:
    tokens: np.ndarray  # int64 [n]
    parents: np.ndarray  # int32 [n + 1]
    depths: np.ndarray  # int32 [n + 1]
    scores: np.ndarray  # float32 [n + 1]

    def __len__(self) -> int:
        return len(self.parents)


def build_tree(log_probs: np.ndarray, token_ids: np.ndarray, budget: int) -> ReferenceTree:
    """The ``budget`` most probable prefixes, best first (see module docs)."""
    lp = np.asarray(log_probs, dtype=np.float32).tolist()
    ids = np.asarray(token_ids).tolist()
    depth = len(lp)
    width = len(lp[0]) if depth else 0
    tokens: list[int] = []
    parents = [-1]
    depths = [0]
    scores = [0.0]
    heap: list[tuple[float, tuple[int, ...], int]] = []
    if depth and width and budget > 0:
        heapq.heappush(heap, (-lp[0][0], (0,), 0))
    while heap and len(tokens) < budget:
        neg_score, ranks, parent = heapq.heappop(heap)
        node = len(parents)
        d = len(ranks)
        tokens.append(ids[d - 1][ranks[-1]])
        parents.append(parent)
        depths.append(d)
        scores.append(-neg_score)
        if ranks[-1] + 1 < width:
            sibling_score = scores[parent] + lp[d - 1][ranks[-1] + 1]
            heapq.heappush(heap, (-sibling_score, ranks[:-1] + (ranks[-1] + 1,), parent))
        if d < depth:
            heapq.heappush(heap, (-(-neg_score + lp[d][0]), ranks + (0,), node))
    return ReferenceTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int32),
        depths=np.array(depths, dtype=np.int32),
        scores=np.array(scores, dtype=np.float32),
    )


def ancestors_or_self(parents: np.ndarray, node: int) -> list[int]:
    """``node``, its parent, ..., the root."""
    chain = [node]
    while chain[-1] != 0:
        chain.append(int(parents[chain[-1]]))
    return chain


def compile_tree(tree: ReferenceTree, start: int = 0, window: int = 0) -> dict[str, np.ndarray]:
    """Positions, dense visibility mask and conv windows of ``tree``."""
    n = len(tree)
    mask = np.zeros((n, n), dtype=bool)
    windows = np.zeros((n, window), dtype=np.int32)
    for i in range(n):
        chain = ancestors_or_self(tree.parents, i)
        mask[i, chain] = True
        older = chain[1:] + [-(k + 1) for k in range(window)]
        windows[i] = older[:window][::-1]
    return {
        "positions": start + tree.depths.astype(np.int64),
        "mask": mask,
        "windows": windows,
    }


def accept(tree: ReferenceTree, target_tokens) -> tuple[list[int], int]:
    """Walk from the root while the target's token is a child's token."""
    target = [int(t) for t in target_tokens]
    path = [0]
    while True:
        node = path[-1]
        children = [c for c in range(1, len(tree)) if tree.parents[c] == node]
        match = [c for c in children if tree.tokens[c - 1] == target[node]]
        if not match:
            return path, target[node]
        path.append(match[0])


def kv_move_plan(path: list[int]) -> tuple[list[int], list[int]]:
    """Accepted node ``path[k]`` moves to slot ``k`` (identity moves dropped)."""
    moves = [(node, k) for k, node in enumerate(path) if node != k]
    return [s for s, _ in moves], [d for _, d in moves]


def expected_acceptance(tree: ReferenceTree) -> float:
    """1 (bonus) + the sum of every draft node's prefix probability."""
    return 1.0 + sum(math.exp(s) for s in tree.scores[1:].tolist())
