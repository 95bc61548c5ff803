"""The DFlash drafter: checkpoint format, save/load round trip, incremental context cache."""

import json

import pytest
import torch
from safetensors import safe_open

from ddtree.engine import DFlashDraftModel, DrafterContext
from ddtree.engine.tiny import tiny_target_config


@pytest.fixture(scope="module")
def drafter():
    config = tiny_target_config("qwen3", num_layers=4)
    model = DFlashDraftModel.random(config, num_layers=2, block_size=5, target_layer_ids=[0, 2], seed=3)
    with torch.no_grad():  # non-trivial norms, so a mix-up of norm weights would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def test_checkpoint_has_the_released_drafters_layout(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 5
    assert config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 2]}
    assert config["vocab_size"] == 128 and config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("fc.weight").shape == (32, 64)
        assert weights.get_tensor("hidden_norm.weight").shape == (32,)
    assert {
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.1.post_attention_layernorm.weight",
    } <= names
    assert not any(name.startswith(("embed_tokens", "lm_head", "rotary")) for name in names)


def test_save_load_round_trip_gives_the_same_drafts(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDraftModel.from_pretrained(str(tmp_path))
    assert loaded.block_size == 5 and loaded.mask_token_id == 127 and loaded.target_layer_ids == [0, 2]
    features = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    block = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (drafter, loaded):
        context = DrafterContext()
        model.extend_context(context, features)
        outputs.append(model(block, context))
    assert torch.equal(outputs[0], outputs[1])


def test_context_cache_built_step_by_step_equals_built_at_once(drafter):
    features = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    block = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    at_once, in_steps = DrafterContext(), DrafterContext()
    drafter.extend_context(at_once, features)
    for start, end in [(0, 4), (4, 5), (5, 9)]:
        drafter.extend_context(in_steps, features[start:end])
    assert in_steps.length == 9
    assert torch.allclose(drafter(block, at_once), drafter(block, in_steps), atol=1e-6)


def test_block_attention_is_bidirectional(drafter):
    """Changing the last block slot changes the first slot's output (no causal mask)."""
    context = DrafterContext()
    drafter.extend_context(context, torch.randn(3, 64, generator=torch.Generator().manual_seed(4)))
    block = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))
    changed = block.clone()
    changed[-1] += 1.0
    assert not torch.allclose(drafter(block, context)[0], drafter(changed, context)[0])


def test_loading_rejects_other_architectures(tmp_path, drafter):
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        DFlashDraftModel.from_pretrained(str(tmp_path))


def test_proposer_drafts_a_full_block_whatever_the_depth():
    """Near the token limit the engine asks for fewer positions; the drafter must still see the block it
    was trained on (bonus + block_size - 1 masks): its attention over the block is bidirectional, so a
    shorter block would change every slot's output. Shallower drafts are a prefix of the full one."""
    from ddtree.engine import TargetModel
    from ddtree.engine.drafting import DFlashDraftProposer
    from ddtree.engine.tiny import tiny_target

    hf_target = tiny_target("qwen3", seed=5)
    target = TargetModel(hf_target)
    model = DFlashDraftModel.random(hf_target.config, num_layers=2, block_size=6, target_layer_ids=[0, 2], seed=7)
    proposer = DFlashDraftProposer(model, target)
    state = proposer.new_request()
    proposer.add_context(state, torch.randn(7, 64, generator=torch.Generator().manual_seed(8)))
    committed = [3, 9, 4]
    full = proposer.draft_logits(state, committed, proposer.num_draft_positions)
    assert full.shape == (5, 128)
    for depth in range(1, 5):
        assert torch.allclose(proposer.draft_logits(state, committed, depth), full[:depth], atol=1e-6)
