"""The committed trained pair (tests/fixtures/models): real acceptance, exact greedy output, the demo.

Random models make acceptance meaningless and near-tied logits make greedy comparisons flaky; this pair is
confident (its card: fp32 greedy margins median 2.7) and its drafter is trained, so these checks can fail for
real reasons: a verification bug shows up as a wrong token, a tree or acceptance bug as a lower tau.
"""

import os

import pytest
import torch

from ddtree.cli import main as cli_main
from ddtree.engine import SpeculativeEngine
from ddtree.engine.drafter import DFlashDraftModel
from ddtree.engine.pair_demo import load_pair_prompts, run_modes
from ddtree.engine.validation import EngineInputError

PAIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def pair():
    from ddtree.engine.target import load_causal_lm

    torch.manual_seed(0)
    target = load_causal_lm(os.path.join(PAIR, "target"), torch.float32)
    drafter = DFlashDraftModel.from_pretrained(os.path.join(PAIR, "drafter"), dtype=torch.float32, device="cpu")
    return SpeculativeEngine(target, drafter), load_pair_prompts(PAIR)


@pytest.fixture(scope="module")
def decoded(pair):
    engine, data = pair
    return run_modes(engine, data["prompts"][:2], NEW_TOKENS, budgets=(16, 64))


def test_greedy_output_matches_the_recorded_fp32_reference(pair, decoded):
    _, data = pair
    expected = [ids[:NEW_TOKENS] for ids in data["greedy_fp32"][:2]]
    for name, entry in decoded.items():
        assert entry["outputs"] == expected, name


def test_trees_accept_more_than_the_chain(decoded):
    # Measured with this pair (64 tokens, 2 prompts): chain 2.17, budget 16 2.86, budget 64 3.32.
    chain, small, large = decoded["chain"]["tau"], decoded["ddtree-16"]["tau"], decoded["ddtree-64"]["tau"]
    assert chain >= 1.8, decoded["chain"]
    assert small > 1.15 * chain and large > small, (chain, small, large)


def test_acceptance_by_depth_splits_into_the_drafters_top1_path_and_after_a_sibling(decoded):
    """A chain never leaves the drafter's top-1; a tree's acceptance is the two parts' sum, and this pair's trees
    gain by accepting tokens that were not the drafter's top-1."""
    for name in ("chain", "ddtree-64"):
        for stats in decoded[name]["stats"]:
            trials, depth = stats.depth_trials, stats.accepted_at_depth
            for d in range(len(depth)):
                assert trials.on_top1_accepted[d] + trials.after_sibling_accepted[d] == depth[d], (name, d)
                assert trials.on_top1_accepted[d] <= trials.on_top1_reached[d]
                assert trials.after_sibling_accepted[d] <= trials.after_sibling_reached[d]
            assert trials.on_top1_reached[0] == stats.steps  # every step tries depth 1 from the root
            if name == "chain":
                assert sum(trials.after_sibling_reached) == 0 and sum(trials.accepted_off_top1) == 0
    assert sum(sum(s.depth_trials.accepted_off_top1) for s in decoded["ddtree-64"]["stats"]) > 0


def test_depth_trials_count_each_depth_once_per_step():
    from ddtree.engine import DepthTrials

    trials = DepthTrials(4)
    trials.record([0, 2, 0], draft_depth=4)  # top-1, a sibling, then a top-1 token; depth 4 rejected
    trials.record([], draft_depth=2)  # nothing accepted in a draft 2 deep
    trials.record([1], draft_depth=1)  # a sibling at depth 1, the draft's only depth
    assert trials.on_top1_reached == [3, 1, 0, 0] and trials.on_top1_accepted == [2, 1, 0, 0]
    assert trials.after_sibling_reached == [0, 0, 1, 1] and trials.after_sibling_accepted == [0, 0, 1, 0]
    assert trials.accepted_off_top1 == [1, 1, 0, 0]


def test_demo_decodes_with_the_pair(capsys):
    assert cli_main(["demo", "--budget", "16", "--pair", PAIR, "--new-tokens", "12", "--budgets", "16"]) == 0
    out = capsys.readouterr().out
    assert "ddtree-16" in out and "chain" in out and "False" not in out


def test_demo_names_a_bad_pair_directory(tmp_path, capsys):
    assert cli_main(["demo", "--pair", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "prompts.json" in err
    with pytest.raises(EngineInputError, match="missing"):
        load_pair_prompts(str(tmp_path))
