"""Every tree node's verification logits equal transformers decoding its root path token by token.

Dense (Qwen3), hybrid with MoE (Qwen3-Next) and hybrid (Qwen3.5) targets; random
trees of 1..64 nodes from ``ddtree.build_tree`` (bushy, chains, stars) verified
over several steps, each committing a random root path, so the KV compaction
and the GDN state/conv commit feed the next step's verification.
"""

import numpy as np
import pytest
import torch

import ddtree
from ddtree.engine import TargetModel, TreeInput
from ddtree.engine.tiny import EXTRA_KINDS, TARGET_KINDS, tiny_target

from _hf_oracle import hf_decode_tree

TOLERANCE = 1e-4
STEPS = 4


def random_tree(rng: np.random.Generator, vocab: int) -> ddtree.Tree:
    """A draft tree of 1..64 nodes (root included) of a random shape."""
    shape = rng.choice(["bushy", "chain", "star"])
    depth = {"bushy": rng.integers(1, 8), "chain": rng.integers(1, 16), "star": 1}[shape]
    width = {"bushy": rng.integers(2, 8), "chain": 1, "star": rng.integers(2, 24)}[shape]
    budget = int(rng.integers(0, 64))
    logits = rng.normal(size=(depth, vocab)) * 2
    log_probs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    order = np.argsort(-log_probs, axis=1)[:, :width]
    return ddtree.build_tree(np.take_along_axis(log_probs, order, 1).astype(np.float32), order.astype(np.int64), budget)


def random_root_path(rng: np.random.Generator, parents: np.ndarray) -> np.ndarray:
    node = int(rng.integers(0, len(parents)))
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return np.array(path[::-1], dtype=np.int32)


@pytest.mark.parametrize("kind", TARGET_KINDS + EXTRA_KINDS)
@pytest.mark.parametrize("prompt_len, seed", [(7, 0), (2, 1)])  # 2 < conv width - 1: history padding
def test_tree_logits_match_token_by_token_decoding(kind, prompt_len, seed):
    model = tiny_target(kind, seed=seed)
    target = TargetModel(model)
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    committed = [int(t) for t in rng.integers(0, vocab, prompt_len)]

    # Prefill in two chunks (a chain each), as the engine does for long prompts.
    state = target.new_request_state()
    split = max(1, prompt_len // 2)
    for chunk in (committed[:split], committed[split:]):
        if chunk:
            out = target.forward_trees([state], [TreeInput.chain(chunk, state.cached_len)])
            target.commit([state], out, [np.arange(len(chunk))])
    committed.append(int(rng.integers(0, vocab)))  # the root of the first step

    sizes, worst_seen = [], []
    for step in range(STEPS):
        tree = random_tree(rng, vocab)
        tree_input = TreeInput.from_tree(tree, committed[-1], state.cached_len)
        out = target.forward_trees([state], [tree_input])
        expected = hf_decode_tree(model, committed[:-1], tree_input.tokens.tolist(), tree.parents.tolist())
        diff = (out.logits - expected).abs().max(dim=-1).values
        worst_seen.append(float(diff.max()))
        assert float(diff.max()) <= TOLERANCE, (
            f"step {step}: worst node {int(diff.argmax())} off by {float(diff.max()):.2e}"
        )
        assert float(expected.std()) > 1e-3  # compared logits are not trivially flat

        path = random_root_path(rng, tree.parents)
        target.commit([state], out, [path])
        committed += [int(tree.tokens[node - 1]) for node in path[1:]]
        committed.append(int(rng.integers(0, vocab)))  # next root (a "bonus")
        assert state.cached_len == len(committed) - 1
        sizes.append(len(tree))
    assert max(sizes) > 1
    print(f"{kind}: worst |logit difference| over {sum(sizes)} nodes: {max(worst_seen):.1e}")


@pytest.mark.parametrize("kind", TARGET_KINDS)
@torch.no_grad()
def test_batched_requests_match_single_requests_and_features_match_hf(kind):
    """Flattening several requests into one forward changes nothing; features are HF hidden_states[l + 1]."""
    model = tiny_target(kind, seed=3)
    target = TargetModel(model)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, target.vocab_size, n)] for n in (9, 4, 6)]
    layer_ids = [0, target.num_layers - 1]  # the last one is the normed output in transformers

    states = [target.new_request_state() for _ in prompts]
    out = target.forward_trees(states, [TreeInput.chain(p, 0) for p in prompts], layer_ids)
    for index, prompt in enumerate(prompts):
        rows = out.request_rows(index)
        single = target.forward_trees([target.new_request_state()], [TreeInput.chain(prompt, 0)], layer_ids)
        assert (out.logits[rows] - single.logits).abs().max() <= 1e-5
        hf = model(torch.tensor([prompt]), output_hidden_states=True)
        expected = torch.cat([hf.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
        assert (out.features[rows] - expected).abs().max() <= 1e-4
        assert (out.logits[rows] - hf.logits[0]).abs().max() <= 1e-4
