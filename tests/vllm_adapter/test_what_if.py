"""What the engine's trees say about other drafts (``ddtree.vllm.what_if``), against drafts built and walked anew."""

import numpy as np
import pytest

from ddtree.vllm.step import PLACEHOLDER, TreeStore, accept, plan_verify
from ddtree.vllm.what_if import WhatIfAcceptance


def _proposal(rng, requests, depth, width):
    ids = np.stack([rng.permutation(40)[:width] for _ in range(requests * depth)]).reshape(requests, depth, width)
    lp = np.sort(rng.normal(size=(requests, depth, width)) * 1.5, axis=-1)[..., ::-1]
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    return lp.astype(np.float32), ids.astype(np.int32)


def _prefixes(tree):
    out = [()]
    for i in range(1, len(tree)):
        out.append(out[tree.parents[i]] + (int(tree.tokens[i - 1]),))
    return out


def _chain_walk(top1, index_of, target_at):
    """The DFlash chain's drafts ``top1`` walked where the tree knows the target's token: (accepted, censored)."""
    prefix, accepted = (), 0
    for token in top1:
        child = prefix + (int(token),)
        if child not in index_of:
            return accepted, True  # the chain's next draft is not in the tree: unknown from here
        if target_at[index_of[prefix]] != token:
            return accepted, False
        prefix, accepted = child, accepted + 1
    return accepted, False


@pytest.mark.parametrize("seed", range(10))
def test_the_chain_accepts_what_it_would_have_accepted_from_the_same_state(seed):
    """The chain's drafts are the top-1 token at each depth; walked with the target's tokens where the tree has the
    prefix, they give what the statistics report, and the trees where the chain's next draft is not in the tree
    are the censored ones (their count a lower bound). A cut tree counts (from what it kept); a filler does not."""
    rng = np.random.default_rng(seed)
    depth, width, budget, requests = 4, 3, 14, 8
    lp, ids = _proposal(rng, requests, depth, width)
    names = [f"r{j}" for j in range(requests)]
    store = TreeStore(budget=budget)
    lists = store.propose(names, lp, ids)
    scheduled = dict(zip(names, lists))
    scheduled[names[-1]] = lists[-1][:6]  # cut by the scheduler
    scheduled["f"] = [PLACEHOLDER] * budget  # placeholders without a proposal: a filler tree
    num_scheduled = np.array([len(scheduled[n]) + 1 for n in names + ["f"]])
    plan = plan_verify(
        store, names + ["f"], np.full(requests + 1, 4), num_scheduled, scheduled, unproposed=(depth, width)
    )
    assert plan.filler_mask.tolist() == [False] * requests + [True]
    target = np.full(plan.num_tokens, 999, dtype=np.int64)
    trees, expected, censored = plan.trees, 0, 0
    for j in range(requests + 1):
        tree = trees[j]
        lo = int(trees.node_offsets[j])
        for i in range(len(tree)):
            children = [k for k in range(1, len(tree)) if tree.parents[k] == i]
            if children and rng.random() < 0.8:  # mostly the first child (the chain's), sometimes another
                pick = children[0] if rng.random() < 0.6 else rng.choice(children)
                target[lo + i] = tree.tokens[pick - 1]
        if j < requests:
            index_of = {p: i for i, p in enumerate(_prefixes(tree))}
            walked, unknown = _chain_walk(ids[j, :, 0], index_of, target[lo : lo + len(tree)])
            expected, censored = expected + walked, censored + unknown
    walk = accept(plan, target, depth + 1)
    what_if = WhatIfAcceptance()
    what_if.observe(plan, walk.paths, walk.path_lengths - 1)
    chain = what_if.summary()["chain"]
    assert chain["trees"] == requests and chain["censored_trees"] == censored
    assert chain["acceptance_length"] == pytest.approx(1.0 + expected / requests)
    own = walk.path_lengths[:requests] - 1
    assert chain["acceptance_length_of_the_trees"] == pytest.approx(1.0 + own.sum() / requests)
    assert what_if.chain_accepted <= own.sum()  # the tree holds the chain's accepted drafts


