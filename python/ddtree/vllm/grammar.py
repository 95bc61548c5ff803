"""Structured outputs with trees in vLLM (``docs/structured-outputs.md``): the channel through which a step's trees
reach the scheduler's grammar masks, and the step's rows in vLLM's layout. A tree's rows themselves come from
:mod:`ddtree.grammar` (one xgrammar walk per tree).

The scheduler computes a step's masks after the runner has built that step's trees (in ``execute_model``, which
returns before vLLM asks for the masks, on the same thread with one GPU): the runner publishes them here
(:func:`publish_step`) and patch 12 reads them (:func:`trees_for`) to fill each structured request's rows with
:func:`fill_step_bitmask`.

No vLLM import.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ddtree.grammar import ALL_ALLOWED, fill_tree_bitmask


# ---- a step's trees, from the runner to the scheduler's masks ------------------------------------------------------
#: One tree: tree-local parents in pop order (``[n + 1]``, -1 for the root) and the draft tokens of nodes 1..n.
Tree = Tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass
class StepTrees:
    """The trees one step verifies, as the runner built them."""

    scheduler_output: Any  # the scheduler's output the step was planned from (matched by identity)
    req_ids: Sequence[str]  # the tree requests, in the trees' order
    trees: Callable[[], Any]  # the step's ``ddtree.TreeBatch`` (called once, when a mask needs it)

    def by_request(self) -> Dict[str, Tree]:
        batch = self.trees()
        if len(batch) != len(self.req_ids):
            raise RuntimeError(f"DDTree: {len(batch)} trees published for {len(self.req_ids)} requests (a bug)")
        parents, tokens = batch.parents, batch.tokens
        nodes, drafts = batch.node_offsets, batch.token_offsets
        return {
            req_id: (parents[nodes[r] : nodes[r + 1]], tokens[drafts[r] : drafts[r + 1]])
            for r, req_id in enumerate(self.req_ids)
        }


_PUBLISHED: Optional[StepTrees] = None


def publish_step(step: Optional[StepTrees]) -> None:
    """The runner's step (None: a step that verifies no tree, or whose masks are vLLM's own)."""
    global _PUBLISHED
    _PUBLISHED = step


def trees_for(scheduler_output: Any) -> Dict[str, Tree]:
    """The trees verified in the step planned from ``scheduler_output``, by request id (empty: none published for
    it: the step verifies no tree)."""
    step = _PUBLISHED
    if step is None or step.scheduler_output is not scheduler_output:
        return {}
    return step.by_request()


#: Threads that walk different requests' trees at once (xgrammar's walk runs without Python's lock: two trees on two
#: threads took 0.57x the time of one after the other on the development CPU); made at the first step with two.
_POOL: Optional[ThreadPoolExecutor] = None
#: Rows at least this many words wide (vocabularies of 32k tokens and more) are walked on threads: with the test
#: pair's 4,096 tokens a tree's walk is ~0.2 ms and the threads gained nothing there (``bench_grammar_masks.py``).
POOL_MIN_WORDS = 1024


def _walk_pool() -> ThreadPoolExecutor:
    """Half the CPUs (vLLM's sizing for its own grammar threads), at least two, at most eight: the engine's thread
    only waits for them."""
    global _POOL
    if _POOL is None:
        workers = max(2, min((os.cpu_count() or 2) // 2, 8))
        _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ddtree-grammar")
    return _POOL


@dataclasses.dataclass
class MaskStats:
    """What the grammar rows of tree steps cost and found, for ``ddtree_summary`` (this process's engine)."""

    steps: int = 0  # steps whose rows came from trees
    trees: int = 0
    nodes: int = 0  # tree nodes given a row (roots included)
    unmasked_nodes: int = 0  # of those, nodes the grammar gave no mask (refused, below a refusal, or ending it)
    seconds: float = 0.0  # host time of those steps' rows, vLLM's own part (its rows without drafts) included

    def summary(self) -> Dict[str, object]:
        return {
            "grammar_tree_steps": self.steps,
            "grammar_trees": self.trees,
            "grammar_tree_nodes": self.nodes,
            "grammar_unmasked_nodes": self.unmasked_nodes,
            "grammar_mask_ms_per_step": round(1e3 * self.seconds / self.steps, 3) if self.steps else None,
        }


STATS = MaskStats()


def fill_step_bitmask(
    out,
    request_ids: Sequence[str],
    num_drafts: Sequence[int],
    vllm_rows,
    matcher_of: Callable[[str], Any],
    trees: Mapping[str, Tree],
    stride: Optional[int] = None,
) -> int:
    """Writes a step's grammar rows into ``out`` in vLLM's layout: for each structured request (``request_ids``, the
    order of vLLM's ``GrammarOutput``), ``1 + num_drafts[k]`` rows, one per logits row the runner samples for it.
    They follow each other (vLLM 0.25), or request ``k``'s start at row ``k * stride`` (``stride``: vLLM 0.33's
    fixed block of ``1 + num_speculative_tokens`` rows a request).

    A request verifying a tree gets :func:`fill_tree_bitmask`'s rows for its ``n + 1`` nodes (node ``j``'s row is
    logits row ``start + j``) and all-allowed rows for draft slots its tree left unused (a cut tree's); a request
    with no draft slot gets ``vllm_rows[k]``, vLLM's own row for it. Several requests' trees are walked on threads
    where the rows are wide (:data:`POOL_MIN_WORDS`). Returns the rows written; counts the trees in :data:`STATS`.

    Raises:
        RuntimeError: a request with draft slots but no tree, or a tree larger than its slots (a bug: its rows
            would not be its nodes'); checked for every request before any tree is walked.
    """
    walks = []
    offset = nodes = 0
    for k, req_id in enumerate(request_ids):
        drafts = int(num_drafts[k])
        if stride is not None:
            if 1 + drafts > stride:
                raise RuntimeError(f"DDTree: request {req_id!r} has {1 + drafts} grammar rows in blocks of {stride}")
            offset = k * stride
        rows = out[offset : offset + 1 + drafts]
        tree = trees.get(req_id)
        if tree is None:
            if drafts:
                raise RuntimeError(
                    f"DDTree: request {req_id!r} has {drafts} draft slots but no tree reached its grammar masks "
                    "(a bug: its rows would be a chain's)"
                )
            rows[0] = torch.as_tensor(vllm_rows[k])
        else:
            parents, tokens = tree
            if len(parents) > drafts + 1:
                raise RuntimeError(
                    f"DDTree: request {req_id!r}'s tree of {len(parents)} nodes has {drafts + 1} rows (a bug)"
                )
            walks.append(functools.partial(_fill_tree_rows, matcher_of(req_id), parents, tokens, rows))
            nodes += len(parents)
        offset += 1 + drafts
    rows_written = offset if stride is None else len(request_ids) * stride
    if out.shape[-1] >= POOL_MIN_WORDS and len(walks) > 1:
        unmasked = [done.result() for done in [_walk_pool().submit(walk) for walk in walks]]
    else:
        unmasked = [walk() for walk in walks]
    if walks:
        STATS.steps += 1
        STATS.trees += len(walks)
        STATS.nodes += nodes
        STATS.unmasked_nodes += sum(unmasked)
    return rows_written


def _fill_tree_rows(matcher, parents: np.ndarray, tokens: np.ndarray, rows) -> int:
    """One request's rows: its tree's, then all-allowed rows for the slots the tree left unused; returns its nodes
    the grammar gave no mask."""
    n = len(parents)
    unmasked = fill_tree_bitmask(matcher, parents, tokens, rows[:n])
    rows[n:] = ALL_ALLOWED
    return unmasked
