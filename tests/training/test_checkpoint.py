"""Saved checkpoints reload with transformers and with ddtree.engine and give identical logits."""

import copy
import json
import os

import torch
from safetensors import safe_open

from ddtree.engine import DFlashDraftModel, GenerationConfig, SpeculativeEngine, TargetModel, TreeInput
from ddtree.training import model

#: vLLM 0.25.1 Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (orig_to_new_prefix), which
#: Qwen3_5ForConditionalGeneration inherits; every saved weight must map into the language model.
VLLM_PREFIXES = {
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}


def test_target_round_trip(tiny_pair, tiny_data, tmp_path):
    _, target, _ = tiny_pair
    directory = str(tmp_path / "target")
    model.save_target(target, directory, tiny_data.tokenizer_path)
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5"
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["tie_word_embeddings"] is False
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert sum(text["rope_parameters"]["mrope_section"]) == int(text["head_dim"] * 0.25) // 2
    assert "vision_config" in config
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
        assert all(handle.get_tensor(n).dtype == torch.bfloat16 for n in names)
    mapped = []
    for name in names:
        prefix = next(p for p in VLLM_PREFIXES if name.startswith(p))
        mapped.append(VLLM_PREFIXES[prefix] + name[len(prefix) :])
    assert all(m.startswith(("language_model.model.", "language_model.lm_head.")) for m in mapped)
    assert any("linear_attn.in_proj_qkv" in n for n in names) and any("self_attn.q_proj" in n for n in names)

    loaded = model.load_target(directory)
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM"
    tokens = torch.randint(3, tiny_data.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, target(input_ids=tokens).logits, atol=0, rtol=0)
        # the engine's layer-by-layer target on the reloaded model: same logits as transformers' forward
        engine_target = TargetModel(loaded)
        out = engine_target.forward_trees([engine_target.new_request_state()], [TreeInput.chain(tokens[0].tolist(), 0)])
        torch.testing.assert_close(out.logits, target(input_ids=tokens[:1]).logits[0], atol=2e-5, rtol=1e-4)


def test_drafter_round_trip_and_engine(tiny_pair, tiny_data, tmp_path):
    _, target, drafter = tiny_pair
    directory = str(tmp_path / "drafter")
    drafter = copy.deepcopy(drafter)
    model.round_to_bf16_(drafter)
    copy.deepcopy(drafter).to(torch.bfloat16).save_pretrained(directory)
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 16
    assert config["dflash_config"] == {"mask_token_id": tiny_data.mask_id, "target_layer_ids": [1, 2]}
    loaded = DFlashDraftModel.from_pretrained(directory, dtype=torch.float32)
    for (name, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    # the engine runs the reloaded pair, losslessly
    prompt = tiny_data.prompts[0]["ids"]
    engine = SpeculativeEngine(target, loaded)
    ar = engine.generate([prompt], GenerationConfig(mode="ar", max_new_tokens=12))[0].output_ids
    for mode, budget in (("chain", 0), ("ddtree", 16)):
        out = engine.generate([prompt], GenerationConfig(mode=mode, budget=budget, max_new_tokens=12))[0]
        assert out.output_ids == ar