def _random_step(rng, requests, depth, width, budget, *, cut=False, filler=False, top1=True):
    """One verify step's plan and walk: trees of the budget (one cut, a filler), the target's tokens mostly down
    the first child."""
    lp, ids = _proposal(rng, requests, depth, width)
    names = [f"r{j}" for j in range(requests)]
    store = TreeStore(budget=budget)
    scheduled = dict(zip(names, store.propose(names, lp, ids)))
    if cut:
        scheduled[names[-1]] = scheduled[names[-1]][:3]
    if filler:
        names, scheduled["f"] = names + ["f"], [PLACEHOLDER] * budget
    num_scheduled = np.array([len(scheduled[n]) + 1 for n in names])
    plan = plan_verify(store, names, np.full(len(names), 4), num_scheduled, scheduled, unproposed=(depth, width))
    if not top1:
        plan.top1_tokens = None
    trees, target = plan.trees, np.full(plan.num_tokens, 999, dtype=np.int64)
    for j in range(len(names)):
        tree, lo = trees[j], int(trees.node_offsets[j])
        for i in range(len(tree)):
            children = [k for k in range(1, len(tree)) if tree.parents[k] == i]
            if children and rng.random() < 0.8:
                target[lo + i] = tree.tokens[(children[0] if rng.random() < 0.6 else rng.choice(children)) - 1]
    return plan, accept(plan, target, depth + 1)


def _counters(what_if):
    what_if.fold()
    return (
        what_if.budget_trees.tolist(),
        what_if.budget_accepted_own.tolist(),
        what_if.budget_accepted.tolist(),
        (what_if.chain_trees, what_if.chain_accepted_own, what_if.chain_accepted, what_if.chain_censored),
    )


@pytest.mark.parametrize("seed", range(5))
def test_steps_folded_together_count_what_each_step_counts_alone(seed):
    """The fold puts several steps' trees side by side: steps of different batch sizes, budgets and path widths,
    with cut trees, fillers and a step without the drafter's top-1 tokens count exactly as step by step."""
    rng = np.random.default_rng(seed)
    shapes = [
        dict(requests=3, depth=4, width=3, budget=14, cut=True),
        dict(requests=1, depth=4, width=3, budget=6),
        dict(requests=4, depth=5, width=2, budget=9, filler=True),  # a wider path than the steps before
        dict(requests=2, depth=4, width=3, budget=14, top1=False),  # no chain count for its trees
        dict(requests=5, depth=3, width=4, budget=20, cut=True, filler=True),
    ]
    steps = [_random_step(rng, **shape) for shape in shapes]
    alone, together = WhatIfAcceptance((2, 5, 8), fold_every=1), WhatIfAcceptance((2, 5, 8), fold_every=100)
    for plan, walk in steps:
        alone.observe(plan, walk.paths, walk.path_lengths - 1)
        together.observe(plan, walk.paths, walk.path_lengths - 1)
    assert together.chain_trees == 0  # kept, not counted yet
    assert _counters(together) == _counters(alone)
    assert alone.chain_trees == sum(len(plan.num_nodes) for plan, _ in steps) - 2 - 2  # fillers, no top-1
    assert alone.budget_trees.tolist()[0] > 0 and alone.chain_accepted > 0


def test_a_kept_step_does_not_change_when_its_buffers_are_reused():
    """The runner's paths are views of a reused buffer: a kept step holds its own copy."""
    rng = np.random.default_rng(0)
    plan, walk = _random_step(rng, requests=3, depth=4, width=3, budget=14)
    reference, kept = WhatIfAcceptance((5,), fold_every=1), WhatIfAcceptance((5,), fold_every=100)
    # int64, as observe keeps them: only a copy protects them
    paths, accepted = walk.paths.astype(np.int64), (walk.path_lengths - 1).astype(np.int64)
    reference.observe(plan, paths, accepted)
    kept.observe(plan, paths, accepted)
    paths[:] = 0
    accepted[:] = 0
    assert _counters(kept) == _counters(reference)


