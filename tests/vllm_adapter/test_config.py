"""Translation and validation of method "ddtree" (pure Python, no vLLM needed)."""

from types import SimpleNamespace

import pytest

from ddtree.vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    ATTENTION_BACKEND,
    WORKER_CLS,
    DDTreeConfig,
    DDTreeConfigError,
    check_target,
    engine_overrides,
    parse_spec_config,
    resolve_draft_len,
    unsupported_sampling_reasons,
)

BASE = {"method": "ddtree", "model": "/d", "num_speculative_tokens": 15, "ddtree_budget": 64}


def test_translation_to_dflash_with_budget():
    spec, cfg = parse_spec_config(dict(BASE, draft_tensor_parallel_size=1, ddtree_top_k=8, ddtree_num_threads=2))
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 64, "draft_tensor_parallel_size": 1}
    assert cfg == DDTreeConfig(budget=64, draft_len=15, top_k=8, num_threads=2)
    assert DDTreeConfig.from_dict(cfg.to_dict()) == cfg
    assert ADDITIONAL_CONFIG_KEY == "ddtree"


def test_depth_may_come_from_drafter_later():
    spec, cfg = parse_spec_config({"method": "ddtree", "model": "/d", "ddtree_budget": 32})
    assert spec["num_speculative_tokens"] == 32 and cfg.draft_len is None
    assert resolve_draft_len(cfg, 16).draft_len == 15
    with pytest.raises(DDTreeConfigError, match="block_size"):
        resolve_draft_len(cfg, None)
    with pytest.raises(DDTreeConfigError, match="smaller than the drafter's depth"):
        resolve_draft_len(DDTreeConfig(budget=8, draft_len=None, top_k=None), 16)


def test_depth_must_match_drafter_block():
    _, cfg = parse_spec_config(BASE)
    assert resolve_draft_len(cfg, 16) == cfg
    assert resolve_draft_len(cfg, None) == cfg
    with pytest.raises(DDTreeConfigError, match="block_size - 1 = 7"):
        resolve_draft_len(cfg, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"ddtree_budget": 0}, "positive integer"),
        ({"ddtree_budget": 4096}, "at most"),
        ({"ddtree_budget": "64"}, "positive integer"),
        ({"ddtree_budget": True}, "positive integer"),
        ({"ddtree_budget": 8}, "smaller than the drafter's depth"),
        ({"ddtree_top_k": -1}, "positive integer"),
        ({"ddtree_bugdet": 3}, "unknown ddtree option"),
        ({"model": None}, "DFlash drafter"),
        ({"num_speculative_tokens": 0}, "positive integer"),
        ({"disable_padded_drafter_batch": True}, "padded drafter batch"),
        ({"draft_sample_method": "probabilistic"}, "never sampled"),
        ({"rejection_sample_method": "block"}, "replaces vLLM's rejection sampler"),
    ],
)
def test_invalid_values_are_refused_with_a_reason(change, match):
    spec = dict(BASE, **change)
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(DDTreeConfigError, match=match):
        parse_spec_config(spec)


def test_budget_is_required():
    with pytest.raises(DDTreeConfigError, match="ddtree_budget"):
        parse_spec_config({"method": "ddtree", "model": "/d"})


def _args(**kw):
    base = dict(enforce_eager=False, async_scheduling=None, enable_prefix_caching=None, attention_backend=None,
                worker_cls="auto", tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                attention_config=SimpleNamespace(backend=None))
    base.update(kw)
    return SimpleNamespace(**base)


def test_engine_overrides_fill_unset_settings():
    changes = engine_overrides(_args(), environ={})
    assert changes == {"enforce_eager": True, "async_scheduling": False, "enable_prefix_caching": False,
                       "attention_backend": ATTENTION_BACKEND, "worker_cls": WORKER_CLS}
    assert engine_overrides(_args(**changes), environ={"VLLM_USE_V2_MODEL_RUNNER": "0"}) == {}


