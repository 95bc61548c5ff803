"""The helpers the GPU harnesses share (they run only on a GPU; their pure parts are checked here)."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from ddtree.vllm.tiny_models import engine_kwargs_for, spec_metrics  # noqa: E402


def test_spec_metrics_reads_vllm_counters_and_never_raises():
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts_total", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens_total", value=640),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_total", value=12),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", value=None, values=[8, 3, 1]),
        SimpleNamespace(name="vllm:num_requests_running", value=2),
    ]
    out = spec_metrics(SimpleNamespace(get_metrics=lambda: metrics))
    assert out == {"drafts": 10.0, "draft_tokens": 640.0, "accepted": 12.0, "per_pos": [8.0, 3.0, 1.0]}

    def broken():
        raise RuntimeError("stats logging disabled")

    failed = spec_metrics(SimpleNamespace(get_metrics=broken))
    assert failed["drafts"] == 0.0 and "stats logging disabled" in failed["error"]


@pytest.mark.parametrize("architecture, expected", [
    ("Qwen3ForCausalLM", {}),
    ("Qwen3NextForCausalLM", {"additional_config": {"gdn_prefill_backend": "triton"}}),
    ("Qwen3_5ForConditionalGeneration",
     {"additional_config": {"gdn_prefill_backend": "triton"}, "language_model_only": True}),
])
def test_engine_arguments_follow_the_target_architecture(tmp_path, architecture, expected):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert engine_kwargs_for(str(tmp_path)) == expected


def test_tiny_qwen3_next_routes_every_token_to_the_chosen_number_of_experts(tmp_path):
    from ddtree.vllm.tiny_models import write_qwen3_next_target

    write_qwen3_next_target(str(tmp_path / "all"), experts_per_token=4)
    with open(tmp_path / "all" / "config.json") as handle:
        config = json.load(handle)
    assert config["num_experts_per_tok"] == 4 and config["num_experts"] == 4
    with pytest.raises(ValueError, match="experts_per_token must be 1..4"):
        write_qwen3_next_target(str(tmp_path / "bad"), experts_per_token=5)
