"""``ddtree_budget: "auto"`` (``ddtree.vllm.auto_budget``): the policy against worlds whose best budget is known,
its estimators against hand-computed values, the step timer, and the hand-over of its lookup to vLLM's scheduler."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.vllm import auto_budget
from ddtree.vllm.auto_budget import (
    KEEP,
    MAX_BUFFERED_STEPS,
    MAX_PROBES,
    PROBE_EVERY,
    AcceptanceByBudget,
    AutoBudget,
    ProbedRatios,
    StepTimer,
    auto_candidates,
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


def _steps(auto: AutoBudget, trees: int, windows: int, period) -> None:
    """``windows`` windows of verify steps at ``trees`` requests, as the runner feeds them: each step of the lookup's
    budget, its period ``period(budget, trees)`` landed, then the window's decision."""
    for _ in range(windows):
        for _ in range(auto.window_steps):
            budget = auto.budget_for(trees)
            auto.observe_step_time(budget, trees, period(budget, trees))
            _observe(auto, budget, trees=trees, steps=1)
        auto.maybe_decide()


def _per_token_world(fixed: float, per_token: float):
    return lambda budget, trees: fixed + per_token * trees * (budget + 1)


def test_a_probe_compares_the_two_budgets_periods_at_each_batch_size_per_octave():
    ratios = ProbedRatios()
    for ms in (10.0, 12.0, 11.0):
        ratios.observe(31, 8, ms)  # median 11
    for ms in (22.0, 20.0, math.nan, 0.0, -1.0):  # not periods: dropped
        ratios.observe(63, 8, ms)  # median 21
    for budget, ms in ((31, 10.0), (31, 10.0), (63, 15.0), (63, 15.0)):
        ratios.observe(budget, 9, ms)  # 1.5, in the same octave (8-15)
    for budget, ms in ((63, 5.0), (31, 50.0), (31, 50.0)):
        ratios.observe(budget, 12, ms)  # one period of 63 at 12 requests: not enough for a ratio
    for budget, ms in ((31, 4.0), (63, 6.0), (31, 4.0), (63, 6.0)):
        ratios.observe(budget, 2, ms)  # octave 2-3
    assert not ratios.log_ratios  # nothing is compared before the probe closes
    ratios.close((63, 31))
    eighth = (2 * math.log(21 / 11) + 2 * math.log(1.5)) / 4  # weighted by the smaller count of each batch size
    assert ratios.log_ratios[4][(31, 63)] == (pytest.approx(eighth), 4.0)
    assert ratios.log_ratios[2][(31, 63)] == (pytest.approx(math.log(1.5)), 2.0)
    # What the probe kept, by budget and batch size, and the octaves it measured (the summary's probe_history).
    assert list(ratios.history) == [
        {
            "pair": [31, 63],
            "kept": {"31@12": 2, "31@2": 2, "31@8": 3, "31@9": 2, "63@12": 1, "63@2": 2, "63@8": 2, "63@9": 2},
            "measured": ["2-3", "8-15"],
        }
    ]
    ratios.close((31, 63))  # a probe that kept nothing measures nothing, and says so
    assert ratios.history[-1] == {"pair": [31, 63], "kept": {}, "measured": []}
    assert ratios.log_ratios[4][(31, 63)] == (pytest.approx(eighth), 4.0)
    assert ratios.measured(4, 63, 31) and not ratios.measured(4, 63, 127) and not ratios.measured(3, 31, 63)
    candidates = (15, 31, 63, 127)
    assert ratios.relative(4, candidates, 31) == {31: 1.0, 63: pytest.approx(math.exp(eighth))}
    assert ratios.relative(4, candidates, 63) == {63: 1.0, 31: pytest.approx(math.exp(-eighth))}
    assert ratios.relative(5, candidates, 63) == {63: 1.0}
    # A later probe of the same pair folds in, the earlier weight decayed; another pair chains on.
    for budget, ms in ((31, 10.0), (63, 30.0), (31, 10.0), (63, 30.0)):
        ratios.observe(budget, 8, ms)
    ratios.close((31, 63))
    folded = (2 * math.log(3.0) + KEEP * 4 * eighth) / (2 + KEEP * 4)
    assert ratios.log_ratios[4][(31, 63)] == (pytest.approx(folded), pytest.approx(2 + KEEP * 4))
    for budget, ms in ((127, 8.0), (63, 4.0), (127, 8.0), (63, 4.0)):
        ratios.observe(budget, 15, ms)
    ratios.close((127, 63))
    assert ratios.relative(4, candidates, 31) == {
        31: 1.0,
        63: pytest.approx(math.exp(folded)),
        127: pytest.approx(2 * math.exp(folded)),
    }
    assert ratios.describe()["8-15"] == {"63/31": round(math.exp(folded), 4), "127/63": 2.0}


