"""Per-node target tokens and the losslessness of sample-then-walk (torch on CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ddtree  # noqa: E402
from ddtree.vllm.node_sampling import apply_top_k_top_p, sample_rows  # noqa: E402


def test_greedy_rows_are_argmax():
    logits = torch.randn(7, 30)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 0.0, 2.0])
    out = sample_rows(logits, temp, None, None)
    greedy = temp == 0
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(sample_rows(logits, None, None, None, all_greedy=True), logits.argmax(-1))


def test_an_all_greedy_step_writes_its_argmax_where_it_is_asked_to():
    """``greedy_out``: the walk graph's own target buffer, so the walk copies nothing; only for all-greedy steps."""
    logits = torch.randn(7, 30)
    buffer = torch.full((7,), -1, dtype=torch.int64)
    assert sample_rows(logits, None, None, None, all_greedy=True, greedy_out=buffer) is buffer
    assert torch.equal(buffer, logits.argmax(-1))
    temp = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="greedy_out is for all-greedy steps"):
        sample_rows(logits, temp, None, None, greedy_out=buffer)


def test_top_k_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 0, 5]), torch.tensor([1.0, 0.5, 1.0]))
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    # p = 0.5: softmax mass of the top token is ~0.64 >= 0.5, so only it survives
    assert torch.isfinite(out[1, 0]) and torch.isinf(out[1, 1:]).all()
    assert torch.isfinite(out[2]).all()


def test_seeded_requests_are_reproducible_and_independent_of_batch_mates():
    logits = torch.randn(9, 50)
    temp = torch.ones(9)
    ranges = [(0, 4), (4, 5)]
    a = sample_rows(logits, temp, None, None, {1: torch.Generator().manual_seed(3)}, ranges)
    b = sample_rows(logits, temp, None, None, {1: torch.Generator().manual_seed(3)}, ranges)
    assert torch.equal(a[4:], b[4:])


def test_sampled_rows_follow_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]]).repeat(20000, 1)
    temp = torch.full((20000,), 0.7)
    out = sample_rows(logits, temp, None, torch.full((20000,), 0.9))
    probs = apply_top_k_top_p((logits[:1] / 0.7).clone(), None, torch.tensor([0.9])).softmax(-1)[0]
    freq = torch.bincount(out, minlength=4).float() / out.numel()
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)


def test_tree_verification_at_temperature_one_is_lossless():
    """Monte Carlo: a toy target LM (next token depends on the last one) decoded two tokens at a
    time with DDTree trees + per-node sampling gives the target's own joint distribution."""
    rng = np.random.default_rng(0)
    vocab, depth = 4, 2
    table = torch.from_numpy(rng.normal(size=(vocab, vocab)) * 1.5).float()  # logits of next | last
    draft = ddtree.build_tree(
        np.array([[-0.3, -1.5, -2.5], [-0.2, -1.9, -3.0]], dtype=np.float32),
        np.array([[1, 2, 0], [3, 1, 2]], dtype=np.int64),
        5,
    )
    parents = draft.parents
    node_tok = np.concatenate([[0], draft.tokens])  # root = last committed token 0
    n = 20000
    gen = torch.Generator().manual_seed(1)
    counts = np.zeros((vocab, vocab))
    logits = table[torch.from_numpy(node_tok)].repeat(n, 1)  # every node's next-token logits
    tokens = sample_rows(logits, torch.ones(len(logits)), None, None, {i: gen for i in range(1)}, [(0, 0)])
    tokens = tokens.view(n, len(node_tok)).numpy()
    for t in tokens:
        path, bonus = ddtree.accept(draft, t)
        emitted = [int(node_tok[p]) for p in path[1:]] + [int(bonus)]
        if len(emitted) < depth:
            # continue with plain target sampling from the last emitted token
            last = emitted[-1]
            nxt = torch.multinomial(table[last].softmax(-1), 1, generator=gen).item()
            emitted.append(nxt)
        counts[emitted[0], emitted[1]] += 1
    p1 = table[0].softmax(-1)
    joint = (p1[:, None] * table.softmax(-1)).numpy()
    assert np.abs(counts / n - joint).max() < 0.015, (counts / n, joint)
    del parents


def test_min_p_follows_vllm_order_temperature_then_min_p_then_top_p():
    """min-p keeps tokens whose probability (after temperature) is at least min_p times the row's largest; rows
    with min_p 0 are untouched; the kept tokens are then sampled in proportion."""
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.5, 0.0, -1.0]]).repeat(20000, 1)
    temp = torch.full((20000,), 0.8)
    min_p = torch.full((20000,), 0.3)
    min_p[10000:] = 0.0
    out = sample_rows(logits, temp, None, None, min_p=min_p)
    probs = (logits[0] / 0.8).softmax(-1)
    kept = probs >= 0.3 * probs.max()
    assert kept.tolist() == [True, True, False, False]
    assert set(out[:10000].tolist()) <= {0, 1}
    freq = torch.bincount(out[:10000], minlength=4).float() / 10000
    assert torch.allclose(freq, torch.where(kept, probs, 0.0) / probs[kept].sum(), atol=0.015)
    assert set(out[10000:].tolist()) == {0, 1, 2, 3}
    assert torch.equal(sample_rows(logits[:3], torch.zeros(3), None, None, min_p=min_p[:3]), logits[:3].argmax(-1))
