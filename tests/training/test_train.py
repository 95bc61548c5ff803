"""A few optimisation steps reduce the loss on a fixed tiny batch (target LM and DFlash drafter)."""

import copy

import torch
import torch.nn.functional as F

from ddtree.training import dflash, train


def test_target_steps_reduce_loss(tiny_pair, tiny_data):
    _, target, _ = tiny_pair
    model = copy.deepcopy(target).train()
    batch = torch.from_numpy(tiny_data.train[: 4 * 33].astype("int64")).view(4, 33)
    settings = train.PhaseSettings(batch_size=4, seq_len=32, peak_lr=3e-3, warmup_steps=1)
    optimizer = train.make_optimizer(list(model.parameters()), settings, torch.device("cpu"))

    def loss_fn():
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    assert_three_steps_reduce(loss_fn, optimizer)


def assert_three_steps_reduce(loss_fn, optimizer) -> None:
    before = float(loss_fn().detach())
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    assert float(loss_fn().detach()) < before - 0.05


def test_drafter_steps_reduce_loss_and_target_stays_frozen(tiny_pair, tiny_data):
    _, target, drafter = tiny_pair
    drafter = copy.deepcopy(drafter).train()
    target = copy.deepcopy(target).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    tokens = torch.from_numpy(tiny_data.train[: 2 * 40].astype("int64")).view(2, 40)
    anchors = dflash.sample_anchors(2, 40, 6, drafter.block_size, torch.Generator().manual_seed(0))
    hook = dflash.TargetFeatures(target, drafter.target_layer_ids)
    with torch.no_grad():
        target(input_ids=tokens)
    features = hook.take()
    hook.remove()
    weights = dflash.position_weights(drafter.block_size, 7.0)
    settings = train.PhaseSettings(batch_size=2, seq_len=40, peak_lr=3e-3, warmup_steps=1, weight_decay=0.0)
    optimizer = train.make_optimizer(list(drafter.parameters()), settings, torch.device("cpu"))

    def loss_fn():
        logits, labels = dflash.dflash_step_logits(drafter, target, tokens, features, anchors)
        return dflash.dflash_loss(logits, labels, weights)[0]

    assert_three_steps_reduce(loss_fn, optimizer)
    for name, value in target.state_dict().items():
        assert torch.equal(value, frozen[name]), name


def test_cosine_schedule():
    assert dflash.cosine_lr(0, 100, 1.0, 10) == 0.1
    assert dflash.cosine_lr(9, 100, 1.0, 10) == 1.0
    assert abs(dflash.cosine_lr(100, 100, 1.0, 10) - 0.1) < 1e-9
