"""The Rust core against the pure-Python reference, singly and batched."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree import reference

from core_strategies import awkward_distributions, distributions


def assert_same_tree(tree, ref) -> None:
    np.testing.assert_array_equal(tree.tokens, ref.tokens)
    np.testing.assert_array_equal(tree.parents, ref.parents)
    np.testing.assert_array_equal(tree.depths, ref.depths)
    np.testing.assert_array_equal(tree.scores, ref.scores)


@given(distributions(), st.integers(0, 80))
def test_build_tree_matches_reference(dist, budget):
    log_probs, token_ids = dist
    tree = ddtree.build_tree(log_probs, token_ids, budget)
    ref = reference.build_tree(log_probs, token_ids, budget)
    assert_same_tree(tree, ref)
    assert tree.tokens.dtype == np.int64 and tree.parents.dtype == np.int32
    assert tree.depths.dtype == np.int32 and tree.scores.dtype == np.float32
    assert len(tree) == tree.num_draft_nodes + 1
    assert tree.expected_acceptance() == pytest.approx(reference.expected_acceptance(ref), rel=1e-6)


@settings(max_examples=300)
@given(awkward_distributions(), st.integers(0, 80))
def test_build_tree_matches_reference_when_pop_order_is_not_score_order(dist, budget):
    """Positive log-probs (within the tolerance) and rounding ties: the core's
    first-child queues must still reproduce the reference heap's pop order."""
    log_probs, token_ids = dist
    assert_same_tree(
        ddtree.build_tree(log_probs, token_ids, budget), reference.build_tree(log_probs, token_ids, budget)
    )


@given(distributions(max_depth=4, max_width=4), st.integers(0, 40))
def test_tree_invariants(dist, budget):
    """Prefix-closed, parents first, scores non-increasing, size min(budget, #prefixes)."""
    log_probs, token_ids = dist
    tree = ddtree.build_tree(log_probs, token_ids, budget)
    depth, width = log_probs.shape
    prefixes = sum(width**d for d in range(1, depth + 1))
    assert tree.num_draft_nodes == min(budget, prefixes)
    parents = tree.parents
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, len(tree)))
    assert np.all(tree.depths[1:] == tree.depths[parents[1:]] + 1)
    scores = tree.scores[1:].astype(np.float64)
    finite = np.isfinite(scores)
    assert np.all(np.diff(scores[finite]) <= 1e-6)
    assert np.all(finite[:-1] >= finite[1:]), "a -inf prefix came before a finite one"


@given(distributions(dtype=np.int32), st.integers(0, 40))
def test_int32_and_int64_token_ids_agree(dist, budget):
    log_probs, ids32 = dist
    a = ddtree.build_tree(log_probs, ids32, budget)
    b = ddtree.build_tree(log_probs, ids32.astype(np.int64), budget)
    assert_same_tree(a, b)


def test_non_contiguous_input_is_read_in_order():
    rng = np.random.default_rng(0)
    wide = np.sort(np.log(rng.dirichlet(np.ones(8), size=6)).astype(np.float32), axis=1)[:, ::-1]
    ids = np.tile(np.arange(8), (6, 1))
    strided_lp, strided_ids = wide[:, ::2], ids[:, ::2]
    assert not strided_lp.flags.c_contiguous
    tree = ddtree.build_tree(strided_lp, strided_ids, 20)
    assert_same_tree(tree, reference.build_tree(np.ascontiguousarray(strided_lp), strided_ids, 20))


def test_fortran_ordered_input_is_read_in_order():
    """Fortran order is contiguous too, but not in C order: it must not be read as flat C memory."""
    rng = np.random.default_rng(1)
    lp = np.sort(np.log(rng.dirichlet(np.ones(5), size=4)).astype(np.float32), axis=1)[:, ::-1]
    ids = rng.permuted(np.tile(np.arange(5), (4, 1)), axis=1)
    ref = reference.build_tree(lp, ids, 30)
    assert_same_tree(ddtree.build_tree(np.asfortranarray(lp), np.asfortranarray(ids), 30), ref)
    batch = ddtree.build_trees(np.asfortranarray(np.stack([lp, lp])), np.asfortranarray(np.stack([ids, ids])), 30)
    assert_same_tree(batch[1], ref)


