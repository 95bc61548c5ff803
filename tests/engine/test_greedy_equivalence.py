"""Greedy DDTree and greedy DFlash-chain generations equal greedy autoregressive generation.

Batch of three prompts of different lengths, 64+ new tokens, on dense and hybrid
targets; with a (random) DFlash drafter and with a noisy oracle drafter that gets
long, branching acceptances. The engine's autoregressive mode is itself checked
against transformers' own cached greedy decoding.
"""

import pytest

from ddtree.engine import DFlashDraftModel, GenerationConfig, SpeculativeEngine
from ddtree.engine.tiny import TARGET_KINDS, tiny_target

from _hf_oracle import hf_greedy
from _proposers import NoisyOracleProposer

PROMPTS = [[5, 17, 99, 3, 42, 8, 64, 21, 7, 11, 90], [120, 4], [33, 2, 81, 16, 9]]
NEW_TOKENS = 64


def outputs(results):
    return [r.output_ids for r in results]


@pytest.fixture(scope="module", params=TARGET_KINDS)
def target_and_reference(request):
    """A tiny target and its greedy autoregressive outputs for PROMPTS (engine's AR mode)."""
    model = tiny_target(request.param, seed=11)
    reference = SpeculativeEngine(model).generate(PROMPTS, GenerationConfig(mode="ar", max_new_tokens=NEW_TOKENS))
    return model, outputs(reference)


def test_engine_autoregressive_equals_transformers_greedy(target_and_reference):
    model, reference = target_and_reference
    for prompt, output in zip(PROMPTS, reference):
        assert output == hf_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("mode, budget", [("chain", 0), ("ddtree", 1), ("ddtree", 24), ("ddtree", 64)])
def test_dflash_drafter_greedy_equals_autoregressive(target_and_reference, mode, budget):
    model, reference = target_and_reference
    drafter = DFlashDraftModel.random(model.config, num_layers=1, block_size=8, seed=5)
    results = SpeculativeEngine(model, drafter).generate(
        PROMPTS, GenerationConfig(mode=mode, budget=budget, max_new_tokens=NEW_TOKENS)
    )
    assert outputs(results) == reference
    for result in results:
        assert result.finish_reason == "length" and len(result.output_ids) == NEW_TOKENS


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_high_acceptance_drafter_greedy_equals_autoregressive(target_and_reference, mode):
    model, reference = target_and_reference
    oracle = NoisyOracleProposer([p + r for p, r in zip(PROMPTS, reference)], model.config.vocab_size, depth=7)
    results = SpeculativeEngine(model, oracle).generate(
        PROMPTS, GenerationConfig(mode=mode, budget=32, max_new_tokens=NEW_TOKENS)
    )
    assert outputs(results) == reference
    taus = [r.stats.mean_acceptance_length for r in results]
    longest = max(max(r.stats.acceptance_lengths) for r in results)
    # The engine really took multi-token steps (else this test would prove little).
    assert min(taus) > (2.5 if mode == "ddtree" else 1.8) and longest >= 6, (taus, longest)
    for r in results:
        assert sum(r.stats.acceptance_lengths) + 1 == len(r.output_ids) or r.finish_reason == "length"


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_generation_stops_after_a_stop_token(target_and_reference, mode):
    model, reference = target_and_reference
    stop = reference[0][20]
    oracle = NoisyOracleProposer([p + r for p, r in zip(PROMPTS, reference)], model.config.vocab_size, depth=7)
    results = SpeculativeEngine(model, oracle).generate(
        PROMPTS, GenerationConfig(mode=mode, budget=16, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    )
    for result, expected in zip(results, reference):
        if stop in expected:
            assert result.output_ids == expected[: expected.index(stop) + 1] and result.finish_reason == "stop"
        else:
            assert result.output_ids == expected and result.finish_reason == "length"