def test_the_policy_climbs_each_octave_to_its_best_budget_and_unmeasured_octaves_follow():
    auto = AutoBudget((16, 32, 64), max_num_seqs=40, window_steps=4, min_trees=1, margin=0.0)
    world = _per_token_world(4.0, 0.02)  # at 1 request 64 is best, at 32 requests 16 (tau 2.5-3 / 3.5-4 / 5-6)
    assert auto.lookup == [64] * 41 and auto.budget_for(99) == 64
    _steps(auto, 1, windows=1, period=world)
    # No ratio measured: 64 everywhere, and a probe of 64 and its neighbour (none above: the next below), in turns.
    assert auto.probing and auto.lookup[1:] == [32] * 40 and auto.probes == 1
    assert auto.describe().startswith("probing budgets 32 and 64 in turns for one window")
    turns = []
    for _ in range(4):  # a window of 4 steps: one step per turn
        budget = auto.budget_for(1)
        turns.append(budget)
        auto.observe_step_time(budget, 1, world(budget, 1))
        _observe(auto, budget, trees=1, steps=1)
    assert turns == [32, 64, 32, 64]
    auto.maybe_decide()
    assert not auto.probing and auto.octave_budgets == {1: 64} and auto.lookup[1:] == [64] * 40
    _steps(auto, 1, windows=2 * PROBE_EVERY, period=world)
    assert auto.probes == 1  # 64's only neighbour is measured at 1 request: nothing more to probe there
    # Traffic at 32 requests: its octave is probed (64 against 32: 32 wins), then, PROBE_EVERY windows later, 32
    # against its other neighbour (16 wins); the batch sizes between take the nearer measured octave's budget.
    _steps(auto, 32, windows=2, period=world)
    assert auto.octave_budgets == {1: 64, 6: 32} and auto.probes == 2
    _steps(auto, 32, windows=PROBE_EVERY + 1, period=world)
    assert auto.octave_budgets == {1: 64, 6: 16} and auto.probes == 3 and not auto.probing
    # Between the two measured octaves, each batch size takes the nearer one's budget (2-7: one request's).
    assert auto.lookup[1:8] == [64] * 7 and auto.lookup[8:] == [16] * 33 and auto.lookup[0] == 64
    assert "1-7: 64, 8-40: 16" in auto.describe()
    summary = auto.summary()
    assert summary["octave_budgets"] == {"1-1": 64, "32-63": 16}
    assert summary["period_ratios"]["32-63"]["64/32"] == pytest.approx(world(64, 32) / world(32, 32), rel=1e-3)
    _steps(auto, 32, windows=2 * PROBE_EVERY, period=world)
    assert auto.probes == 3  # 16's only neighbour is measured


def test_an_octave_that_took_a_smaller_budget_from_above_climbs_up():
    """Traffic at 32 requests first settles their octave at 16; one request's octave then starts from 16 (no measured
    octave below it) and probes upwards, next larger first, to 64."""
    auto = AutoBudget((16, 32, 64), max_num_seqs=40, window_steps=4, min_trees=1, margin=0.0)
    world = _per_token_world(4.0, 0.02)
    _steps(auto, 32, windows=2 + 2 * PROBE_EVERY, period=world)
    assert auto.octave_budgets == {6: 16} and auto.lookup[1:] == [16] * 40
    _steps(auto, 1, windows=2, period=world)
    assert auto.octave_budgets == {1: 32, 6: 16}  # 32 probed against 16 at one request, and taken
    _steps(auto, 1, windows=2 * PROBE_EVERY, period=world)
    assert auto.octave_budgets == {1: 64, 6: 16} and auto.lookup[1:8] == [64] * 7 and auto.lookup[8:] == [16] * 33


