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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(os.path.join(PAIR, "target"), dtype=torch.float32)
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
