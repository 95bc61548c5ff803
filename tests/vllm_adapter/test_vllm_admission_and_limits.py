"""Admission of requests and vLLM's config creation for ddtree engines (what `vllm serve` validates before loading)."""

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")

from ddtree.vllm import patches  # noqa: E402
from ddtree.vllm.config import DDTreeConfigError  # noqa: E402


def test_admission_refuses_unservable_requests():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    holder = type("Holder", (), {"_validate_params": lambda self, p, *a, **k: None})
    patches._wrap_validate_params(holder)  # the wrapper vLLM's InputProcessor gets, around a stub
    h = holder()
    h.vllm_config = SimpleNamespace(
        additional_config={"ddtree": {"budget": 8}}, parallel_config=SimpleNamespace(world_size=1)
    )
    h._validate_params(SamplingParams(temperature=0.5, top_p=0.9, seed=1))
    json_only = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="structured outputs") as refused:  # a 400, no traceback
        h._validate_params(json_only)
    assert refused.value.parameter == "structured_outputs"
    h._validate_params(SamplingParams(logprobs=2, repetition_penalty=1.2, bad_words=["x"]))  # served
    h.vllm_config = SimpleNamespace(additional_config={})
    h._validate_params(json_only)  # not a ddtree engine: untouched


def test_admission_returns_what_vllms_validation_returns():
    """vLLM 0.33's ``_validate_params`` returns a flag its caller asserts on: the wrapper hands it back, for ddtree
    engines as for the others."""
    from vllm.sampling_params import SamplingParams

    holder = type("Holder", (), {"_validate_params": lambda self, p, *a, **k: ("checked", p.temperature)})
    patches._wrap_validate_params(holder)
    h = holder()
    for extra in ({"ddtree": {"budget": 8}}, {}):
        h.vllm_config = SimpleNamespace(additional_config=extra)
        assert h._validate_params(SamplingParams(temperature=0.5)) == ("checked", 0.5)


def test_admission_through_vllms_own_checks_serves_min_p_and_logit_bias_only_for_ddtree():
    """vLLM's own ``SamplingParams.verify`` refuses min_p and logit_bias under any speculative config; a
    ddtree engine serves them (per-node sampling), a dflash engine still refuses them."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    patches.apply()
    model_config = SimpleNamespace(
        max_logprobs=20,
        get_vocab_size=lambda: 100,
        logits_processors=None,
        is_diffusion=False,
        return_sampling_mask=False,  # (read by vLLM 0.33)
    )

    def processor(additional_config):
        p = object.__new__(InputProcessor)  # vLLM's checks only read these attributes
        p.__dict__.update(
            model_config=model_config,
            validate_logits_processors_params=lambda params: None,  # (vLLM 0.33's, set in its __init__)
            speculative_config=SimpleNamespace(method="dflash"),
            structured_outputs_config=None,
            renderer=SimpleNamespace(tokenizer=None),
            vllm_config=SimpleNamespace(
                additional_config=additional_config,
                reasoning_config=None,
                _check_supports_watermarking=lambda params: False,  # (vLLM 0.33's)
            ),
        )
        return p

    from vllm.exceptions import VLLMValidationError

    refused = (ValueError, VLLMValidationError)  # (vLLM 0.25 raises ValueError; 0.33 VLLMValidationError, not one)
    ddtree_engine, dflash_engine = processor({"ddtree": {"budget": 8}}), processor({})
    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 5.0})):
        ddtree_engine._validate_params(params, ("generate",))
        with pytest.raises(refused, match="min_p and logit_bias"):
            dflash_engine._validate_params(params, ("generate",))
    with pytest.raises(refused, match="out of vocabulary|out-of-vocab|vocab"):
        ddtree_engine._validate_params(SamplingParams(logit_bias={1000: 5.0}), ("generate",))  # vLLM's check kept


PAIR = "tests/fixtures/models"


def _pair_args(budget, **kw):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=f"{PAIR}/target",
        language_model_only=True,
        additional_config={"gdn_prefill_backend": "triton"},
        speculative_config={"method": "ddtree", "model": f"{PAIR}/drafter", "ddtree_budget": budget},
        **kw,
    )


def _drafting_reserve(config, depth: int) -> int:
    """vLLM's own drafting slots a request for a DFlash chain of ``depth`` drafts."""
    spec = config.speculative_config
    budget, spec.num_speculative_tokens = spec.num_speculative_tokens, depth
    try:
        return int(spec.max_num_new_slots_for_drafting)
    finally:
        spec.num_speculative_tokens = budget