def test_an_octave_without_a_measurement_takes_the_nearest_measured_octave_the_one_above_on_a_tie():
    auto = AutoBudget((16, 32, 64), max_num_seqs=40)
    auto._fill_lookup()
    assert auto.lookup == [64] * 41  # nothing measured: the largest
    auto.octave_budgets = {4: 32}
    auto._fill_lookup()
    assert auto.lookup == [32] * 41  # one measured octave: everyone's
    auto.octave_budgets = {1: 64, 6: 16}  # 1 request, and 32-63
    auto._fill_lookup()
    # 2-3 and 4-7 are nearer to 1 request's octave, 8-15 and 16-31 to 32-63's.
    assert auto.lookup[1:8] == [64] * 7 and auto.lookup[8:] == [16] * 33 and auto.lookup[0] == 64
    auto.octave_budgets = {2: 64, 4: 16}  # 4-7 (octave 3) is as near to both: the one above (the smaller budget)
    auto._fill_lookup()
    assert auto.lookup[1:4] == [64] * 3 and auto.lookup[4:] == [16] * 37


def test_an_octave_keeps_its_budget_unless_another_is_clearly_faster():
    # Two requests (one deep, one shallow path): tau 2.5 (16) and 5 (64); 16 is 5 % faster per period.
    period = {16: 4.0, 64: 5.0 / (2.5 / 4.0 / 1.05)}
    for margin, want in ((0.5, 64), (0.0, 16)):
        auto = AutoBudget((16, 64), max_num_seqs=2, window_steps=4, min_trees=1, margin=margin)
        _steps(auto, 2, windows=2, period=lambda budget, trees: period[budget])
        assert auto.probes == 1 and auto.octave_budgets == {2: want} and auto.lookup[1:] == [want, want]


def test_probes_stop_once_an_octaves_neighbours_are_measured_or_after_the_most_probes():
    # Half the steps at 4 requests (a probe opens), the rest at 5 and 6: in turns of one step, no batch size gets
    # two periods of each budget, so no ratio.
    auto = AutoBudget((16, 64), max_num_seqs=8, window_steps=4, min_trees=1, margin=0.0)
    probed_at = []
    for window in range(1, 1 + PROBE_EVERY * MAX_PROBES + 3):
        for trees in (4, 4, 5, 6):
            auto.observe_step_time(auto.lookup[1], trees, 5.0)
            _observe(auto, auto.lookup[1], trees=trees, steps=1)
        auto.maybe_decide()
        if auto.probing:
            probed_at.append(window)
    assert probed_at == [1 + PROBE_EVERY * k for k in range(MAX_PROBES)] and auto.probes == MAX_PROBES
    assert not auto.ratios.log_ratios and auto.lookup[1:] == [64] * 8
    # A probe that measures the only neighbour settles the octave: no more probes there.
    settled = AutoBudget((16, 64), max_num_seqs=8, window_steps=4, min_trees=1, margin=0.0)
    _steps(settled, 4, windows=2 + 2 * PROBE_EVERY, period=lambda budget, trees: 5.0 if budget == 64 else 4.9)
    assert settled.probes == 1 and settled.octave_budgets == {3: 64}  # tau 5 / 5 ms against 2.5 / 4.9


