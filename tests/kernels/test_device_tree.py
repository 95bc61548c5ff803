"""The fixed-shape torch tree build (``ddtree.kernels.device_tree``) against the Rust core's ``build_trees``: the
same nodes in the same order, parents, depths and tokens, also where bf16 logits make equal log-probabilities
(ties broken by rank tuple) common."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree.kernels.device_tree import build_trees


def top_k(num_reqs: int, depth: int, top_k: int, vocab: int, seed: int, bf16: bool, sharp: float):
    """A drafter's top-K as ``torch.topk`` of log-softmaxed logits gives it (rows sorted descending)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * sharp
    if bf16:  # few distinct values: many exactly equal log-probabilities
        logits = logits.to(torch.bfloat16).float()
    log_probs = torch.log_softmax(logits, dim=-1).clamp(max=0.0)
    values, ids = log_probs.topk(top_k, dim=-1)
    return values, ids.to(torch.int32)


def core_trees(log_probs: torch.Tensor, token_ids: torch.Tensor, budget: int):
    """The Rust core's trees as ``[R, budget + 1]`` arrays (parents, depths, tokens with the root's -1)."""
    batch = ddtree.build_trees(log_probs.numpy(), token_ids.numpy(), budget)
    size = budget + 1
    parents = batch.parents.astype(np.int64).reshape(-1, size)
    depths = batch.depths.astype(np.int64).reshape(-1, size)
    tokens = np.full((len(batch), size), -1, dtype=np.int64)
    tokens[:, 1:] = batch.tokens.reshape(-1, budget)
    return parents, depths, tokens


@settings(max_examples=60, deadline=None)
@given(
    num_reqs=st.integers(1, 4),
    depth=st.integers(1, 6),
    k=st.integers(2, 12),
    budget=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
    sharp=st.sampled_from([0.5, 2.0, 6.0]),
)
def test_the_device_build_is_the_cores_tree(num_reqs, depth, k, budget, seed, bf16, sharp):
    budget = min(budget, sum(k**d for d in range(1, depth + 1)))
    log_probs, token_ids = top_k(num_reqs, depth, k, vocab=64, seed=seed, bf16=bf16, sharp=sharp)
    trees = build_trees(log_probs, token_ids, budget)
    parents, depths, tokens = core_trees(log_probs, token_ids, budget)
    np.testing.assert_array_equal(trees.depths.numpy(), depths)
    np.testing.assert_array_equal(trees.parents.numpy(), parents)
    np.testing.assert_array_equal(trees.tokens.numpy(), tokens)


def test_the_servings_shape_with_bf16_ties():
    """Budget 63 of a 15-deep, 64-wide top-K (the pair's drafter and the README's budget), 8 requests, bf16 logits
    over a 4096-token vocabulary (the pair's): ties everywhere in the tails."""
    log_probs, token_ids = top_k(8, 15, 64, vocab=4096, seed=7, bf16=True, sharp=3.0)
    assert (log_probs[..., 1:] == log_probs[..., :-1]).any()  # the ties are there
    for budget in (15, 63, 255):
        trees = build_trees(log_probs, token_ids, budget)
        parents, depths, tokens = core_trees(log_probs, token_ids, budget)
        np.testing.assert_array_equal(trees.parents.numpy(), parents)
        np.testing.assert_array_equal(trees.depths.numpy(), depths)
        np.testing.assert_array_equal(trees.tokens.numpy(), tokens)
        assert (trees.scores[:, 1:] <= trees.scores[:, :-1]).all()  # pop order: scores never rise


def test_a_smaller_budget_is_a_prefix_of_a_larger_ones_pop_order():
    log_probs, token_ids = top_k(3, 6, 8, vocab=100, seed=3, bf16=True, sharp=2.0)
    large = build_trees(log_probs, token_ids, 40)
    for budget in (1, 7, 20):
        small = build_trees(log_probs, token_ids, budget)
        for name in ("parents", "depths", "tokens", "ranks"):
            assert torch.equal(getattr(small, name), getattr(large, name)[:, : budget + 1]), name


@pytest.mark.parametrize(
    "shape, budget, message",
    [
        ((2, 3), 4, r"must both be \[R, L, K\]"),
        ((1, 2, 3), 0, r"budget must be in \[1, 12\]"),
        ((1, 2, 3), 13, r"budget must be in \[1, 12\]"),
    ],
)
def test_bad_input_names_the_problem(shape, budget, message):
    log_probs = -torch.rand(*shape)
    with pytest.raises(ValueError, match=message):
        build_trees(log_probs, torch.zeros(shape, dtype=torch.int32), budget)
    with pytest.raises(ValueError, match="floating point"):
        build_trees(torch.zeros((1, 2, 3), dtype=torch.int64), torch.zeros((1, 2, 3), dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="token_ids must be an integer tensor, got torch.float32"):
        build_trees(-torch.rand(1, 2, 3), torch.zeros((1, 2, 3)), 2)
    with pytest.raises(ValueError, match="on one device; got cpu and meta"):
        build_trees(-torch.rand(1, 2, 3), torch.zeros((1, 2, 3), dtype=torch.int32, device="meta"), 2)