def test_the_cases_the_chain_test_covers():
    """The seeds above reach every case: chains that stop below the tree's path, censored chains, chains through
    all L depths (not censored)."""
    seen = {"shorter": 0, "censored": 0, "full_depth": 0}
    original = WhatIfAcceptance._observe_chain

    def spy(self, plan, paths, on_path, accepted, proposal):  # plan: the folded steps
        before = (self.chain_accepted, self.chain_censored)
        original(self, plan, paths, on_path, accepted, proposal)
        seen["shorter"] += self.chain_accepted - before[0] < int(accepted[proposal].sum())
        seen["censored"] += self.chain_censored > before[1]
        seen["full_depth"] += int((accepted[proposal] == plan.draft_depth[proposal]).sum())

    WhatIfAcceptance._observe_chain = spy
    try:
        for seed in range(10):
            test_the_chain_accepts_what_it_would_have_accepted_from_the_same_state(seed)
    finally:
        WhatIfAcceptance._observe_chain = original
    assert all(seen.values()), seen


def test_the_what_if_line_is_logged_on_the_statistics_interval_after_new_trees():
    from ddtree.vllm.what_if import PeriodicLog, log_interval

    what_if = WhatIfAcceptance((8,))
    assert what_if.log_line() is None  # nothing counted yet
    now = [100.0]
    log, lines = PeriodicLog(10.0, clock=lambda: now[0]), []
    log.maybe(what_if, lines.append)
    what_if.chain_trees, what_if.chain_accepted_own, what_if.chain_accepted, what_if.chain_censored = 4, 8, 4, 1
    what_if.budget_trees[:], what_if.budget_accepted_own[:], what_if.budget_accepted[:] = 4, 8, 6
    now[0] = 105.0
    log.maybe(what_if, lines.append)  # within the interval: nothing
    assert lines == []
    now[0] = 111.0
    log.maybe(what_if, lines.append)
    assert lines == [
        "DDTree what-if over 4 trees: acceptance length 3.00; vLLM's DFlash chain from the same states 2.00 (a lower "
        "bound on 25% of the trees); smaller budgets 8: 2.50"
    ]
    now[0] = 130.0
    log.maybe(what_if, lines.append)  # no new tree since: nothing
    assert len(lines) == 1
    assert log_interval({}) == 10.0 and log_interval({"VLLM_LOG_STATS_INTERVAL": "2.5"}) == 2.5
    assert (
        log_interval({"VLLM_LOG_STATS_INTERVAL": "soon"}) == 10.0
        and log_interval({"VLLM_LOG_STATS_INTERVAL": "0"}) == 10.0
    )


def test_the_statistics_count_verify_steps_with_a_prefill_beside_the_trees():
    """A verify step no FULL graph replayed counts as beside a prefill when its scheduled tokens are more than its
    trees' nodes; a FULL graph's step (trees only) is not looked at."""
    from types import SimpleNamespace

    from ddtree.vllm.stats import DDTreeStats

    stats = DDTreeStats(3)
    trees = SimpleNamespace(num_nodes=np.array([4, 4]), num_tokens=8)
    beside = SimpleNamespace(num_nodes=np.array([4, 4]), num_tokens=13)
    stats.count_verify_step(trees, None)
    assert stats.prefill_beside_trees_steps == 0
    stats.count_verify_step(beside, None)
    stats.count_verify_step(beside, (8, 2))  # (a FULL graph's key: (tokens, trees); not a mixed step by vLLM's word)
    assert stats.prefill_beside_trees_steps == 1 and stats.full_graph_steps == 1
    assert stats.summary()["prefill_beside_trees_steps"] == 1