def test_a_window_that_passed_through_batch_sizes_opens_no_probe():
    """A batch's tail (one request fewer every step or two) gives no batch size two periods of each budget: a probe
    there would run the neighbour's trees and measure nothing. A probe opens only where half the window's steps had
    one batch size."""
    tail = AutoBudget((16, 64), max_num_seqs=8, window_steps=4, min_trees=1)
    for trees in (8, 7, 5, 2):
        _observe(tail, 64, trees=trees, steps=1)
    assert tail.maybe_decide() is False and not tail.probing and tail.probes == 0
    for trees in (8, 8, 5, 2):
        _observe(tail, 64, trees=trees, steps=1)
    assert tail.maybe_decide() and tail.probing and tail._probe_pair == (16, 64)
    idle = AutoBudget((16, 64), max_num_seqs=8, window_steps=1, min_trees=1)
    idle._steps_in_window = 1  # a window of steps the policy never saw (none observed): no probe either
    assert idle.maybe_decide() is False and not idle.probing


@pytest.mark.parametrize("settle", [True, False])
def test_a_burst_opens_its_probe_once_it_settles_and_measures_before_its_tail(monkeypatch, settle):
    """A burst of requests stays at its full batch size for a dozen steps, then tails off (the test pair's batch of
    32: 10-14 steps at 32 a run on the H200). A window's close comes too late there: its probe ran in the tail and
    measured nothing. The probe opens once the traffic has stayed :data:`SETTLE_STEPS` steps at one batch size
    (closing the window early) and measures the octave before the tail; without that rule it does not. Fed as the
    runner feeds it: every step's trees and period as it runs, its acceptance in bursts of four (the statistics'
    ring, ``counts.PathRing``)."""
    if not settle:
        monkeypatch.setattr(auto_budget, "SETTLE_STEPS", 10**9)
    auto = AutoBudget((16, 64), max_num_seqs=32, window_steps=16, min_trees=1, margin=0.0)
    world = _per_token_world(4.0, 0.02)
    burst = [32] * 12 + [31, 29, 27, 24, 20, 17, 12, 9, 5, 3, 2] + [1] * 20  # then one request for a while
    landing = []
    for step, trees in enumerate(burst, 1):
        budget = auto.budget_for(trees)
        auto.observe_step_time(budget, trees, world(budget, trees))
        landing.append((budget, trees))
        if step % 4 == 0:  # the ring's copy has landed: the last four steps' acceptance
            for budget, trees in landing:
                _observe(auto, budget, trees=trees, steps=1)
            landing.clear()
        auto.note_step(trees)
        auto.maybe_decide()
    assert auto.ratios.measured(6, 16, 64) == settle
    if settle:
        assert auto.ratios.history[0]["measured"] == ["32-63"] and auto.octave_budgets[6] == 16
        assert auto.ratios.history[0]["opened"] == "settled at 32"
    else:
        # Opened for 32 requests at the window's close, it ran in the tail and after it: not at 32.
        assert auto.ratios.history[0]["opened"] == "window at 32"
        assert "32-63" not in auto.ratios.history[0]["measured"]


def test_an_octave_keeps_its_budget_while_that_budgets_acceptance_is_not_trusted_yet():
    """The smaller candidates can pass ``min_trees`` first (every tree counts for them, and a probe adds theirs);
    an octave leaves its budget only once that budget's own acceptance is trusted."""
    auto = AutoBudget((16, 64), max_num_seqs=1, window_steps=4, min_trees=3, margin=0.0)
    auto.ratios.log_ratios = {1: {(16, 64): (math.log(100.0), 1.0)}}  # 64 a hundred times dearer
    drafts, accepted = _paths(1)
    auto.observe(np.array([64]), np.ones(1, dtype=bool), drafts, accepted)  # 1 tree counts for both
    for _ in range(3):
        auto.observe(np.array([16]), np.ones(1, dtype=bool), drafts, accepted)  # 3 more for 16 only
    assert auto.maybe_decide() is False and auto.lookup[1] == 64  # 16 is trusted (4 trees), 64 not (1)
    assert set(auto.acceptance.acceptance_length(3)) == {16}


def test_periods_outside_a_probe_change_nothing():
    """A period is compared only with the other budget's in the same probe (taken in turns); outside one it is
    dropped."""
    outside = AutoBudget((16, 64), max_num_seqs=4)
    outside.observe_step_time(64, 2, 5.0)
    outside.observe_step_time(16, 2, 1.0)
    assert not outside.ratios._open and not outside.ratios.log_ratios


