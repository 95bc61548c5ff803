"""DDTree's tree build in fixed-shape torch operations: every request's tree of ``budget`` nodes from the drafter's
top-K, on whatever device the top-K lives on, without a host round trip (capture-safe: no data-dependent shape,
no host synchronisation).

Why: under vLLM's CUDA graphs the test pair's step is host work (the GPU busy ~10% of it), and the largest part of
ddtree's own is the plan, which starts by waiting for the drafter's top-K on the host and building the trees there
(``ddtree.build_trees``). Built on the device, the trees never leave it; what the plan lays out from them (positions,
ancestor bits, conv windows, the walk's node arrays) can follow in the same graph. This module is that first step,
and the oracle of a fused kernel: as ~500 small kernels it costs 1.3 ms of GPU time in one CUDA graph at budget 63
and batch 1 on an H200, against 0.04 ms for the host copy and the Rust build (``gpu-h200-device-tree-33df4a8``), so
the runner does not use it (``docs/performance.md``, "The host path from here").

The tree is the Rust core's (``rust/src/build.rs``): the ``budget`` most probable prefixes of rank tuples, a
prefix's score the float64 sum of its ranks' log-probabilities in depth order, equal scores ordered by the
lexicographically smaller rank tuple, nodes in that order (the heap's pop order). Built depth by depth:

* A prefix among the ``budget`` best at its depth has its parent among the ``budget`` best at the depth above
  (each better parent has a first child that beats it), and a rank at or past ``budget`` never makes the cut (its
  ``budget`` elder siblings beat it): each depth keeps ``budget`` prefixes, chosen from ``budget x min(K, budget)``
  children by one stable sort (children laid out in lexicographic order, so equal scores keep it).
* The tree is the ``budget`` best of all kept prefixes and the root: one stable sort by score over the prefixes
  laid out in lexicographic order across depths (the pre-order of the kept prefixes' forest, from subtree sizes).

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
    check_top_k(log_probs, token_ids, budget)
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
    num_reqs, depth, top_k = token_ids.shape
    device = token_ids.device
    sizes = [s.shape[1] for s in kept_scores]
    starts = [1 + sum(sizes[:d]) for d in range(depth)]  # candidate 0: the root; then depth by depth
    total = 1 + sum(sizes)
    zero = torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)
    cand_score = torch.cat([torch.zeros(num_reqs, 1, dtype=torch.float64, device=device), *kept_scores], dim=1)
    cand_rank = torch.cat([zero - 1, *kept_ranks], dim=1)
    cand_parent = torch.cat([zero - 1, *(p + (starts[d - 1] if d else 0) for d, p in enumerate(kept_parents))], dim=1)
    cand_depth = torch.cat([torch.full((s,), d + 1, dtype=torch.int64, device=device) for d, s in enumerate(sizes)])
    cand_depth = torch.cat([cand_depth.new_zeros(1), cand_depth])
    lex = _preorder(kept_parents, sizes, num_reqs, device)  # [R, total]: each candidate's lexicographic place
    in_lex = torch.empty_like(lex).scatter_(1, lex, torch.arange(total, device=device).expand(num_reqs, -1))
    by_score = torch.sort(torch.gather(cand_score, 1, in_lex), dim=1, descending=True, stable=True).indices
    chosen = torch.gather(in_lex, 1, by_score)[:, : budget + 1]  # candidate index of each node, pop order
    # Each candidate's node index (its place in pop order) turns the parents' candidate indices into node indices.
    node_of = torch.full((num_reqs, total), -1, dtype=torch.int64, device=device)
    node_of.scatter_(1, chosen, torch.arange(budget + 1, device=device).expand(num_reqs, -1))
    parent_cand = torch.gather(cand_parent, 1, chosen)
    parents = torch.where(parent_cand >= 0, torch.gather(node_of, 1, parent_cand.clamp(min=0)), -1)
    depths = cand_depth[chosen]
    ranks = torch.gather(cand_rank, 1, chosen)
    flat = token_ids.to(torch.int64).reshape(num_reqs, -1)  # [R, L * K]
    tokens = torch.gather(flat, 1, (depths - 1).clamp(min=0) * top_k + ranks.clamp(min=0))
    tokens = torch.where(depths > 0, tokens, -1)
    return DeviceTrees(parents, depths, tokens, torch.gather(cand_score, 1, chosen), ranks)


def _preorder(kept_parents, sizes, num_reqs: int, device) -> torch.Tensor:
    """``[R, 1 + sum(sizes)]``: every candidate's place in lexicographic order of rank tuples (the root first, a
    prefix before its extensions): the pre-order of the kept prefixes' forest, children by rank. Each depth's kept
    prefixes are in lexicographic order, so siblings are contiguous and in rank order; a node's place is its
    parent's, plus one, plus the subtrees of its elder siblings."""
    depth = len(sizes)
    subtree = [torch.ones(num_reqs, s, dtype=torch.int64, device=device) for s in sizes]
    for d in range(depth - 1, 0, -1):  # bottom-up: each node's subtree size
        subtree[d - 1] = subtree[d - 1].scatter_add(1, kept_parents[d], subtree[d])
    places = [torch.zeros(num_reqs, 1, dtype=torch.int64, device=device)]
    for d in range(depth):  # top-down: parent's place + 1 + elder siblings' subtrees
        parents = kept_parents[d]
        before = torch.cumsum(subtree[d], dim=1) - subtree[d]  # exclusive, over the whole depth
        index = torch.arange(sizes[d], device=device).expand(num_reqs, -1)
        first = torch.ones_like(parents, dtype=torch.bool)
        first[:, 1:] = parents[:, 1:] != parents[:, :-1]
        first_sibling = torch.cummax(torch.where(first, index, 0), dim=1).values
        elder = before - torch.gather(before, 1, first_sibling)
        places.append(torch.gather(places[-1], 1, parents) + 1 + elder)
    return torch.cat(places, dim=1)


def check_top_k(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> None:
    """A tree build's arguments, refused with what is wrong (shapes, dtypes, device, a budget the top-K can fill);
    shared by every device build."""
    if log_probs.dim() != 3 or log_probs.shape != token_ids.shape:
        raise ValueError(
            f"log_probs and token_ids must both be [R, L, K]; got {list(log_probs.shape)} and {list(token_ids.shape)}"
        )
    if not log_probs.dtype.is_floating_point:
        raise ValueError(f"log_probs must be floating point, got {log_probs.dtype}")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.is_complex():
        raise ValueError(f"token_ids must be an integer tensor, got {token_ids.dtype}")
    if log_probs.device != token_ids.device:
        raise ValueError(
            f"log_probs and token_ids must be on one device; got {log_probs.device} and {token_ids.device}"
        )
    _, depth, top_k = log_probs.shape
    reachable = sum(top_k**d for d in range(1, depth + 1))
    if budget < 1 or budget > reachable:
        raise ValueError(f"budget must be in [1, {reachable}] for L={depth}, K={top_k}; got {budget}")
