"""``ddtree_budget: "auto"`` (``ddtree.vllm.auto_budget``): the policy against a world whose best budget is known,
its estimators against hand-computed values, and the hand-over of its lookup to vLLM's scheduler."""

import math
from collections import deque
from types import SimpleNamespace

import numpy as np
import torch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.vllm import auto_budget
from ddtree.vllm.auto_budget import (
    KEEP,
    MAX_BUFFERED_STEPS,
    STEP_SAMPLES,
    AcceptanceByBudget,
    AutoBudget,
    StepCosts,
    StepTimer,
    auto_candidates,
    timed_counts,
)

# Two kinds of accepted paths (draft numbers in pop order): what each candidate keeps of them is known by hand.
DEEP = [1, 2, 20, 40, 60]  # keeps 2 drafts at budget 16, 3 at 32, 5 at 64
SHALLOW = [1, 17, 33]  # keeps 1, 2, 3
TAU = {16: 1 + (2 + 1) / 2, 32: 1 + (3 + 2) / 2, 64: 1 + (5 + 3) / 2}  # half of the trees each


def _paths(trees: int):
    drafts = np.zeros((trees, 6), dtype=np.int64)
    accepted = np.zeros(trees, dtype=np.int64)
    for r in range(trees):
        path = DEEP if r % 2 == 0 else SHALLOW
        drafts[r, : len(path)] = path
        accepted[r] = len(path)
    return drafts, accepted


def _observe(auto: AutoBudget, budget: int, trees: int, steps: int) -> None:
    drafts, accepted = _paths(trees)
    for _ in range(steps):
        auto.observe(np.full(trees, budget), np.ones(trees, dtype=bool), drafts, accepted)


def test_candidates_fill_whole_row_blocks_from_the_depth_up_to_the_maximum():
    # 2^k - 1 nodes and the root: 2^k tokens per tree; the maximum is the engine's B whatever its form.
    assert auto_candidates(15, 256) == (15, 31, 63, 127, 255, 256)
    assert auto_candidates(15, 63) == (15, 31, 63)
    assert auto_candidates(15, 100) == (15, 31, 63, 100)
    assert auto_candidates(7, 64) == (7, 15, 31, 63, 64)
    assert auto_candidates(None, 63) == (7, 15, 31, 63)
    assert auto_candidates(16, 40) == (31, 40)  # the smallest holds the depth
    assert auto_candidates(16, 16) == (16,)
    assert auto_candidates(15, 15) == (15,)


def test_acceptance_by_budget_counts_what_each_candidate_keeps_of_the_path():
    est = AcceptanceByBudget((16, 32, 64))
    drafts, accepted = _paths(4)
    whole = np.array([True, True, True, False])  # a cut tree does not count
    est.observe(np.array([64, 64, 32, 64]), whole, drafts, accepted)
    est.close_window()
    # Budget 64: trees 0 and 1; 32 and 16: trees 0, 1 and 2 (a budget-32 tree says nothing about 64).
    assert est.trees.tolist() == [3, 3, 2]
    # 64 is 32's estimate plus what 64 keeps beyond 32 on trees 0 and 1 (5 - 3 and 3 - 2): 1.5 per tree.
    assert est.acceptance_length(min_trees=1) == pytest.approx(
        {16: 1 + (2 + 1 + 2) / 3, 32: 1 + (3 + 2 + 3) / 3, 64: 1 + 8 / 3 + 1.5}
    )
    assert est.acceptance_length(min_trees=3) == pytest.approx({16: 1 + 5 / 3, 32: 1 + 8 / 3})


def test_a_budget_not_run_lately_follows_the_traffic_through_its_gain_on_common_trees():
    """Traffic changes while only the smallest budget runs: the larger budgets' estimates move with it (the smallest's
    fresh level plus what each keeps beyond the next smaller one on trees that said both), never below a smaller
    budget's. From its own trees alone, 64 would stay at the old traffic's 4.0 while 16 rose to 1 + 11/7."""
    est = AcceptanceByBudget((16, 32, 64), keep=0.75)
    shallow_drafts, shallow_accepted = _paths(2)
    est.observe(np.full(4, 64), np.ones(4, dtype=bool), shallow_drafts[1:].repeat(4, 0), shallow_accepted[1:].repeat(4))
    est.close_window()  # 4 shallow trees of budget 64: 16 keeps 1, 32 keeps 2, 64 keeps 3
    deep_drafts, deep_accepted = shallow_drafts[:1].repeat(4, 0), shallow_accepted[:1].repeat(4)
    est.observe(np.full(4, 16), np.ones(4, dtype=bool), deep_drafts, deep_accepted)
    est.close_window()  # 4 deep trees of budget 16: 16 keeps 2 (they say nothing about 32 or 64)
    tau = est.acceptance_length(min_trees=1)
    base = 1 + (0.75 * 4 * 1 + 4 * 2) / (0.75 * 4 + 4)
    assert tau == pytest.approx({16: base, 32: base + 1, 64: base + 2})
    assert 1 + est.kept[2] / est.trees[2] == pytest.approx(4.0)  # what 64's own trees alone say


def test_acceptance_decays_by_window_and_only_where_the_window_saw_trees():
    est = AcceptanceByBudget((16, 64), keep=0.5)
    drafts, accepted = _paths(2)
    est.observe(np.array([64, 64]), np.ones(2, dtype=bool), drafts, accepted)
    est.close_window()
    est.observe(np.array([16, 16]), np.ones(2, dtype=bool), drafts[1:2].repeat(2, axis=0), accepted[1:2].repeat(2))
    est.close_window()
    # 16: half of the old window (2 trees, 3 kept) plus the new one (2 shallow trees, 1 kept each); 64 untouched.
    assert est.trees.tolist() == [3.0, 2.0]
    assert est.kept.tolist() == [1.5 + 2, 8.0]


def test_step_costs_interpolate_the_timed_counts_and_add_the_live_rest():
    costs = StepCosts({64: {1: 2.0, 4: 5.0, 8: 9.0}, 16: {2: 1.0}})
    assert costs.forward_ms(64, 1) == 2.0
    assert costs.forward_ms(64, 2) == pytest.approx(3.0)  # between 1 and 4
    assert costs.forward_ms(64, 16) == pytest.approx(17.0)  # past 8: the last slope
    assert costs.forward_ms(16, 8) == pytest.approx(4.0)  # one timed count: per tree
    assert costs.forward_ms(16, 1) == pytest.approx(0.5)
    assert costs.forward_ms(32, 1) is None
    assert costs.rest_ms(64, 4) == 0.0 and not costs.needs_probe(4)  # nothing live yet: nothing to probe for
    costs.observe_step(64, 4, 12.0)
    assert costs.rest_ms(64, 4) == pytest.approx(7.0) and costs.rest_ms(64, 6) == pytest.approx(7.0)  # the nearest
    costs.observe_step(64, 4, 22.0)
    assert costs.rest_ms(64, 4) == pytest.approx(12.0)  # the median of 7 and 17
    assert costs.step_ms(16, 4) == pytest.approx(2.0 + 12.0)  # one budget measured: no per-token part yet
    assert costs.needs_probe(4) and costs.per_token_ms() == 0.0
    costs.observe_step(32, 4, 50.0)  # a budget never timed says nothing
    costs.observe_step(64, 4, float("nan"))
    assert costs.rest_ms(64, 4) == pytest.approx(12.0)