def test_under_asynchronous_scheduling_nothing_changes_until_the_scheduler_reads_the_lookup():
    auto = AutoBudget((16, 64), max_num_seqs=3, window_steps=1, min_trees=1)
    auto.needs_scheduler = True
    _observe(auto, 64, trees=2, steps=1)
    assert auto.maybe_decide() is None and auto.lookup == [64] * 4
    scheduler = SimpleNamespace(dynamic_sd_lookup=[0, 64, 64, 64])
    auto_budget.publish(auto)
    assert auto_budget.attach_scheduler(scheduler) and scheduler.dynamic_sd_lookup is auto.lookup
    assert not auto_budget.attach_scheduler(SimpleNamespace(dynamic_sd_lookup=[0, 64]))  # taken: nothing waits
    _observe(auto, 64, trees=2, steps=1)
    assert auto.maybe_decide() and scheduler.dynamic_sd_lookup[1:] == [16, 16, 16]  # the probe's first turn


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
    from ddtree.vllm.graphs import ShapeGraphs
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=63, draft_len=15, top_k=8, auto=True)
    runner.ddtree_stats = DDTreeStats(15)  # (as the runner's __init__ makes it)
    runner._ddtree_auto = AutoBudget(runner.ddtree_cfg.budgets, max_num_seqs=40)
    runner.drafter = SimpleNamespace(top_k=8)
    keys = {BatchDescriptor(num_tokens=t * n, num_reqs=n, uniform=True) for t, n in captured}
    keys.add(BatchDescriptor(num_tokens=512))  # a PIECEWISE-style key without requests: not a tree graph
    runner.cudagraph_dispatcher = SimpleNamespace(cudagraph_keys={CUDAGraphMode.FULL: keys})
    monkeypatch.setattr(DDTreeGPUModelRunner, "_ddtree_full_graphs", lambda self: True)
    # No graph key ran for the first time during these steps (the counter is process-wide: other tests raise it).
    monkeypatch.setattr(ShapeGraphs, "first_runs", 0)
    log = _Recorder()
    monkeypatch.setattr(runner_module, "logger", log)
    return runner, log


def test_each_step_feeds_the_timer_and_a_new_choice_is_logged(monkeypatch):
    runner, log = _auto_runner(monkeypatch, [])
    auto = runner._ddtree_auto
    auto.window_steps, auto.min_trees = 2, 1
    finished, landed = [], []
    runner._ddtree_step_timer = SimpleNamespace(finish=finished.append, landed=lambda: list(landed))
    runner._ddtree_whole_tree_tokens = 64
    runner._ddtree_plan = SimpleNamespace(num_nodes=np.array([64, 64]))
    for _ in range(2):
        _observe(auto, 63, trees=2, steps=1)
        runner._ddtree_auto_step()
    # The first decision: no ratio yet, so 63 (the largest) stays and a probe of 31 and 63 starts: logged.
    assert finished == [(63, 2), (63, 2)] and auto.probing and runner.ddtree_budget_for(7) == 31
    assert log.lines == [("info", "DDTree auto: " + auto.describe())] and "probing budgets 31 and 63" in log.lines[0][1]
    # The probe's periods land: 31 at 2 requests costs 5 ms, 63 costs 12 (tau 3.5 against 5: 31 is faster).
    for budget in (31, 63):
        landed[:] = [((budget, 2), 5.0 if budget == 31 else 12.0)] * 2
        _observe(auto, budget, trees=2, steps=1)
        runner._ddtree_auto_step()
    assert not auto.probing and auto.octave_budgets == {2: 31}
    assert runner.ddtree_budget_for(1) == runner.ddtree_budget_for(40) == 31  # the other octaves follow
    assert len(log.lines) == 2 and "1-40: 31" in log.lines[1][1]
    runner._ddtree_whole_tree_tokens = 0  # a step that was not whole trees of one size: not timed
    runner._ddtree_auto_step()
    assert finished[-1] is None


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
    auto._probes_by_octave = {2: (MAX_PROBES, 0)}  # no probe left at 2 requests: the first decision keeps 63
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

    init = patches._scheduler_set_up_for_trees(Scheduler.__init__)
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