@pytest.mark.parametrize("usage", ["OPENAI_API_SERVER", "LLM_CLASS"])
@pytest.mark.parametrize("budget", [16, 64, 256, 1024])
def test_vllms_own_config_validation_passes_with_its_defaults(h200_platform, usage, budget):
    """What `vllm serve` runs in its API-server process before loading anything (issue: the README's command
    died there with `max_num_scheduled_tokens is set to -6144`): vLLM's defaults, every budget."""
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    config = _pair_args(budget).create_engine_config(UsageContext[usage])
    scheduler, compilation = config.scheduler_config, config.compilation_config
    depth = config.additional_config["ddtree"]["draft_len"]
    assert config.speculative_config.num_speculative_tokens == budget  # vLLM's view: the budget
    # Every running request can verify its whole tree in one step.
    assert scheduler.max_num_scheduled_tokens >= scheduler.max_num_seqs * (budget + 1)
    # ... with what vLLM keeps for the drafter at its depth (vLLM 0.25: depth - 1 slots; 0.33: none, its DFlash
    # drafts in a pass of its own).
    assert scheduler.max_num_batched_tokens >= scheduler.max_num_seqs * (budget + 1 + _drafting_reserve(config, depth))
    assert compilation.cudagraph_mode.name == "FULL_AND_PIECEWISE" and not config.model_config.enforce_eager
    sizes = compilation.cudagraph_capture_sizes
    trees = min(scheduler.max_num_seqs, 32)
    assert all(
        k * (budget + 1) in sizes for k in range(1, trees + 1) if k * (budget + 1) <= scheduler.max_num_batched_tokens
    )
    assert compilation.max_cudagraph_capture_size == sizes[-1] <= scheduler.max_num_batched_tokens


def test_user_limits_that_hold_no_tree_are_refused_before_loading(h200_platform):
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    reserve = _drafting_reserve(_pair_args(64).create_engine_config(UsageContext.OPENAI_API_SERVER), 15)
    crowded = _pair_args(64, max_num_seqs=1024, max_num_batched_tokens=8192)
    if reserve:  # vLLM 0.25 keeps 14 slots a sequence for the drafter: 8192 tokens hold no tree beside 1024 of them
        assert reserve == 14
        with pytest.raises(DDTreeConfigError, match="--max-num-batched-tokens >= 80896 or --max-num-seqs <= 103"):
            crowded.create_engine_config(UsageContext.OPENAI_API_SERVER)
    else:  # vLLM 0.33 keeps none (its DFlash drafts in a pass of its own): served, crowded steps cut their trees
        config = crowded.create_engine_config(UsageContext.OPENAI_API_SERVER)
        assert (config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens) == (1024, 8192)
    # The user's sequences are kept, the default tokens grow to hold their trees.
    config = _pair_args(64, max_num_seqs=300).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert config.scheduler_config.max_num_seqs == 300
    assert config.scheduler_config.max_num_batched_tokens == 300 * (64 + 1 + reserve)
    # User-chosen capture sizes are left alone; eager mode captures nothing.
    config = _pair_args(64, compilation_config={"cudagraph_capture_sizes": [1, 2, 65]}).create_engine_config(
        UsageContext.LLM_CLASS
    )
    assert config.compilation_config.cudagraph_capture_sizes == [1, 2, 65]
    config = _pair_args(64, enforce_eager=True).create_engine_config(UsageContext.LLM_CLASS)
    assert config.compilation_config.cudagraph_mode.name == "NONE"