def test_a_few_slow_steps_do_not_move_the_rest_of_a_step():
    """Live steps that paid a first compilation or an idle gap (100 ms where steps take 7) are outliers: the rest of
    a step is the median of its last samples, and old samples leave the window."""
    from ddtree.vllm.auto_budget import STEP_SAMPLES

    costs = StepCosts({64: {1: 2.0}})
    costs.observe_step(64, 1, 102.0)  # the first step of a shape: its kernels compile
    for ms in (7.0, 7.2, 6.8, 7.1, 150.0, 7.0):
        costs.observe_step(64, 1, ms)
    assert costs.rest_ms(64, 1) == pytest.approx(5.1)  # the median of 100, 5, 5.2, 4.8, 5.1, 148, 5
    for _ in range(STEP_SAMPLES):
        costs.observe_step(64, 1, 9.0)
    assert costs.rest_ms(64, 1) == pytest.approx(7.0)  # the window moved on


def test_the_rest_of_a_step_grows_with_the_tokens_it_verifies():
    """The part beyond the forward: 3 ms plus 0.01 ms per verified token, seen at two budgets at n = 4 in a probe."""
    costs = StepCosts({16: {4: 1.0}, 64: {4: 2.0}})
    for _ in range(2):
        costs.observe_step(64, 4, 2.0 + 3.0 + 0.01 * 4 * 65, probing=True)
        costs.observe_step(16, 4, 1.0 + 3.0 + 0.01 * 4 * 17, probing=True)
    assert costs.needs_probe(4) and costs.per_token_ms() == 0.0  # the probe is still open
    costs.close_probe()
    assert not costs.needs_probe(4) and not costs.needs_probe(7) and costs.needs_probe(8)  # its octave only
    assert costs.per_token_ms() == pytest.approx(0.01) and costs.slopes[-1][:2] == (4, pytest.approx(0.01))
    assert costs.rest_ms(16, 4) == pytest.approx(3.0 + 0.68) and costs.rest_ms(64, 8) == pytest.approx(3.0 + 5.2)
    costs.observe_step(64, 2, 10.0)  # one budget at n = 2: its fixed part, the slope from n = 4
    assert costs.rest_ms(16, 2) == pytest.approx(10.0 - 1.0 - 0.01 * 2 * 65 + 0.01 * 2 * 17)
    slower = StepCosts({16: {4: 1.0}, 64: {4: 2.0}})
    for _ in range(2):
        slower.observe_step(64, 4, 3.0, probing=True)
        slower.observe_step(16, 4, 9.0, probing=True)  # the smaller tree's step longer: noise, not a negative cost
    slower.close_probe()
    assert slower.per_token_ms() == 0.0 and not slower.needs_probe(4)


def test_only_a_probes_own_steps_measure_the_per_token_part():
    """Step times of two budgets taken at different times say how the host drifted, not what a token costs: outside
    a probe they set the part every budget shares, and the slope comes from the probe's steps (each budget's with
    at least MIN_PROBE_SAMPLES of them). The H200 run `gpu-h200-pair-wallclock-18591c9` had budget 127 at 4 requests
    12.3 ms beyond its forward and at 3 requests 6.8."""
    from ddtree.vllm.auto_budget import MIN_PROBE_SAMPLES

    costs = StepCosts({16: {4: 1.0}, 64: {4: 2.0}})
    for _ in range(5):
        costs.observe_step(64, 4, 2.0 + 3.0)  # a fast host, budget 64
    for _ in range(5):
        costs.observe_step(16, 4, 1.0 + 9.0)  # minutes later, a slow host, budget 16
    assert costs.per_token_ms() == 0.0 and costs.needs_probe(4)
    assert costs.rest_ms(64, 4) == costs.rest_ms(16, 4) == pytest.approx(6.0)  # shared: the mean of 3 and 9
    for _ in range(MIN_PROBE_SAMPLES):
        costs.observe_step(64, 4, 2.0 + 9.0 + 0.01 * 4 * 65, probing=True)
    costs.observe_step(16, 4, 1.0 + 9.0 + 0.01 * 4 * 17, probing=True)  # one step of 16: too few
    costs.close_probe()
    assert costs.needs_probe(4) and costs.per_token_ms() == 0.0
    for _ in range(MIN_PROBE_SAMPLES):  # the next probe starts afresh: both budgets anew
        costs.observe_step(64, 4, 2.0 + 9.0 + 0.01 * 4 * 65, probing=True)
        costs.observe_step(16, 4, 1.0 + 9.0 + 0.01 * 4 * 17, probing=True)
    costs.close_probe()
    assert costs.per_token_ms() == pytest.approx(0.01) and not costs.needs_probe(4)


def _world_costs():
    """The forward of n trees of c: 4 ms plus 0.05 ms per token (a small model, where trees are not free)."""
    return {c: {n: 4.0 + 0.05 * n * (c + 1) for n in (1, 2, 4, 8)} for c in (16, 32, 64)}


def _world_step(c: int, n: int) -> float:
    """A live step: the forward, 3 ms of drafter and the like, and 0.02 ms per verified token outside the forward
    (logits, sampling), which the start-up timing does not see."""
    return 4.0 + 0.05 * n * (c + 1) + 3.0 + 0.02 * n * (c + 1)


def _oracle(n: int) -> int:
    rates = {c: TAU[c] / _world_step(c, n) for c in TAU}
    return max(rates, key=rates.get)


def test_the_policy_finds_each_batch_sizes_best_budget():
    auto = AutoBudget((16, 32, 64), max_num_seqs=8, window_steps=4, min_trees=8, margin=0.0)
    auto.set_forward_costs(_world_costs())
    assert auto.lookup == [64] * 9 and auto.budget_for(5) == 64 and auto.budget_for(99) == 64
    for n in range(1, 9):  # live budget-64 steps at every batch size
        auto.observe_step_time(64, n, _world_step(64, n))
    _observe(auto, 64, trees=4, steps=3)
    assert auto.maybe_decide() is None and auto.lookup == [64] * 9  # the window is not full yet
    _observe(auto, 64, trees=4, steps=1)
    # The per-token part is unknown: a window of the current budget and its neighbour in turns measures it.
    assert auto.maybe_decide() and auto.probing and auto.lookup[1:] == [32] * 8 and auto.probes == 1
    assert auto.describe().startswith("probing budgets 32 and 64 in turns for one window")
    turns = []
    for _ in range(4):  # a window of 4 steps: one step per turn
        budget = auto.lookup[1]
        turns.append(budget)
        for n in range(1, 9):
            auto.observe_step_time(budget, n, _world_step(budget, n))
        _observe(auto, budget, trees=4, steps=1)
    assert turns == [32, 64, 32, 64]
    auto.maybe_decide()
    want = [_oracle(n) for n in range(1, 9)]
    assert not auto.probing and auto.lookup[1:] == want and auto.probes == 1
    assert want[0] == 64 and want[-1] == 16 and 32 in want  # the answer depends on the batch size
    assert auto.costs.per_token_ms() == pytest.approx(0.02)
    assert "64: 5.00" in auto.describe() and "16: 2.50" in auto.describe()
    # Windows of the smaller trees keep the larger candidates' estimates: nothing changes, no more probes.
    _observe(auto, 16, trees=4, steps=4)
    assert auto.maybe_decide() is False and auto.lookup[1:] == want and auto.decisions == 3


