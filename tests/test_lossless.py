"""Sample-then-walk acceptance is exactly lossless at temperature > 0.

A toy "target" over a 4-token vocabulary with context-dependent next-token
distributions, and a deliberately wrong "drafter". DDTree steps (draft tree ->
one target sample per node -> walk) must emit token sequences distributed
exactly as sampling the target autoregressively. We compare the empirical
distribution of the first three emitted tokens with the exact one by a
chi-square test at a false-alarm rate of 1e-4 (fixed seeds, so the outcome is
deterministic; a wrong acceptance rule, e.g. accepting the drafter's token with
its own probability, fails it by orders of magnitude).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

import ddtree

VOCAB = 4
DEPTH = 3
PREFIX = 3  # tokens whose joint distribution is checked


@functools.lru_cache(maxsize=None)
def target_probs(context: tuple[int, ...]) -> np.ndarray:
    """A fixed, context-dependent next-token distribution."""
    seed = hash(context[-2:]) % (2**32)
    logits = np.random.default_rng(seed).standard_normal(VOCAB) * 1.5
    p = np.exp(logits - logits.max())
    return p / p.sum()


def draft_distribution(rng) -> tuple[np.ndarray, np.ndarray]:
    """An arbitrary drafter: random per-position distributions, top-K sorted."""
    probs = rng.dirichlet(np.ones(VOCAB), size=DEPTH)
    order = np.argsort(-probs, axis=1)
    log_probs = np.log(np.take_along_axis(probs, order, 1)).astype(np.float32)
    return log_probs, order.astype(np.int64)


def ddtree_generate(rng, length: int, budget: int) -> tuple[int, ...]:
    out: tuple[int, ...] = (0,)  # the prompt
    while len(out) - 1 < length:
        tree = ddtree.build_tree(*draft_distribution(rng), budget)
        # Each node's context: the committed tokens plus its root path's tokens.
        contexts = [out]
        for i in range(1, len(tree)):
            contexts.append(contexts[tree.parents[i]] + (int(tree.tokens[i - 1]),))
        targets = np.array([rng.choice(VOCAB, p=target_probs(c)) for c in contexts])
        path, bonus = ddtree.accept(tree, targets)
        out = contexts[path[-1]] + (int(bonus),)
    return out[1 : 1 + length]


def exact_joint() -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=PREFIX):
        p, context = 1.0, (0,)
        for t in seq:
            p *= target_probs(context)[t]
            context += (t,)
        joint[seq] = p
    return joint


def chi_square_critical(dof: int, alpha: float) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof)."""
    # z for one-sided alpha = 1e-4
    z = 3.719
    assert alpha == 1e-4
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_ddtree_sampling_matches_target_distribution():
    rng = np.random.default_rng(1234)
    samples = 6000
    counts: dict[tuple[int, ...], int] = {}
    accepted_any = 0
    for _ in range(samples):
        seq = ddtree_generate(rng, PREFIX, budget=10)
        counts[seq] = counts.get(seq, 0) + 1
    for _ in range(200):
        tree = ddtree.build_tree(*draft_distribution(rng), 10)
        targets = np.array([rng.choice(VOCAB) for _ in range(len(tree))])
        accepted_any += len(ddtree.accept(tree, targets)[0]) > 1
    assert accepted_any > 50, "the test must exercise accepted draft tokens"
    joint = exact_joint()
    stat = sum((counts.get(s, 0) - samples * p) ** 2 / (samples * p) for s, p in joint.items())
    dof = len(joint) - 1
    assert stat < chi_square_critical(dof, 1e-4), f"chi2 = {stat:.1f} with {dof} dof"


def test_the_check_detects_a_biased_rule():
    """The same statistic rejects a lossy rule: always taking the draft's first child."""
    rng = np.random.default_rng(99)
    samples = 6000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(samples):
        log_probs, ids = draft_distribution(rng)
        seq = tuple(int(t) for t in ids[:PREFIX, 0])  # the drafter's greedy chain
        counts[seq] = counts.get(seq, 0) + 1
    joint = exact_joint()
    stat = sum((counts.get(s, 0) - samples * p) ** 2 / (samples * p) for s, p in joint.items())
    assert stat > chi_square_critical(len(joint) - 1, 1e-4)
