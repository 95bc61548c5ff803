"""The adapter's per-step tree bookkeeping against vLLM's batch layout (numpy only)."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree
from ddtree import reference
from ddtree.vllm.step import (
    PLACEHOLDER,
    DeferredProposal,
    DraftMismatchError,
    TreeStore,
    accept,
    chain_as_tree_check,
    plan_verify,
    stop_token_rows,
    take_device_plannable,
    tree_size,
)


def random_distribution(rng, depth, width, vocab=50):
    logits = rng.normal(size=(depth, vocab)) * 2.0
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ids = np.argsort(-log_probs, axis=-1)[:, :width]
    lp = np.take_along_axis(log_probs, ids, axis=-1).astype(np.float32)
    return lp, ids.astype(np.int32)


def propose(store, rng, req_ids, depth=5, width=4):
    dists = [random_distribution(rng, depth, width) for _ in req_ids]
    lp = np.stack([d[0] for d in dists])
    ids = np.stack([d[1] for d in dists])
    return store.propose(req_ids, lp, ids), lp, ids


@given(st.integers(0, 2**31 - 1), st.integers(1, 40), st.integers(1, 6), st.integers(1, 5))
def test_a_prefix_of_pop_order_is_the_tree_of_the_smaller_budget(seed, budget, depth, width):
    """What makes vLLM's truncation of a request's drafts safe."""
    rng = np.random.default_rng(seed)
    lp, ids = random_distribution(rng, depth, width)
    full = ddtree.build_tree(lp, ids, budget)
    for b in range(len(full.tokens) + 1):
        small = ddtree.build_tree(lp, ids, b)
        assert np.array_equal(small.tokens, full.tokens[:b])
        assert np.array_equal(small.parents, full.parents[: b + 1])


def test_plan_for_a_mixed_batch():
    """Prefill, plain decode and two trees (one truncated by the scheduler) in one step."""
    rng = np.random.default_rng(0)
    store = TreeStore(budget=10)
    lists, lp, ids = propose(store, rng, ["a", "b"])
    assert all(len(x) == 10 for x in lists)
    req_ids = ["p", "a", "d", "b"]  # vLLM's input batch order
    scheduled = {"a": lists[0], "b": lists[1][:6]}  # b truncated to 6 drafts
    num_sched = np.array([7, 11, 1, 7])
    num_computed = np.array([0, 20, 33, 41])
    plan = plan_verify(store, req_ids, num_computed, num_sched, scheduled)
    assert len(store) == 0  # records consumed
    assert plan.batch_index.tolist() == [1, 3]
    assert plan.num_nodes.tolist() == [11, 7]
    # flat token index: p occupies 0..6, a 7..17, d 18, b 19..25
    assert plan.token_index.tolist() == list(range(7, 18)) + list(range(19, 26))
    # logits rows: p 1 row (0), a 11 rows (1..11), d 1 row (12), b 7 rows (13..19)
    assert plan.logit_rows.tolist() == list(range(1, 12)) + list(range(13, 20))
    assert plan.row_start.tolist() == [-1, 0, -1, 11]
    tree_a = ddtree.build_tree(lp[0], ids[0], 10)
    tree_b = ddtree.build_tree(lp[1], ids[1], 6)
    assert plan.positions.tolist() == (20 + tree_a.depths).tolist() + (41 + tree_b.depths).tolist()
    ca = ddtree.compile_tree(tree_a, 20)
    assert np.array_equal(plan.ancestor_bits[:11, : ca.ancestor_bits.shape[1]], ca.ancestor_bits)
    assert plan.conv_index is None


def test_plan_for_a_hybrid_target_carries_conv_windows():
    """Each node's conv rows: its ancestors (or its request's history once the path runs out), then itself."""
    rng = np.random.default_rng(1)
    store = TreeStore(budget=8)
    lists, lp, ids = propose(store, rng, ["a", "b"])
    plan = plan_verify(
        store, ["a", "b"], np.array([5, 9]), np.array([9, 9]), {"a": lists[0], "b": lists[1]}, conv_window=3
    )
    parents = plan.trees.parents
    offsets = plan.trees.node_offsets
    num_requests = 2
    for r in range(num_requests):
        for node in range(int(offsets[r]), int(offsets[r + 1])):
            chain = [node]
            while len(chain) < 4 and parents[chain[-1]] >= 0:
                chain.append(int(offsets[r]) + int(parents[chain[-1]]))
            rows = [num_requests * 3 + n for n in reversed(chain)]
            history = [r * 3 + k for k in range(3)][len(rows) - 1 :] if len(rows) < 4 else []
            assert plan.conv_index[node].tolist() == history + rows


@pytest.mark.parametrize("with_prefill", [False, True])
def test_a_tree_request_must_be_scheduled_its_drafts_and_its_root(with_prefill):
    """vLLM schedules ``b + 1`` tokens for ``b`` drafts; any other count names the request (in a step of decodes
    only and in one with a prefill beside the trees)."""
    rng = np.random.default_rng(2)
    store = TreeStore(budget=6)
    lists, _, _ = propose(store, rng, ["a", "b"])
    names = ["p", "a", "b"] if with_prefill else ["a", "b"]
    scheduled = {"a": lists[0], "b": lists[1]}
    counts = {"p": 9, "a": len(lists[0]) + 1, "b": len(lists[1]) + 2}  # "b": one token too many
    with pytest.raises(DraftMismatchError, match=rf"request b: {len(lists[1]) + 2} tokens scheduled with "):
        plan_verify(store, names, np.full(len(names), 5), np.array([counts[n] for n in names]), scheduled)


def test_scheduled_drafts_must_match_the_tree():
    rng = np.random.default_rng(1)
    store = TreeStore(budget=6)
    lists, _, _ = propose(store, rng, ["a"])
    bad = list(lists[0])
    bad[2] = (bad[2] + 1) % 50
    with pytest.raises(DraftMismatchError, match="not a prefix"):
        plan_verify(store, ["a"], np.array([5]), np.array([7]), {"a": bad})
    with pytest.raises(DraftMismatchError, match="no DDTree proposal"):
        plan_verify(store, ["z"], np.array([5]), np.array([3]), {"z": [1, 2]})
    # The proposal's own trees are reused when scheduled whole; any sequence of the right tokens matches.
    lists, _, _ = propose(store, rng, ["a"])
    plan = plan_verify(store, ["a"], np.array([5]), np.array([7]), {"a": tuple(lists[0])})
    assert plan.trees.tokens.tolist() == lists[0]


def test_no_drafts_no_plan():
    store = TreeStore(budget=6)
    assert plan_verify(store, ["a", "b"], np.array([3, 4]), np.array([1, 5]), {}) is None


def test_records_outlive_an_unscheduled_step_and_die_with_the_request():
    rng = np.random.default_rng(2)
    store = TreeStore(budget=4)
    propose(store, rng, ["a", "b"])
    propose(store, rng, ["b"])  # a was not scheduled this step: its record stays
    assert set(store.records) == {"a", "b"}
    store.discard({"a"})
    assert set(store.records) == {"b"}


def reference_walk(parents, tokens, target):
    """Straightforward walk: follow the child whose token is the target's token at the current node."""
    path, node = [0], 0
    children = {}
    for i in range(1, len(parents)):
        children.setdefault(int(parents[i]), {})[int(tokens[i - 1])] = i
    while int(target[node]) in children.get(node, {}):
        node = children[node][int(target[node])]
        path.append(node)
    return path, int(target[node])


