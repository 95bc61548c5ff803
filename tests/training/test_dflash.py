"""The DFlash training objective: weights, anchors, masks, and equivalence with the inference drafter."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ddtree.engine import DrafterContext, TargetModel, TreeInput
from ddtree.training import dflash


def test_position_weights_decay_from_one():
    w = dflash.position_weights(16, dflash.default_gamma(16))
    assert dflash.default_gamma(16) == 7.0
    assert w.shape == (15,)
    assert w[0] == 1.0  # slot k = 1
    for k in range(1, 16):
        assert math.isclose(float(w[k - 1]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)


@pytest.mark.parametrize("seq_len,count", [(17, 1), (40, 10), (64, 48)])
def test_anchors_never_cross_the_sequence_end(seq_len, count):
    bs = 16
    for seed in range(20):
        anchors = dflash.sample_anchors(4, seq_len, count, bs, torch.Generator().manual_seed(seed))
        assert anchors.shape == (4, count)
        assert int(anchors.min()) >= 1  # at least one context token
        assert int(anchors.max()) + bs - 1 <= seq_len - 1  # every label inside the sequence
        assert all(len(set(row.tolist())) == count for row in anchors)
        assert torch.equal(anchors, anchors.sort(dim=1).values)
    with pytest.raises(ValueError):
        dflash.sample_anchors(1, 16, 1, bs, torch.Generator())


def test_block_layout_and_mask():
    bs, mask_id = 4, 99
    tokens = torch.arange(10, 30)[None]  # token value = position + 10
    anchors = torch.tensor([[2, 7]])
    ids, positions, labels = dflash.block_layout(tokens, anchors, bs, mask_id)
    assert ids.tolist() == [[12, 99, 99, 99, 17, 99, 99, 99]]
    assert positions.tolist() == [[2, 3, 4, 5, 7, 8, 9, 10]]
    assert labels.tolist() == [[[13, 14, 15], [18, 19, 20]]]
    mask = dflash.attention_mask(anchors, tokens.shape[1], bs)[0, 0]  # [M, T + M]
    assert mask.shape == (8, 20 + 8)
    assert mask[0, :20].tolist() == [t < 2 for t in range(20)]
    assert mask[5, :20].tolist() == [t < 7 for t in range(20)]
    assert mask[:4, 20:24].all() and not mask[:4, 24:].any() and not mask[4:, 20:24].any()


def test_loss_is_position_weighted_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 15, 11)
    labels = torch.randint(0, 11, (2, 3, 15))
    w = dflash.position_weights(16, 7.0)
    loss, info = dflash.dflash_loss(logits, labels, w)
    manual = 0.0
    for b in range(2):
        for n in range(3):
            ce = F.cross_entropy(logits[b, n], labels[b, n], reduction="none")
            manual += float((ce * w).sum() / w.sum())
    assert math.isclose(float(loss), manual / 6, rel_tol=1e-5)
    # a perfect prediction of the first slots only: teacher-forced chain tau counts until the first miss
    logits = torch.full((1, 1, 15, 11), -10.0)
    labels = torch.zeros(1, 1, 15, dtype=torch.long)
    logits[0, 0, :3, 0] = 10.0
    logits[0, 0, 3:, 2] = 10.0  # wrong from slot 4 on
    assert dflash.dflash_loss(logits, labels, w)[1]["chain_tau"] == 4.0


def test_features_hook_matches_engine_features(tiny_pair):
    _, target, drafter = tiny_pair
    tokens = torch.randint(3, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    hook = dflash.TargetFeatures(target, drafter.target_layer_ids)
    with torch.no_grad():
        target(input_ids=tokens)
    features = hook.take()[0]
    hook.remove()
    engine_target = TargetModel(target)
    state = engine_target.new_request_state()
    out = engine_target.forward_trees([state], [TreeInput.chain(tokens[0].tolist(), 0)], drafter.target_layer_ids)
    torch.testing.assert_close(features, out.features, atol=2e-5, rtol=1e-4)


def test_training_forward_equals_inference_drafter(tiny_pair):
    """Many anchors in one masked pass give exactly what DFlashDraftModel computes per block at inference."""
    _, target, drafter = tiny_pair
    drafter = copy.deepcopy(drafter)
    torch.manual_seed(3)
    with torch.no_grad():  # make the drafter non-trivial
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    seq_len, bs = 48, drafter.block_size
    tokens = torch.randint(3, target.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(2))
    features = torch.randn(2, seq_len, drafter.fc.in_features)
    anchors = torch.tensor([[1, 9, 30], [5, 17, 32]])
    with torch.no_grad():
        logits, labels = dflash.dflash_step_logits(drafter, target, tokens, features, anchors)
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                context = DrafterContext()
                drafter.extend_context(context, features[b, :a])
                block = torch.full((bs,), drafter.mask_token_id)
                block[0] = tokens[b, a]
                hidden = drafter(target.get_input_embeddings()(block), context)[1:]
                expected = target.get_output_embeddings()(hidden)
                torch.testing.assert_close(logits[b, n], expected, atol=1e-4, rtol=1e-4)
                assert labels[b, n].tolist() == tokens[b, a + 1 : a + bs].tolist()


def test_walk_chain_visits_only_the_engines_anchors():
    """A stretch the drafter gets right is covered by few steps: the mean over all anchors overstates tau."""
    bs = 5
    # anchors 10..29: 10..19 all hits (a loop), 20..29 all misses
    correct = torch.zeros(20, bs - 1, dtype=torch.bool)
    correct[:10] = True
    lengths = dflash.walk_chain(correct, 10, 29)
    # steps at 10 (+5), 15 (+5), 20..29 one token each; the last step (anchor 29) drafts nothing
    assert lengths == [5, 5] + [1] * 10
    assert sum(lengths) == 29 - 10 + 1
    anchor_mean = 1 + float(correct.long().cumprod(-1).sum(-1).float().mean())
    assert anchor_mean == 3.0 and sum(lengths) / len(lengths) == pytest.approx(20 / 12)
    # the depth cap near the end: never accept past the last anchor
    assert dflash.walk_chain(torch.ones(4, bs - 1, dtype=torch.bool), 0, 3) == [4]


def test_teacher_forced_chain_equals_the_engines_chain(tiny_pair, tiny_data):
    """The training-side metric reproduces the engine's greedy chain acceptance lengths step by step."""
    from ddtree.engine import GenerationConfig, SpeculativeEngine
    from ddtree.training import train

    _, target, drafter = tiny_pair
    drafter = copy.deepcopy(drafter).train()
    prompts = [p["ids"] for p in tiny_data.prompts]
    new_tokens = 40
    engine = SpeculativeEngine(target, None)
    reference = [r.output_ids for r in engine.generate(prompts, GenerationConfig(mode="ar", max_new_tokens=new_tokens))]
    # fit the drafter to these very continuations so that the chain accepts more than the bonus
    tokens = torch.tensor([p + r for p, r in zip(prompts, reference)])
    hook = dflash.TargetFeatures(target, drafter.target_layer_ids)
    with torch.no_grad():
        target(input_ids=tokens)
    features = hook.take()
    hook.remove()
    anchors = torch.arange(1, tokens.shape[1] - drafter.block_size + 1)[None].expand(len(prompts), -1)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    weights = dflash.position_weights(drafter.block_size, 7.0)
    for _ in range(60):
        logits, labels = dflash.dflash_step_logits(drafter, target, tokens, features, anchors)
        loss = dflash.dflash_loss(logits, labels, weights)[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()

    chain = SpeculativeEngine(target, drafter).generate(
        prompts, GenerationConfig(mode="chain", max_new_tokens=new_tokens)
    )
    assert [r.output_ids for r in chain] == reference
    assert train.greedy_continuations(target, prompts, new_tokens, tiny_data.pad_id, torch.device("cpu")) == reference
    result = dflash.teacher_forced_chain(drafter, target, prompts, reference)
    assert result["lengths"] == [r.stats.acceptance_lengths for r in chain]
    assert max(max(r.stats.acceptance_lengths) for r in chain) > 2  # a non-trivial chain was compared
    assert result["steps"] == sum(r.stats.steps for r in chain)


def test_target_greedy_labels(tiny_pair):
    """Labels from the target's argmax: the continuation of a greedy output labels itself."""
    from ddtree.engine import GenerationConfig, SpeculativeEngine

    _, target, drafter = tiny_pair
    prompt = torch.randint(3, target.config.vocab_size, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    output = SpeculativeEngine(target, None).generate([prompt], GenerationConfig(mode="ar", max_new_tokens=20))[0]
    tokens = torch.tensor([prompt + output.output_ids])
    with torch.no_grad():
        labels = dflash.target_greedy_labels(tokens, target(input_ids=tokens).logits)
    assert labels[0, 20:].tolist() == output.output_ids  # inside the greedy continuation: the tokens themselves
    assert labels[0, 0] == tokens[0, 0]
    anchors = torch.tensor([[3, 19]])
    _, text_labels = dflash.dflash_step_logits(
        drafter, target, tokens, torch.zeros(1, 40, drafter.fc.in_features), anchors
    )
    _, greedy_labels = dflash.dflash_step_logits(
        drafter, target, tokens, torch.zeros(1, 40, drafter.fc.in_features), anchors, labels
    )
    assert torch.equal(greedy_labels[0, 1], text_labels[0, 1])  # anchor 19: labels 20.. are all greedy output
    assert greedy_labels[0, 0].tolist() == labels[0, 4:19].tolist()


def test_training_refuses_a_drafter_whose_layers_are_causal_or_windowed(tiny_pair):
    # The training mask is DFlash's full block attention; a sliding-window layer would train unlike it infers.
    _, target, drafter = tiny_pair
    drafter = copy.deepcopy(drafter)
    drafter.layers[0].self_attn.causal, drafter.layers[0].self_attn.window = True, 2048
    features = torch.randn(1, 48, drafter.fc.in_features)
    tokens = torch.randint(3, target.config.vocab_size, (1, 48))
    with pytest.raises(ValueError, match=r"causal or sliding-window layers is not supported \(layers \[0\]\)"):
        dflash.dflash_step_logits(drafter, target, tokens, features, torch.tensor([[1]]))
