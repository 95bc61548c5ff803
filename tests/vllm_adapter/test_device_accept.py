"""The device walk (``ddtree.vllm.device_accept``) against the Rust acceptance (``step.accept``) on the same plans."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.vllm import device_accept
from ddtree.vllm.step import TreeStore, accept, emitted_logit_rows, plan_verify


def random_distribution(rng, depth, width, vocab=12):
    logits = rng.normal(size=(depth, vocab)) * 2.0
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-log_probs, axis=-1)[:, :width]
    return np.take_along_axis(log_probs, ids, axis=-1).astype(np.float32), ids.astype(np.int32)


def random_step(rng, conv_window):
    """A step with tree requests (some cut by the scheduler) and requests without a tree between them."""
    depth, width = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    store = TreeStore(budget=int(rng.integers(depth, 24)))
    tree_ids = [f"t{i}" for i in range(int(rng.integers(1, 5)))]
    dists = [random_distribution(rng, depth, width) for _ in tree_ids]
    lists = store.propose(tree_ids, np.stack([d[0] for d in dists]), np.stack([d[1] for d in dists]))
    scheduled = {r: lists[i][: int(rng.integers(1, len(lists[i]) + 1))] for i, r in enumerate(tree_ids)}
    req_ids, num_sched = [], []
    for r in tree_ids:
        if rng.random() < 0.4:  # a decode or prefill chunk without a tree
            req_ids.append(f"plain-{r}")
            num_sched.append(int(rng.integers(1, 6)))
        req_ids.append(r)
        num_sched.append(len(scheduled[r]) + 1)
    computed = np.arange(len(req_ids), dtype=np.int64) * 50 + 7
    plan = plan_verify(store, req_ids, computed, np.array(num_sched), scheduled, conv_window=conv_window)
    return plan, depth


def device_trees(plan):
    arrays = device_accept.node_arrays(plan.trees)
    tensors = {name: torch.from_numpy(a) for name, a in arrays.items()}
    return device_accept.DeviceTrees(
        **tensors,
        node_offsets=torch.from_numpy(np.asarray(plan.trees.node_offsets, dtype=np.int64)),
        query_starts=torch.from_numpy(plan.query_starts.astype(np.int64)),
        token_index=torch.from_numpy(plan.token_index.astype(np.int64)),
        ancestor_bits=torch.from_numpy(plan.ancestor_bits),
    )


def agreeing_target(rng, plan):
    """Target tokens that often agree with the drafts: each node's among its tree's draft tokens, or a miss."""
    target = np.empty(plan.num_tree_tokens, dtype=np.int64)
    for j in range(plan.batch_index.shape[0]):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        toks = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        target[lo:hi] = rng.choice(np.concatenate([toks, [999]]), size=hi - lo)
    return target


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([0, 3]))
def test_the_device_walk_equals_the_rust_acceptance(seed, conv_window):
    rng = np.random.default_rng(seed)
    plan, depth = random_step(rng, conv_window)
    target = agreeing_target(rng, plan)
    width = int(plan.num_nodes.max()) + int(rng.integers(0, 3))  # vLLM's rows may be wider than any path
    rust = accept(plan, target, width)
    path_width = rust.paths.shape[1]
    ours = device_accept.accept_on_device(
        device_trees(plan), torch.from_numpy(target), width, path_width, plan.num_tokens, conv_window
    )
    for name in ("output_tokens", "context_order", "paths", "path_lengths"):
        assert ours[name].dtype == torch.from_numpy(getattr(rust, name)).dtype, name
        assert np.array_equal(ours[name].numpy(), getattr(rust, name)), name
    rows = ours["path_rows"].numpy()  # the statistics' copy: the length, then the path, per tree
    assert rows.dtype == np.int32 and np.array_equal(rows[:, 0], rust.path_lengths)
    assert np.array_equal(rows[:, 1:], rust.paths)
    if conv_window:
        assert np.array_equal(ours["commit_conv_index"].numpy(), rust.commit_conv_index)
    else:
        assert "commit_conv_index" not in ours
    # The same real moves in the same order; every other slot moves a root onto itself.
    src, dst = ours["kv_src"].numpy(), ours["kv_dst"].numpy()
    real = src != dst
    assert np.array_equal(src[real], rust.kv_src) and np.array_equal(dst[real], rust.kv_dst)
    assert set(src[~real].tolist()) <= set(plan.query_starts.tolist())
    assert not set(dst[real].tolist()) & set(plan.query_starts.tolist())  # no real move writes a root
    # Each emitted token's logits row (logprobs), in vLLM's layout, rows of requests without a tree included.
    num_reqs = int(plan.row_start.shape[0])
    last_rows = rng.permutation(plan.num_tokens + 5)[:num_reqs]
    rows = device_accept.emitted_logit_rows(
        device_trees(plan).node_offsets,
        torch.from_numpy(plan.logit_rows),
        torch.from_numpy(plan.batch_index),
        ours,
        torch.from_numpy(last_rows),
        width,
    )
    assert np.array_equal(rows.numpy(), emitted_logit_rows(plan, rust.accepted, last_rows, width))


def test_padding_moves_leave_the_cache_as_the_real_moves_alone():
    """Applied with the gather-then-scatter of kernels.kv_moves, the padded move list moves exactly what Rust's
    does (a root slot written with its own value, never a real move's destination)."""
    from ddtree.kernels.kv_moves import apply_kv_moves_indexed, kv_move_index

    rng = np.random.default_rng(3)
    for _ in range(30):
        plan, _ = random_step(rng, 0)
        target = agreeing_target(rng, plan)
        rust = accept(plan, target, int(plan.num_nodes.max()))
        ours = device_accept.accept_on_device(
            device_trees(plan),
            torch.from_numpy(target),
            rust.output_tokens.shape[1],
            rust.paths.shape[1],
            plan.num_tokens,
            0,
        )
        block = 4
        blocks = plan.num_tokens // block + 1
        cache = torch.randn(blocks, 2, block, 1, 2)  # [blocks, K/V, block, heads, dim]
        expected = cache.clone()
        apply_kv_moves_indexed(
            expected, kv_move_index(torch.from_numpy(rust.kv_src), torch.from_numpy(rust.kv_dst), block)
        )
        apply_kv_moves_indexed(cache, kv_move_index(ours["kv_src"], ours["kv_dst"], block))
        assert torch.equal(cache, expected)


def test_a_node_whose_parent_was_rejected_is_rejected_even_if_its_own_token_matches():
    rng = np.random.default_rng(0)
    plan, _ = random_step(rng, 0)
    trees = device_trees(plan)
    # The target matches every non-root node's token at its parent, except at the roots: nothing is accepted.
    target = torch.full((plan.num_tree_tokens,), -7, dtype=torch.int64)
    target[trees.node_parents] = trees.node_tokens  # parent p's target = (some) child's token
    roots = trees.node_local == 0
    target[roots] = -7
    accepted = device_accept.accepted_nodes(trees, target)
    assert torch.equal(accepted, roots)


@pytest.mark.parametrize("n", [33, 70])
def test_trees_wider_than_one_bit_word(n):
    """Chains of n nodes: the ancestor bits span several 32-bit words."""
    lp = np.zeros((n - 1, 1), dtype=np.float32)
    ids = np.arange(n - 1, dtype=np.int32)[:, None] + 5
    store = TreeStore(budget=n - 1)
    drafts = store.propose(["a"], lp[None], ids[None])[0]
    plan = plan_verify(store, ["a"], np.array([3]), np.array([n]), {"a": drafts})
    target = np.append(np.asarray(drafts, dtype=np.int64), 77)  # accept everything, bonus 77
    rust = accept(plan, target, n)
    ours = device_accept.accept_on_device(device_trees(plan), torch.from_numpy(target), n, rust.paths.shape[1], n, 0)
    assert int(ours["path_lengths"][0]) == n == int(rust.path_lengths[0])
    assert np.array_equal(ours["output_tokens"].numpy(), rust.output_tokens)
