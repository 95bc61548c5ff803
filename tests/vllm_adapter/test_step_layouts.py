"""The Rust step layouts (``ddtree.verify_layout_into`` / ``acceptance_layout_into``) against the numpy oracle,
and their argument errors."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ddtree
from ddtree.vllm.staging import StepStaging
from ddtree.vllm.step import TreeStore, accept, plan_verify
from layout_oracle import acceptance_layout, verify_layout


def _trees(rng, requests, depth=4, width=3, vocab=40):
    logits = rng.normal(size=(requests, depth, vocab)) * 2.0
    ids = np.argsort(-logits, axis=-1)[..., :width]
    lp = np.take_along_axis(logits - np.log(np.exp(logits).sum(-1, keepdims=True)), ids, axis=-1)
    budgets = rng.integers(0, depth * width + 1, size=requests)
    return ddtree.build_trees(lp.astype(np.float32), ids.astype(np.int64), budgets)


def _placement(rng, trees, num_rows):
    """Trees in random distinct rows of a batch, laid out in row order with gaps (other requests' tokens)."""
    sizes = np.diff(trees.node_offsets)
    rows = np.sort(rng.choice(num_rows, size=len(sizes), replace=False))
    gaps = rng.integers(0, 5, size=len(sizes))
    query = np.cumsum(gaps + sizes) - sizes
    logit = np.cumsum(rng.integers(0, 3, size=len(sizes)) + sizes) - sizes
    starts = rng.integers(0, 1000, size=len(sizes))
    return rows.astype(np.int64), starts, query.astype(np.int64), logit.astype(np.int64), int(query[-1] + sizes[-1])


@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(0, 4), st.integers(0, 2))
def test_layouts_equal_the_numpy_oracle(seed, requests, window, extra_words):
    rng = np.random.default_rng(seed)
    trees = _trees(rng, requests)
    num_rows = requests + int(rng.integers(0, 4))
    rows, starts, query, logit, num_tokens = _placement(rng, trees, num_rows)
    total = int(trees.node_offsets[-1])
    words = (int(np.diff(trees.node_offsets).max()) + 31) // 32 + extra_words
    want = verify_layout(trees, rows, starts, query, logit, num_rows, words, window)
    got = {name: np.full_like(a, 7) for name, a in want.items()}  # garbage: every element must be written
    ddtree.verify_layout_into(trees, rows, starts, query, logit, **got)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    assert got["token_index"].shape == (total,)

    targets = np.empty(total, dtype=np.int64)  # often the first child's token, so paths get long
    for r in range(requests):
        lo, hi = trees.node_offsets[r], trees.node_offsets[r + 1]
        tokens = trees.tokens[trees.token_offsets[r] : trees.token_offsets[r + 1]]
        targets[lo:hi] = rng.choice(np.concatenate([tokens, [999]]), size=hi - lo)
    accepted = ddtree.accept_trees(trees, targets)
    width = int(accepted.output_tokens.shape[1]) + int(rng.integers(0, 3))
    want = acceptance_layout(want["token_index"], trees, accepted, num_tokens, width, window)
    got = {name: np.full_like(a, 7) for name, a in want.items()}
    ddtree.acceptance_layout_into(trees, accepted, query, **got)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


@given(st.integers(0, 2**31 - 1), st.integers(1, 6))
def test_node_outputs_equal_their_numpy_reference(seed, requests):
    """The optional per-node outputs (the runner's device side) against ``device_accept.node_arrays`` and the
    definitions: every draft node's step index and token, tree by tree in pop order."""
    from ddtree.vllm import device_accept
    from ddtree.vllm.step import index_within_groups

    rng = np.random.default_rng(seed)
    trees = _trees(rng, requests)
    rows, starts, query, logit, _ = _placement(rng, trees, requests + 2)
    total, num_trees = int(trees.node_offsets[-1]), len(trees)
    reference = device_accept.node_arrays(trees)
    sizes = np.diff(trees.node_offsets).astype(np.int64)
    drafts = np.diff(trees.token_offsets).astype(np.int64)
    want = {
        "depths": reference["node_depths"],
        "root_index": np.repeat(query, sizes),
        **{name: reference[name] for name in device_accept.NODE_ARRAYS},
        "draft_step_index": np.repeat(query, drafts) + index_within_groups(drafts) + 1,
        "draft_tokens": trees.tokens.astype(np.int32),
    }
    got = {name: np.full(total, 7, dtype=np.int64) for name in want}
    got["draft_step_index"] = np.full(total - num_trees, 7, dtype=np.int64)
    got["draft_tokens"] = np.full(total - num_trees, 7, dtype=np.int32)
    layout = {
        name: np.full_like(a, 7)
        for name, a in verify_layout(trees, rows, starts, query, logit, requests + 2, 1, 0).items()
    }
    ddtree.verify_layout_into(trees, rows, starts, query, logit, **layout, **got)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    # A draft node's step index is its node's, and its token the node's: the two layouts agree.
    assert np.array_equal(got["draft_step_index"], layout["token_index"][got["node_local"] > 0])


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(depths=np.zeros(2, dtype=np.int64)), ValueError, "depths: expected shape"),
        (dict(node_tree=np.zeros(3, dtype=np.int32)), TypeError, "node_tree: expected int64"),
        (dict(draft_step_index=np.zeros(3, dtype=np.int64)), ValueError, "draft_step_index: expected shape"),
        (dict(draft_tokens=np.zeros(2, dtype=np.int64)), TypeError, "draft_tokens: expected int32"),
    ],
)
def test_node_output_errors_name_the_argument(change, error, message):
    with pytest.raises(error, match=message):
        ddtree.verify_layout_into(_one_tree(), 0, 0, 0, 0, **_outputs(), **change)


