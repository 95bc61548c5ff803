"""At temperature > 0, DDTree's output has exactly the autoregressive sampling distribution.

A tiny-vocabulary target (V = 8, LM head scaled so its distributions are far
from uniform) generates the first three tokens of many independently seeded
requests with DDTree (budget 4 < V, depth 2, a drafter close to the target:
first steps reject at depth 1, accept one, or accept two draft tokens, each
often); their joint histogram over the 512 outcomes is compared
with the exact autoregressive probabilities p(t1) p(t2 | t1) p(t3 | t1, t2),
computed with transformers' own forward, by a chi-square goodness-of-fit test.

False-alarm rate: ALPHA = 1e-3 per test (cells with expected count < 5 are
pooled so the chi-square approximation holds). Seeds are fixed, so the
outcome is deterministic. The same test is run with two plausible sampling
bugs patched in and must reject them, so it has power where it matters.
"""

import numpy as np
import pytest
import torch

import ddtree.engine.engine as engine_module
from ddtree.engine import GenerationConfig, SamplingSettings, SpeculativeEngine, processed_probs
from ddtree.engine.sampling import sample_from_probs
from ddtree.engine.tiny import tiny_target

from _proposers import TargetMimicProposer

ALPHA = 1e-3
VOCAB = 8
PROMPT = [1, 5, 2]
FIRST_TOKENS = 3


def peaked_target(kind: str):
    model = tiny_target(kind, seed=2, vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)  # random tiny models are near-uniform; make the test sensitive
    return model


@torch.no_grad()
def exact_joint(model, sampling: SamplingSettings) -> torch.Tensor:
    """``[V, V, V]``: probability of (t1, t2, t3) under autoregressive sampling."""
    prefixes = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    logits = model(prefixes).logits.float()  # [V*V, P + 2, V]
    p1 = processed_probs(logits[0, len(PROMPT) - 1][None], sampling)[0]
    p2 = processed_probs(logits[::VOCAB, len(PROMPT)], sampling)  # row a: p(t2 | t1 = a)
    p3 = processed_probs(logits[:, len(PROMPT) + 1], sampling).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def ddtree_counts(model, sampling: SamplingSettings, num_samples: int, batch: int = 125, mode: str = "ddtree"):
    """Histogram ``[V, V, V]`` of the first three generated tokens of ``num_samples`` requests."""
    engine = SpeculativeEngine(model, TargetMimicProposer(model, depth=2))
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    first_step_taus = []
    for start in range(0, num_samples, batch):
        # One more token than counted, so the first DDTree step may be 2 deep (t2, t3 drafted).
        config = GenerationConfig(mode=mode, budget=4, max_new_tokens=FIRST_TOKENS + 1, sampling=sampling, seed=start)
        for result in engine.generate([PROMPT] * min(batch, num_samples - start), config):
            counts[tuple(result.output_ids[:FIRST_TOKENS])] += 1
            first_step_taus.append(result.stats.acceptance_lengths[0])
    # Every outcome of the walk happened often: reject at depth 1, accept 1, accept 2.
    for tau in (1, 2, 3):
        assert first_step_taus.count(tau) > 0.05 * num_samples, (tau, np.bincount(first_step_taus))
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (same shape); small cells pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = (((observed - expected) ** 2)[keep] / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


@pytest.mark.parametrize(
    "kind, mode, sampling, num_samples",
    [
        ("qwen3", "ddtree", SamplingSettings(temperature=1.0), 1500),
        ("qwen3_5", "ddtree", SamplingSettings(temperature=1.0), 600),
        ("qwen3", "ddtree", SamplingSettings(temperature=0.8, top_k=5, top_p=0.9), 1000),
        ("qwen3", "chain", SamplingSettings(temperature=1.0), 1000),
    ],
)
def test_first_tokens_follow_autoregressive_distribution(kind, mode, sampling, num_samples):
    model = peaked_target(kind)
    counts = ddtree_counts(model, sampling, num_samples, mode=mode)
    p_value = chi_square_p_value(counts, exact_joint(model, sampling))
    assert p_value > ALPHA, f"DDTree samples do not follow the autoregressive distribution (p = {p_value:.2e})"


def shared_uniform_tokens(logits, params, generator):
    """BUG: one uniform for all nodes of a step (inverse CDF), so samples along a path are correlated."""
    probs = processed_probs(logits, params)
    u = torch.rand((), generator=generator)
    return (probs.cumsum(-1) < u).sum(-1).clamp(max=probs.shape[-1] - 1)


def greedy_below_root_tokens(logits, params, generator):
    """BUG: only the root is sampled; deeper nodes take the argmax."""
    tokens = logits.argmax(-1)
    tokens[0] = sample_from_probs(processed_probs(logits[:1], params), generator)[0]
    return tokens


@pytest.mark.parametrize("wrong_rule", [shared_uniform_tokens, greedy_below_root_tokens])
def test_the_distribution_test_rejects_wrong_sampling_rules(monkeypatch, wrong_rule):
    model = peaked_target("qwen3")
    sampling = SamplingSettings(temperature=1.0)
    monkeypatch.setattr(engine_module, "target_tokens", wrong_rule)
    p_value = chi_square_p_value(ddtree_counts(model, sampling, 1000), exact_joint(model, sampling))
    assert p_value < ALPHA, f"a wrong sampling rule went unnoticed (p = {p_value:.2e})"


def test_processed_probs_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)]:
        ours = processed_probs(logits, SamplingSettings(temperature, top_p, top_k))
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        assert torch.allclose(ours, scores.softmax(-1), atol=1e-6)