@given(distributions(), st.integers(0, 60), st.integers(0, 10_000), st.integers(0, 4))
def test_compile_matches_reference(dist, budget, start, window):
    log_probs, token_ids = dist
    tree = ddtree.build_tree(log_probs, token_ids, budget)
    compiled = ddtree.compile_tree(tree, start, window)
    ref = reference.compile_tree(reference.build_tree(log_probs, token_ids, budget), start, window)
    np.testing.assert_array_equal(compiled.positions, ref["positions"])
    np.testing.assert_array_equal(compiled.dense_mask(), ref["mask"])
    np.testing.assert_array_equal(compiled.windows, ref["windows"])
    n = len(tree)
    bits = compiled.ancestor_bits
    assert bits.dtype == np.uint32 and bits.shape == (n, (n + 31) // 32)
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
    np.testing.assert_array_equal(unpacked, ref["mask"])
    bias = compiled.attention_bias()
    np.testing.assert_array_equal(bias == 0, ref["mask"])
    assert np.all(np.isneginf(bias[~ref["mask"]]))


def random_targets(tree, rng, agree: float) -> np.ndarray:
    """Per-node target tokens that pick a child with probability ``agree``."""
    n = len(tree)
    out = np.full(n, 10**6, dtype=np.int64)
    for i in range(n):
        children = np.flatnonzero(tree.parents == i)
        if len(children) and rng.random() < agree:
            out[i] = tree.tokens[rng.choice(children) - 1]
    return out


@given(distributions(), st.integers(0, 60), st.integers(0, 2**32 - 1), st.floats(0, 1))
def test_accept_matches_reference(dist, budget, seed, agree):
    log_probs, token_ids = dist
    tree = ddtree.build_tree(log_probs, token_ids, budget)
    ref_tree = reference.build_tree(log_probs, token_ids, budget)
    target = random_targets(tree, np.random.default_rng(seed), agree)
    path, bonus = ddtree.accept(tree, target)
    ref_path, ref_bonus = reference.accept(ref_tree, target)
    assert path.dtype == np.int32
    assert path.tolist() == ref_path and bonus == ref_bonus
    src, dst = ddtree.kv_move_plan(path)
    ref_src, ref_dst = reference.kv_move_plan(ref_path)
    assert src.tolist() == ref_src and dst.tolist() == ref_dst
    assert ddtree.accept(tree, target.astype(np.int32))[0].tolist() == ref_path


@st.composite
def batches(draw):
    requests = draw(st.integers(1, 6))
    depth = draw(st.integers(0, 4))
    width = draw(st.integers(0, 4))
    lp = np.empty((requests, depth, width), dtype=np.float32)
    ids = np.empty((requests, depth, width), dtype=np.int64)
    for r in range(requests):
        rows = [
            sorted(
                draw(st.lists(st.sampled_from([0.0, -0.7, -1.4, -3.0]), min_size=width, max_size=width)), reverse=True
            )
            for _ in range(depth)
        ]
        lp[r] = np.array(rows, dtype=np.float32).reshape(depth, width)
        ids[r] = np.array([draw(st.permutations(range(2 * width)))[:width] for _ in range(depth)]).reshape(depth, width)
    budgets = draw(st.one_of(st.integers(0, 30), st.lists(st.integers(0, 30), min_size=requests, max_size=requests)))
    starts = draw(st.lists(st.integers(0, 500), min_size=requests, max_size=requests))
    return lp, ids, budgets, starts


@given(batches(), st.integers(0, 2**32 - 1), st.sampled_from([None, 1, 2]))
def test_batch_equals_loop_of_singles(batch_input, seed, threads):
    lp, ids, budgets, starts = batch_input
    requests = lp.shape[0]
    executor = ddtree.Executor(threads) if threads else None
    batch = ddtree.build_trees(lp, ids, budgets, executor=executor)
    per_request = budgets if isinstance(budgets, list) else [budgets] * requests
    singles = [ddtree.build_tree(lp[r], ids[r], per_request[r]) for r in range(requests)]
    assert len(batch) == requests and batch.draft_depth == lp.shape[1]
    offsets = batch.node_offsets
    assert offsets.tolist() == np.cumsum([0] + [len(t) for t in singles]).tolist()
    for r, single in enumerate(singles):
        assert_same_tree(batch[r], single)
        nodes = slice(offsets[r], offsets[r + 1])
        np.testing.assert_array_equal(batch.parents[nodes], single.parents)
    np.testing.assert_allclose(batch.expected_acceptance(), [t.expected_acceptance() for t in singles])

    compiled = ddtree.compile_trees(batch, starts, window=3)
    masks = compiled.dense_masks()
    largest = max(len(t) for t in singles)
    assert masks.shape == (requests, largest, largest)
    for r, single in enumerate(singles):
        n = len(single)
        np.testing.assert_array_equal(masks[r, :n, :n], ddtree.compile_tree(single).dense_mask())
        assert not masks[r, n:].any() and not masks[r, :, n:].any()
    rng = np.random.default_rng(seed)
    targets = [random_targets(t, rng, 0.7) for t in singles]
    accepted = ddtree.accept_trees(batch, np.concatenate(targets))
    width = lp.shape[1] + 1
    assert accepted.paths.shape == (requests, width) and accepted.output_tokens.shape == (requests, width)
    kv_pairs = set(zip(accepted.kv_src.tolist(), accepted.kv_dst.tolist()))
    for r, single in enumerate(singles):
        nodes = slice(offsets[r], offsets[r + 1])
        c = ddtree.compile_tree(single, starts[r], 3)
        np.testing.assert_array_equal(compiled.positions[nodes], c.positions)
        np.testing.assert_array_equal(compiled.windows[nodes], c.windows)
        words = c.ancestor_bits.shape[1]
        np.testing.assert_array_equal(compiled.ancestor_bits[nodes, :words], c.ancestor_bits)
        assert not compiled.ancestor_bits[nodes, words:].any()
        path, bonus = ddtree.accept(single, targets[r])
        m = len(path)
        assert accepted.paths[r, :m].tolist() == path.tolist() and (accepted.paths[r, m:] == -1).all()
        assert accepted.accepted[r] == m - 1 and accepted.bonus[r] == bonus
        expected_out = [int(single.tokens[p - 1]) for p in path[1:]] + [bonus]
        assert accepted.output_tokens[r, :m].tolist() == expected_out
        assert (accepted.output_tokens[r, m:] == -1).all()
        src, dst = ddtree.kv_move_plan(path)
        assert {(offsets[r] + s, offsets[r] + d) for s, d in zip(src.tolist(), dst.tolist())} <= kv_pairs


def test_large_batch_on_threads_equals_serial():
    """Big enough to cross the parallel threshold."""
    rng = np.random.default_rng(1)
    requests, depth, width = 64, 15, 128
    logits = rng.standard_normal((requests, depth, 1000)).astype(np.float32) * 3
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-log_probs, axis=-1)[..., :width]
    top = np.take_along_axis(log_probs, order, -1).astype(np.float32)
    serial = ddtree.build_trees(top, order, 128)
    threaded = ddtree.build_trees(top, order, 128, executor=ddtree.Executor(2))
    for name in ("tokens", "parents", "depths", "scores", "node_offsets"):
        np.testing.assert_array_equal(getattr(serial, name), getattr(threaded, name))
    assert_same_tree(serial[17], reference.build_tree(top[17], order[17], 128))


