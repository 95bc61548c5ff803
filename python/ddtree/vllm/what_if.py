"""What the engine's own trees say about other drafts: smaller budgets, and the DFlash chain.

Every verified tree answers two questions besides its own acceptance, without another forward pass:

* **A smaller budget** ``c``: the tree of budget ``c`` is the first ``c`` drafts of a larger tree's pop order
  (best-first, parents first), and the target's token at a node depends only on the node's prefix, so the accepted
  path keeps, with budget ``c``, exactly its drafts numbered ``<= c``. Only whole trees that are the drafter's own
  proposal count (a cut tree is not the tree a smaller budget builds; a filler tree has no drafter).
* **The chain** vLLM's DFlash proposer would have verified from the same state: the drafter's top-1 token at each
  of the L depths (``plan.top1_tokens``; a DFlash drafter predicts every depth from one pass, so these are the
  tree's rank-0 tokens at every depth). The chain accepts the accepted path's leading run of top-1 tokens, and
  is known to stop there when that run is not the whole path (the target took another child) or when the tree
  goes deeper than the path: the run's nodes are then the tree's best nodes at their depths, the tree holds the
  best node one depth further (a prefix of pop order holds a depth's best node before any other), which is the
  chain's next draft, and the target refused it. When the tree goes no deeper than the path and the path is
  above depth L, the chain's next draft is not in the tree: the count is a lower bound, and such trees are counted
  as ``censored``.

Greedy decoding makes both exact; sampled, they hold in distribution. Pure numpy: CI tests it on CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np


def drafter_proposals(plan) -> np.ndarray:
    """``[R]`` the plan's trees that are the drafter's proposals (not fillers for placeholders)."""
    proposal = np.ones(plan.num_nodes.shape[0], dtype=bool)
    if plan.filler_mask is not None:
        proposal &= ~plan.filler_mask
    return proposal


def whole_proposed_trees(plan, proposal: Optional[np.ndarray] = None) -> np.ndarray:
    """``[R]`` the drafter's trees verified whole at the budget they were proposed with (not cut, not fillers):
    those whose smaller-budget counterfactuals are exact."""
    proposal = drafter_proposals(plan) if proposal is None else proposal
    return proposal & (plan.num_nodes == plan.proposed_budgets + 1)


class WhatIfAcceptance:
    """Counts, over verified trees, what smaller budgets and the chain would have accepted.

    A step's trees are kept when observed and counted with the other kept steps in one numpy pass (:meth:`fold`,
    every ``fold_every`` steps and before any result is read): one step's count was ~30 small-array calls, ~0.2 ms
    of the engine loop's host time on this repository's CPU at any batch size.
    """

    def __init__(self, smaller_budgets: Sequence[int] = (), fold_every: int = 16):
        self.smaller_budgets = np.asarray(sorted(smaller_budgets), dtype=np.int64)
        self.fold_every = fold_every
        # Per smaller budget: trees counted, the drafts they accepted, the drafts the smaller tree keeps.
        self.budget_trees = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        self.budget_accepted_own = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        self.budget_accepted = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        # The chain: trees counted, their own accepted drafts, the chain's (a lower bound where censored).
        self.chain_trees = 0
        self.chain_accepted_own = 0
        self.chain_accepted = 0
        self.chain_censored = 0
        self._kept: List[_ObservedStep] = []  # observed, not counted yet

    def observe(self, plan, paths: np.ndarray, accepted: np.ndarray) -> None:
        """One verify step: ``paths`` ``[R, P]`` tree-local accepted nodes from the root, ``accepted`` ``[R]``
        drafts accepted (path length - 1), for the plan's trees (``plan.trees``, ``num_nodes``,
        ``proposed_budgets``, ``filler_mask``, ``top1_tokens``). Copied (they may be views of a reused buffer)."""
        self._kept.append(
            _ObservedStep(
                plan.host_trees(),  # (a device-planned step's are built now, on the host)
                plan.num_nodes,
                plan.proposed_budgets,
                plan.filler_mask,
                plan.top1_tokens,
                np.array(paths, dtype=np.int64),
                np.array(accepted, dtype=np.int64),
            )
        )
        if len(self._kept) >= self.fold_every:
            self.fold()

    def fold(self) -> None:
        """Counts the kept steps, all in one pass (their trees side by side, as one step's)."""
        steps, self._kept = self._kept, []
        if not steps:
            return
        merged = _MergedSteps(steps)
        paths, accepted = merged.paths, merged.accepted
        proposal = drafter_proposals(merged)
        on_path = np.arange(paths.shape[1] - 1)[None, :] < accepted[:, None]
        self._observe_budgets(merged, paths[:, 1:], on_path, accepted, proposal)
        self._observe_chain(merged, paths, on_path, accepted, proposal & merged.has_top1)

    def _observe_budgets(self, plan, drafts, on_path, accepted, proposal) -> None:
        if not self.smaller_budgets.size:
            return
        whole = whole_proposed_trees(plan, proposal)
        budgets = self.smaller_budgets[:, None]
        counted = whole[None, :] & (plan.proposed_budgets[None, :] > budgets)  # [C, R]
        kept = ((drafts[None, :, :] <= budgets[:, :, None]) & on_path[None, :, :]).sum(axis=2)  # [C, R]
        self.budget_trees += counted.sum(axis=1)
        self.budget_accepted_own += counted @ accepted
        self.budget_accepted += (counted * kept).sum(axis=1)

    def _observe_chain(self, steps: "_MergedSteps", paths, on_path, accepted, proposal) -> None:
        """``proposal``: the trees to count (the drafter's, with its top-1 tokens known)."""
        if not proposal.any():
            return
        drafts = paths[:, 1:]  # tree-local nodes 1..n (0 where unused); node i's token is tokens[first + i - 1]
        tokens = steps.tokens[np.maximum(steps.first_tokens[:, None] + drafts - 1, 0)]
        top1 = steps.top1_tokens[:, : drafts.shape[1]]
        chain = np.cumprod((tokens == top1) & on_path, axis=1).sum(axis=1)
        censored = (chain == accepted) & (steps.deepest <= accepted) & (accepted < steps.draft_depth)
        self.chain_trees += int(proposal.sum())
        self.chain_accepted_own += int(accepted[proposal].sum())
        self.chain_accepted += int(chain[proposal].sum())
        self.chain_censored += int(censored[proposal].sum())

    def summary(self) -> Dict[str, object]:
        """``{"budgets": {c: ...}, "chain": ...}``: mean acceptance lengths (bonus included) of the counted trees at
        their own budget and as the smaller tree or the chain would have had them."""
        self.fold()
        budgets = {}
        for budget, trees, own, kept in zip(
            self.smaller_budgets, self.budget_trees, self.budget_accepted_own, self.budget_accepted
        ):
            if trees:
                budgets[int(budget)] = {
                    "trees": int(trees),
                    "acceptance_length": 1.0 + kept / trees,
                    "acceptance_length_at_own_budget": 1.0 + own / trees,
                }
        chain = {}
        if self.chain_trees:
            chain = {
                "trees": self.chain_trees,
                "acceptance_length": 1.0 + self.chain_accepted / self.chain_trees,
                "acceptance_length_of_the_trees": 1.0 + self.chain_accepted_own / self.chain_trees,
                "censored_trees": self.chain_censored,
            }
        return {"budgets": budgets, "chain": chain}

    def log_line(self) -> Optional[str]:
        """The summary as one log line (None before any tree was counted)."""
        summary = self.summary()
        chain = summary["chain"]
        if not chain:
            return None
        censored = chain["censored_trees"] / chain["trees"]
        own = chain["acceptance_length_of_the_trees"]
        line = (
            f"DDTree what-if over {chain['trees']} trees: acceptance length {own:.2f}; "
            f"vLLM's DFlash chain from the same states {chain['acceptance_length']:.2f} (a lower bound on "
            f"{100 * censored:.0f}% of the trees)"
        )
        smaller = ", ".join(f"{b}: {s['acceptance_length']:.2f}" for b, s in summary["budgets"].items())
        return line + (f"; smaller budgets {smaller}" if smaller else "")


#: A no-token id: the top-1 "token" of trees whose drafter's top-1 tokens are not known (never counted for the chain).
_NO_TOKEN = -2


class _ObservedStep(NamedTuple):
    trees: Any  # ddtree.TreeBatch
    num_nodes: np.ndarray
    proposed_budgets: np.ndarray
    filler_mask: Optional[np.ndarray]
    top1_tokens: Optional[np.ndarray]
    paths: np.ndarray
    accepted: np.ndarray


class _MergedSteps:
    """Several observed steps' trees side by side, as :class:`WhatIfAcceptance` counts them: per-tree arrays
    concatenated (``num_nodes``, ``proposed_budgets``, ``filler_mask`` as a plan has them; each tree's first draft
    token in ``tokens``, its deepest node's depth and its drafter's depth), the rows of ``paths`` and
    ``top1_tokens`` padded to the widest step's."""

    def __init__(self, steps: Sequence[_ObservedStep]):
        sizes = np.array([s.num_nodes.shape[0] for s in steps])
        self.num_nodes = np.concatenate([s.num_nodes for s in steps])
        self.proposed_budgets = np.concatenate([s.proposed_budgets for s in steps])
        masks = [s.filler_mask for s in steps]
        self.filler_mask = None
        if any(m is not None for m in masks):
            self.filler_mask = np.concatenate(
                [np.zeros(n, dtype=bool) if m is None else m for m, n in zip(masks, sizes)]
            )
        self.accepted = np.concatenate([s.accepted for s in steps])
        self.paths = _rows(steps, [s.paths for s in steps], max(s.paths.shape[1] for s in steps), 0)
        width = self.paths.shape[1] - 1
        self.has_top1 = np.repeat([s.top1_tokens is not None for s in steps], sizes)
        self.top1_tokens = _rows(steps, [s.top1_tokens for s in steps], width, _NO_TOKEN)
        tokens = [np.asarray(s.trees.tokens) for s in steps]
        depths = [np.asarray(s.trees.depths) for s in steps]
        token_base = np.repeat(np.cumsum([0] + [t.shape[0] for t in tokens[:-1]]), sizes)
        node_base = np.repeat(np.cumsum([0] + [d.shape[0] for d in depths[:-1]]), sizes)
        first_tokens = np.concatenate([np.asarray(s.trees.token_offsets[:-1], dtype=np.int64) for s in steps])
        first_nodes = np.concatenate([np.asarray(s.trees.node_offsets[:-1], dtype=np.int64) for s in steps])
        self.tokens = np.concatenate(tokens)
        self.first_tokens = first_tokens + token_base
        self.draft_depth = np.repeat([s.trees.draft_depth for s in steps], sizes)
        self.deepest = np.maximum.reduceat(np.concatenate(depths), first_nodes + node_base)


def _rows(steps: Sequence[_ObservedStep], arrays: Sequence[Optional[np.ndarray]], width: int, fill: int) -> np.ndarray:
    """The steps' ``[R_i, *]`` rows stacked, each cut or padded with ``fill`` to ``width`` columns (a missing array:
    rows of ``fill``)."""
    if all(a is not None and a.shape[1] == width for a in arrays):
        return np.concatenate(arrays).astype(np.int64, copy=False)
    out = np.full((sum(s.num_nodes.shape[0] for s in steps), width), fill, dtype=np.int64)
    row = 0
    for step, a in zip(steps, arrays):
        n = step.num_nodes.shape[0]
        if a is not None:
            out[row : row + n, : min(width, a.shape[1])] = a[:, :width]
        row += n
    return out


class PeriodicLog:
    """Emits :meth:`WhatIfAcceptance.log_line` at most once per ``interval`` seconds, and only after new trees were
    counted: beside vLLM's own periodic statistics, what a served engine's trees say about the chain and smaller
    budgets (``collective_rpc("ddtree_summary")`` is not reachable through ``vllm serve``)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval, self.clock = interval, clock
        self.last = clock()
        self.trees_logged = 0

    def maybe(self, what_if: WhatIfAcceptance, emit: Callable[[str], None]) -> None:
        now = self.clock()
        if now - self.last < self.interval:
            return
        what_if.fold()
        if what_if.chain_trees == self.trees_logged:
            return
        self.last, self.trees_logged = now, what_if.chain_trees
        line = what_if.log_line()
        if line:
            emit(line)


def log_interval(environ: Mapping[str, str] = os.environ) -> float:
    """vLLM's statistics interval (``VLLM_LOG_STATS_INTERVAL``, seconds; 10 unset or unreadable)."""
    try:
        interval = float(environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    except ValueError:
        return 10.0
    return interval if interval > 0 else 10.0
