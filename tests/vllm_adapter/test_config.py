"""Translation and validation of method "ddtree" (pure Python, no vLLM needed)."""

import json
from types import SimpleNamespace

import pytest

from ddtree.vllm.config import (
    ADDITIONAL_CONFIG_KEY,
    ATTENTION_BACKEND,
    WORKER_CLS,
    DDTreeConfig,
    DDTreeConfigError,
    budget_description,
    check_target,
    commit_graphs_enabled,
    commit_in_place_enabled,
    device_accept_enabled,
    late_trees_enabled,
    large_batch_advice,
    lone_row_advice,
    lone_row_budgets,
    precapture_commits,
    precapture_enabled,
    topk_graphs_enabled,
    whole_tree_gdn_metadata_enabled,
    cudagraph_mode_choice,
    engine_overrides,
    fit_batch_limits,
    override_reason,
    parse_spec_config,
    resolve_draft_len,
    schedule_tree_graphs,
    tree_capture_sizes,
    unsupported_sampling_reasons,
    vllm_default_capture_sizes,
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
    base = dict(
        enforce_eager=False,
        async_scheduling=None,
        enable_prefix_caching=None,
        attention_backend=None,
        worker_cls="auto",
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        attention_config=SimpleNamespace(backend=None),
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_engine_overrides_fill_unset_settings():
    changes = engine_overrides(_args(), environ={})
    assert all(override_reason(attr) for attr in changes)  # each one logged with its reason
    assert "DDTREE_ASYNC_SCHEDULING" in override_reason("async_scheduling")
    assert changes == {
        "async_scheduling": True,
        "attention_backend": ATTENTION_BACKEND,
        "worker_cls": WORKER_CLS,
    }
    assert engine_overrides(_args(**changes), environ={"VLLM_USE_V2_MODEL_RUNNER": "0"}) == {}


def _async(user=None, env=None, tp=1, cfg=None):
    return engine_overrides(_args(async_scheduling=user, tensor_parallel_size=tp), environ=env or {}, cfg=cfg).get(
        "async_scheduling", "kept"
    )


def test_asynchronous_scheduling_by_default_with_one_gpu():
    """Unset, a ddtree engine schedules asynchronously with one GPU and synchronously under tensor parallelism; a
    user's choice is kept where the engine can honour it."""
    assert _async() is True
    assert _async(tp=2) is False
    assert _async(env={"DDTREE_ASYNC_SCHEDULING": "0"}) is False
    assert _async(user=False) == "kept"  # --no-async-scheduling
    assert _async(user=True) == "kept"
    by_hand = {"DDTREE_ASYNC_SCHEDULING": "1", "DDTREE_DEVICE_ACCEPT": "1", "DDTREE_LATE_TREES": "1"}
    assert _async(user=True, tp=2, env=by_hand) == "kept"  # all by hand under TP (not run there: the user's risk)


def test_asynchronous_scheduling_refusals_name_the_problem():
    with pytest.raises(DDTreeConfigError, match="only with DDTREE_ASYNC_SCHEDULING=1.*tensor_parallel_size=2"):
        _async(user=True, tp=2)
    with pytest.raises(DDTreeConfigError, match="only with DDTREE_ASYNC_SCHEDULING=1.*switch 0"):
        _async(user=True, env={"DDTREE_ASYNC_SCHEDULING": "0"})
    with pytest.raises(DDTreeConfigError, match="async_scheduling=False was given too"):
        _async(user=False, env={"DDTREE_ASYNC_SCHEDULING": "1"})
    with pytest.raises(DDTreeConfigError, match="DDTREE_ASYNC_SCHEDULING must be 1 .*or 0 .*got .yes."):
        _async(env={"DDTREE_ASYNC_SCHEDULING": "yes"})


def test_the_start_up_log_says_why_an_engine_schedules_synchronously():
    assert "synchronous here" not in override_reason("async_scheduling", {}, 1)
    assert override_reason("async_scheduling", {}, 2).endswith("synchronous here: tensor_parallel_size=2")
    off = override_reason("async_scheduling", {"DDTREE_ASYNC_SCHEDULING": "0"}, 1)
    assert off.endswith("synchronous here: DDTREE_ASYNC_SCHEDULING=0")
    narrow = DDTreeConfig(budget=16, draft_len=3, top_k=2)
    assert override_reason("async_scheduling", {}, 1, narrow).endswith(
        "synchronous here: it needs trees that fill every budget (top-K 2 at depth 3 cannot fill [16])"
    )
    assert "late trees" in override_reason("async_scheduling", {"DDTREE_LATE_TREES": "0"}, 1)
    assert "DDTREE_PREFIX_CACHING=0" in override_reason("enable_prefix_caching", {}, 2)


def test_asynchronous_scheduling_needs_late_device_walked_trees_that_fill_the_budget():
    """What asynchronous scheduling lacks turns the default to synchronous, and is refused when asked for by hand."""
    host_walk = {"DDTREE_DEVICE_ACCEPT": "0"}
    assert _async(env=host_walk) is False
    assert _async(env={"DDTREE_LATE_TREES": "0"}) is False
    with pytest.raises(DDTreeConfigError, match="the tree walk on the device and late trees"):
        _async(env=dict(host_walk, DDTREE_ASYNC_SCHEDULING="1"))
    with pytest.raises(DDTreeConfigError, match="the tree walk on the device"):
        _async(user=True, env=host_walk)
    # top-K 2 at depth 3 gives at most 2 + 4 + 8 = 14 nodes: budget 16 cannot fill, 8 can.
    narrow = DDTreeConfig(budget=16, draft_len=3, top_k=2, budget_schedule=((1, 16), (8, 8)))
    assert narrow.budgets_unfilled() == [16]
    assert _async(cfg=narrow) is False
    with pytest.raises(DDTreeConfigError, match=r"top-K 2 at depth 3 cannot fill \[16\]"):
        _async(cfg=narrow, env={"DDTREE_ASYNC_SCHEDULING": "1"})
    assert _async(cfg=DDTreeConfig(budget=8, draft_len=3, top_k=2)) is True
    assert _async(cfg=DDTreeConfig(budget=64, draft_len=None, top_k=2)) is True  # depth unknown: the runner checks
    assert _async(cfg=DDTreeConfig(budget=64, draft_len=15, top_k=None)) is True  # K = budget: always fills


@pytest.mark.parametrize(
    "kw, env, match",
    [
        ({"enable_prefix_caching": True}, {"DDTREE_PREFIX_CACHING": "0"}, "enable_prefix_caching=True"),
        ({"attention_backend": SimpleNamespace(name="FLASH_ATTN")}, {}, "attention_backend"),
        ({"attention_config": SimpleNamespace(backend="FLASH_ATTN")}, {}, "attention_config.backend"),
        ({"worker_cls": "my.Worker"}, {}, "worker_cls"),
        ({"pipeline_parallel_size": 2}, {}, "pipeline_parallel_size=1"),
        ({"pipeline_parallel_size": 2}, {}, "pipeline_parallel_size=1"),
        ({}, {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "V1 model runner"),
        ({}, {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, "not breakable ones; unset VLLM_USE_BREAKABLE_CUDAGRAPH"),
    ],
)
def test_engine_overrides_refuse_conflicts(kw, env, match):
    with pytest.raises(DDTreeConfigError, match=match):
        engine_overrides(_args(**kw), environ=env)


def test_custom_backend_through_attention_config_is_accepted():
    changes = engine_overrides(
        _args(attention_config=SimpleNamespace(backend=SimpleNamespace(name="CUSTOM"))), environ={}
    )
    assert "attention_backend" not in changes


def _target(**kw):
    base = dict(
        is_hybrid=False,
        uses_mrope=False,
        sliding_window=None,
        kv_cache_dtype="auto",
        vocab_size=1000,
        cfg=DDTreeConfig(budget=64, draft_len=15, top_k=None),
    )
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"is_hybrid": True, "architecture": "NemotronHForCausalLM"}, "Gated DeltaNet"),
        (
            {"is_hybrid": True, "architecture": "Qwen3NextForCausalLM", "mamba_cache_mode": "align"},
            "mamba_cache_mode 'none' for this hybrid",
        ),
        (
            {"is_hybrid": True, "architecture": "Qwen3NextForCausalLM", "mamba_cache_mode": "all"},
            "mamba_cache_mode 'none' for this hybrid",
        ),
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
    base = dict(
        structured_outputs=None,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        bad_words=None,
        logit_bias=None,
        min_p=0.0,
        allowed_token_ids=None,
        min_tokens=0,
        logprobs=None,
        logits_processors=None,
        thinking_token_budget=None,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=3,
    )
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
    assert len(reasons) == 1 and word in reasons[0][1] and reasons[0][0] in kw


def test_plain_sampling_is_served():
    assert unsupported_sampling_reasons(_params()) == []
    assert unsupported_sampling_reasons(_params(logprobs=5)) == []  # the sampler returns them
    assert unsupported_sampling_reasons(_params(allowed_token_ids=[1, 2])) == []  # a per-node mask
    assert unsupported_sampling_reasons(_params(min_tokens=3)) == []  # stop tokens masked by node depth
    assert unsupported_sampling_reasons(_params(min_p=0.1, logit_bias={1: 2.0})) == []  # the same at every node
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    assert unsupported_sampling_reasons(_params(**penalties, bad_words=["x"])) == []  # each node's own history
    check_target(**_target(logprobs_mode="raw_logits"))


def test_cudagraph_mode_is_vllms_default_unless_the_user_chose_eager_or_a_served_mode():
    assert cudagraph_mode_choice(None, enforce_eager=False) == "FULL_AND_PIECEWISE"
    assert cudagraph_mode_choice(None, enforce_eager=None) == "FULL_AND_PIECEWISE"
    assert cudagraph_mode_choice(None, enforce_eager=True) is None  # eager: vLLM turns graphs off itself
    for served in ("PIECEWISE", "NONE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        assert cudagraph_mode_choice(served, enforce_eager=False) is None
    with pytest.raises(DDTreeConfigError, match="cudagraph_mode=FULL .*FULL_AND_PIECEWISE"):
        cudagraph_mode_choice("FULL", enforce_eager=False)


def _fit(**kw):
    base = dict(
        budget=64,
        reserve_per_request=14,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        seqs_from_user=False,
        tokens_from_user=False,
    )
    base.update(kw)
    return fit_batch_limits(**base)


def test_default_batch_limits_shrink_to_whole_trees():
    # vllm serve on an H200: 1024 sequences, 8192 tokens. vLLM's own check would see 8192 - 14 * 1024 < 0.
    limits = _fit()
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (8192 // 79, 8192)
    assert limits.max_num_batched_tokens - 14 * limits.max_num_seqs >= limits.max_num_seqs * 65
    assert "max_num_seqs 1024 -> 103" in limits.reason
    # Limits that already hold whole trees are kept, user-set or not.
    assert _fit(max_num_seqs=32, max_num_batched_tokens=8192).reason is None
    assert _fit(max_num_seqs=32, seqs_from_user=True, tokens_from_user=True).max_num_seqs == 32


def test_a_budget_larger_than_the_default_tokens_grows_them_when_the_user_set_neither():
    limits = _fit(budget=1024, max_num_batched_tokens=512)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (1, 1024 + 1 + 14)
    with pytest.raises(DDTreeConfigError, match="--max-num-batched-tokens >= 1039"):
        _fit(budget=1024, max_num_batched_tokens=512, tokens_from_user=True)


def test_user_set_sequences_grow_the_default_tokens():
    limits = _fit(max_num_seqs=256, seqs_from_user=True)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (256, 256 * 79)
    assert "max_num_batched_tokens 8192 -> 20224" in limits.reason


def test_user_set_limits_are_kept_while_one_tree_fits_and_refused_with_working_values_otherwise():
    crowded = _fit(max_num_seqs=256, max_num_batched_tokens=8192, seqs_from_user=True, tokens_from_user=True)
    assert (crowded.max_num_seqs, crowded.max_num_batched_tokens, crowded.reason) == (256, 8192, None)
    with pytest.raises(DDTreeConfigError) as err:
        _fit(max_num_seqs=1024, max_num_batched_tokens=8192, seqs_from_user=True, tokens_from_user=True)
    message = str(err.value)
    assert "--max-num-batched-tokens >= 80896" in message and "--max-num-seqs <= 103" in message
    # The values it names work.
    assert _fit(max_num_seqs=1024, max_num_batched_tokens=80896, seqs_from_user=True, tokens_from_user=True)
    assert _fit(max_num_seqs=103, max_num_batched_tokens=8192, seqs_from_user=True, tokens_from_user=True)


def test_capture_sizes_hold_every_whole_number_of_trees():
    sizes = tree_capture_sizes(64, max_num_seqs=32, max_num_batched_tokens=8192)
    assert sizes == sorted(set(sizes))
    assert set(vllm_default_capture_sizes(512)) <= set(sizes)
    assert all(k * 65 in sizes for k in range(1, 33))
    assert sizes[-1] == 32 * 65 and 33 * 65 not in sizes
    # Bounded by the batched tokens and by the sequences.
    assert max(tree_capture_sizes(64, max_num_seqs=1024, max_num_batched_tokens=4096)) <= 4096
    assert max(tree_capture_sizes(16, max_num_seqs=2, max_num_batched_tokens=8192)) == 512
    # Past 32 trees, every 8th count, up to 128 trees.
    many = tree_capture_sizes(16, max_num_seqs=1024, max_num_batched_tokens=1 << 20)
    assert 40 * 17 in many and 36 * 17 not in many and 128 * 17 in many and 136 * 17 not in many


def test_a_schedules_smaller_budgets_get_graphs_at_the_batch_sizes_that_pick_them():
    def graphs(schedule, max_num_seqs=64, max_tokens=8192, size=lambda budget: budget + 1):
        cfg = DDTreeConfig(budget=max(b for _, b in schedule), draft_len=15, top_k=8, budget_schedule=schedule)
        return schedule_tree_graphs(cfg, size, max_num_seqs, max_tokens)

    got = graphs(((1, 64), (8, 32), (32, 16)))
    assert [n for s, n in got if s == 33] == list(range(8, 32))  # 32 from 8 requests to 31
    assert [n for s, n in got if s == 17] == [32, 40, 48, 56, 64]  # past 32 trees, every 8th count
    assert all(s != 65 for s, _ in got)  # the largest budget's graphs are vLLM's own
    # Bounded by the largest capture size and by the sequences; the tree size is the builder's, not budget + 1.
    assert graphs(((1, 64), (8, 32)), max_tokens=10 * 33) == [(33, n) for n in range(8, 11)]
    assert graphs(((1, 64), (2, 32)), max_num_seqs=3, size=lambda budget: 29) == [(29, 2), (29, 3)]
    # A budget that comes back later in the schedule, and no schedule at all.
    assert graphs(((1, 32), (4, 64), (8, 32)), max_num_seqs=9) == [(33, 1), (33, 2), (33, 3), (33, 8), (33, 9)]
    assert schedule_tree_graphs(DDTreeConfig(budget=64, draft_len=15, top_k=8), lambda b: b + 1, 64, 8192) == []


def test_vllm_default_capture_sizes_match_vllms_own_list():
    assert vllm_default_capture_sizes(512) == [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    assert vllm_default_capture_sizes(6) == [1, 2, 4]


@pytest.mark.parametrize(
    "env, on", [({}, True), ({"DDTREE_COMMIT_GRAPHS": "1"}, True), ({"DDTREE_COMMIT_GRAPHS": " 0"}, False)]
)
def test_commit_graphs_are_on_unless_turned_off(env, on):
    assert commit_graphs_enabled(env) is on


@pytest.mark.parametrize("value", ["yes", "true", "", "2"])
def test_commit_graphs_setting_refuses_other_values(value):
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_COMMIT_GRAPHS must be 1 .* or 0 .*got '"):
        commit_graphs_enabled({"DDTREE_COMMIT_GRAPHS": value})


@pytest.mark.parametrize(
    "env, on", [({}, True), ({"DDTREE_PRECAPTURE": "1"}, True), ({"DDTREE_PRECAPTURE": "0"}, False)]
)
def test_start_up_captures_of_the_step_graphs_are_on_unless_turned_off(env, on):
    assert precapture_enabled(env) is on
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_PRECAPTURE must be 1 \(step graphs captured at start-up"):
        precapture_enabled({"DDTREE_PRECAPTURE": "yes"})


def test_precapture_all_also_captures_the_commits_graphs_and_other_values_are_refused():
    assert precapture_commits({}) is False and precapture_commits({"DDTREE_PRECAPTURE": "1"}) is False
    assert precapture_commits({"DDTREE_PRECAPTURE": "all"}) is True
    assert precapture_enabled({"DDTREE_PRECAPTURE": "all"}) is True
    with pytest.raises(DDTreeConfigError, match=r"must be 1 .*, 0 .* or all .*got 'some'"):
        precapture_commits({"DDTREE_PRECAPTURE": "some"})


def test_the_drafters_top_k_graphs_are_off_unless_switched_on_and_refused_under_tensor_parallelism():
    assert topk_graphs_enabled({}) is False
    assert topk_graphs_enabled({"DDTREE_TOPK_GRAPHS": "1"}) is True
    assert topk_graphs_enabled({"DDTREE_TOPK_GRAPHS": "0"}, tensor_parallel_size=2) is False
    with pytest.raises(
        DDTreeConfigError, match=r"DDTREE_TOPK_GRAPHS=1 runs with one GPU only \(tensor_parallel_size=2"
    ):
        topk_graphs_enabled({"DDTREE_TOPK_GRAPHS": "1"}, tensor_parallel_size=2)
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_TOPK_GRAPHS must be 0 .* or 1 .*got 'on'"):
        topk_graphs_enabled({"DDTREE_TOPK_GRAPHS": "on"})


@pytest.mark.parametrize(
    "env, on", [({}, True), ({"DDTREE_COMMIT_IN_PLACE": "1"}, True), ({"DDTREE_COMMIT_IN_PLACE": "0"}, False)]
)
def test_commits_reading_the_walks_paths_in_place_are_on_unless_turned_off(env, on):
    assert commit_in_place_enabled(env) is on
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_COMMIT_IN_PLACE must be 1 .* or 0 .*got 'on'"):
        commit_in_place_enabled({"DDTREE_COMMIT_IN_PLACE": "on"})


@pytest.mark.parametrize(
    "env, on",
    [({}, True), ({"DDTREE_WHOLE_TREE_GDN_METADATA": "1"}, True), ({"DDTREE_WHOLE_TREE_GDN_METADATA": "0 "}, False)],
)
def test_whole_tree_gdn_metadata_is_on_unless_turned_off(env, on):
    assert whole_tree_gdn_metadata_enabled(env) is on


def test_whole_tree_gdn_metadata_setting_refuses_other_values():
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_WHOLE_TREE_GDN_METADATA must be 1 .* or 0 .*got 'on'"):
        whole_tree_gdn_metadata_enabled({"DDTREE_WHOLE_TREE_GDN_METADATA": "on"})


@pytest.mark.parametrize("switch", [device_accept_enabled, late_trees_enabled])
@pytest.mark.parametrize(
    "value, tp, on", [(None, 1, True), (None, 2, False), ("1", 2, True), ("0", 1, False), ("1", 1, True)]
)
def test_the_device_walk_and_late_trees_are_on_with_one_gpu_unless_turned_off(switch, value, tp, on):
    """Measured on one GPU (gpu-h200-late-trees-33fbda4), not yet under tensor parallelism: there only on request."""
    name = {device_accept_enabled: "DDTREE_DEVICE_ACCEPT", late_trees_enabled: "DDTREE_LATE_TREES"}[switch]
    env = {} if value is None else {name: value}
    assert switch(env, tensor_parallel_size=tp) is on


def test_device_walk_and_late_tree_settings_refuse_other_values():
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_DEVICE_ACCEPT must be 1 .* or 0 .*got 'yes'"):
        device_accept_enabled({"DDTREE_DEVICE_ACCEPT": "yes"})
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_LATE_TREES must be 0 .*the default.* or 1 .*got 'on'"):
        late_trees_enabled({"DDTREE_LATE_TREES": "on"}, tensor_parallel_size=2)


def test_a_budget_schedule_by_batch_size():
    spec, cfg = parse_spec_config(dict(BASE, ddtree_budget={"1": 64, "8": 32, "32": 16}))
    assert spec["num_speculative_tokens"] == 64 and cfg.budget == 64  # the largest sizes vLLM's draft slots
    assert cfg.budget_schedule == ((1, 64), (8, 32), (32, 16)) and cfg.budgets == (16, 32, 64)
    assert [cfg.budget_for(n) for n in (1, 7, 8, 31, 32, 500)] == [64, 64, 32, 32, 16, 16]
    assert DDTreeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # through additional_config
    # One budget at every size is no schedule.
    assert parse_spec_config(dict(BASE, ddtree_budget={"1": 64, "4": 64}))[1].budget_schedule is None
    assert parse_spec_config(BASE)[1].budget_for(100) == 64


@pytest.mark.parametrize(
    "budget, match",
    [
        ({}, "at least one entry"),
        ({"8": 32}, r"must start at batch size 1 \(got batch sizes \[8\]\)"),
        ({"1": 64, "x": 32}, r"ddtree_budget's batch size 'x' must be a positive integer"),
        ({"1": 64, "0": 32}, r"batch size '0' must be a positive integer"),
        ({"1": 64, "8": 0}, r"ddtree_budget\['8'\] must be a positive integer"),
        ({"1": 64, "8": 2048}, r"ddtree_budget\['8'\] must be at most 1024"),
        ({"1": 64, "8": 8}, r"ddtree_budget=8 is smaller than the drafter's depth num_speculative_tokens=15"),
    ],
)
def test_budget_schedules_that_cannot_serve_are_refused(budget, match):
    with pytest.raises(DDTreeConfigError, match=match):
        parse_spec_config(dict(BASE, ddtree_budget=budget))


def test_a_schedules_smallest_budget_must_hold_the_drafters_depth():
    _, cfg = parse_spec_config(dict(BASE, ddtree_budget={"1": 64, "16": 12}, num_speculative_tokens=None))
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget=12 is smaller than the drafter's depth 15"):
        resolve_draft_len(cfg, 16)
    assert resolve_draft_len(cfg, 13).draft_len == 12


def test_the_start_up_line_states_a_schedule():
    assert budget_description(parse_spec_config(BASE)[1]) == "64"
    text = budget_description(parse_spec_config(dict(BASE, ddtree_budget={"1": 64, "8": 16}))[1])
    assert text == "64 from 1, 16 from 8 requests"


def test_the_docs_list_every_switch_with_its_default():
    """docs/vllm-adapter.md's table of environment switches names each DDTREE_* switch of config.py, with the default
    the code applies."""
    import re
    from pathlib import Path

    from ddtree.vllm import config

    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm-adapter.md").read_text()
    table = dict(re.findall(r"^\| `(DDTREE_[A-Z_]+)` \| ([^|]+) \|", text, flags=re.M))
    switches = {v for k, v in vars(config).items() if k.endswith("_ENV") and v.startswith("DDTREE_")}
    assert set(table) == switches
    defaults = {
        "DDTREE_DEVICE_ACCEPT": (config.device_accept_enabled({}, 1), config.device_accept_enabled({}, 2)),
        "DDTREE_LATE_TREES": (config.late_trees_enabled({}, 1), config.late_trees_enabled({}, 2)),
        "DDTREE_ASYNC_SCHEDULING": (config.async_scheduling_enabled({}, 1), config.async_scheduling_enabled({}, 2)),
        "DDTREE_COMMIT_GRAPHS": (config.commit_graphs_enabled({}),) * 2,
        "DDTREE_STEP_GRAPHS": (config.step_graphs_enabled({}),) * 2,
        "DDTREE_LAUNCH_AHEAD": (config.launch_ahead_enabled({}),) * 2,
        "DDTREE_WHOLE_TREE_GDN_METADATA": (config.whole_tree_gdn_metadata_enabled({}),) * 2,
        "DDTREE_STRUCTURED_OUTPUTS": (config.structured_outputs_enabled({}),) * 2,
        "DDTREE_HYBRID_PREFIX_CACHING": (config.hybrid_prefix_caching_enabled({}),) * 2,
        "DDTREE_DEVICE_PLAN_SUBSETS": (config.device_plan_subsets_enabled({}),) * 2,
        "DDTREE_MIXED_WALK_GRAPHS": (config.mixed_walk_graphs_enabled({}),) * 2,
    }
    for name, (one_gpu, tensor_parallel) in defaults.items():
        doc = table[name].strip()
        if one_gpu == tensor_parallel:
            assert doc == str(int(one_gpu)), name
        else:
            assert doc == f"{int(one_gpu)} with one GPU, {int(tensor_parallel)} under tensor parallelism", name


def test_a_budget_schedule_as_vllms_dynamic_speculation_schedule():
    from ddtree.vllm.config import dynamic_sd_schedule

    cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8, budget_schedule=((1, 64), (8, 32), (32, 16)))
    assert dynamic_sd_schedule(cfg, 64) == [(1, 7, 64), (8, 31, 32), (32, 64, 16)]
    assert dynamic_sd_schedule(cfg, 10) == [(1, 7, 64), (8, 10, 32)]  # entries past max_num_seqs dropped
    assert dynamic_sd_schedule(DDTreeConfig(budget=64, draft_len=15, top_k=8), 4) == [(1, 4, 64)]


def test_an_auto_budget_with_its_candidates():
    spec, cfg = parse_spec_config(dict(BASE, ddtree_budget="auto"))
    assert cfg.auto and cfg.budget == 63 and spec["num_speculative_tokens"] == 63  # the default largest candidate
    assert cfg.budgets == (15, 31, 63) and cfg.varies_by_batch_size and cfg.budget_schedule is None
    assert budget_description(cfg) == "auto (candidates 15, 31, 63)"
    _, cfg = parse_spec_config(dict(BASE, ddtree_budget="auto", ddtree_max_budget=256))
    assert cfg.budgets == (15, 31, 63, 127, 255, 256) and cfg.budget == 256
    assert DDTreeConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # through additional_config
    # The depth known only from the drafter: the candidates follow it.
    _, cfg = parse_spec_config(dict(BASE, ddtree_budget="auto", num_speculative_tokens=None))
    assert cfg.budgets == (7, 15, 31, 63) and resolve_draft_len(cfg, 16).budgets == (15, 31, 63)
    with pytest.raises(DDTreeConfigError, match=r"ddtree_max_budget=63 is smaller than the drafter's depth 99"):
        resolve_draft_len(cfg, 100)
    assert not parse_spec_config(BASE)[1].varies_by_batch_size


def test_budgets_that_open_a_kernel_block_for_one_row_get_a_hint():
    assert lone_row_budgets(parse_spec_config(BASE)[1]) == (64,)
    assert lone_row_budgets(parse_spec_config(dict(BASE, ddtree_budget={"1": 256, "8": 63, "32": 16}))[1]) == (16, 256)
    for quiet in (63, 100, 15, {"1": 255, "8": 31}, "auto"):
        cfg = parse_spec_config(dict(BASE, ddtree_budget=quiet))[1]
        assert lone_row_budgets(cfg) == () and lone_row_advice(cfg) is None
    advice = lone_row_advice(parse_spec_config(BASE)[1])
    assert "budget(s) 64 verify one token past a multiple of 16" in advice and "63 for 64" in advice


def test_a_fixed_budget_on_a_large_target_served_to_many_requests_gets_a_hint():
    """At the Qwen3.6-27B shape (hidden size 5120) budget 64 costs 2.47x the chain's step at batch 8: a fixed budget
    whose steps would be bound by the target's arithmetic is pointed at a schedule (or ``auto``)."""
    cfg = parse_spec_config(dict(BASE, ddtree_budget=63))[1]
    advice = large_batch_advice(cfg, max_num_seqs=256, hidden_size=5120)
    assert "a fixed budget of 63 verifies up to 256 x 64 = 16384 tokens a step" in advice
    assert 'a schedule such as {"1": 63, "8": 15}, or "auto"' in advice
    wide = parse_spec_config(dict(BASE, ddtree_budget=127))[1]  # 4 x 128 tokens: from 4 requests on
    assert 'a schedule such as {"1": 127, "4": 15}' in large_batch_advice(wide, max_num_seqs=4, hidden_size=5120)
    deep = parse_spec_config(dict(BASE, ddtree_budget=63, num_speculative_tokens=31))[1]
    assert '"8": 31}' in large_batch_advice(deep, max_num_seqs=256, hidden_size=5120)  # (no budget below the depth)
    assert large_batch_advice(cfg, max_num_seqs=256, hidden_size=256) is None  # the test pair: host-bound steps
    assert large_batch_advice(cfg, max_num_seqs=7, hidden_size=5120) is None  # 7 x 64 < 512 tokens a step
    for chosen in ({"1": 63, "8": 15}, "auto", 15):  # a schedule, auto, or no larger than the advised budget
        assert large_batch_advice(parse_spec_config(dict(BASE, ddtree_budget=chosen))[1], 256, 5120) is None
    shallow = parse_spec_config(dict(BASE, ddtree_budget=7, num_speculative_tokens=7))[1]
    assert large_batch_advice(shallow, 256, 5120) is None  # (a schedule to 15 would raise it)
    huge = parse_spec_config(dict(BASE, ddtree_budget=511))[1]
    assert large_batch_advice(huge, max_num_seqs=1, hidden_size=5120) is None  # one request: no batch to schedule


@pytest.mark.parametrize(
    "change, match",
    [
        ({"ddtree_budget": "fast"}, r"ddtree_budget must be a positive integer, a schedule .* or \"auto\"; got 'fast'"),
        ({"ddtree_max_budget": 128}, r"ddtree_max_budget goes with ddtree_budget \"auto\" \(got ddtree_budget=64\)"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 8}, r"ddtree_max_budget=8 is smaller than the drafter's depth"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 4096}, r"ddtree_max_budget must be at most 1024"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": "big"}, r"ddtree_max_budget must be a positive integer"),
    ],
)
def test_auto_budgets_that_cannot_serve_are_refused(change, match):
    with pytest.raises(DDTreeConfigError, match=match):
        parse_spec_config(dict(BASE, **change))


def test_auto_runs_with_one_gpu_only():
    _, cfg = parse_spec_config(dict(BASE, ddtree_budget="auto"))
    with pytest.raises(DDTreeConfigError, match=r"\"auto\" runs with one GPU only \(tensor_parallel_size=2\)"):
        engine_overrides(_args(tensor_parallel_size=2), environ={}, cfg=cfg)
    assert "async_scheduling" in engine_overrides(_args(), environ={}, cfg=cfg)


def test_auto_captures_every_candidate_at_every_batch_size_and_starts_at_the_largest():
    from ddtree.vllm.config import dynamic_sd_schedule, graphed_tree_counts

    cfg = DDTreeConfig(budget=63, draft_len=15, top_k=8, auto=True)
    graphs = schedule_tree_graphs(cfg, lambda budget: budget + 1, 40, 1024)
    assert {size for size, _ in graphs} == {16, 32}  # the largest's graphs are vLLM's own
    assert sorted(n for size, n in graphs if size == 16) == [1, 2, 3] + list(range(4, 33)) + [40]
    assert sorted(n for size, n in graphs if size == 32) == [n for n in graphed_tree_counts(40) if n * 32 <= 1024]
    assert dynamic_sd_schedule(cfg, 40) == [(1, 40, 63)]  # vLLM's scheduler starts from the largest everywhere


def test_prefix_caching_follows_vllm_unless_switched_off_or_beside_a_kv_connector():
    """Unset, prefix caching is left to vLLM's default (on for attention-only targets, off for hybrids) and a user's
    choice is kept; DDTREE_PREFIX_CACHING=0 turns it off and refuses an explicit True, naming the switch; beside a KV
    connector an unset value is turned off (check_target would refuse the pair at start-up)."""
    assert "enable_prefix_caching" not in engine_overrides(_args(), environ={})
    assert "enable_prefix_caching" not in engine_overrides(_args(enable_prefix_caching=True), environ={})
    assert "enable_prefix_caching" not in engine_overrides(_args(enable_prefix_caching=False), environ={})
    off = {"DDTREE_PREFIX_CACHING": "0"}
    assert engine_overrides(_args(), environ=off)["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in engine_overrides(_args(enable_prefix_caching=False), environ=off)
    with pytest.raises(DDTreeConfigError, match=r"turned off by DDTREE_PREFIX_CACHING=0, got enable_prefix_caching"):
        engine_overrides(_args(enable_prefix_caching=True), environ=off)
    connector = SimpleNamespace(kv_connector="SomeConnector")
    assert engine_overrides(_args(kv_transfer_config=connector), environ={})["enable_prefix_caching"] is False
    kept = engine_overrides(_args(kv_transfer_config=connector, enable_prefix_caching=True), environ={})
    assert "enable_prefix_caching" not in kept  # asked for by hand: refused at start-up, by check_target
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_PREFIX_CACHING must be 1 .* or 0 .*got 'yes'"):
        engine_overrides(_args(), environ={"DDTREE_PREFIX_CACHING": "yes"})


def test_prefix_caching_is_refused_for_hybrid_targets_and_beside_a_kv_connector():
    cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8)
    target = dict(uses_mrope=False, sliding_window=None, kv_cache_dtype="auto", vocab_size=1000, cfg=cfg)
    check_target(is_hybrid=False, prefix_caching=True, **target)  # attention-only: accepted
    check_target(is_hybrid=True, architecture="Qwen3NextForCausalLM", prefix_caching=False, **target)
    hybrid = dict(is_hybrid=True, architecture="Qwen3NextForCausalLM", prefix_caching=True, **target)
    with pytest.raises(DDTreeConfigError, match="DDTREE_HYBRID_PREFIX_CACHING=1 .*enable_prefix_caching=False"):
        check_target(mamba_cache_mode="align", **hybrid)
    # Under the switch: vLLM's "align" is served (boundary commits), its "all" is not.
    check_target(mamba_cache_mode="align", hybrid_prefix_caching=True, **hybrid)
    with pytest.raises(DDTreeConfigError, match=r"mamba_cache_mode 'none' or 'align' .*got 'all'"):
        check_target(mamba_cache_mode="all", hybrid_prefix_caching=True, **hybrid)
    with pytest.raises(DDTreeConfigError, match="with prefix caching refuses a KV connector"):
        check_target(is_hybrid=False, prefix_caching=True, kv_connector=True, **target)
    check_target(is_hybrid=False, prefix_caching=False, kv_connector=True, **target)  # no caching: no conflict