def test_root_only_trees():
    lp = np.zeros((0, 4), dtype=np.float32)
    tree = ddtree.build_tree(lp, np.zeros((0, 4), dtype=np.int64), 10)
    assert len(tree) == 1 and tree.parents.tolist() == [-1] and tree.tokens.size == 0
    tree = ddtree.build_tree(np.zeros((3, 2), np.float32), np.array([[1, 2]] * 3), 0)
    assert len(tree) == 1
    path, bonus = ddtree.accept(tree, np.array([42]))
    assert path.tolist() == [0] and bonus == 42


def test_neg_inf_prefixes_only_when_nothing_better():
    lp = np.array([[0.0, -np.inf], [-np.inf, -np.inf]], dtype=np.float32)
    ids = np.array([[1, 2], [3, 4]])
    tree = ddtree.build_tree(lp, ids, 6)
    # Finite: (0,) only. Then -inf ones in rank-tuple order: (0,0), (0,1), (1,), (1,0), (1,1).
    assert tree.tokens.tolist() == [1, 3, 4, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, 4]


def test_ties_go_to_the_smallest_rank_tuple():
    lp = np.log(np.array([[0.5, 0.5], [0.5, 0.5]], dtype=np.float32))
    tree = ddtree.build_tree(lp, np.array([[10, 11], [20, 21]]), 6)
    # (0,) (1,) tie at 0.5; then (0,0) (0,1) (1,0) (1,1) tie at 0.25.
    assert tree.tokens.tolist() == [10, 11, 20, 21, 20, 21]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2]