def test_a_plan_and_its_acceptance_fit_in_one_staging_buffer():
    """The runner's path: the Rust core writes disjoint views of one (pinned) buffer, uploaded in one copy."""
    rng = np.random.default_rng(3)
    store = TreeStore(budget=9)
    logits = rng.normal(size=(2, 4, 30))
    ids = np.argsort(-logits, axis=-1)[..., :4]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lp = np.take_along_axis(log_probs, ids, axis=-1).astype(np.float32)
    lists = store.propose(["a", "b"], lp, ids.astype(np.int64))
    staging = StepStaging(torch.device("cpu"))
    args = (["p", "a", "b"], np.array([4, 10, 20]), np.array([3, 10, 10]), {"a": lists[0], "b": lists[1]})
    plan = plan_verify(store, *args, conv_window=3, words=2, arrays=staging.host_arrays)
    store.propose(["a", "b"], lp, ids.astype(np.int64))
    fresh = plan_verify(store, *args, conv_window=3, words=2)
    device = staging.upload_host()
    for name in ("token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "node_offsets", "conv_index"):
        assert np.array_equal(device[name].numpy(), getattr(fresh, name)), name
    assert device["batch_index"].tolist() == [1, 2]
    result = accept(plan, np.zeros(plan.num_tree_tokens, dtype=np.int64), 10, arrays=staging.host_arrays)
    device = staging.upload_host()
    assert device["context_order"].tolist() == result.context_order.tolist()
    assert sorted(result.context_order.tolist()) == list(range(plan.num_tokens))


def _one_tree():
    return ddtree.build_trees(np.array([[[-0.1, -1.0]]], dtype=np.float32), np.array([[[3, 4]]]), 2)


def _outputs(total=3, words=1, rows=1):
    return {
        "token_index": np.zeros(total, dtype=np.int64),
        "logit_rows": np.zeros(total, dtype=np.int64),
        "positions": np.zeros(total, dtype=np.int64),
        "ancestor_bits": np.zeros((total, words), dtype=np.uint32),
        "row_start": np.zeros(rows, dtype=np.int32),
        "node_offsets": np.zeros(2, dtype=np.int32),
    }


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(positions=np.zeros(4, dtype=np.int64)), ValueError, "positions: expected shape"),
        (dict(positions=np.zeros(3, dtype=np.int32)), TypeError, "positions: expected int64"),
        (dict(positions=np.zeros(6, dtype=np.int64)[::2]), ValueError, "positions: must be a C-contiguous"),
        (dict(ancestor_bits=np.zeros((3, 0), dtype=np.uint32)), ValueError, "ancestor_bits: rows of 0 words"),
        (dict(row_start=np.zeros(0, dtype=np.int32)), ValueError, "rows: row 0 of tree 0 is outside"),
        (dict(conv_index=np.zeros((3, 1), dtype=np.int64)), ValueError, "conv_index: needs at least 2 columns"),
    ],
)
def test_verify_layout_errors_name_the_argument(change, error, message):
    outputs = dict(_outputs(), **change)
    with pytest.raises(error, match=message):
        ddtree.verify_layout_into(_one_tree(), 0, 0, 0, 0, **outputs)


def test_outputs_that_share_memory_or_are_read_only_are_refused():
    outputs = _outputs()
    outputs["logit_rows"] = outputs["token_index"]
    with pytest.raises(ValueError, match="logit_rows: must be writable and share no memory"):
        ddtree.verify_layout_into(_one_tree(), 0, 0, 0, 0, **outputs)
    outputs = _outputs()
    outputs["positions"].flags.writeable = False
    with pytest.raises(ValueError, match="positions: must be writable"):
        ddtree.verify_layout_into(_one_tree(), 0, 0, 0, 0, **outputs)


def test_two_trees_in_one_row_and_negative_starts_are_refused():
    trees = ddtree.build_trees(np.zeros((2, 1, 1), dtype=np.float32), np.zeros((2, 1, 1), dtype=np.int64), 1)
    outputs = _outputs(total=4, rows=2)
    outputs["node_offsets"] = np.zeros(3, dtype=np.int32)
    with pytest.raises(ValueError, match="rows: row 1 holds two trees"):
        ddtree.verify_layout_into(trees, [1, 1], 0, [0, 2], [0, 2], **outputs)
    with pytest.raises(ValueError, match="query_starts: must be >= 0"):
        ddtree.verify_layout_into(trees, [0, 1], 0, [-1, 2], [0, 2], **outputs)


def test_acceptance_wider_than_the_engine_rows_is_refused():
    tree = _one_tree()
    accepted = ddtree.accept_trees(tree, np.array([3, 4, 4]))  # accepts token 3: two emitted tokens
    outputs = {
        "output_tokens": np.zeros((1, 1), dtype=np.int32),
        "kv_src": np.zeros(0, dtype=np.int64),
        "kv_dst": np.zeros(0, dtype=np.int64),
        "context_order": np.zeros(3, dtype=np.int64),
        "paths": np.zeros((1, 2), dtype=np.int32),
        "path_lengths": np.zeros(1, dtype=np.int32),
    }
    with pytest.raises(ValueError, match="output_tokens: tree 0: 2 emitted tokens do not fit rows of width 1"):
        ddtree.acceptance_layout_into(tree, accepted, 0, **outputs)
    outputs["output_tokens"] = np.zeros((1, 2), dtype=np.int32)
    ddtree.acceptance_layout_into(tree, accepted, 0, **outputs)
    assert outputs["output_tokens"].tolist() == [[3, 4]] and outputs["path_lengths"].tolist() == [2]