@pytest.mark.parametrize("seed", range(30))
def test_in_random_worlds_each_octave_climbs_to_a_local_best_and_to_the_best_when_there_is_one_peak(seed):
    """Random candidates, acceptance (every tree one path), and periods by budget and batch size (a fixed part and a
    per-token part, convex or not): traffic at one batch size for enough windows leaves its octave at a budget no
    neighbour beats, and at the best of all when the rate has one peak over the candidates. The lookup holds
    candidates only, one budget per octave."""
    rng = np.random.default_rng(seed)
    candidates = tuple(sorted(rng.choice([8, 16, 32, 64, 128], size=int(rng.integers(2, 6)), replace=False).tolist()))
    max_num_seqs = int(rng.integers(1, 40))
    trees = int(rng.integers(1, max_num_seqs + 1))
    fixed, per_token, bend = rng.uniform(0.5, 8), rng.uniform(0, 0.05), rng.uniform(0, 1e-4)

    def period(budget, n):
        tokens = n * (budget + 1)
        return fixed + per_token * tokens + bend * tokens**2

    depth = int(rng.integers(2, 7))
    path = np.cumsum(rng.integers(1, 40, size=depth))
    auto = AutoBudget(candidates, max_num_seqs, window_steps=4, min_trees=1, margin=0.0)
    drafts, accepted = np.tile(path, (trees, 1)), np.full(trees, depth)
    for _ in range((MAX_PROBES + 2) * PROBE_EVERY):
        for _ in range(auto.window_steps):
            budget = auto.budget_for(trees)
            auto.observe_step_time(budget, trees, period(budget, trees))
            auto.observe(np.full(trees, budget), np.ones(trees, dtype=bool), drafts, accepted)
        auto.maybe_decide()
        assert set(auto.lookup) <= set(candidates)
    assert not auto.probing
    tau = {c: 1.0 + float((path <= c).sum()) for c in candidates}
    rate = {c: tau[c] / period(c, trees) for c in candidates}
    chosen = auto.budget_for(trees)
    i = candidates.index(chosen)
    for j in (i - 1, i + 1):
        if 0 <= j < len(candidates):
            assert rate[chosen] >= rate[candidates[j]] * (1 - 1e-9), (candidates, chosen, rate)
    rates = [rate[c] for c in candidates]
    peak = int(np.argmax(rates))
    one_peak = all(a <= b for a, b in zip(rates[:peak], rates[1 : peak + 1])) and all(
        a >= b for a, b in zip(rates[peak:], rates[peak + 1 :])
    )
    if one_peak:
        assert rate[chosen] == pytest.approx(max(rates), rel=1e-9)
    for n in range(1, max_num_seqs + 1):  # one budget per octave
        assert auto.lookup[n] == auto.lookup[1 << (n.bit_length() - 1)]