def test_a_batch_size_keeps_its_budget_unless_another_is_clearly_faster():
    auto = AutoBudget((16, 64), max_num_seqs=2, window_steps=1, min_trees=1, margin=0.5)
    auto.set_forward_costs({16: {1: 1.0, 2: 1.0}, 64: {1: 1.5, 2: 1.5}})  # 64: tau 5 / 1.5 against 16: 2.5 / 1.0
    _observe(auto, 64, trees=2, steps=1)
    assert not auto.maybe_decide() and auto.lookup[1:] == [64, 64]  # 16 is slower: 2.5 per ms against 3.33
    auto.margin = 0.0
    auto.set_forward_costs({16: {1: 1.0, 2: 1.0}, 64: {1: 2.1, 2: 2.1}})  # now 16 is 5 % faster
    _observe(auto, 64, trees=2, steps=1)
    assert auto.maybe_decide() and auto.lookup[1:] == [16, 16]
    auto.margin = 0.1
    auto.set_forward_costs({16: {1: 1.0, 2: 1.0}, 64: {1: 1.95, 2: 1.95}})  # 64 is 2.6 % faster: not enough
    _observe(auto, 64, trees=2, steps=1)
    assert not auto.maybe_decide() and auto.lookup[1:] == [16, 16]


def test_probes_stop_once_one_measures_the_per_token_part_or_after_the_most_probes():
    from ddtree.vllm.auto_budget import MAX_PROBES, PROBE_EVERY

    auto = AutoBudget((16, 64), max_num_seqs=2, window_steps=4, min_trees=1, margin=0.0)
    auto.set_forward_costs({16: {1: 1.0}, 64: {1: 1.2}})
    auto.observe_step_time(64, 1, 5.0)
    probed_at = []
    for window in range(1, 1 + PROBE_EVERY * MAX_PROBES + 3):
        for step in range(4):  # each step timed at another batch size: none gets two steps of a budget
            auto.observe_step_time(auto.lookup[1], 1 + step, 5.0)
            _observe(auto, auto.lookup[1], trees=2, steps=1)
        auto.maybe_decide()
        if auto.probing:
            probed_at.append(window)
    assert probed_at == [1 + PROBE_EVERY * k for k in range(MAX_PROBES)] and auto.probes == MAX_PROBES
    assert not auto.costs.slopes  # 16 and 64 one step each per probe at 2 trees: never two of each
    # A probe whose steps time both budgets at one batch size settles that octave: no more probes.
    settled = AutoBudget((16, 64), max_num_seqs=2, window_steps=4, min_trees=1, margin=0.0)
    settled.set_forward_costs({16: {1: 1.0}, 64: {1: 1.2}})
    settled.observe_step_time(64, 2, 5.0)
    _observe(settled, 64, trees=2, steps=4)
    assert settled.maybe_decide() and settled.probing
    for _ in range(4):
        settled.observe_step_time(settled.lookup[1], 2, 5.0 if settled.lookup[1] == 64 else 4.9)
        _observe(settled, settled.lookup[1], trees=2, steps=1)
    settled.maybe_decide()
    assert not settled.probing and not settled.costs.needs_probe(2)
    for _ in range(PROBE_EVERY * 2):
        _observe(settled, settled.lookup[1], trees=2, steps=4)
        settled.maybe_decide()
        assert not settled.probing
    # At 2 trees: tau 5 / 5.15 ms against 2.5 / 4.75 (the forward 2.4 and 2.0, the rest 2.75 either way).
    assert settled.probes == 1 and settled.lookup[1:] == [64, 64]


def test_a_batch_size_keeps_its_budget_while_that_budgets_acceptance_is_not_trusted_yet():
    """The smaller candidates can pass ``min_trees`` first (every tree counts for them, and a probe adds theirs);
    a batch size leaves its budget only once that budget's own acceptance is trusted."""
    auto = AutoBudget((16, 64), max_num_seqs=1, window_steps=1, min_trees=3, margin=0.0)
    auto.set_forward_costs({16: {1: 1.0}, 64: {1: 1.1}})
    drafts, accepted = _paths(2)
    auto.observe(np.array([64, 64]), np.ones(2, dtype=bool), drafts, accepted)  # 2 trees count for both
    auto.observe(np.array([16, 16]), np.ones(2, dtype=bool), drafts, accepted)  # 2 more for 16 only
    assert auto.maybe_decide() is False and auto.lookup[1] == 64  # 16 is trusted (4 trees), 64 not (2)
    assert set(auto.acceptance.acceptance_length(3)) == {16}


def test_without_costs_or_acceptance_every_batch_size_keeps_the_largest_budget():
    auto = AutoBudget((16, 64), max_num_seqs=4, window_steps=1, min_trees=1)
    _observe(auto, 64, trees=2, steps=1)
    assert not auto.maybe_decide() and auto.lookup == [64] * 5  # no step costs (timing failed, or not yet)
    fresh = AutoBudget((16, 64), max_num_seqs=4, window_steps=1, min_trees=1)
    fresh.set_forward_costs({16: {1: 1.0}, 64: {1: 9.0}})
    _observe(fresh, 64, trees=0, steps=1)  # a window without trees: no acceptance known yet
    assert not fresh.maybe_decide() and fresh.lookup == [64] * 5
    auto.set_forward_costs({16: {1: 1.0}, 64: {1: 9.0}})  # the costs arrive: the estimate kept decides
    _observe(auto, 64, trees=0, steps=1)
    assert auto.maybe_decide() and auto.lookup[1:] == [16] * 4


def test_under_asynchronous_scheduling_nothing_changes_until_the_scheduler_reads_the_lookup():
    auto = AutoBudget((16, 64), max_num_seqs=3, window_steps=1, min_trees=1)
    auto.needs_scheduler = True
    auto.set_forward_costs({16: {1: 1.0}, 64: {1: 9.0}})
    _observe(auto, 64, trees=2, steps=1)
    assert auto.maybe_decide() is None and auto.lookup == [64] * 4
    scheduler = SimpleNamespace(dynamic_sd_lookup=[0, 64, 64, 64])
    auto_budget.publish(auto)
    assert auto_budget.attach_scheduler(scheduler) and scheduler.dynamic_sd_lookup is auto.lookup
    assert not auto_budget.attach_scheduler(SimpleNamespace(dynamic_sd_lookup=[0, 64]))  # taken: nothing waits
    _observe(auto, 64, trees=2, steps=1)
    assert auto.maybe_decide() and scheduler.dynamic_sd_lookup[1:] == [16, 16, 16]


def test_a_lookup_of_another_length_is_not_attached():
    auto = AutoBudget((16, 64), max_num_seqs=3)
    auto_budget.publish(auto)
    scheduler = SimpleNamespace(dynamic_sd_lookup=[0, 64])
    assert not auto_budget.attach_scheduler(scheduler) and not auto.attached and scheduler.dynamic_sd_lookup == [0, 64]


def _timed_steps(timer, clock, steps):
    """Runs ``steps`` of ``(key, ms)`` through ``timer`` (each step's period: its start to the next start)."""
    for key, ms in steps:
        timer.start()
        timer.finish(key)
        clock[0] += ms / 1e3


