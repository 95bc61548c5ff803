"""A seeded request's noise keyed by its seed and the sampled position (``ddtree.vllm.seeded_noise``): the hash
against a plain-Python oracle, Exp(1) noise, and tree decoding that repeats token-by-token sampling exactly
whatever the budget."""

import math

import numpy as np
import pytest
import torch

import ddtree
from ddtree.vllm.node_sampling import sample_rows
from ddtree.vllm.seeded_noise import mix32, position_noise, tree_noise


def _hash(x: int) -> int:
    """The mix in Python integers, written out: xorshift 16, multiply, xorshift 15, multiply, xorshift 15."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) % 2**32
    x ^= x >> 15
    x = (x * 0x735A2D97) % 2**32
    return x ^ (x >> 15)


def test_the_tensor_mix_is_the_integer_mix_and_a_bijection():
    rng = np.random.default_rng(0)
    values = np.concatenate([[0, 1, 2**16, 2**31, 2**32 - 1], rng.integers(0, 2**32, size=2000)])
    mixed = mix32(torch.from_numpy(values.astype(np.int64)))
    assert mixed.tolist() == [_hash(int(v)) for v in values] == [mix32(int(v)) for v in values]
    assert torch.unique(mix32(torch.arange(1 << 16, dtype=torch.int64))).shape[0] == 1 << 16


def test_a_row_depends_on_its_seed_and_position_only(monkeypatch):
    import ddtree.vllm.seeded_noise as seeded_noise

    positions = torch.tensor([7, 3, 7, 100, 3])
    noise = position_noise(11, positions, 50)
    assert torch.equal(noise[0], noise[2]) and torch.equal(noise[1], noise[4])  # one position, one noise
    assert torch.equal(position_noise(11, positions[[3]], 50)[0], noise[3])  # whatever the other rows
    monkeypatch.setattr(seeded_noise, "CHUNK_ENTRIES", 16 * 50)
    many = position_noise(11, torch.arange(40), 50)  # 16 rows a pass: three passes
    assert torch.equal(many[7], noise[0]) and torch.equal(many[3], noise[1])
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(position_noise(12, positions, 50), noise)  # another seed
    assert not torch.equal(position_noise(11 + (1 << 32), positions, 50), noise)  # the seed's high bits count


def test_a_trees_rows_get_one_vector_per_depth_gathered():
    """``tree_noise`` makes one vector per depth from the root's position and gathers it: the same rows as
    ``position_noise`` row by row, with or without the drafter's depth bounding the vectors."""
    positions = torch.tensor([41, 42, 42, 43, 42, 44, 43])  # root (samples 41), nodes at depths 1-3
    expected = position_noise(9, positions, 30)
    assert torch.equal(tree_noise(9, positions, 30, torch.float32), expected)
    assert torch.equal(tree_noise(9, positions, 30, torch.float32, max_depth=3), expected)
    assert torch.equal(tree_noise(9, positions[:1], 30, torch.float32, max_depth=3), expected[:1])


def test_the_noise_is_exponential():
    noise = position_noise(5, torch.arange(400), 500).flatten().double()
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)
    assert (noise > 1).double().mean().item() == pytest.approx(math.exp(-1), abs=0.005)
    assert (noise > 3).double().mean().item() == pytest.approx(math.exp(-3), abs=0.002)


def test_position_keyed_samples_follow_the_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    generators = {0: torch.Generator().manual_seed(3)}
    tokens = sample_rows(
        logits, torch.ones(20000), None, None, generators, [(0, 20000)], row_positions=torch.arange(20000)
    )
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    assert torch.allclose(freq, logits[0].double().softmax(-1), atol=0.015)


def _target_logits(prefix, vocab):
    """A toy target model: the next token's logits as a fixed random function of the whole prefix."""
    rng = np.random.default_rng(abs(hash(tuple(prefix))) % (2**32))
    return torch.from_numpy(rng.normal(size=vocab) * 2.0).float()


def _decode_one_by_one(prompt, seed, n, vocab):
    out = list(prompt)
    generator = {0: torch.Generator().manual_seed(seed)}
    while len(out) < len(prompt) + n:
        logits = _target_logits(out, vocab)[None]
        token = sample_rows(
            logits, torch.ones(1), None, None, generator, [(0, 1)], row_positions=torch.tensor([len(out)])
        )
        out.append(int(token[0]))
    return out[len(prompt) :]


def _decode_with_trees(prompt, seed, n, vocab, budget, rng):
    """Steps of one tree each (a random drafter's top-3 at depth 4), per-node samples keyed by position, the
    accepted path and bonus appended."""
    out = list(prompt)
    generator = {0: torch.Generator().manual_seed(seed)}
    while len(out) < len(prompt) + n:
        ids = np.stack([rng.permutation(vocab)[:3] for _ in range(4)]).astype(np.int64)
        lp = np.sort(rng.normal(size=(4, 3)), axis=-1)[:, ::-1].astype(np.float32)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        tree = ddtree.build_tree(lp, ids, budget)
        prefixes = [[]]
        for i in range(1, len(tree)):
            prefixes.append(prefixes[tree.parents[i]] + [int(tree.tokens[i - 1])])
        logits = torch.stack([_target_logits(out + p, vocab) for p in prefixes])
        positions = torch.tensor([len(out) + len(p) for p in prefixes])  # the position each node samples
        tokens = sample_rows(
            logits, torch.ones(len(tree)), None, None, generator, [(0, len(tree))], row_positions=positions
        )
        path, bonus = ddtree.accept(tree, tokens.numpy())
        out += prefixes[path[-1]] + [int(bonus)]
    return out[len(prompt) : len(prompt) + n]


@pytest.mark.parametrize("seed", [0, 1, 2**40 + 5])
def test_a_seeded_request_decodes_the_same_tokens_whatever_its_trees(seed):
    """What makes a seeded request repeat under ``auto``: trees of any budget (1 to 40 drafts) give exactly the
    tokens of sampling one position at a time with the same seed."""
    prompt, vocab, n = [3, 1, 4], 12, 40
    expected = _decode_one_by_one(prompt, seed, n, vocab)
    for budget in (1, 6, 40):
        got = _decode_with_trees(prompt, seed, n, vocab, budget, np.random.default_rng(budget))
        assert got == expected, budget
    assert _decode_one_by_one(prompt, seed + 1, n, vocab) != expected  # the seed matters


def test_the_kernels_rows_and_keys_list_every_seeded_row_with_its_seeds_key():
    from ddtree.vllm.seeded_noise import seed_key, seeded_rows_and_keys

    host = seeded_rows_and_keys([(5, 3, 2), (2**40, 10, 3), (7, 0, 1)])
    assert host.dtype == np.int64
    assert host[0].tolist() == [3, 4, 10, 11, 12, 0]
    assert host[1].tolist() == [seed_key(5)] * 2 + [seed_key(2**40)] * 3 + [seed_key(7)]
    assert seed_key(2**40) != seed_key(0) and 0 <= seed_key(2**40) < 2**32
    assert seeded_rows_and_keys([]).shape == (2, 0)


def test_requests_without_rows_are_skipped_and_the_torch_path_fills_only_seeded_rows():
    from ddtree.vllm.seeded_noise import fill_seeded_noise

    positions = torch.arange(10, 16)
    noise = fill_seeded_noise(torch.zeros(6, 40), positions, [(4, 1, 2), (9, 5, 0)])
    assert not noise[[0, 3, 4, 5]].any()
    assert torch.equal(noise[1:3], position_noise(4, positions[1:3], 40))