@pytest.mark.parametrize(
    "kw, env, match",
    [
        ({"async_scheduling": True}, {}, "async_scheduling"),
        ({"enable_prefix_caching": True}, {}, "enable_prefix_caching"),
        ({"attention_backend": SimpleNamespace(name="FLASH_ATTN")}, {}, "attention_backend"),
        ({"attention_config": SimpleNamespace(backend="FLASH_ATTN")}, {}, "attention_config.backend"),
        ({"worker_cls": "my.Worker"}, {}, "worker_cls"),
        ({"pipeline_parallel_size": 2}, {}, "pipeline_parallel_size=1"),
        ({"pipeline_parallel_size": 2}, {}, "pipeline_parallel_size=1"),
        ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "V1 model runner"),
    ],
)
def test_engine_overrides_refuse_conflicts(kw, env, match):
    with pytest.raises(DDTreeConfigError, match=match):
        engine_overrides(_args(**kw), environ=env)


def test_custom_backend_through_attention_config_is_accepted():
    changes = engine_overrides(_args(attention_config=SimpleNamespace(backend=SimpleNamespace(name="CUSTOM"))),
                               environ={})
    assert "attention_backend" not in changes


def _target(**kw):
    base = dict(is_hybrid=False, uses_mrope=False, sliding_window=None, kv_cache_dtype="auto", vocab_size=1000,
                cfg=DDTreeConfig(budget=64, draft_len=15, top_k=None))
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"is_hybrid": True, "architecture": "NemotronHForCausalLM"}, "Gated DeltaNet"),
        ({"is_hybrid": True, "architecture": "Qwen3NextForCausalLM", "mamba_cache_mode": "align"},
         "mamba_cache_mode='none'"),
        ({"sliding_window": 4096}, "sliding-window"),
        ({"kv_cache_dtype": "fp8"}, "unquantized"),
        ({"use_v2_model_runner": True}, "V1"),
        ({"has_logits_processors": True}, "logits processors"),
        ({"cfg": DDTreeConfig(budget=64, draft_len=15, top_k=5000)}, "exceeds the vocabulary"),
        ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode='processed_logprobs' is not supported"),
    ],
)
def test_targets_the_adapter_cannot_verify_are_refused(kw, match):
    with pytest.raises(DDTreeConfigError, match=match):
        check_target(**_target(**kw))
    check_target(**_target())


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration"])
def test_gdn_hybrids_and_mrope_targets_are_accepted(architecture):
    check_target(**_target(is_hybrid=True, architecture=architecture, uses_mrope=True))


def test_width_is_min_of_topk_budget_vocab():
    assert DDTreeConfig(budget=64, draft_len=15, top_k=None).width(1000) == 64
    assert DDTreeConfig(budget=64, draft_len=15, top_k=8).width(1000) == 8
    assert DDTreeConfig(budget=256, draft_len=15, top_k=None).width(100) == 100


def _params(**kw):
    base = dict(structured_outputs=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                bad_words=None, logit_bias=None, min_p=0.0, allowed_token_ids=None, min_tokens=0, logprobs=None,
                logits_processors=None, thinking_token_budget=None, temperature=0.7, top_p=0.9, top_k=20, seed=3)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"structured_outputs": object()}, "structured outputs"),
    ],
)
def test_unservable_requests_are_named(kw, word):
    reasons = unsupported_sampling_reasons(_params(**kw))
    assert len(reasons) == 1 and word in reasons[0]


def test_plain_sampling_is_served():
    assert unsupported_sampling_reasons(_params()) == []
    assert unsupported_sampling_reasons(_params(logprobs=5)) == []  # the sampler returns them
    assert unsupported_sampling_reasons(_params(allowed_token_ids=[1, 2])) == []  # a per-node mask
    assert unsupported_sampling_reasons(_params(min_tokens=3)) == []  # stop tokens masked by node depth
    assert unsupported_sampling_reasons(_params(min_p=0.1, logit_bias={1: 2.0})) == []  # the same at every node
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    assert unsupported_sampling_reasons(_params(**penalties, bad_words=["x"])) == []  # each node's own history
    check_target(**_target(logprobs_mode="raw_logits"))
