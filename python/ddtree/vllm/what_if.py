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
from typing import Callable, Dict, Mapping, Optional, Sequence

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
    """Counts, over verified trees, what smaller budgets and the chain would have accepted."""

    def __init__(self, smaller_budgets: Sequence[int] = ()):
        self.smaller_budgets = np.asarray(sorted(smaller_budgets), dtype=np.int64)
        # Per smaller budget: trees counted, the drafts they accepted, the drafts the smaller tree keeps.
        self.budget_trees = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        self.budget_accepted_own = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        self.budget_accepted = np.zeros(self.smaller_budgets.shape[0], dtype=np.int64)
        # The chain: trees counted, their own accepted drafts, the chain's (a lower bound where censored).
        self.chain_trees = 0
        self.chain_accepted_own = 0
        self.chain_accepted = 0
        self.chain_censored = 0

    def observe(self, plan, paths: np.ndarray, accepted: np.ndarray) -> None:
        """One verify step: ``paths`` ``[R, P]`` tree-local accepted nodes from the root, ``accepted`` ``[R]``
        drafts accepted (path length - 1), for the plan's trees (``plan.trees``, ``num_nodes``,
        ``proposed_budgets``, ``filler_mask``)."""
        paths = np.asarray(paths, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        proposal = drafter_proposals(plan)
        on_path = np.arange(paths.shape[1] - 1)[None, :] < accepted[:, None]
        self._observe_budgets(plan, paths[:, 1:], on_path, accepted, proposal)
        self._observe_chain(plan, paths, on_path, accepted, proposal)

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

    def _observe_chain(self, plan, paths, on_path, accepted, proposal) -> None:
        if not proposal.any() or plan.top1_tokens is None:
            return
        trees = plan.trees
        drafts = paths[:, 1:]  # tree-local nodes 1..n (0 where unused); node i's token is tokens[first + i - 1]
        first_token = np.asarray(trees.token_offsets[:-1], dtype=np.int64)[:, None]
        tokens = np.asarray(trees.tokens)[np.maximum(first_token + drafts - 1, 0)]
        top1 = plan.top1_tokens[:, : drafts.shape[1]]
        chain = np.cumprod((tokens == top1) & on_path, axis=1).sum(axis=1)
        censored = (chain == accepted) & (plan.deepest <= accepted) & (accepted < trees.draft_depth)
        self.chain_trees += int(proposal.sum())
        self.chain_accepted_own += int(accepted[proposal].sum())
        self.chain_accepted += int(chain[proposal].sum())
        self.chain_censored += int(censored[proposal].sum())

    def summary(self) -> Dict[str, object]:
        """``{"budgets": {c: ...}, "chain": ...}``: mean acceptance lengths (bonus included) of the counted trees at
        their own budget and as the smaller tree or the chain would have had them."""
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
        if now - self.last < self.interval or what_if.chain_trees == self.trees_logged:
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
