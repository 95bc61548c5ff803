"""DDTree's tree build in fixed-shape torch operations: every request's tree of ``budget`` nodes from the drafter's
top-K, on whatever device the top-K lives on, without a host round trip (capture-safe: no data-dependent shape,
no host synchronisation).

Why: under vLLM's CUDA graphs the test pair's step is host work (the GPU busy ~10% of it), and the largest part of
ddtree's own is the plan, which starts by waiting for the drafter's top-K on the host and building the trees there
(``ddtree.build_trees``). Built on the device, the trees never leave it; what the plan lays out from them (positions,
ancestor bits, conv windows, the walk's node arrays) can follow in the same graph. This module is that first step;
the runner does not use it yet (``docs/performance.md``, "The host path").

The tree is the Rust core's (``rust/src/build.rs``): the ``budget`` most probable prefixes of rank tuples, a
prefix's score the float64 sum of its ranks' log-probabilities in depth order, equal scores ordered by the
lexicographically smaller rank tuple, nodes in that order (the heap's pop order). Built depth by depth:

* A prefix among the ``budget`` best at its depth has its parent among the ``budget`` best at the depth above
  (each better parent has a first child that beats it), and a rank at or past ``budget`` never makes the cut (its
  ``budget`` elder siblings beat it): each depth keeps ``budget`` prefixes, chosen from ``budget x min(K, budget)``
  children by one stable sort (children laid out in lexicographic order, so equal scores keep it).
* The tree is the ``budget`` best of all kept prefixes and the root: one stable sort by score over the prefixes
  laid out in lexicographic order across depths (a radix sort on their rank tuples, deepest rank first).

Exact against the Rust core for log-probabilities <= 0 (a parent then never scores below its child, so the best
prefixes are prefix-closed and the sort order is the heap's pop order). A log-softmax's top entry can round a hair
above 0 (the core accepts up to 1e-3): here such entries count as 0, so a tree may then differ from the core's (it
is still a valid tree; verification is exact for any tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceTrees:
    """``R`` trees of ``budget + 1`` nodes each (root first, then pop order), every tensor ``[R, budget + 1]``."""

    parents: torch.Tensor  # int64, tree-local; -1 for the root
    depths: torch.Tensor  # int64
    tokens: torch.Tensor  # int64; the root's is -1 (the target's last sampled token, not known here)
    scores: torch.Tensor  # float64 prefix log-probabilities (the root's 0)
    ranks: torch.Tensor  # int64 rank of each node's token at its depth; -1 for the root


def build_trees(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> DeviceTrees:
    """Every request's tree of ``budget`` nodes: ``log_probs`` ``[R, L, K]`` (each row sorted descending, as
    ``torch.topk`` gives them) and ``token_ids`` ``[R, L, K]``. Requires ``1 <= budget`` and enough prefixes
    (``sum over d of K^d >= budget``: with ``K >= 2`` and ``L >= 1`` any budget up to ``K^L``)."""
    _check(log_probs, token_ids, budget)
    num_reqs, depth, top_k = log_probs.shape
    device = log_probs.device
    scores = log_probs.to(torch.float64).clamp(max=0.0)
    width = min(top_k, budget)  # ranks past the budget never make a tree of that budget
    # Per depth: the kept prefixes in lexicographic order, their scores, parents (slot above) and ranks.
    kept_scores, kept_parents, kept_ranks = [], [], []
    parent_scores = torch.zeros(num_reqs, 1, dtype=torch.float64, device=device)
    for d in range(depth):
        # Children of every kept parent, parent by parent, rank by rank: lexicographic order.
        children = (parent_scores[:, :, None] + scores[:, d, None, :width]).reshape(num_reqs, -1)
        keep = min(budget, children.shape[1])
        order = torch.sort(children, dim=1, descending=True, stable=True).indices[:, :keep]
        order = torch.sort(order, dim=1).values  # the kept ones back in lexicographic order
        kept_scores.append(torch.gather(children, 1, order))
        kept_parents.append(torch.div(order, width, rounding_mode="floor"))
        kept_ranks.append(order % width)
        parent_scores = kept_scores[-1]
    return _best_prefixes(kept_scores, kept_parents, kept_ranks, token_ids, budget)


def _best_prefixes(kept_scores, kept_parents, kept_ranks, token_ids, budget: int) -> DeviceTrees:
    """The ``budget`` best of every depth's kept prefixes and the root, in (score descending, rank tuple) order."""
    num_reqs, depth = token_ids.shape[:2]
    device = token_ids.device
    sizes = [s.shape[1] for s in kept_scores]
    starts = [1 + sum(sizes[:d]) for d in range(depth)]  # slot 0: the root
    total = 1 + sum(sizes)
    # Every candidate's rank tuple, [R, total, L] (-1 past its depth: a prefix sorts before its extensions), its
    # depth, its parent's candidate index.
    tuples = torch.full((num_reqs, total, depth), -1, dtype=torch.int64, device=device)
    cand_depth = torch.zeros(total, dtype=torch.int64, device=device)
    cand_parent = torch.full((num_reqs, total), -1, dtype=torch.int64, device=device)
    cand_score = torch.zeros(num_reqs, total, dtype=torch.float64, device=device)
    for d in range(depth):
        rows = slice(starts[d], starts[d] + sizes[d])
        parent_rows = kept_parents[d] + (starts[d - 1] if d else 0)
        if d:
            tuples[:, rows, :d] = torch.gather(tuples, 1, parent_rows[:, :, None].expand(-1, -1, depth))[:, :, :d]
        tuples[:, rows, d] = kept_ranks[d]
        cand_depth[rows] = d + 1
        cand_parent[:, rows] = parent_rows
        cand_score[:, rows] = kept_scores[d]
    # Lexicographic order of the rank tuples (stable sorts from the deepest rank up), then a stable sort by score.
    order = torch.arange(total, device=device).expand(num_reqs, -1)
    for d in reversed(range(depth)):
        key = torch.gather(tuples[:, :, d], 1, order)
        order = torch.gather(order, 1, torch.sort(key, dim=1, stable=True).indices)
    by_score = torch.sort(torch.gather(cand_score, 1, order), dim=1, descending=True, stable=True).indices
    chosen = torch.gather(order, 1, by_score)[:, : budget + 1]  # candidate index of each node, pop order
    # Each candidate's node index (its place in pop order) turns the parents' candidate indices into node indices.
    node_of = torch.full((num_reqs, total), -1, dtype=torch.int64, device=device)
    node_of.scatter_(1, chosen, torch.arange(budget + 1, device=device).expand(num_reqs, -1))
    parent_cand = torch.gather(cand_parent, 1, chosen)
    parents = torch.where(parent_cand >= 0, torch.gather(node_of, 1, parent_cand.clamp(min=0)), -1)
    depths = cand_depth[chosen]
    chosen_tuples = torch.gather(tuples, 1, chosen[:, :, None].expand(-1, -1, depth))
    ranks = torch.gather(chosen_tuples, 2, (depths - 1).clamp(min=0)[:, :, None]).squeeze(2)
    ranks = torch.where(depths > 0, ranks, -1)
    flat = token_ids.to(torch.int64).reshape(num_reqs, -1)  # [R, L * K]
    top_k = token_ids.shape[2]
    tokens = torch.gather(flat, 1, ((depths - 1).clamp(min=0) * top_k + ranks.clamp(min=0)))
    tokens = torch.where(depths > 0, tokens, -1)
    return DeviceTrees(parents, depths, tokens, torch.gather(cand_score, 1, chosen), ranks)


def _check(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    if log_probs.dim() != 3 or log_probs.shape != token_ids.shape:
        raise ValueError(
            f"log_probs and token_ids must both be [R, L, K]; got {list(log_probs.shape)} and {list(token_ids.shape)}"
        )
    if not log_probs.dtype.is_floating_point:
        raise ValueError(f"log_probs must be floating point, got {log_probs.dtype}")
    _, depth, top_k = log_probs.shape
    reachable = sum(top_k**d for d in range(1, depth + 1))
    if budget < 1 or budget > reachable:
        raise ValueError(f"budget must be in [1, {reachable}] for L={depth}, K={top_k}; got {budget}")
