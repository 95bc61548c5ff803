"""The generation loop: prefill, then draft -> verify -> accept -> commit until done.

One step for every active request:

1. draft: the drafter proposes logits for the next ``L`` positions; the mode
   turns them into a tree (``ar``: root only; ``chain``: the argmax chain;
   ``ddtree``: ``ddtree.build_tree`` over the top-``min(budget, V)`` tokens);
2. verify: one target forward over all requests' ``[root, nodes]``,
   flattened (:meth:`TargetModel.forward_trees`);
3. accept: the target's token at every node (argmax, or a sample from its
   processed distribution), then ``ddtree.accept`` walks the tree;
4. commit: the accepted path's K/V and GDN state become the cache; its
   target features become drafter context; accepted tokens + bonus are output.

The drafter runs once per request per step (a per-request loop; the target
forward is batched). Greedy output equals greedy autoregressive decoding and
sampled output has autoregressive sampling's distribution, whatever the drafter
proposes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

import ddtree

from .constraints import GrammarConstraint, masked_logits
from .drafter import DFlashDraftModel
from .drafting import DFlashDraftProposer, DraftProposer, draft_tree_with_ranks, empty_tree
from .progress import ProgressBar
from .sampling import SamplingSettings, target_tokens
from .target import RequestState, TargetModel, TreeInput
from .validation import EngineInputError, check_drafter_matches_target, check_prompts, check_settings


@dataclass
class GenerationConfig:
    """How to generate.

    mode: ``"ar"``, ``"chain"`` (DFlash) or ``"ddtree"``.
    budget: draft tree nodes per step (``ddtree``); the chain uses ``L`` nodes.
    max_new_tokens: generated tokens per request (stops earlier on a stop
        token or at the target's max_position_embeddings).
    sampling: temperature / top-p / top-k of the target (temperature 0: greedy).
    seed: request ``r`` samples with ``torch.Generator().manual_seed(seed + r)``.
    prefill_chunk: prompt tokens per prefill forward (bounds the O(n^2) GDN tree solve).
    constraints: one :class:`~ddtree.engine.constraints.GrammarConstraint` (or None) per prompt: every verified
        node's logits row masked by the grammar after its root path; the constraint is advanced by the output.
    """

    mode: str = "ddtree"
    budget: int = 64
    max_new_tokens: int = 64
    sampling: SamplingSettings = SamplingSettings()
    seed: int = 0
    stop_token_ids: Sequence[int] = ()
    prefill_chunk: int = 128
    progress: bool = False
    constraints: Optional[Sequence[Optional[GrammarConstraint]]] = None


@dataclass
class RequestStats:
    """Per-request statistics.

    acceptance_lengths: tau per verification step, accepted draft tokens + 1 (bonus).
    accepted_at_depth: ``[L]``, entry ``d - 1`` counts steps that accepted >= d draft tokens.
    depth_trials: acceptance at each depth split by the path that led there (see :class:`DepthTrials`).
    total_seconds: wall time from the start of ``generate`` to this request's
        last token (prefill included; batch-mates share the steps).
    """

    prompt_tokens: int
    generated_tokens: int = 0
    acceptance_lengths: List[int] = field(default_factory=list)
    accepted_at_depth: List[int] = field(default_factory=list)
    depth_trials: "DepthTrials" = field(default_factory=lambda: DepthTrials(0))
    verified_nodes: int = 0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per verification step (the first token, from prefill, excluded)."""
        return float(np.mean(self.acceptance_lengths)) if self.acceptance_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def summary(self) -> str:
        depth = " ".join(str(c) for c in self.accepted_at_depth)
        return (
            f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok in {self.steps} steps, "
            f"tau {self.mean_acceptance_length:.2f}, {self.tokens_per_second:.1f} tok/s "
            f"(prefill {self.prefill_seconds:.2f} s), accepted at depth 1..L: [{depth}]"
        )


@dataclass
class DepthTrials:
    """Acceptance at each depth, split by the accepted path that reached the depth before it.

    ``on_top1``: the path so far is the drafter's own top-1 at every depth (the DFlash chain's proposal);
    ``after_sibling``: the path took a token that was not the drafter's top-1 at some earlier depth, where
    only a tree could go. Entry ``d - 1`` of ``*_reached`` counts steps whose path reached depth ``d - 1`` and
    whose draft went at least ``d`` deep; ``*_accepted`` those that then accepted a node at depth ``d``;
    ``accepted_off_top1`` the accepted depth-``d`` nodes that were not the drafter's top-1 there.
    """

    depth: int
    on_top1_reached: List[int] = field(default_factory=list)
    on_top1_accepted: List[int] = field(default_factory=list)
    after_sibling_reached: List[int] = field(default_factory=list)
    after_sibling_accepted: List[int] = field(default_factory=list)
    accepted_off_top1: List[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("on_top1_reached", "on_top1_accepted", "after_sibling_reached", "after_sibling_accepted"):
            setattr(self, name, list(getattr(self, name)) or [0] * self.depth)
        self.accepted_off_top1 = list(self.accepted_off_top1) or [0] * self.depth

    def record(self, path_ranks: Sequence[int], draft_depth: int) -> None:
        """One step: the ranks of the accepted path's nodes (root excluded), the draft's depth."""
        branched = False
        for d in range(min(draft_depth, self.depth)):
            accepted = d < len(path_ranks)
            if branched:
                self.after_sibling_reached[d] += 1
                self.after_sibling_accepted[d] += accepted
            else:
                self.on_top1_reached[d] += 1
                self.on_top1_accepted[d] += accepted
            if not accepted:
                return
            if path_ranks[d] != 0:
                self.accepted_off_top1[d] += 1
                branched = True

    def add(self, other: "DepthTrials") -> None:
        for name in (
            "on_top1_reached",
            "on_top1_accepted",
            "after_sibling_reached",
            "after_sibling_accepted",
            "accepted_off_top1",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, count in enumerate(theirs):
                mine[d] += count


@dataclass
class GenerationResult:
    prompt_ids: List[int]
    output_ids: List[int]
    finish_reason: str  # "length", "stop" or "max_position_embeddings"
    stats: RequestStats


@dataclass
class _Request:
    """Mutable per-request bookkeeping of one generate call."""

    prompt: List[int]
    limit: int  # most tokens it may generate
    limit_reason: str
    generator: torch.Generator
    target_state: RequestState
    drafter_state: object
    stats: RequestStats
    tokens: List[int] = field(default_factory=list)  # committed: prompt + generated
    prefilled: int = 0
    finish_reason: Optional[str] = None
    constraint: Optional[GrammarConstraint] = None

    def node_logits(self, logits: torch.Tensor, tree: ddtree.Tree) -> torch.Tensor:
        """The logits each node's token is taken from: the grammar's masks applied, if the request has one."""
        if self.constraint is None:
            return logits
        return masked_logits(logits, self.constraint.node_masks(tree.parents, tree.tokens))

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def emit(self, new_tokens: Sequence[int], stop_token_ids: Sequence[int], now: float) -> int:
        """Append output tokens up to the limit or a stop token (the grammar, if any, advanced by them); returns how
        many were kept."""
        kept = 0
        for token in new_tokens:
            if self.finish_reason is not None:
                break
            self.tokens.append(int(token))
            kept += 1
            if int(token) in stop_token_ids:
                self.finish_reason = "stop"
            elif self.generated >= self.limit:
                self.finish_reason = self.limit_reason
        if self.constraint is not None:
            self.constraint.advance(self.tokens[len(self.tokens) - kept :])
        self.stats.generated_tokens = self.generated
        if self.finish_reason is not None:
            self.stats.total_seconds = now
        return kept


class SpeculativeEngine:
    """Autoregressive, DFlash-chain and DDTree generation on a transformers target.

    Args:
        target: a :class:`TargetModel` (or a transformers causal LM, wrapped).
        drafter: a :class:`DFlashDraftModel`, any :class:`DraftProposer`, or
            None (then only ``mode="ar"`` works).
    """

    def __init__(self, target, drafter=None):
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        if isinstance(drafter, DFlashDraftModel):
            check_drafter_matches_target(drafter, self.target)
            drafter = DFlashDraftProposer(drafter, self.target)
        self.proposer: Optional[DraftProposer] = drafter

    # ------------------------------------------------------------------ API

    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> List[GenerationResult]:
        """Generate for a batch of token-id prompts; one result per prompt, in order."""
        check_settings(config.mode, config.budget, config.max_new_tokens, self.proposer is not None)
        config.sampling.validate()
        check_prompts(prompts, self.target)
        if config.constraints is not None and len(config.constraints) != len(prompts):
            raise EngineInputError(
                f"{len(config.constraints)} constraints for {len(prompts)} prompts (one each, or None)"
            )

        started = time.perf_counter()
        requests = [self._new_request(index, prompt, config) for index, prompt in enumerate(prompts)]
        progress = ProgressBar(sum(r.limit for r in requests), label=config.mode, enabled=config.progress)
        self._prefill(requests, config, started, progress)
        while True:
            active = [r for r in requests if r.finish_reason is None]
            if not active:
                break
            self._step(active, config, started, progress)
        progress.close()
        return [GenerationResult(r.prompt, r.tokens[len(r.prompt) :], r.finish_reason, r.stats) for r in requests]

    # ------------------------------------------------------------------ steps

    def _new_request(self, index: int, prompt: Sequence[int], config: GenerationConfig) -> _Request:
        room = self.target.max_positions - len(prompt)
        limit, reason = (config.max_new_tokens, "length")
        if room < limit:
            limit, reason = room, "max_position_embeddings"
        uses_drafter = config.mode != "ar"
        return _Request(
            prompt=[int(t) for t in prompt],
            limit=limit,
            limit_reason=reason,
            generator=torch.Generator().manual_seed(config.seed + index),
            target_state=self.target.new_request_state(),
            drafter_state=self.proposer.new_request() if uses_drafter else None,
            stats=RequestStats(
                prompt_tokens=len(prompt),
                accepted_at_depth=[0] * (self.proposer.num_draft_positions if uses_drafter else 0),
                depth_trials=DepthTrials(self.proposer.num_draft_positions if uses_drafter else 0),
            ),
            tokens=[int(t) for t in prompt],
            constraint=config.constraints[index] if config.constraints is not None else None,
        )

    def _feature_layers(self, config: GenerationConfig) -> Sequence[int]:
        return self.proposer.feature_layer_ids if config.mode != "ar" else ()

    def _prefill(self, requests: List[_Request], config: GenerationConfig, started: float, progress) -> None:
        """Run every prompt through the target in chunks (chains), then sample the first token."""
        feature_layers = self._feature_layers(config)
        while True:
            pending = [r for r in requests if r.prefilled < len(r.prompt)]
            if not pending:
                return
            trees = []
            for r in pending:
                chunk = r.prompt[r.prefilled : r.prefilled + config.prefill_chunk]
                trees.append(TreeInput.chain(chunk, cached_len=r.target_state.cached_len))
            output = self.target.forward_trees([r.target_state for r in pending], trees, feature_layers)
            self.target.commit([r.target_state for r in pending], output, [np.arange(len(t)) for t in trees])
            now = time.perf_counter() - started
            for index, (r, tree) in enumerate(zip(pending, trees)):
                rows = output.request_rows(index)
                if feature_layers:
                    self.proposer.add_context(r.drafter_state, output.features[rows])
                r.prefilled += len(tree)
                if r.prefilled == len(r.prompt):
                    first_logits = r.node_logits(output.logits[rows][-1:], empty_tree())
                    first = target_tokens(first_logits, config.sampling, r.generator)
                    r.stats.prefill_seconds = now
                    progress.update(r.emit([int(first[0])], config.stop_token_ids, now))

    def _propose(self, r: _Request, config: GenerationConfig) -> Tuple[ddtree.Tree, np.ndarray, int]:
        """The tree to verify for one request, never deeper than its remaining tokens allow; with each node's
        rank among the drafter's candidates and the draft's depth."""
        # A step emits accepted + 1 tokens, so depth <= remaining - 1 wastes no verification.
        depth = 0 if config.mode == "ar" else min(self.proposer.num_draft_positions, r.limit - r.generated - 1)
        if depth <= 0:
            return empty_tree(), np.zeros(1, dtype=np.int64), 0
        logits = self.proposer.draft_logits(r.drafter_state, r.tokens, depth)
        return (*draft_tree_with_ranks(config.mode, logits, config.budget), depth)

    def _step(self, active: List[_Request], config: GenerationConfig, started: float, progress) -> None:
        feature_layers = self._feature_layers(config)
        proposals = [self._propose(r, config) for r in active]
        trees = [tree for tree, _, _ in proposals]
        inputs = [TreeInput.from_tree(tree, r.tokens[-1], r.target_state.cached_len) for tree, r in zip(trees, active)]
        output = self.target.forward_trees([r.target_state for r in active], inputs, feature_layers)

        paths, bonuses = [], []
        for index, (r, tree) in enumerate(zip(active, trees)):
            logits = r.node_logits(output.logits[output.request_rows(index)], tree)
            node_tokens = target_tokens(logits, config.sampling, r.generator)
            path, bonus = ddtree.accept(tree, node_tokens.cpu().numpy())
            paths.append(path)
            bonuses.append(bonus)
        self.target.commit([r.target_state for r in active], output, paths)

        now = time.perf_counter() - started
        for index, (r, (tree, ranks, depth), path, bonus) in enumerate(zip(active, proposals, paths, bonuses)):
            if feature_layers:
                rows = output.request_rows(index)
                self.proposer.add_context(
                    r.drafter_state, output.features[rows][torch.as_tensor(path, dtype=torch.long)]
                )
            accepted = [int(tree.tokens[node - 1]) for node in path[1:]]
            self._record_step(r.stats, len(accepted), len(tree))
            r.stats.depth_trials.record([int(ranks[node]) for node in path[1:]], depth)
            progress.update(r.emit(accepted + [int(bonus)], config.stop_token_ids, now))

    @staticmethod
    def _record_step(stats: RequestStats, accepted: int, tree_nodes: int) -> None:
        stats.acceptance_lengths.append(accepted + 1)
        stats.verified_nodes += tree_nodes
        if len(stats.accepted_at_depth) < accepted:
            stats.accepted_at_depth.extend([0] * (accepted - len(stats.accepted_at_depth)))
        for depth in range(accepted):
            stats.accepted_at_depth[depth] += 1


def generate(target, drafter, prompts: Sequence[Sequence[int]], **settings) -> List[GenerationResult]:
    """One-call form: ``generate(model, drafter, [[1, 2, 3]], mode="ddtree", budget=32, temperature=0.7)``.

    ``temperature``, ``top_p`` and ``top_k`` go into :class:`SamplingSettings`; the
    other keywords are :class:`GenerationConfig` fields.
    """
    sampling = SamplingSettings(
        temperature=settings.pop("temperature", 0.0), top_p=settings.pop("top_p", 1.0), top_k=settings.pop("top_k", 0)
    )
    return SpeculativeEngine(target, drafter).generate(prompts, GenerationConfig(sampling=sampling, **settings))