def test_the_step_timer_times_each_step_until_the_next_starts_and_keeps_only_runs_of_one_key():
    clock = [0.0]
    timer = StepTimer(clock=lambda: clock[0])
    a, b = (63, 8), (15, 8)
    timer.start()
    clock[0] = 0.005
    timer.finish(a)  # known when the next step starts, and kept only if that one and the one before are `a` too
    assert timer.landed() == []
    clock[0] = 0.008  # the loop's own work between the steps is the step's too
    timer.start()
    clock[0] = 0.010
    timer.finish(a)  # the first step of the run: it has no `a` before it, so its 8 ms are not kept
    assert timer.landed() == []
    clock[0] = 0.013
    timer.start()
    clock[0] = 0.015
    timer.finish(a)
    assert [(k, round(ms, 6)) for k, ms in timer.landed()] == [(a, 5.0)]  # the second step, between two `a`s
    clock[0] = 0.018
    timer.start()
    timer.start()  # the step before sampled nothing: its time runs from its start to the first of these
    clock[0] = 0.020
    timer.finish(a)
    assert [(k, round(ms, 6)) for k, ms in timer.landed()] == [(a, 5.0)]
    clock[0] = 0.500  # an idle engine, then a prefill: the last step's time would hold the idle gap: dropped
    timer.start()
    timer.finish(None)
    clock[0] = 0.510
    _timed_steps(timer, clock, [(a, 5.0), (a, 6.0), (a, 7.0), (b, 10.0), (b, 11.0), (b, 12.0), (a, 1.0)])
    # 5: no `a` before it (the untimed step); 7: the next step is `b`, whose host work its period holds; 10: the
    # first `b`, whose plan waited for the last `a` on the GPU; 12: the next is `a` again. The last `a`: not over.
    assert [(k, round(ms, 6)) for k, ms in timer.landed()] == [(a, 6.0), (b, 11.0)]
    assert timer.landed() == []
    assert [(budget, trees, round(ms, 6), kept) for budget, trees, ms, kept in timer.trace][-6:] == [
        (63, 8, 5.0, False),
        (63, 8, 6.0, True),
        (63, 8, 7.0, False),
        (15, 8, 10.0, False),
        (15, 8, 11.0, True),
        (15, 8, 12.0, False),
    ]


def test_periods_at_a_budget_change_are_not_given_to_either_budget():
    """Steps of two budgets in blocks of four, as a probe runs them, where each period holds part of the step
    before's GPU work (the lag of asynchronous scheduling): what lands for each budget is its own period."""
    clock = [0.0]
    timer = StepTimer(clock=lambda: clock[0])
    own = {(63, 32): 16.0, (127, 32): 24.0}
    keys = [(63, 32)] * 4 + [(127, 32)] * 4 + [(63, 32)] * 4 + [(127, 32)] * 4 + [(63, 32)]
    previous = keys[0]
    for key in keys:
        timer.start()
        timer.finish(key)
        clock[0] += (0.5 * own[key] + 0.5 * own[previous]) / 1e3  # half of it the step before's
        previous = key
    landed = timer.landed()
    assert landed and {key for key, _ in landed} == set(own)
    for key, ms in landed:
        assert ms == pytest.approx(own[key])
    assert len(timer.trace) == len(keys) - 1
    assert sum(kept for *_, kept in timer.trace) == len(landed)


def test_timed_counts_are_the_powers_of_two_and_the_largest_of_the_graphed_counts():
    assert timed_counts([]) == []
    assert timed_counts(range(1, 41)) == [1, 2, 4, 8, 16, 32, 40]
    assert timed_counts([3, 5, 6]) == [6]


class _Recorder:
    def __init__(self):
        self.lines = []

    def info(self, message, *args):
        self.lines.append(("info", message % args))

    def warning(self, message, *args):
        self.lines.append(("warning", message % args))