@given(st.integers(0, 2**31 - 1))
def test_accept_gives_vllm_chain_rows_moves_and_drafter_order(seed):
    rng = np.random.default_rng(seed)
    store = TreeStore(budget=int(rng.integers(1, 20)))
    req_ids = ["r0", "r1", "r2"]
    lists, _, _ = propose(store, rng, req_ids, depth=4, width=3)
    scheduled = {r: lists[i][: int(rng.integers(1, len(lists[i]) + 1))] for i, r in enumerate(req_ids)}
    num_sched = np.array([len(scheduled[r]) + 1 for r in req_ids])
    plan = plan_verify(store, req_ids, np.array([10, 20, 30]), num_sched, scheduled)
    # A target that often agrees with the drafts: pick each node's token among the drafts' tokens.
    target = np.empty(plan.num_tree_tokens, dtype=np.int64)
    for j in range(len(req_ids)):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        toks = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        target[lo:hi] = rng.choice(np.concatenate([toks, [999]]), size=hi - lo)
    width = max(len(v) for v in scheduled.values()) + 1
    result = accept(plan, target, width)
    total = int(num_sched.sum())
    assert plan.num_tokens == total
    order = result.context_order
    assert sorted(order.tolist()) == list(range(total))
    assert order.tolist() == _context_order_oracle(plan, result.accepted, total)
    for j in range(len(req_ids)):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        parents = plan.trees.parents[lo:hi]
        toks = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        path, bonus = reference_walk(parents, toks, target[lo:hi])
        row = result.output_tokens[j]
        want = [int(toks[n - 1]) for n in path[1:]] + [bonus]
        assert row[: len(want)].tolist() == want and (row[len(want) :] == -1).all()
        assert chain_as_tree_check(result.output_tokens)[j] == len(path) - 1
        # drafter order: root and path first, in path order
        base = plan.token_index[lo]
        assert order[base : base + len(path)].tolist() == [base + n for n in path]
        # KV moves: accepted node path[i] -> position i
        moves = {int(s): int(d) for s, d in zip(result.kv_src, result.kv_dst) if base <= s < base + (hi - lo)}
        assert moves == {base + n: base + i for i, n in enumerate(path) if n != i}


def _context_order_oracle(plan, accepted, num_tokens):
    """drafter_context_order one request at a time: root and accepted path, then the other nodes in order."""
    order = list(range(num_tokens))
    for j in range(plan.batch_index.shape[0]):
        lo, hi = int(plan.trees.node_offsets[j]), int(plan.trees.node_offsets[j + 1])
        path = [int(p) for p in accepted.paths[j] if p >= 0]
        rest = [n for n in range(hi - lo) if n not in path]
        base = int(plan.token_index[lo])
        order[base : base + hi - lo] = [base + n for n in path + rest]
    return order