def test_a_refused_request_is_a_400_without_a_server_traceback(caplog):
    """vLLM's API server registers its handlers as below (``api_server.build_app``): a VLLMValidationError is
    answered with a 400 by Starlette's exception middleware; a plain ValueError falls through to the
    catch-all, which answers but re-raises, and the ASGI server logs 'Exception in ASGI application'."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    try:
        from vllm.entrypoints.serve.utils.server_utils import exception_handler
    except ImportError:  # vLLM 0.33
        from vllm.entrypoints.serve.exception_handling.handlers.exception import exception_handler
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    holder = type("Holder", (), {"_validate_params": lambda self, p, *a, **k: None})
    patches._wrap_validate_params(holder)
    admission = holder()
    admission.vllm_config = SimpleNamespace(
        additional_config={"ddtree": {"budget": 8}}, parallel_config=SimpleNamespace(world_size=1)
    )
    app = FastAPI()
    app.state.args = SimpleNamespace(log_error_stack=False)
    app.exception_handler(VLLMValidationError)(exception_handler)
    app.exception_handler(Exception)(exception_handler)

    @app.post("/v1/completions")
    def completions():
        admission._validate_params(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))

    response = TestClient(app, raise_server_exceptions=True).post("/v1/completions")  # raises if re-raised
    assert response.status_code == 400
    body = response.json()["error"]
    assert "structured outputs" in body["message"] and body.get("param") in ("structured_outputs", None)


def test_a_budget_schedule_passes_vllms_own_config_validation(h200_platform):
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    config = _pair_args({"1": 64, "8": 16}).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert config.speculative_config.num_speculative_tokens == 64  # the largest budget sizes vLLM's draft slots
    assert [tuple(e) for e in config.additional_config["ddtree"]["budget_schedule"]] == [(1, 64), (8, 16)]


def sliding_pair_drafter(tmp_path, use_sliding_window):
    """The pair's drafter with the released Qwen3.6-27B drafter's layer kinds (every layer but the last
    ``sliding_attention``, window 2048), ``use_sliding_window`` set as given (None: left out), under ``tmp_path``."""
    import json
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(f"{PAIR}/drafter", drafter)
    config = json.loads((drafter / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], sliding_window=2048)
    if use_sliding_window is not None:
        config["use_sliding_window"] = use_sliding_window
    (drafter / "config.json").write_text(json.dumps(config))
    return drafter


@pytest.mark.parametrize("switch", [True, None])
def test_a_drafter_with_sliding_window_layers_is_refused_before_loading(h200_platform, tmp_path, switch):
    """The released Qwen3.6-27B drafter's layer_types: four sliding-window layers and one full one; refused with
    ``use_sliding_window: true`` and without it (transformers then loads the switch off, and vLLM's drafter, which
    reads layer_types alone, would refuse it only after the target had loaded)."""
    from vllm.usage.usage_lib import UsageContext

    drafter = sliding_pair_drafter(tmp_path, switch)
    patches.apply()
    args = _pair_args(64)
    args.speculative_config = dict(args.speculative_config, model=str(drafter))
    with pytest.raises(DDTreeConfigError, match=r"sliding-window attention layers \(\[0"):
        args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def test_a_ddtree_setting_with_a_value_it_does_not_take_is_refused_before_loading(h200_platform, monkeypatch):
    """Every DDTREE_* setting is read where `vllm serve` configures the engine: a bad value stops it there, naming
    the setting and what it takes, not in the engine's worker after the model loaded; a misspelt name is warned."""
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    monkeypatch.setenv("DDTREE_DEVICE_PLAN", "yes")
    with pytest.raises(DDTreeConfigError, match=r"DDTREE_DEVICE_PLAN must be one of auto .*got 'yes'"):
        _pair_args(64).create_engine_config(UsageContext.OPENAI_API_SERVER)
    monkeypatch.delenv("DDTREE_DEVICE_PLAN")
    warned = []
    monkeypatch.setattr(
        patches, "_log", lambda: SimpleNamespace(warning=lambda f, *a: warned.append(f % a), info=print)
    )
    monkeypatch.setenv("DDTREE_WALK_GRAPHS", "0")  # (the step graphs' old name)
    _pair_args(64).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert warned == [
        "DDTree: DDTREE_WALK_GRAPHS is not a ddtree setting and changes nothing (did you mean DDTREE_STEP_GRAPHS?)"
    ]