def _auto_runner(monkeypatch, captured):
    """A runner (no GPU, no vLLM engine) with ``auto`` candidates 15/31/63 at depth 15, top-K 8, FULL graphs of
    ``captured`` ``(tokens per tree, trees)``."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor

    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=63, draft_len=15, top_k=8, auto=True)
    runner._ddtree_auto = AutoBudget(runner.ddtree_cfg.budgets, max_num_seqs=40)
    runner.drafter = SimpleNamespace(top_k=8)
    keys = {BatchDescriptor(num_tokens=t * n, num_reqs=n, uniform=True) for t, n in captured}
    keys.add(BatchDescriptor(num_tokens=512))  # a PIECEWISE-style key without requests: not a tree graph
    runner.cudagraph_dispatcher = SimpleNamespace(cudagraph_keys={CUDAGraphMode.FULL: keys})
    monkeypatch.setattr(DDTreeGPUModelRunner, "_ddtree_full_graphs", lambda self: True)
    log = _Recorder()
    monkeypatch.setattr(runner_module, "logger", log)
    return runner, log


def test_the_runner_times_each_candidates_graphed_tree_counts_once(monkeypatch):
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    captured = [(16, n) for n in range(1, 41)] + [(32, n) for n in range(1, 20)] + [(64, n) for n in (1, 2, 3, 8)]
    runner, log = _auto_runner(monkeypatch, captured)
    timed = []

    def time_forward(self, tokens, trees, full):
        timed.append((tokens, trees, full))
        return tokens * trees / 100

    monkeypatch.setattr(DDTreeGPUModelRunner, "_ddtree_time_forward", time_forward)
    runner.ddtree_time_candidates()
    costs = runner._ddtree_auto.costs
    assert {b: sorted(dict(p)) for b, p in costs.forward.items()} == {
        15: [1, 2, 4, 8, 16, 32, 40],
        31: [1, 2, 4, 8, 16, 19],
        63: [1, 2, 8],
    }
    assert costs.forward_ms(31, 19) == pytest.approx(32 * 19 / 100) and all(full for *_, full in timed)
    assert (
        log.lines[0][0] == "info" and "candidates 15, 31, 63" in log.lines[0][1] and "(63, 8): 5.12" in log.lines[0][1]
    )
    runner.ddtree_time_candidates()  # once only
    assert len(timed) == 7 + 6 + 3


def test_a_failed_timing_leaves_the_largest_budget_and_says_so(monkeypatch):
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner, log = _auto_runner(monkeypatch, [(16, 1), (64, 1)])

    def broken(self, tokens, trees, full):
        raise RuntimeError("no graph")

    monkeypatch.setattr(DDTreeGPUModelRunner, "_ddtree_time_forward", broken)
    runner.ddtree_time_candidates()
    assert runner._ddtree_auto.costs is None and runner.ddtree_budget_for(1) == 63
    assert log.lines == [
        (
            "warning",
            "DDTree auto: timing the candidate budgets failed (RuntimeError('no graph')); every batch size "
            "keeps budget 63",
        )
    ]


def test_each_step_feeds_the_timer_and_a_new_choice_is_logged(monkeypatch):
    runner, log = _auto_runner(monkeypatch, [])
    auto = runner._ddtree_auto
    auto.window_steps, auto.min_trees = 1, 1
    auto.set_forward_costs({15: {2: 1.0}, 31: {2: 2.0}, 63: {2: 9.0}})
    finished = []
    for _ in range(2):  # a probe at 2 requests found no per-token part (the smaller trees' steps took longer)
        auto.costs.observe_step(63, 2, 12.0, probing=True)
        auto.costs.observe_step(15, 2, 5.0, probing=True)
    auto.costs.close_probe()
    landed = [((63, 2), 12.0), ((15, 2), 5.0)]
    runner._ddtree_step_timer = SimpleNamespace(finish=finished.append, landed=lambda: landed)
    runner._ddtree_whole_tree_tokens = 64
    runner._ddtree_plan = SimpleNamespace(num_nodes=np.array([64, 64]))
    _observe(auto, 63, trees=2, steps=1)
    runner._ddtree_auto_step()
    assert finished == [(63, 2)] and auto.costs.rest_ms(63, 2) == pytest.approx(3.5)
    # Beyond the forward 3 ms (63) and 4 ms (15): no per-token part (a negative slope is noise), 3.5 ms each.
    # Two requests: tau 2.5 / 4.5 ms (15), 3.5 / 5.5 (31), 5 / 12.5 (63); the forward scales by the request count
    # (one timed count), so 31 wins up to 4 requests (3.5 / 7.5 against 2.5 / 5.5) and 15 from 5 (2.5 / 6 ms).
    assert runner.ddtree_budget_for(1) == runner.ddtree_budget_for(4) == 31
    assert runner.ddtree_budget_for(5) == runner.ddtree_budget_for(40) == 15
    assert log.lines == [("info", "DDTree auto: " + auto.describe())] and "1-4: 31, 5-40: 15" in log.lines[0][1]
    runner._ddtree_whole_tree_tokens = 0  # a step that was not whole trees of one size: not timed
    runner._ddtree_auto_step()
    assert finished[-1] is None and len(log.lines) == 1


def test_a_step_that_captured_a_graph_is_not_timed(monkeypatch):
    from ddtree.vllm.graphs import ShapeGraphs

    runner, _ = _auto_runner(monkeypatch, [])
    finished = []
    runner._ddtree_step_timer = SimpleNamespace(start=lambda: None, finish=finished.append, landed=lambda: [])
    runner._ddtree_whole_tree_tokens = 64
    runner._ddtree_plan = SimpleNamespace(num_nodes=np.array([64, 64]))
    graphs = ShapeGraphs(lambda work: work)
    monkeypatch.setattr(ShapeGraphs, "first_runs", ShapeGraphs.first_runs)  # the process-wide count, restored
    for key in ("new shape", "new shape", "another"):
        runner._ddtree_first_runs_at_start = ShapeGraphs.first_runs  # what execute_model notes at the step's start
        graphs.run(key, lambda: None)
        runner._ddtree_auto_step()
    # The first run of a key compiles and captures: that step is dropped; its replay is timed.
    assert finished == [None, (63, 2), None]


def test_the_first_choice_is_logged_even_when_it_keeps_the_largest_budget(monkeypatch):
    runner, log = _auto_runner(monkeypatch, [])
    auto = runner._ddtree_auto
    auto.window_steps, auto.min_trees = 1, 1
    auto.set_forward_costs({15: {1: 1.0}, 31: {1: 1.1}, 63: {1: 1.2}})  # trees nearly free: 63 everywhere
    for _ in range(2):
        _observe(auto, 63, trees=2, steps=1)
        runner._ddtree_auto_step()
    assert auto.decisions == 2 and auto.changes == 0 and runner.ddtree_budget_for(7) == 63
    assert log.lines == [("info", "DDTree auto: " + auto.describe())] and "1-40: 63" in log.lines[0][1]


def test_the_scheduler_of_an_auto_engine_reads_the_runners_lookup(monkeypatch):
    from ddtree.vllm import patches
    from ddtree.vllm.config import ADDITIONAL_CONFIG_KEY

    class Scheduler:
        def __init__(self, vllm_config, *args, **kwargs):
            self.dynamic_sd_lookup = [0, 64, 64]

    init = patches._live_auto_lookup(Scheduler.__init__)
    log = _Recorder()
    monkeypatch.setattr(patches, "_log", lambda: log)
    auto = AutoBudget((16, 64), max_num_seqs=2)
    auto_budget.publish(auto)
    config = SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: {"auto": True}})
    scheduler = object.__new__(Scheduler)
    init(scheduler, config)
    assert scheduler.dynamic_sd_lookup is auto.lookup and auto.attached and not log.lines
    other = object.__new__(Scheduler)
    init(other, config)  # nothing published in this process: a runner elsewhere
    assert other.dynamic_sd_lookup == [0, 64, 64] and log.lines[0][0] == "warning"
    plain = object.__new__(Scheduler)
    auto_budget.publish(AutoBudget((16, 64), max_num_seqs=2))
    init(plain, SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: {"auto": False}}))  # a schedule's own
    assert plain.dynamic_sd_lookup == [0, 64, 64] and len(log.lines) == 1
    auto_budget._PUBLISHED.clear()


@pytest.mark.parametrize("seed", range(20))
def test_in_random_worlds_the_policy_converges_to_the_best_budget_of_every_batch_size(seed):
    """Random candidates, acceptance curves (rising with the budget), forward costs and per-token costs: after the
    first window, a probe and one more window, every batch size holds the world's best candidate (no hysteresis),
    and the lookup only ever holds candidates."""
    rng = np.random.default_rng(seed)
    candidates = tuple(sorted(rng.choice([8, 16, 32, 64, 128, 256], size=rng.integers(2, 5), replace=False)))
    max_num_seqs = int(rng.integers(1, 12))
    base, per_token, fixed, slope = rng.uniform(0.5, 5), rng.uniform(0, 0.05), rng.uniform(0, 5), rng.uniform(0, 0.05)

    def forward(c, n):
        return base + per_token * n * (c + 1)

    def step(c, n):
        return forward(c, n) + fixed + slope * n * (c + 1)

    # Acceptance: each tree accepts a path whose draft numbers grow geometrically, so larger budgets keep more.
    depth = int(rng.integers(2, 7))
    path = np.cumsum(rng.integers(1, 40, size=depth))
    tau = {c: 1.0 + float((path <= c).sum()) for c in candidates}
    auto = AutoBudget(candidates, max_num_seqs, window_steps=4, min_trees=1, margin=0.0)
    counts = sorted({1, 2, 4, 8, max_num_seqs} & set(range(1, max_num_seqs + 1)))
    auto.set_forward_costs({c: {n: forward(c, n) for n in counts} for c in candidates})
    drafts = np.tile(path, (3, 1))
    accepted = np.full(3, depth)
    for _ in range(3 * 4):  # three windows: the largest everywhere, the probe (in turns), the decision
        used = {auto.budget_for(n) for n in range(1, max_num_seqs + 1)}
        for n in range(1, max_num_seqs + 1):
            auto.observe_step_time(auto.budget_for(n), n, step(auto.budget_for(n), n))
        budget = min(used)
        auto.observe(np.full(3, budget), np.ones(3, dtype=bool), drafts, accepted)
        auto.maybe_decide()
        assert set(auto.lookup[1:]) <= set(candidates)
    assert auto.probes == 1 and not auto.probing
    for n in range(1, max_num_seqs + 1):
        best = max(candidates, key=lambda c: (tau[c] / step(c, n), -c))
        chosen = auto.budget_for(n)
        assert tau[chosen] / step(chosen, n) == pytest.approx(tau[best] / step(best, n), rel=1e-9), (n, chosen, best)


@pytest.mark.parametrize("full", [True, False])
def test_timing_a_candidate_runs_dummy_trees_under_its_query_length(monkeypatch, full):
    """FULL: one dummy run stages the trees, then the captured graph replays; eager: whole dummy runs, each on dummy
    trees (the timing flag), so the GDN layers take the tree path; the flag is down afterwards, also on an error."""
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner, _ = _auto_runner(monkeypatch, [])
    runner.uniform_decode_query_len = 65
    runner.cudagraph_dispatcher.uniform_decode_query_len = 65
    clock = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _ClockEvent(clock))
    runs, replays = [], []

    def dummy_run(self, num_tokens, cudagraph_runtime_mode=None, force_attention=False, uniform_decode=False):
        runs.append((num_tokens, self.uniform_decode_query_len, self._ddtree_timing_trees, force_attention))
        clock[0] += 2.0

    graph = SimpleNamespace(replay=lambda: (replays.append(1), clock.__setitem__(0, clock[0] + 1.0)))
    monkeypatch.setattr(DDTreeGPUModelRunner, "_dummy_run", dummy_run)
    monkeypatch.setattr(DDTreeGPUModelRunner, "_ddtree_forward_graph", lambda self, n, t: graph if full else None)
    ms = runner._ddtree_time_forward(17, 4, full)
    assert ms == (1.0 if full else 2.0) and not runner._ddtree_timing_trees and runner.uniform_decode_query_len == 65
    assert (
        runs[0] == (68, 17, True, not full) and len(runs) == (1 if full else 4) and len(replays) == (3 if full else 0)
    )

    def broken(self, *args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(DDTreeGPUModelRunner, "_dummy_run", broken)
    with pytest.raises(RuntimeError):
        runner._ddtree_time_forward(17, 4, full)
    assert not runner._ddtree_timing_trees and runner.uniform_decode_query_len == 65


class _ClockEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock[0]

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


def _scalar_best(costs: StepCosts, candidates, tau, trees: int, current: int, margin: float) -> int:
    """The decision for one batch size, candidate by candidate (the oracle of the vectorised one)."""
    rates = {}
    for c in candidates:
        step = costs.step_ms(c, trees) if c in tau else None
        if step is not None and step > 0:
            rates[c] = tau[c] / step
    if current not in rates:
        return current
    best = max(rates, key=lambda c: (rates[c], -c))
    return current if rates[best] <= rates[current] * (1 + margin) else best


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorised_decision_equals_the_decision_batch_size_by_batch_size(seed):
    """Random timed counts (one or several per budget, some budgets untimed), live samples at random (budget,
    trees), random trusted acceptance and current budgets: every step cost and every choice equals the scalar one."""
    rng = np.random.default_rng(seed)
    candidates = (16, 32, 64, 128, 256)
    timed = [c for c in candidates if rng.random() < 0.85] or [64]
    forward = {
        c: {int(n): float(rng.uniform(0.2, 5.0)) for n in rng.choice([1, 2, 4, 8, 16, 32], rng.integers(1, 5), False)}
        for c in timed
    }
    costs = StepCosts(forward)
    max_num_seqs = int(rng.integers(1, 70))
    for _ in range(int(rng.integers(0, 12))):
        costs.observe_step(int(rng.choice(timed)), int(rng.integers(1, max_num_seqs + 1)), float(rng.uniform(1, 30)))
    trees = np.arange(1, max_num_seqs + 1)
    table = costs.step_ms_table(candidates, trees)
    for row, c in enumerate(candidates):
        for col, n in enumerate(trees):
            expected = costs.step_ms(c, int(n))
            if expected is None:
                assert np.isnan(table[row, col])
            else:
                assert table[row, col] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    tau = {c: float(rng.uniform(1.5, 6.0)) for c in candidates if rng.random() < 0.8}
    margin = float(rng.choice([0.0, 0.03, 0.2]))
    auto = AutoBudget(candidates, max_num_seqs, margin=margin)
    auto.costs = costs
    current = [int(rng.choice(candidates)) for _ in range(max_num_seqs)]
    chosen = auto._best(tau, np.asarray(current)).tolist()
    assert chosen == [_scalar_best(costs, candidates, tau, n, cur, margin) for n, cur in zip(trees, current)]


def test_a_decision_at_256_sequences_is_one_table_not_a_loop():
    """The decision runs in the step's path every window: at 256 sequences and 5 candidates it is a handful of
    array operations (StepCosts.step_ms is not called per batch size and candidate)."""
    auto = AutoBudget((16, 32, 64, 128, 256), max_num_seqs=256, window_steps=1, min_trees=1)
    auto.set_forward_costs({c: {1: 1.0 + c / 100, 256: 10.0 + c / 10} for c in auto.candidates})
    auto.costs.step_ms = None  # the scalar path would fail here
    _observe(auto, 256, trees=4, steps=1)
    auto.maybe_decide()
    assert set(auto.lookup[1:]) <= set(auto.candidates)


def test_a_batch_size_far_from_the_probed_one_is_probed_again_and_its_slope_counts_most():
    """The H200's failure (`gpu-h200-pair-cb8bd51`): traffic at 1 request first, probed there, then at 8, where the
    per-token part decides. Here 0.1 ms per verified token, and the batch-1 probe's smaller trees (32, beside the
    current 64) happened to look slower (+6 ms, noise): read at 1 request alone the slope is negative (so 0) and 64
    looks best at 8 requests. A second probe in the octave of 8 measures it where it matters, and the pooled slope
    weighs each batch size by its token spread, so 8 requests set it: 16 is chosen at 8 requests, as the true step
    costs say."""
    from ddtree.vllm.auto_budget import STEP_SAMPLES

    def forward(c, n):
        return 0.3 + 0.0005 * n * (c + 1)

    def step(c, n):
        return forward(c, n) + 4.0 + 0.5 * n + 0.1 * n * (c + 1)

    auto = AutoBudget((16, 32, 64), max_num_seqs=8, window_steps=2, min_trees=1, margin=0.0)
    auto.set_forward_costs({c: {n: forward(c, n) for n in (1, 2, 4, 8)} for c in (16, 32, 64)})

    def window(n, noise_of_32=0.0):
        for i in range(2):
            budget = auto.budget_for(n)
            for _ in range(STEP_SAMPLES):
                auto.observe_step_time(budget, n, step(budget, n) + (noise_of_32 if budget == 32 else 0.0))
            rows = [DEEP if (r + i) % 2 == 0 else SHALLOW for r in range(n)]  # half deep, half shallow: TAU
            drafts = np.zeros((n, 6), dtype=np.int64)
            for r, path in enumerate(rows):
                drafts[r, : len(path)] = path
            auto.observe(np.full(n, budget), np.ones(n, dtype=bool), drafts, np.array([len(p) for p in rows]))
        auto.maybe_decide()

    window(1)
    assert auto.probing and auto.probes == 1  # batch 1: timed at one budget only
    assert auto.describe().startswith("probing budgets 32 and 64")
    window(1, noise_of_32=6.0)
    assert not auto.probing and auto.costs.per_token_ms() == 0.0 and auto.budget_for(8) == 64
    window(8)
    assert auto.probing and auto.probes == 2  # batch 8: its octave has no batch size timed at two budgets
    window(8)
    true_best = max((16, 32, 64), key=lambda c: TAU[c] / step(c, 8))
    # Pooled by token spread: batch 1's (32 tokens apart, 6 ms of noise: -2.8 ms) weighs 512, batch 8's 32768.
    pooled = (-2.8 / 32 * 512 + 0.1 * 32768) / (512 + 32768)
    assert true_best == 16 and auto.budget_for(8) == 16 and auto.costs.per_token_ms() == pytest.approx(pooled)
    window(8)
    assert auto.probes == 2 and not auto.probing  # settled: no third probe


def test_the_runner_feeds_auto_each_steps_wall_clock_period(monkeypatch):
    """execute_model starts the timer and sampling names the step: a whole-tree step's time, from its start to the
    next step's start, reaches auto's costs once that next step turns out timed too."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.graphs import ShapeGraphs

    runner, _ = _auto_runner(monkeypatch, [])
    auto = runner._ddtree_auto
    auto.set_forward_costs({15: {2: 1.0}, 31: {2: 2.0}, 63: {2: 3.0}})
    clock = [0.0]
    runner._ddtree_step_timer = StepTimer(clock=lambda: clock[0])
    auto.period_trace = runner._ddtree_step_timer.trace
    monkeypatch.setattr(GPUModelRunner, "execute_model", lambda self, *a, **k: None)
    runner.drafter = SimpleNamespace(last_req_ids=[], last_drafts=[])
    runner._ddtree_whole_tree_tokens = 64
    runner._ddtree_plan = SimpleNamespace(num_nodes=np.array([64, 64]))
    monkeypatch.setattr(ShapeGraphs, "first_runs", ShapeGraphs.first_runs)
    for period in (0.010, 0.012, 0.011):  # seconds from one execute_model to the next
        runner.execute_model("scheduler output")
        runner._ddtree_auto_step()
        clock[0] += period
    runner.execute_model("scheduler output")
    runner._ddtree_auto_step()
    # Three periods known, the first without a timed step before it (not kept); each is 3 ms of forward plus the
    # rest: the median of 9 and 8 ms.
    assert auto.costs.beyond[(63, 2)] == pytest.approx(8.5)
    assert [[round(ms, 6), kept] for *_, ms, kept in auto.summary()["step_periods"]] == [
        [10.0, False],
        [12.0, True],
        [11.0, True],
    ]