def test_the_runner_feeds_auto_each_steps_wall_clock_period(monkeypatch):
    """execute_model starts the timer and sampling names the step: a whole-tree step's time, from its start to the
    next step's start, reaches a probe once the steps beside it turn out timed and of its key too. Each step's trees
    reach the policy as it runs (``note_step``), a step without trees as 0."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.graphs import ShapeGraphs

    runner, _ = _auto_runner(monkeypatch, [])
    auto = runner._ddtree_auto
    auto._before_probe = list(auto.lookup)  # a probe is open: its periods are collected
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
    # Three periods known, the first without a timed step before it (not kept).
    assert auto.ratios._open == {(63, 2): [pytest.approx(12.0), pytest.approx(11.0)]}
    assert [[round(ms, 6), kept] for *_, ms, kept in auto.summary()["step_periods"]] == [
        [10.0, False],
        [12.0, True],
        [11.0, True],
    ]
    assert (auto._last_trees, auto._settled_steps) == (2, 4)
    runner._ddtree_plan = None
    runner._ddtree_auto_step()
    assert (auto._last_trees, auto._settled_steps) == (0, 1)


def test_the_statistics_and_autos_bookkeeping_after_sampling_are_timed_host_work(monkeypatch):
    """What the runner does after vLLM's sampling (the landed steps' statistics, ``auto``'s window) runs on the
    engine loop's path every step: it counts as host work ("stats"), beside plan, accept and commit."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.stats import DDTreeStats

    runner, _ = _auto_runner(monkeypatch, [])
    runner.ddtree_stats = DDTreeStats(15)
    runner._ddtree_counts = SimpleNamespace(landed=lambda wait: [])  # (nothing landed this step)
    runner._ddtree_what_if_log = None
    runner._ddtree_plan, runner._ddtree_step_timer, runner.drafter = None, None, SimpleNamespace()
    stepped = []
    monkeypatch.setattr(GPUModelRunner, "sample_tokens", lambda self, grammar_output: "sampled")
    monkeypatch.setattr(type(runner), "_ddtree_auto_step", lambda self: stepped.append(True))
    assert runner.sample_tokens(None) == "sampled" and stepped == [True]
    assert runner.ddtree_stats.host_seconds["stats"] > 0


# ---- the per-step part, buffered, against the eager version it replaced -----------------------------------


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


class _EagerAutoBudget(AutoBudget):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.acceptance = _EagerAcceptance(self.candidates)


def _same_acceptance(mine, eager):
    for name in ("trees", "kept", "gains", "_window_trees", "_window_kept", "_window_gains"):
        assert np.array_equal(getattr(mine, name), getattr(eager, name)), name  # bit for bit
    for min_trees in (1.0, 8.0, 32.0):
        assert mine.acceptance_length(min_trees) == eager.acceptance_length(min_trees)


def _same_auto(mine, eager):
    assert mine.lookup == eager.lookup and mine.probing == eager.probing
    assert (mine.decisions, mine.changes, mine.probes) == (eager.decisions, eager.changes, eager.probes)
    _same_acceptance(mine.acceptance, eager.acceptance)
    assert mine.ratios.log_ratios == eager.ratios.log_ratios and mine.ratios._open == eager.ratios._open
    assert mine.summary() == eager.summary() and mine.describe() == eager.describe()


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_buffered_bookkeeping_decides_exactly_as_the_eager_one(seed):
    """Random runs of steps (any batch size, path width, budgets, cut trees, step times, some rejected), decisions,
    probes and reads between steps: the buffered acceptance gives, bit for bit, every count, ratio, decision and
    summary of the step-by-step version. A step's drafts are a view of one buffer scribbled over after each step
    (as the runner's are): what was observed must have been copied."""
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
    attach_at = int(rng.integers(0, 150))
    buffer = np.zeros((max_num_seqs, 24), dtype=np.int64)
    batch_sizes = rng.integers(0, max_num_seqs + 1, int(rng.integers(1, 4)))  # a few: probes time them twice
    reads = float(rng.choice([0.0, 0.07]))  # without reads, windows of 80 steps outgrow the buffer
    for op in range(int(rng.integers(1, 150))):
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
    """``auto``'s per-step work runs on the engine loop's path: a step's acceptance is buffered, and its period is
    appended to the open probe's samples (no median until the probe closes) or, outside a probe, dropped."""
    auto = AutoBudget((15, 31, 63), max_num_seqs=8, window_steps=1000)
    auto.observe_step_time(63, 4, 7.0)
    assert not auto.ratios._open
    auto._before_probe = list(auto.lookup)
    medians = []
    real_median = np.median
    try:
        np.median = lambda *a, **k: medians.append(a) or real_median(*a, **k)
        for _ in range(3):
            auto.observe_step_time(63, 4, 7.0)
        _observe(auto, 63, trees=4, steps=3)
    finally:
        np.median = real_median
    assert not medians and auto.ratios._open == {(63, 4): [7.0, 7.0, 7.0]} and len(auto.acceptance._buffered) == 3