def test_hybrid_prefix_caching_is_served_under_its_switch_and_off_where_vllms_default_alone_turned_it_on(
    h200_platform, monkeypatch, caplog
):
    """The pair's target is a hybrid. vLLM 0.25 leaves its prefix caching off; a user's True is refused naming
    DDTREE_HYBRID_PREFIX_CACHING and served (vLLM's mamba cache mode "align") under it. A vLLM whose default turns it
    on for hybrids (0.33; modelled by that default here) gets it turned off unless the switch is on."""
    from vllm.config.model import ModelConfig
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    monkeypatch.delenv("DDTREE_HYBRID_PREFIX_CACHING", raising=False)
    config = _pair_args(64).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert config.model_config.is_hybrid and not config.cache_config.enable_prefix_caching
    with pytest.raises(DDTreeConfigError, match="DDTREE_HYBRID_PREFIX_CACHING=1"):
        _pair_args(64, enable_prefix_caching=True).create_engine_config(UsageContext.OPENAI_API_SERVER)
    monkeypatch.setenv("DDTREE_HYBRID_PREFIX_CACHING", "1")
    # Served where the boundary commits follow vLLM's state-block accounting (0.25); refused, naming the version,
    # where vLLM changed it (0.33).
    served = patches.vllm_below(patches.HYBRID_ALIGN_CHANGED_IN)
    patches.check_hybrid_prefix_caching_served("0.25.1")
    with pytest.raises(DDTreeConfigError, match="vLLM 0.33.0 changed it and is not served yet"):
        patches.check_hybrid_prefix_caching_served("0.33.0")
    import vllm

    with monkeypatch.context() as newer:
        newer.setattr(vllm, "__version__", "0.33.0")
        with pytest.raises(DDTreeConfigError, match="enable_prefix_caching=False"):
            _pair_args(64, enable_prefix_caching=True).create_engine_config(UsageContext.OPENAI_API_SERVER)
    caplog.clear()
    monkeypatch.setattr(ModelConfig, "is_prefix_caching_supported", property(lambda self: True))
    for user in (True, None):  # asked for; vLLM's default
        if not served:
            with pytest.raises(DDTreeConfigError, match="is not served yet"):
                _pair_args(64, enable_prefix_caching=user).create_engine_config(UsageContext.OPENAI_API_SERVER)
            continue
        config = _pair_args(64, enable_prefix_caching=user).create_engine_config(UsageContext.OPENAI_API_SERVER)
        assert config.cache_config.enable_prefix_caching and config.cache_config.mamba_cache_mode == "align"
        experimental = "hybrid target (DDTREE_HYBRID_PREFIX_CACHING=1) is experimental"
        assert any(experimental in r.message for r in caplog.records)
    monkeypatch.delenv("DDTREE_HYBRID_PREFIX_CACHING")
    args = _pair_args(64)
    config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert not config.cache_config.enable_prefix_caching and config.cache_config.mamba_cache_mode == "none"
    assert args.enable_prefix_caching is False
    # Made again from arguments vLLM's first creation had filled in: the config a user who turned it off gets.
    fresh = _pair_args(64, enable_prefix_caching=False).create_engine_config(UsageContext.OPENAI_API_SERVER)

    def settled(c):
        s, g = c.scheduler_config, c.compilation_config
        return (s.max_num_seqs, s.max_num_batched_tokens, s.max_num_scheduled_tokens, g.cudagraph_capture_sizes)

    assert settled(config) == settled(fresh) and config.cache_config.block_size == fresh.cache_config.block_size


def test_a_long_prefill_threshold_that_cuts_every_tree_is_refused(h200_platform):
    """vLLM cuts scheduled tokens to long_prefill_token_threshold: at or below the budget every tree would be cut,
    and a first decode vLLM padded with placeholders would be cut below its drafts (which no tree can verify); one
    above the budget is served."""
    from vllm.usage.usage_lib import UsageContext

    from ddtree.vllm.config import check_long_prefill_threshold

    patches.apply()
    with pytest.raises(DDTreeConfigError, match="got 64: set it to at least 65"):
        _pair_args(64, long_prefill_token_threshold=64).create_engine_config(UsageContext.OPENAI_API_SERVER)
    config = _pair_args(64, long_prefill_token_threshold=65).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert config.scheduler_config.long_prefill_token_threshold == 65
    check_long_prefill_threshold(0, 64)  # none: vLLM's default