@given(st.integers(0, 2**31 - 1))
def test_drafter_order_with_requests_without_trees_between(seed):
    rng = np.random.default_rng(seed)
    store = TreeStore(budget=int(rng.integers(1, 12)))
    lists, _, _ = propose(store, rng, ["a", "b"], depth=3, width=3)
    scheduled = {"a": lists[0], "b": lists[1][: max(1, len(lists[1]) // 2)]}
    req_ids = ["p", "a", "q", "b"]  # "p" and "q" decode or prefill without a tree
    num_sched = np.array([int(rng.integers(1, 9)), len(scheduled["a"]) + 1, 1, len(scheduled["b"]) + 1])
    plan = plan_verify(store, req_ids, np.array([5, 10, 20, 30]), num_sched, scheduled)
    target = rng.integers(0, 4, size=plan.num_tree_tokens).astype(np.int64)
    result = accept(plan, target, int(num_sched.max()))
    total = int(num_sched.sum())
    assert result.context_order.tolist() == _context_order_oracle(plan, result.accepted, total)


def test_reference_oracle_agrees_on_acceptance():
    """The adapter's accept() is the Rust walk; check it against the Python oracle too."""
    rng = np.random.default_rng(7)
    lp, ids = random_distribution(rng, 4, 3)
    store = TreeStore(budget=12)
    store.propose(["a"], lp[None], ids[None])
    drafts = store.records["a"].tokens.tolist()
    plan = plan_verify(store, ["a"], np.array([0]), np.array([13]), {"a": drafts})
    ref_tree = reference.build_tree(lp.astype(np.float64), ids.astype(np.int64), 12)
    target = rng.choice(np.concatenate([ref_tree.tokens, [7]]), size=13)
    result = accept(plan, target, 13)
    path, bonus = reference.accept(ref_tree, target)
    assert result.accepted.paths[0][: len(path)].tolist() == list(path)
    assert int(result.accepted.bonus[0]) == bonus


def test_ranks_that_do_not_build_at_proposal_verify_the_same_trees():
    """A tensor-parallel rank keeping only the distribution plans exactly what the drafting rank plans,
    and still refuses drafts its own tree does not reproduce."""
    rng = np.random.default_rng(3)
    driver, follower = TreeStore(budget=12), TreeStore(budget=12)
    lists, lp, ids = propose(driver, rng, ["a", "b"])
    assert follower.propose(["a", "b"], lp, ids, build=False) == [[], []]
    scheduled = {"a": lists[0], "b": lists[1][:5]}
    args = (["a", "b"], np.array([7, 30]), np.array([13, 6]), scheduled)
    mine, theirs = plan_verify(driver, *args, conv_window=3), plan_verify(follower, *args, conv_window=3)
    for field in ("token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "conv_index"):
        assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    follower.propose(["a"], lp[:1], ids[:1], build=False)
    wrong = list(lists[0])
    wrong[0] = (wrong[0] + 1) % 1000
    with pytest.raises(DraftMismatchError, match="rebuilt tree differs"):
        plan_verify(follower, ["a"], np.array([7]), np.array([13]), {"a": wrong})


def test_min_tokens_masks_stop_tokens_by_node_depth():
    """A node at depth d samples the output token d places after the next one: its row masks the stop
    tokens while d is below the tokens the request still needs, whatever its branch."""
    rng = np.random.default_rng(5)
    store = TreeStore(budget=9)
    lists, _, _ = propose(store, rng, ["a", "b"])
    req_ids = ["p", "a", "b"]
    plan = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 10, 10]), {"a": lists[0], "b": lists[1]})
    starts = np.array([0, 1, 11])
    rows, tokens = stop_token_rows(plan, starts, [(0, 1, [7]), (1, 2, [5, 6]), (2, 0, [5])])
    a_rows = plan.logit_rows[plan.trees.node_offsets[0] : plan.trees.node_offsets[1]]
    a_depths = plan.trees.depths[plan.trees.node_offsets[0] : plan.trees.node_offsets[1]]
    expected = {(0, 7)} | {(int(row), t) for row, d in zip(a_rows, a_depths) if d < 2 for t in (5, 6)}
    assert set(zip(rows.tolist(), tokens.tolist())) == expected  # "b" has nothing left to wait for
    assert {int(d) for row, d in zip(a_rows, a_depths) if (int(row), 5) in expected} == {0, 1}
    assert stop_token_rows(None, starts, [])[0].shape == (0,)


def test_whole_trees_reuse_the_proposal_and_plan_the_same():
    """A step that verifies exactly the last proposal's trees, whole and in order, reuses them; the plan is
    the one a rank that builds at verification makes. Anything else builds again."""
    rng = np.random.default_rng(11)
    driver, follower = TreeStore(budget=7), TreeStore(budget=7)
    lists, lp, ids = propose(driver, rng, ["a", "b"])
    proposed = driver.last_batch[1]
    follower.propose(["a", "b"], lp, ids, build=False)
    scheduled = {"a": lists[0], "b": lists[1]}
    args = (["a", "b"], np.array([4, 9]), np.array([8, 8]), scheduled)
    mine, theirs = plan_verify(driver, *args, conv_window=2), plan_verify(follower, *args, conv_window=2)
    assert mine.trees is proposed and theirs.trees is not proposed and driver.last_batch is None
    for field in ("token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "conv_index"):
        assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    # A truncated tree is built again (the proposal's batch has more nodes).
    propose(driver, rng, ["a", "b"])
    again = driver.last_batch[1]
    lists = [driver.records["a"].tokens.tolist(), driver.records["b"].tokens.tolist()]
    plan = plan_verify(driver, ["a", "b"], np.array([4, 9]), np.array([8, 4]), {"a": lists[0], "b": lists[1][:3]})
    assert plan.trees is not again and plan.num_nodes.tolist() == [8, 4]


def test_a_step_budget_below_the_stores_and_what_counts_as_cut():
    """A budget schedule's smaller budget builds smaller trees; only trees the scheduler shortened count as cut."""
    rng = np.random.default_rng(3)
    store = TreeStore(budget=10)
    lists, lp, ids = propose_with(store, rng, ["a", "b"], budget=6)
    assert [len(x) for x in lists] == [6, 6]
    assert np.array_equal(store.records["a"].tokens, ddtree.build_tree(lp[0], ids[0], 6).tokens)
    scheduled = {"a": lists[0], "b": lists[1][:4]}  # b cut to 4 by the scheduler
    plan = plan_verify(store, ["a", "b"], np.array([5, 9]), np.array([7, 5]), scheduled)
    assert plan.num_nodes.tolist() == [7, 5] and plan.proposed_budgets.tolist() == [6, 6]
    assert plan.num_cut_trees == 1
    with pytest.raises(ValueError, match=r"a step's budget must be in 1\.\.10 .* got 11"):
        store.propose(["c"], lp[:1], ids[:1], budget=11)


def propose_with(store, rng, req_ids, budget, depth=5, width=4):
    dists = [random_distribution(rng, depth, width) for _ in req_ids]
    lp = np.stack([d[0] for d in dists])
    ids = np.stack([d[1] for d in dists])
    return store.propose(req_ids, lp, ids, budget=budget), lp, ids


@given(st.integers(0, 2**31 - 1), st.integers(1, 80), st.integers(1, 5), st.integers(1, 6))
def test_tree_size_is_what_the_builder_returns(seed, budget, depth, width):
    """The placeholder count handed to vLLM's scheduler before any tree is built (late trees), against the builder,
    -inf log-probs included (they are still prefixes)."""
    rng = np.random.default_rng(seed)
    lp, ids = random_distribution(rng, depth, width)
    lp[rng.random(lp.shape) < 0.2] = -np.inf
    lp = -np.sort(-lp, axis=-1)
    assert len(ddtree.build_tree(lp, ids, budget).tokens) == tree_size(budget, width, depth)


def _deferred(store, rng, req_ids, depth=5, width=4, budget=None):
    """A late proposal: the top-K as the proposer copies it to the host ([R, L, 2K] float32, ids bit-cast)."""
    dists = [random_distribution(rng, depth, width) for _ in req_ids]
    lp, ids = np.stack([d[0] for d in dists]), np.stack([d[1] for d in dists])
    host = np.concatenate([lp, ids.view(np.float32)], axis=-1)
    landed = []
    proposal = DeferredProposal(host, width, SimpleNamespace(synchronize=lambda: landed.append(True)))
    return store.defer(req_ids, proposal, budget), lp, ids, host, landed


def test_late_trees_plan_what_trees_built_at_proposal_plan():
    """Placeholders go to vLLM's scheduler; at verification the trees are built from the settled top-K: the same
    plan as trees built at proposal, a cut tree included, plus every draft token and where it goes."""
    rng = np.random.default_rng(5)
    late, early = TreeStore(budget=12), TreeStore(budget=12)
    placeholders, lp, ids, host, landed = _deferred(late, rng, ["a", "b"])
    lists = early.propose(["a", "b"], lp, ids)
    assert placeholders == [[PLACEHOLDER] * 12] * 2 and [len(x) for x in lists] == [12, 12]
    late.settle()
    host[...] = np.nan  # the next proposal's copy overwrites the buffer: the records hold their own arrays
    assert landed == [True] and late.deferred is None
    scheduled_late = {"a": placeholders[0], "b": placeholders[1][:5]}
    scheduled_early = {"a": lists[0], "b": lists[1][:5]}
    args = (["p", "a", "b"], np.array([0, 7, 30]), np.array([4, 13, 6]))
    mine = plan_verify(late, *args, scheduled_late, conv_window=3)
    theirs = plan_verify(early, *args, scheduled_early, conv_window=3)
    for field in ("token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "conv_index"):
        assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    assert theirs.draft_tokens is None and theirs.draft_step_index is None
    assert mine.draft_step_index.tolist() == list(range(5, 17)) + list(range(18, 23))
    assert mine.draft_tokens.tolist() == lists[0] + lists[1][:5]
    assert mine.num_cut_trees == 1


@pytest.mark.parametrize("order", ["proposal", "reversed"])
def test_a_late_step_of_uniform_trees_plans_what_the_general_path_plans(monkeypatch, order):
    """The usual late step (every request verifies a tree of the same placeholder count) takes shortcuts: the
    shape's counts are constants, the top-K is the settled proposal's whole (in its order). Its plan is the
    general path's, array by array, in the proposal's order and in another (no shortcut for the top-K there)."""
    import ddtree.vllm.step as step

    def plan(shortcut: bool):
        rng = np.random.default_rng(11)
        store = TreeStore(budget=9)
        placeholders, *_ = _deferred(store, rng, ["a", "b", "c"], depth=4, width=5)
        store.settle()
        req_ids = ["a", "b", "c"] if order == "proposal" else ["c", "b", "a"]
        scheduled = {r: p for r, p in zip(["a", "b", "c"], placeholders)}
        if not shortcut:
            monkeypatch.setattr(step, "_late_uniform_budget", lambda *args: None)
        try:
            return plan_verify(store, req_ids, np.array([3, 40, 17]), np.full(3, 10, np.int32), scheduled, 3, 1)
        finally:
            monkeypatch.undo()

    fast, general = plan(True), plan(False)
    assert step._late_uniform_budget([[PLACEHOLDER] * 9] * 3, [False] * 3, True) == 9  # the shortcut was taken
    for field in (
        "batch_index", "token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "node_offsets",
        "num_nodes", "query_starts", "proposed_budgets", "conv_index", "draft_step_index", "draft_tokens",
        "top1_tokens",
    ):  # fmt: skip
        mine, theirs = getattr(fast, field), getattr(general, field)
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs), field
    assert fast.num_tokens == general.num_tokens == 30 and np.array_equal(fast.trees.tokens, general.trees.tokens)


PLAN_FIELDS = (
    "batch_index", "token_index", "logit_rows", "positions", "ancestor_bits", "row_start", "node_offsets",
    "num_nodes", "query_starts", "proposed_budgets", "conv_index", "draft_step_index", "draft_tokens", "top1_tokens",
)  # fmt: skip


def _assert_same_plans(mine, theirs):
    for field in PLAN_FIELDS:
        a, b = getattr(mine, field), getattr(theirs, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    assert mine.num_tokens == theirs.num_tokens and np.array_equal(mine.trees.tokens, theirs.trees.tokens)


def test_a_whole_late_proposal_is_verified_without_records_and_plans_what_records_plan(monkeypatch):
    """The usual late step verifies exactly the last proposal's requests, whole and in order: no request gets a
    record (none is taken), and the plan is the one the same step plans from records (made when the store's records
    are read first)."""

    def plan(recorded: bool):
        rng = np.random.default_rng(21)
        store = TreeStore(budget=40)
        # Trees of 12 drafts at most (3 + 9), proposed at 30: the count scheduled is not the budget.
        placeholders, *_ = _deferred(store, rng, ["a", "b", "c"], depth=2, width=3, budget=30)
        store.settle()
        if recorded:
            assert sorted(store.records) == ["a", "b", "c"]  # (reading them makes them)
        else:
            monkeypatch.setattr(TreeStore, "take", lambda *a: pytest.fail("a whole step took a record"))
        scheduled = dict(zip("abc", placeholders))
        try:
            return plan_verify(store, list("abc"), np.array([3, 40, 17]), np.full(3, 13, np.int32), scheduled, 3), store
        finally:
            monkeypatch.undo()

    (whole, store), (recorded, _) = plan(False), plan(True)
    _assert_same_plans(whole, recorded)
    assert whole.proposed_budgets.tolist() == [30] * 3 and whole.num_nodes.tolist() == [13] * 3
    # Every request verifies a tree: its logits rows are its nodes, in order (the sampler walks the tokens as is).
    assert whole.logit_rows.tolist() == list(range(whole.num_tokens)) == whole.token_index.tolist()
    assert len(store) == 0  # verified: nothing left


@pytest.mark.parametrize("change", ["discard", "order", "cut", "subset", "new proposal"])
def test_a_step_that_is_not_the_whole_proposal_plans_from_records(change):
    """Anything but the whole proposal verified whole and in order (a request finished, another order, a cut tree,
    fewer requests, a newer proposal of some) records every request first: the plan is the one a store whose records
    were made at once plans, and an unverified request keeps its record."""

    def plan(recorded: bool):
        rng = np.random.default_rng(22)
        store = TreeStore(budget=9)
        placeholders, lp, ids, host, _ = _deferred(store, rng, ["a", "b", "c"], depth=4, width=5)
        if recorded:
            store.records  # noqa: B018 (reading them makes them)
        store.settle()
        host[...] = np.nan  # the next proposal's buffer: no record may point into it
        req_ids, scheduled = list("abc"), dict(zip("abc", placeholders))
        if change == "discard":
            store.discard(["b"])
            req_ids.remove("b")
            del scheduled["b"]
        elif change == "order":
            req_ids.reverse()
        elif change == "cut":
            scheduled["c"] = placeholders[2][:4]
        elif change == "subset":
            del scheduled["a"]
        else:
            propose(store, rng, ["a"])
            del scheduled["a"]
        counts = np.array([len(scheduled[r]) + 1 if r in scheduled else 1 for r in req_ids])
        return plan_verify(store, req_ids, np.array([3, 40, 17])[: len(req_ids)], counts, scheduled, 3), store

    (mine, store), (theirs, _) = plan(False), plan(True)
    _assert_same_plans(mine, theirs)
    left = sorted(store.records)
    assert left == {"discard": [], "order": [], "cut": [], "subset": ["a"], "new proposal": ["a"]}[change]
    if change == "subset":  # the unverified request's record holds its own rows of the settled top-K
        assert not np.isnan(store.records["a"].log_probs).any()


def test_the_uniform_late_step_is_recognised_only_when_every_request_has_placeholders_of_one_count():
    from ddtree.vllm.step import _late_uniform_budget

    P = PLACEHOLDER
    assert _late_uniform_budget([[P] * 4, [P] * 4], [False, False], True) == 4
    assert _late_uniform_budget([[P] * 4, [P] * 3], [False, False], True) is None  # a cut tree
    assert _late_uniform_budget([[P] * 4, [7, 8, 9, 1]], [False, False], True) is None  # known drafts
    assert _late_uniform_budget([[], []], [False, False], True) is None
    assert _late_uniform_budget([[P] * 4, [P] * 4], [False, True], True) is None  # a filler tree
    assert _late_uniform_budget([[P] * 4], [False], False) is None  # not every request


def test_a_step_whose_counts_differ_from_its_uniform_drafts_is_refused():
    """A late step whose scheduled counts are not its drafts + 1 is refused on the shortcut too."""
    rng = np.random.default_rng(12)
    store = TreeStore(budget=9)
    placeholders, *_ = _deferred(store, rng, ["a", "b"], depth=4, width=5)
    store.settle()
    scheduled = {"a": placeholders[0], "b": placeholders[1]}
    with pytest.raises(DraftMismatchError, match="request b: 9 tokens scheduled with 9 drafts"):
        plan_verify(store, ["a", "b"], np.array([3, 40]), np.array([10, 9]), scheduled, 3)


def test_late_trees_refuse_a_count_the_tree_cannot_have_and_a_second_unsettled_proposal():
    rng = np.random.default_rng(6)
    store = TreeStore(budget=40)
    placeholders, *_ = _deferred(store, rng, ["a"], depth=2, width=3)
    assert len(placeholders[0]) == 3 + 9  # every prefix there is: fewer than the budget
    with pytest.raises(RuntimeError, match="not settled"):
        _deferred(store, rng, ["b"])
    with pytest.raises(DraftMismatchError, match="request a: its rebuilt tree has 12 draft nodes, 13 drafts"):
        plan_verify(store, ["a"], np.array([9]), np.array([14]), {"a": [PLACEHOLDER] * 13})


def test_settling_skips_requests_that_finished_and_keeps_unscheduled_ones():
    """A request that finished before its verification is gone; one not scheduled in the next step keeps its
    record (now with its own arrays) for the step that schedules it."""
    rng = np.random.default_rng(7)
    store = TreeStore(budget=6)
    placeholders, lp, ids, host, _ = _deferred(store, rng, ["gone", "later"])
    store.discard(["gone"])
    store.settle()
    host[...] = 0.0
    assert set(store.records) == {"later"}
    record = store.records["later"]
    assert np.array_equal(record.log_probs, lp[1]) and np.array_equal(record.token_ids, ids[1])
    again = TreeStore(budget=6)
    want = again.propose(["later"], lp[1:], ids[1:])
    plan = plan_verify(store, ["later"], np.array([3]), np.array([7]), {"later": placeholders[1]})
    assert plan.draft_tokens.tolist() == want[0]


def test_a_proposal_at_proposal_time_settles_a_deferred_one_first():
    """Late trees switched off between steps: the next proposal (built at once) settles the deferred one, whose
    unverified requests keep what they need."""
    rng = np.random.default_rng(8)
    store = TreeStore(budget=6)
    placeholders, lp, ids, _, landed = _deferred(store, rng, ["old"])
    propose(store, rng, ["new"])
    assert landed == [True] and store.deferred is None
    plan = plan_verify(store, ["old"], np.array([3]), np.array([7]), {"old": placeholders[0]})
    assert plan.draft_tokens.tolist() == TreeStore(budget=6).propose(["old"], lp, ids)[0]


def test_counts_alone_give_the_plans_tree_rows_and_token_index():
    """Under asynchronous scheduling the step is published from vLLM's counts before its trees exist; the plan
    built later must agree."""
    from ddtree.vllm.step import tree_token_layout

    rng = np.random.default_rng(9)
    store = TreeStore(budget=12)
    lists, _, _ = propose(store, rng, ["a", "b"])
    scheduled = {"a": lists[0], "b": lists[1][:5]}
    args = (["p", "a", "c", "b"], np.array([0, 7, 3, 30]), np.array([4, 13, 1, 6]))
    rows, num_nodes, token_index = tree_token_layout(args[0], args[2], scheduled)
    plan = plan_verify(store, *args, scheduled)
    assert rows.tolist() == plan.batch_index.tolist() and num_nodes.tolist() == plan.num_nodes.tolist()
    assert token_index.tolist() == plan.token_index.tolist() == list(range(4, 17)) + list(range(18, 24))
    assert tree_token_layout(["p"], np.array([4]), {}) is None
    # Every request with drafts (decodes only): the step's tokens in order, the plan's too.
    assert propose(store, np.random.default_rng(9), ["a", "b"])[0] == lists  # the same trees, proposed again
    rows, num_nodes, token_index = tree_token_layout(["a", "b"], np.array([13, 6]), scheduled)
    plan = plan_verify(store, ["a", "b"], np.array([7, 30]), np.array([13, 6]), scheduled)
    assert rows.tolist() == [0, 1] and num_nodes.tolist() == [13, 6]
    assert token_index.tolist() == plan.token_index.tolist() == list(range(19))


def test_a_whole_tree_steps_counts_are_the_general_functions():
    """``whole_tree_counts`` (constants of a step of whole trees of one size) answers what ``tree_token_layout``
    answers for such a step, and None for any other (trees of two sizes, a request without drafts), which the
    general function then answers."""
    from ddtree.vllm.step import tree_token_layout, whole_tree_counts

    drafts = {"a": [PLACEHOLDER] * 4, "b": [PLACEHOLDER] * 4, "c": [PLACEHOLDER] * 4}
    for n in (np.array([5, 5, 5], dtype=np.int32), np.array([5, 5, 5])):
        counts = whole_tree_counts(3, 15, n, drafts)
        want = tree_token_layout(["a", "b", "c"], n, drafts)
        assert counts.whole == 5 and all(np.array_equal(x, y) for x, y in zip(counts[:3], want))
    assert whole_tree_counts(3, 15, np.array([5, 6, 4]), drafts) is None  # two sizes
    assert whole_tree_counts(3, 15, np.array([5, 5, 5]), {"a": drafts["a"], "b": drafts["b"]}) is None
    assert whole_tree_counts(3, 15, np.array([5, 5, 5]), {**drafts, "c": []}) is None  # c has no drafts
    assert whole_tree_counts(0, 0, np.array([], dtype=np.int64), {}) is None
    assert whole_tree_counts(3, 16, np.array([5, 5, 6]), drafts) is None  # a total the shape cannot have


def test_placeholders_without_a_proposal_verify_a_filler_tree_only_when_asked():
    """Asynchronous scheduling schedules placeholders for every decoding request, also where the drafter did not
    run: with ``unproposed`` they verify a filler tree (any drafts are valid); otherwise it is an error."""
    store = TreeStore(budget=12)
    args = (store, ["a"], np.array([9]), np.array([13]), {"a": [PLACEHOLDER] * 12})
    with pytest.raises(DraftMismatchError, match="no DDTree proposal"):
        plan_verify(*args)
    plan = plan_verify(*args, unproposed=(5, 4))
    assert plan.num_tree_tokens == 13 and plan.num_cut_trees == 0 and plan.num_filler_trees == 1
    # Fewer placeholders than the budget (near max_model_len, a schedule's smaller budget): whole, not cut.
    few = plan_verify(store, ["a"], np.array([9]), np.array([6]), {"a": [PLACEHOLDER] * 5}, unproposed=(5, 4))
    assert few.num_tree_tokens == 6 and few.num_cut_trees == 0 and few.num_filler_trees == 1
    lp = np.tile(-np.arange(1, 5, dtype=np.float32), (5, 1))  # the filler: token k at log-prob -k - 1
    ids = np.tile(np.arange(4, dtype=np.int64), (5, 1))
    assert plan.draft_tokens.tolist() == TreeStore(budget=12).propose(["x"], lp[None], ids[None])[0]
    with pytest.raises(DraftMismatchError, match="no DDTree proposal"):  # real drafts without a record: a bug
        plan_verify(store, ["a"], np.array([9]), np.array([3]), {"a": [5, 6]}, unproposed=(5, 4))


def test_a_filler_fills_its_placeholders_where_the_top_k_is_too_narrow_beside_cut_proposals():
    """A top-K too narrow to fill the budget (1 candidate at depth 3: trees of 3 nodes, cut, and synchronous
    scheduling) beside a first decode vLLM padded with 6 placeholders: the filler is made wide enough to verify all
    6, and the proposals' trees stay the ones whose drafts vLLM scheduled (their extra candidates never taken)."""
    store = TreeStore(budget=6)
    log_probs = np.array([[[-0.1], [-0.3], [-0.2]], [[-0.5], [-0.1], [-0.4]]], dtype=np.float32)
    token_ids = np.array([[[11], [12], [13]], [[21], [22], [23]]], dtype=np.int32)
    lists = store.propose(["a", "b"], log_probs, token_ids)
    assert lists == [[11, 12, 13], [21, 22, 23]]  # cut: 3 nodes where the budget is 6
    scheduled = {"a": lists[0], "b": lists[1], "n": [PLACEHOLDER] * 6}
    plan = plan_verify(store, ["a", "n", "b"], np.array([9, 0, 7]), np.array([4, 7, 4]), scheduled, unproposed=(3, 1))
    assert plan.num_filler_trees == 1 and plan.num_tree_tokens == 4 + 7 + 4
    offsets = plan.trees.token_offsets.tolist()
    assert plan.trees.tokens[offsets[0] : offsets[1]].tolist() == [11, 12, 13]
    assert plan.trees.tokens[offsets[2] : offsets[3]].tolist() == [21, 22, 23]
    assert offsets[2] - offsets[1] == 6  # the filler: 6 drafts of width 2 at depth 3
    # Widened only where the top-K cannot fill its size, to the least width that does.
    from ddtree.vllm.step import filler_record

    assert filler_record(3, 4, 6).log_probs.shape == (3, 4) and filler_record(3, 1, 6).log_probs.shape == (3, 2)
    assert filler_record(15, 1, 63).log_probs.shape == (15, 2)  # 2 + 4 + ... fills 63 at depth 15


def test_a_late_proposal_at_a_schedules_smaller_budget():
    """A budget schedule with late trees: placeholders of the step's budget, trees whole at that budget."""
    rng = np.random.default_rng(10)
    store = TreeStore(budget=12)
    placeholders, lp, ids, _, _ = _deferred(store, rng, ["a", "b"], budget=6)
    assert [len(p) for p in placeholders] == [6, 6]
    plan = plan_verify(store, ["a", "b"], np.array([3, 9]), np.array([7, 7]), dict(zip("ab", placeholders)))
    assert plan.proposed_budgets.tolist() == [6, 6] and plan.num_cut_trees == 0
    want = TreeStore(budget=12).propose(["a", "b"], lp, ids, budget=6)
    assert plan.draft_tokens.tolist() == want[0] + want[1]


def test_a_settled_proposals_top_k_is_taken_in_one_piece():
    """After settle the records hold rows of one copy of the top-K: a verification of them in order reads a slice
    of it (no copy), a subset or another order one gather, a record proposed since (its own arrays) the stack of
    each; every way gives the arrays np.stack of the records gives."""
    from ddtree.vllm.step import top_k_arrays

    rng = np.random.default_rng(3)
    store = TreeStore(budget=12)
    _, lp, ids, host, _ = _deferred(store, rng, ["a", "b", "c"])
    store.settle()
    host[...] = np.nan  # the host buffer is the next proposal's: nothing may point into it
    records = {r: store.records[r] for r in "abc"}
    whole_lp, whole_ids = top_k_arrays(store, list("abc"), [records[r] for r in "abc"])
    assert np.array_equal(whole_lp, lp) and np.array_equal(whole_ids, ids)
    assert np.shares_memory(whole_lp, records["a"].log_probs)  # a view of the settled copy
    picked = top_k_arrays(store, ["c", "a"], [records["c"], records["a"]])
    assert np.array_equal(picked[0], lp[[2, 0]]) and np.array_equal(picked[1], ids[[2, 0]])
    later = TreeStore(budget=12)
    later.propose(["b"], lp[1:2].copy(), ids[1:2].copy())  # a record of another proposal
    mixed = top_k_arrays(store, ["a", "b"], [records["a"], later.records["b"]])
    assert np.array_equal(mixed[0], lp[:2]) and np.array_equal(mixed[1], ids[:2])
    assert not np.shares_memory(mixed[0], records["a"].log_probs)  # stacked


def test_a_step_of_known_drafts_and_placeholders_checks_the_known_ones():
    """A rank that rebuilds trees (``build=False``) next to a late proposal's placeholders in one step: the known
    drafts must be the rebuilt tree's, the placeholders are taken from the rebuilt tree."""
    rng = np.random.default_rng(8)
    lists, lp, ids = propose(TreeStore(budget=12), rng, ["a"])
    late_rng_state = rng.bit_generator.state

    def step(drafts_of_a):
        store = TreeStore(budget=12)
        store.propose(["a"], lp, ids, build=False)
        rng.bit_generator.state = late_rng_state  # the same late proposal for b every time
        placeholders, *_ = _deferred(store, rng, ["b"])
        store.settle()
        scheduled = {"a": drafts_of_a, "b": placeholders[0]}
        return plan_verify(store, ["a", "b"], np.array([7, 30]), np.array([13, 13]), scheduled, conv_window=3)

    plan = step(lists[0])
    assert plan.draft_tokens[:12].tolist() == lists[0] and len(plan.draft_tokens) == 24
    wrong = list(lists[0])
    wrong[3] = (wrong[3] + 1) % 1000
    with pytest.raises(DraftMismatchError, match="rebuilt tree differs"):
        step(wrong)


@given(
    a=st.lists(st.integers(-(2**40), 2**40), max_size=8),
    b=st.lists(st.integers(-(2**40), 2**40), max_size=8),
    dtypes=st.sampled_from([(np.int64, np.int64), (np.int32, np.int64), (np.int64, np.int32)]),
    strided=st.booleans(),
)
def test_same_values_is_array_equal(a, b, dtypes, strided):
    """The plan's fast comparison equals numpy's, across dtypes (by value), shapes and non-contiguous views."""
    from ddtree.vllm.step import same_values

    for left, right in ((a, b), (a, a)):
        x = np.array(left, dtype=np.int64).astype(dtypes[0], casting="unsafe")
        y = np.array(right, dtype=np.int64).astype(dtypes[1], casting="unsafe")
        if strided:
            x, y = np.repeat(x, 2)[::2], np.repeat(y, 2)[::2]
        assert same_values(x, y) == np.array_equal(x, y)


# ---- the store through mixed traffic: device-planned (DDTREE_DEVICE_PLAN), host-planned, discarded proposals ----


@settings(max_examples=40, deadline=None)
@given(
    rounds=st.lists(st.sampled_from(["device", "host", "discard", "reorder"]), min_size=1, max_size=8),
    seed=st.integers(0, 10_000),
)
def test_every_proposal_reaches_its_trees_whatever_the_traffic(rounds, seed):
    """Rounds of one proposal each (the proposer settles the last one first, as ``_defer`` does), then: its step
    planned on the device (taken unsettled; its host trees built later, from its own top-K, however many proposals
    came after), on the host (``plan_verify``: the Rust trees of its top-K), some of its requests finished, or its
    requests scheduled in another order (not device-plannable: planned on the host). Every built tree is the Rust
    build of the proposal it came from."""
    from ddtree.vllm.step import DeferredTrees

    rng = np.random.default_rng(seed)
    budget, depth, top_k = 7, 3, 4
    store, taken = TreeStore(budget), []
    for round_ in rounds:
        req_ids = [f"r{i}" for i in rng.permutation(5)[: int(rng.integers(1, 5))]]
        logits = rng.normal(size=(len(req_ids), depth, 12)).astype(np.float32)
        ids = np.argsort(-logits, axis=-1)[..., :top_k].astype(np.int32)
        log_probs = np.take_along_axis(logits, ids, axis=-1) - 10.0  # (below 0: log-probabilities)
        host = np.concatenate([log_probs, ids.view(np.float32)], axis=-1)
        store.settle()  # (the proposer's _defer)
        drafts = store.defer(req_ids, DeferredProposal(host.copy(), top_k), budget)
        spec = dict(zip(req_ids, drafts))
        expected = ddtree.build_trees(log_probs, ids, budget)
        if round_ == "device":
            whole = take_device_plannable(store, req_ids, spec, lambda ids: True)
            assert whole is not None
            taken.append((DeferredTrees(store, whole, depth), expected, ids))
        elif round_ in ("host", "reorder"):
            order = req_ids[::-1] if round_ == "reorder" and len(req_ids) > 1 else req_ids
            if round_ == "reorder" and len(req_ids) > 1:
                assert take_device_plannable(store, order, spec, lambda ids: True) is None
            n = len(order)
            plan = plan_verify(store, order, np.zeros(n, np.int64), np.full(n, budget + 1), spec)
            rows = [req_ids.index(r) for r in order]
            want = ddtree.build_trees(log_probs[rows], ids[rows], budget)
            np.testing.assert_array_equal(plan.trees.tokens, want.tokens)
            np.testing.assert_array_equal(plan.trees.parents, want.parents)
        else:
            store.discard(req_ids[: int(rng.integers(1, len(req_ids) + 1))])
    for deferred, expected, ids in taken:
        trees, top1 = deferred.build()
        np.testing.assert_array_equal(trees.tokens, expected.tokens)
        np.testing.assert_array_equal(trees.parents, expected.parents)
        np.testing.assert_array_equal(top1, ids[:, :, 0])