def test_the_statistics_and_autos_bookkeeping_after_sampling_are_timed_host_work(monkeypatch):
    """What the runner does after vLLM's sampling (the landed steps' statistics, ``auto``'s window) runs on the
    engine loop's path every step: it counts as host work ("stats"), beside plan, accept and commit."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeStats

    runner, _ = _auto_runner(monkeypatch, [])
    runner.ddtree_stats = DDTreeStats(15)
    runner._ddtree_counts = SimpleNamespace(landed=lambda wait: [None])
    runner._ddtree_what_if_log = None
    runner._ddtree_plan, runner._ddtree_step_timer, runner.drafter = None, None, SimpleNamespace()
    stepped = []
    monkeypatch.setattr(GPUModelRunner, "sample_tokens", lambda self, grammar_output: "sampled")
    monkeypatch.setattr(type(runner), "_ddtree_auto_step", lambda self: stepped.append(True))
    assert runner.sample_tokens(None) == "sampled" and stepped == [True]
    assert runner.ddtree_stats.host_seconds["stats"] > 0


# ---- the per-step part, buffered and lazy, against the eager version it replaced -----------------------------------
class _EagerAcceptance:
    """:class:`AcceptanceByBudget` as it was when every step was counted into the window at once (the oracle)."""

    def __init__(self, candidates, keep=KEEP):
        self.candidates = np.asarray(sorted(candidates), dtype=np.int64)
        self.keep = keep
        self.trees = np.zeros(self.candidates.shape[0])
        self.kept = np.zeros(self.candidates.shape[0])
        self.gains = np.zeros(self.candidates.shape[0])
        self._window_trees = np.zeros_like(self.trees)
        self._window_kept = np.zeros_like(self.kept)
        self._window_gains = np.zeros_like(self.gains)

    def observe(self, budgets, whole, drafts, accepted):
        drafts = np.asarray(drafts, dtype=np.int64)
        accepted = np.asarray(accepted, dtype=np.int64)
        on_path = np.arange(drafts.shape[1])[None, :] < accepted[:, None]
        caps = self.candidates[:, None]
        counted = np.asarray(whole, dtype=bool)[None, :] & (np.asarray(budgets)[None, :] >= caps)  # [C, R]
        kept = ((drafts[None, :, :] <= caps[:, :, None]) & on_path[None, :, :]).sum(axis=2)  # [C, R]
        self._window_trees += counted.sum(axis=1)
        self._window_kept += (counted * kept).sum(axis=1)
        beyond = np.diff(kept, axis=0, prepend=0)
        self._window_gains += (counted * beyond).sum(axis=1)

    def close_window(self):
        seen = self._window_trees > 0
        self.trees[seen] = self.keep * self.trees[seen] + self._window_trees[seen]
        self.kept[seen] = self.keep * self.kept[seen] + self._window_kept[seen]
        self.gains[seen] = self.keep * self.gains[seen] + self._window_gains[seen]
        self._window_trees[:] = 0
        self._window_kept[:] = 0
        self._window_gains[:] = 0

    acceptance_length = AcceptanceByBudget.acceptance_length


class _EagerStepCosts(StepCosts):
    """:class:`StepCosts` as it was when every step took its median at once and interpolated its forward anew (the
    oracle): ``beyond`` a plain dict, written by every step."""

    beyond = None  # shadows the lazy property: an instance attribute

    def __init__(self, forward_ms):
        super().__init__(forward_ms)
        self.beyond = {}

    def _forward_row(self, budget, trees):
        return self._interpolate(budget, trees)  # uncached

    def forward_ms(self, budget, trees):
        row = self._forward_row(budget, np.array([trees], dtype=np.float64))
        return None if row is None else float(row[0])

    def observe_step(self, budget, trees, step_ms, probing=False):
        forward = self.forward_ms(budget, trees)
        if forward is None or not np.isfinite(step_ms) or step_ms <= 0:
            return
        beyond = max(step_ms - forward, 0.0)
        samples = self._samples.setdefault((budget, trees), deque(maxlen=STEP_SAMPLES))
        samples.append(beyond)
        self.beyond[(budget, trees)] = float(np.median(samples))
        if probing:
            self._probe.setdefault((budget, trees), []).append(beyond)
        self._model = None


class _EagerAutoBudget(AutoBudget):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.acceptance = _EagerAcceptance(self.candidates)

    def set_forward_costs(self, forward_ms):
        self.costs = _EagerStepCosts(forward_ms)


def _same_acceptance(mine, eager):
    for name in ("trees", "kept", "gains", "_window_trees", "_window_kept", "_window_gains"):
        assert np.array_equal(getattr(mine, name), getattr(eager, name)), name  # bit for bit
    for min_trees in (1.0, 8.0, 32.0):
        assert mine.acceptance_length(min_trees) == eager.acceptance_length(min_trees)


def _same_costs(mine, eager, trees=np.arange(1, 41)):
    if mine is None:
        assert eager is None
        return
    assert list(mine.beyond.items()) == list(eager.beyond.items())  # values and order (np.mean over them)
    assert {k: list(q) for k, q in mine._samples.items()} == {k: list(q) for k, q in eager._samples.items()}
    assert mine._rest_model() == eager._rest_model() and list(mine.slopes) == list(eager.slopes)
    budgets = sorted(eager.forward) + [5]
    assert np.array_equal(mine.step_ms_table(budgets, trees), eager.step_ms_table(budgets, trees), equal_nan=True)
    for n in (1, 2, 3, 8, 33):
        assert mine.needs_probe(n) == eager.needs_probe(n)
        for budget in budgets:
            assert mine.forward_ms(budget, n) == eager.forward_ms(budget, n)
            assert mine.rest_ms(budget, n) == eager.rest_ms(budget, n)


def _same_auto(mine, eager):
    assert mine.lookup == eager.lookup and mine.probing == eager.probing
    assert (mine.decisions, mine.changes, mine.probes) == (eager.decisions, eager.changes, eager.probes)
    _same_acceptance(mine.acceptance, eager.acceptance)
    _same_costs(mine.costs, eager.costs, np.arange(1, len(mine.lookup)))
    assert mine.summary() == eager.summary() and mine.describe() == eager.describe()


def _random_forward(rng, candidates):
    timed = [c for c in candidates if rng.random() < 0.85] or [candidates[-1]]
    counts = [1, 2, 4, 8, 16, 32]
    return {
        c: {int(n): float(rng.uniform(0.2, 5.0)) for n in rng.choice(counts, rng.integers(1, 5), replace=False)}
        for c in timed
    }


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_buffered_and_lazy_bookkeeping_decide_exactly_as_the_eager_one(seed):
    """Random runs of steps (any batch size, path width, budgets, cut trees, step times, some rejected), decisions,
    probes and reads between steps: the buffered acceptance and the lazy medians give, bit for bit, every count,
    median, cost, decision and summary of the step-by-step version. A step's drafts are a view of one buffer
    scribbled over after each step (as the runner's are): what was observed must have been copied."""
    rng = np.random.default_rng(seed)
    candidates = tuple(sorted(rng.choice([7, 15, 31, 63, 127], int(rng.integers(1, 5)), replace=False).tolist()))
    max_num_seqs = int(rng.integers(1, 41))
    options = dict(
        window_steps=int(rng.choice([1, 2, 4, 16, 80])),  # 80: more steps than the buffer holds
        min_trees=float(rng.choice([1.0, 8.0, 32.0])),
        margin=float(rng.choice([0.0, 0.03])),
    )
    mine, eager = AutoBudget(candidates, max_num_seqs, **options), _EagerAutoBudget(candidates, max_num_seqs, **options)
    needs_scheduler = rng.random() < 0.3
    mine.needs_scheduler = eager.needs_scheduler = needs_scheduler
    costs_at = int(rng.integers(0, 20)) if rng.random() < 0.9 else -1
    attach_at = int(rng.integers(0, 150))
    forward = _random_forward(rng, candidates)
    buffer = np.zeros((max_num_seqs, 24), dtype=np.int64)
    batch_sizes = rng.integers(0, max_num_seqs + 1, int(rng.integers(1, 4)))  # a few: probes time them twice
    reads = float(rng.choice([0.0, 0.07]))  # without reads, windows of 80 steps outgrow the buffer
    for op in range(int(rng.integers(1, 150))):
        if op == costs_at:
            mine.set_forward_costs(forward)
            eager.set_forward_costs(forward)
        if op == attach_at:
            mine.attached = eager.attached = True
        kind = rng.random()
        if kind < 0.75:  # a verify step, then the step times the timer landed
            rows, width = int(rng.choice(batch_sizes)), int(rng.integers(0, 24))
            budgets = np.where(
                rng.random(rows) < 0.7, mine.budget_for(rows), rng.choice(list(candidates) + [5, 200], rows)
            )
            whole = rng.random(rows) < 0.85
            buffer[:] = rng.integers(1, 260, buffer.shape)
            drafts = buffer[:rows, :width]  # a view of a reused buffer
            accepted = rng.integers(-1, width + 3, rows)
            mine.observe(budgets, whole, drafts, accepted)
            eager.observe(budgets, whole, drafts, accepted)
            buffer[:] = rng.integers(1, 260, buffer.shape)  # the next step's
            for _ in range(int(rng.choice([0, 1, 1, 1, 2])) if rows else 0):  # a step of no trees: not timed
                budget = mine.budget_for(rows) if rng.random() < 0.8 else int(rng.choice(candidates))
                ms = float(rng.choice([rng.uniform(0.5, 30.0), round(rng.uniform(1, 9), 1), math.nan, 0.0, -1.0]))
                mine.observe_step_time(budget, rows, ms)
                eager.observe_step_time(budget, rows, ms)
        elif kind < 1.0 - reads:
            assert mine.maybe_decide() == eager.maybe_decide()
            assert mine.lookup == eager.lookup
        else:  # a read in the middle of a window
            _same_auto(mine, eager)
    _same_auto(mine, eager)
    mine.acceptance.close_window()
    eager.acceptance.close_window()
    _same_acceptance(mine.acceptance, eager.acceptance)


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_lazy_medians_equal_the_eager_ones_whatever_the_reads(seed):
    """Many (budget, trees) keys, some stepped past STEP_SAMPLES, probes opened and closed, reads at random: the
    medians, their order, the rest's model and every step cost are those of taking each median at its step."""
    rng = np.random.default_rng(seed)
    forward = _random_forward(rng, (7, 15, 31, 63))
    mine, eager = StepCosts(forward), _EagerStepCosts(forward)
    for _ in range(int(rng.integers(1, 200))):
        kind = rng.random()
        if kind < 0.85:
            budget, trees = int(rng.choice([7, 15, 31, 63, 5])), int(rng.integers(1, 6))
            ms = float(rng.choice([rng.uniform(0.1, 20.0), 3.0, 3.5, math.inf, math.nan, 0.0]))
            probing = bool(rng.random() < 0.5)
            mine.observe_step(budget, trees, ms, probing)
            eager.observe_step(budget, trees, ms, probing)
        elif kind < 0.9:
            mine.close_probe()
            eager.close_probe()
        else:
            _same_costs(mine, eager)
    _same_costs(mine, eager)


def test_acceptance_counts_steps_of_other_widths_and_a_long_unread_run_exactly():
    """Steps of different batch sizes and path widths (padded when counted together), more of them than the buffer
    holds (counted as it fills: the buffer stays bounded while no window closes), then a read: as counted step by
    step. And a step's arrays are copied: the caller may reuse them."""
    rng = np.random.default_rng(7)
    candidates = (15, 31, 63, 127)
    mine, eager = AcceptanceByBudget(candidates), _EagerAcceptance(candidates)
    drafts = np.zeros((9, 30), dtype=np.int64)
    for step in range(3 * MAX_BUFFERED_STEPS + 5):
        rows, width = int(rng.integers(0, 9)), int(rng.integers(0, 30))
        drafts[:] = rng.integers(1, 200, drafts.shape)
        budgets, whole = rng.choice([15, 31, 63, 127, 100], rows), rng.random(rows) < 0.8
        accepted = rng.integers(0, width + 2, rows)
        mine.observe(budgets, whole, drafts[:rows, :width], accepted)
        eager.observe(budgets, whole, drafts[:rows, :width], accepted)
        budgets[:], whole[:], accepted[:] = 0, False, 0  # the caller's arrays, reused
        assert len(mine._buffered) < MAX_BUFFERED_STEPS
        if step == 2 * MAX_BUFFERED_STEPS:  # one window closed, after more steps than the buffer holds
            mine.close_window()
            eager.close_window()
    _same_acceptance(mine, eager)
    mine.close_window()
    eager.close_window()
    _same_acceptance(mine, eager)


def test_a_step_of_mismatched_shapes_is_refused_when_observed():
    """Counted later, a step's shapes are checked when it is observed (where the error points at its caller)."""
    est = AcceptanceByBudget((16, 64))
    drafts, accepted = _paths(2)
    with pytest.raises(ValueError):
        est.observe(np.array([64]), np.ones(2, dtype=bool), drafts, accepted)
    with pytest.raises(ValueError):
        est.observe(np.array([64, 64]), np.ones(2, dtype=bool), drafts[0], accepted)
    assert est._window_trees.tolist() == [0.0, 0.0]


def test_the_per_step_part_is_a_few_python_operations():
    """``auto``'s per-step work runs on the engine loop's path: a step's acceptance is buffered and its time
    appended, no median and no interpolation per step (the forward of a (budget, trees) is looked up)."""
    auto = AutoBudget((15, 31, 63), max_num_seqs=8, window_steps=1000)
    auto.set_forward_costs({c: {1: 1.0, 8: 2.0} for c in (15, 31, 63)})
    auto.observe_step_time(63, 4, 7.0)
    calls = []
    auto.costs._interpolate = lambda *a: calls.append(a)  # a second interpolation of (63, 4) would land here
    for _ in range(3):
        auto.observe_step_time(63, 4, 7.0)
    assert (
        not calls
        and auto.costs._stale == {(63, 4)}
        and auto.costs.beyond == {(63, 4): pytest.approx(7.0 - (1.0 + 3 / 7))}
    )
    assert not auto.costs._stale


def test_a_probe_of_steps_without_trees_reads_no_slope():
    """Steps of 0 trees at two budgets verify no tokens either way: no spread to divide by, no slope (it raised
    ZeroDivisionError)."""
    from ddtree.vllm.auto_budget import StepCosts

    costs = StepCosts({15: {1: 1.0}, 63: {1: 2.0}})
    for budget in (15, 63, 15, 63):
        costs.observe_step(budget, 0, 5.0, probing=True)
    costs.close_probe()
    assert list(costs.slopes) == []
