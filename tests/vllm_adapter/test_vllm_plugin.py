"""The adapter against an installed vLLM 0.25.x, without a GPU (skipped without vLLM)."""

from importlib.metadata import PackageNotFoundError, distribution, entry_points
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from ddtree.vllm import patches  # noqa: E402
from ddtree.vllm.config import DDTreeConfigError  # noqa: E402


def test_entry_point_is_registered():
    try:
        distribution("ddtree")
    except PackageNotFoundError:  # (imported from a source tree on PYTHONPATH: no metadata, no entry points)
        pytest.skip("ddtree is not installed as a distribution here")
    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("ddtree") == "ddtree.vllm.plugin:register"


def test_version_range():
    patches.check_version("0.25.1")
    patches.check_version("0.25.3+cu130")
    for bad in ("0.24.9", "0.26.0", "0.33.0"):
        with pytest.raises(patches.UnsupportedVLLMVersion, match="supports vLLM >= 0.25.0, < 0.26.0"):
            patches.check_version(bad)


def test_apply_registers_everything_idempotently():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.engine.input_processor import InputProcessor

    patches.apply()
    patches.apply()
    assert getattr(EngineArgs.create_engine_config, "__ddtree_wrapped__", False)
    assert getattr(InputProcessor._validate_params, "__ddtree_wrapped__", False)
    from ddtree.vllm.attention import DDTreeAttentionBackend

    assert AttentionBackendEnum.CUSTOM.get_class() is DDTreeAttentionBackend
    assert DDTreeAttentionBackend.get_name() == "CUSTOM"


def test_engine_args_translation(tmp_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    args = EngineArgs(
        model="/nonexistent",
        speculative_config={"method": "ddtree", "model": "/drafter", "num_speculative_tokens": 15, "ddtree_budget": 32},
    )
    cfg = patches._translate_engine_args(args)
    assert cfg.budget == 32 and cfg.draft_len == 15
    assert args.speculative_config == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 32}
    assert args.additional_config["ddtree"]["budget"] == 32
    assert args.async_scheduling is True  # one GPU: asynchronous
    assert args.enable_prefix_caching is None  # left to vLLM's default (off for hybrids, on otherwise)
    assert args.enforce_eager is False and args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert args.worker_cls == "ddtree.vllm.worker.DDTreeWorker"
    assert str(getattr(args.attention_backend, "name", args.attention_backend)) == "CUSTOM"
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "0"  # (vLLM turns them on by itself where it is unset)
    plain = EngineArgs(
        model="/nonexistent", speculative_config={"method": "dflash", "model": "/d", "num_speculative_tokens": 3}
    )
    assert patches._translate_engine_args(plain) is None
    bad = EngineArgs(  # asynchronous scheduling has not run under tensor parallelism: asked for, it is refused
        model="/nonexistent",
        async_scheduling=True,
        tensor_parallel_size=2,
        speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32},
    )
    with pytest.raises(DDTreeConfigError, match="async_scheduling=True"):
        patches._translate_engine_args(bad)
    full = EngineArgs(
        model="/nonexistent",
        compilation_config={"cudagraph_mode": "FULL"},
        speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32},
    )
    with pytest.raises(DDTreeConfigError, match="FULL_AND_PIECEWISE"):
        patches._translate_engine_args(full)
    piecewise = EngineArgs(
        model="/nonexistent",
        compilation_config={"cudagraph_mode": "PIECEWISE"},
        speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32},
    )
    patches._translate_engine_args(piecewise)
    assert piecewise.compilation_config.cudagraph_mode.name == "PIECEWISE"
    eager = EngineArgs(
        model="/nonexistent",
        enforce_eager=True,
        speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32},
    )
    patches._translate_engine_args(eager)
    assert eager.enforce_eager is True and eager.compilation_config.cudagraph_mode is None


def test_vllms_speculative_shorthands_name_a_ddtree_engine_too(monkeypatch):
    """vLLM 0.33's ``--spec-method ddtree --spec-model D --spec-tokens L`` (merged by vLLM after ddtree's translation
    would have run) are merged first, so the engine is translated as with ``--speculative-config``; a key given both
    ways is refused as vLLM refuses it; another method's shorthands are left to vLLM."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)

    def args(spec, **shorthands):
        made = EngineArgs(model="/nonexistent", speculative_config=spec)
        for name, value in shorthands.items():  # (fields of 0.33's EngineArgs; set by hand where vLLM lacks them)
            setattr(made, name, value)
        return made

    short = args({"ddtree_budget": 32}, spec_method="ddtree", spec_model="/drafter", spec_tokens=15)
    cfg = patches._translate_engine_args(short)
    assert cfg.budget == 32 and cfg.draft_len == 15
    assert short.speculative_config == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 32}
    assert (short.spec_method, short.spec_model, short.spec_tokens) == (None, None, None)
    mixed = args({"method": "ddtree", "model": "/d", "ddtree_budget": 32}, spec_model="/other")
    with pytest.raises(DDTreeConfigError, match=r"--spec-model and --speculative-config\['model'\]"):
        patches._translate_engine_args(mixed)
    chain = args(None, spec_method="dflash", spec_model="/d", spec_tokens=7)
    assert patches._translate_engine_args(chain) is None
    assert chain.speculative_config is None and chain.spec_method == "dflash"  # vLLM merges its own


def test_vllm_layout_assumptions():
    """Signatures and layouts the adapter depends on (catches silent drift within 0.25.x)."""
    import inspect

    import dataclasses

    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # (The K/V cache layout: test_attention_backend, on this vLLM's own shape.)
    # The host-side int the split-KV heuristic takes (no device sync) once the backend enables it.
    max_seq_len = {f.name: f for f in dataclasses.fields(TritonAttentionMetadata)}["max_seq_len"]
    assert max_seq_len.type in (int, "int")
    params = list(inspect.signature(SpecDecodeBaseProposer.propose).parameters)
    assert params[:8] == [
        "self",
        "num_speculative_tokens",
        "target_token_ids",
        "target_positions",
        "target_hidden_states",
        "next_token_ids",
        "token_indices_to_sample",
        "common_attn_metadata",
    ]
    assert "num_rejected_tokens_gpu" in params
    assert list(inspect.signature(SpecDecodeBaseProposer._sample_draft_tokens).parameters) == [
        "self",
        "hidden_states",
        "sampling_metadata",
    ]
    for name in (
        "_prepare_inputs",
        "_sample",
        "_update_states",
        "take_draft_token_ids",
        "sample_tokens",
        "propose_draft_token_ids",
        "execute_model",
    ):
        assert hasattr(GPUModelRunner, name), name
    assert list(inspect.signature(GPUModelRunner._prepare_inputs).parameters) == [
        "self",
        "scheduler_output",
        "num_scheduled_tokens",
    ]
    assert list(inspect.signature(GPUModelRunner._sample).parameters) == ["self", "logits", "spec_decode_metadata"]
    assert issubclass(DFlashProposer, SpecDecodeBaseProposer)
    src = inspect.getsource(GPUModelRunner._prepare_inputs)
    # Slot mapping is computed from the flat positions before we overwrite them with tree depths.
    assert src.index("compute_slot_mapping") < src.index("_prepare_input_ids")
    # The worker builds its runner where DDTreeWorker makes it build ddtree's: a factory method (0.33), or an import
    # inside init_device that patch 4 swaps (0.25).
    worker = __import__("vllm.v1.worker.gpu_worker", fromlist=["Worker"]).Worker
    factory = getattr(worker, "_make_model_runner", None)
    runner_src = inspect.getsource(factory if factory is not None else worker.init_device)
    assert "from vllm.v1.worker.gpu_model_runner import" in runner_src
    if factory is not None:  # ... and the worker's own start-up calls the factory
        assert "self._make_model_runner()" in inspect.getsource(worker)


def test_modules_import():
    import ddtree.vllm.attention  # noqa: F401
    import ddtree.vllm.proposer  # noqa: F401
    import ddtree.vllm.runner  # noqa: F401
    import ddtree.vllm.sampler  # noqa: F401
    import ddtree.vllm.worker  # noqa: F401


def test_hybrid_gdn_engines_get_one_state_slot_per_request():
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.platforms.interface import Platform
    from vllm.v1.kv_cache_interface import MambaSpec

    patches.apply()
    for wrapped in (
        MambaBase.get_kv_cache_spec,
        GatedDeltaNetAttention.__init__,
        Platform._align_hybrid_block_size,
        MambaStateShapeCalculator.gated_delta_net_state_shape,
    ):
        assert getattr(wrapped, "__ddtree_wrapped__", False)

    # 5c: the page-size alignment of a ddtree engine sizes the conv state without the budget's columns.
    args = (1, 2, 4, 16, 16, 4, 64)  # tp, Hk, Hv, Dk, Dv, conv width, num_spec
    conv_chain, _ = MambaStateShapeCalculator.gated_delta_net_state_shape(*args)
    token = patches._SINGLE_SLOT_SHAPES.set(True)
    try:
        conv_tree, _ = MambaStateShapeCalculator.gated_delta_net_state_shape(*args)
        conv_kw, _ = MambaStateShapeCalculator.gated_delta_net_state_shape(*args[:6], num_spec=64)
    finally:
        patches._SINGLE_SLOT_SHAPES.reset(token)
    assert 3 + 64 in conv_chain and 3 in conv_tree and 3 + 64 not in conv_tree and conv_kw == conv_tree

    # 5a: only ddtree engines lose the speculative state blocks.
    class FakeLayer:
        def get_kv_cache_spec(self, vllm_config):
            return MambaSpec(
                shapes=((4, 3), (2, 2)), dtypes=(torch.float32, torch.float32), block_size=16, num_speculative_blocks=64
            )

    patches._wrap_once(FakeLayer, "get_kv_cache_spec", patches._single_slot_spec)
    ddtree_cfg = SimpleNamespace(additional_config={"ddtree": {"budget": 64}})
    plain_cfg = SimpleNamespace(additional_config={})
    assert FakeLayer().get_kv_cache_spec(ddtree_cfg).num_speculative_blocks == 0
    assert FakeLayer().get_kv_cache_spec(plain_cfg).num_speculative_blocks == 64


def test_gdn_forward_core_splits_tree_and_other_tokens(monkeypatch):
    """Tree tokens go to DDTree's verification, the rest to vLLM's code with spec-free metadata."""
    import dataclasses

    import vllm.forward_context
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from ddtree.vllm import gdn

    tree_index = torch.tensor([2, 3, 4])
    other_index = torch.tensor([0, 1, 5])
    md = GDNAttentionMetadata(
        num_prefills=2,
        num_prefill_tokens=3,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=1,
        num_spec_decode_tokens=3,
        num_actual_tokens=6,
        spec_sequence_masks=torch.tensor([False, True, False]),
        spec_state_indices_tensor=torch.tensor([[7]]),
        num_accepted_tokens=torch.tensor([1]),
    )
    metadata = {"layer.0": md}
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(attn_metadata=metadata))
    step = gdn.GdnTreeStep(
        token_index=tree_index,
        other_index=other_index,
        node_offsets=torch.tensor([0, 3]),
        ancestor_bits=torch.zeros(3, 1, dtype=torch.int32),
        conv_index=torch.zeros(3, 4),
        num_requests=1,
        num_tree_tokens=3,
    )
    seen = {}

    def fake_verify(step_, name, x, a, b, conv_state, ssm_state, slots, *rest, out=None):
        seen["verify"] = (x[:, 0].tolist(), slots.tolist())
        seen["views"] = (x.data_ptr(), out)
        result = torch.full((x.shape[0], 2, 2), 100.0) + x[:, :1, None]
        return result if out is None else out.copy_(result)

    def fake_original(layer, x, b, a, out):
        md_now = metadata[layer.prefix]
        seen["original"] = (x[:, 0].tolist(), md_now.spec_sequence_masks, md_now.num_actual_tokens)
        out[:] = -x[:, :1, None]

    monkeypatch.setattr(gdn, "verify_tree_tokens", fake_verify)
    conv = torch.zeros(1, 1, 1)
    layer = SimpleNamespace(
        prefix="layer.0",
        kv_cache=(conv, torch.zeros(1)),
        conv1d=SimpleNamespace(weight=torch.zeros(1, 1, 4), bias=None),
        activation="silu",
        A_log=None,
        dt_bias=None,
        head_k_dim=2,
        head_v_dim=2,
    )
    x = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 4)
    out = torch.zeros(6, 2, 2)
    patches._gdn_forward_core_with_trees(layer, fake_original, step, x, torch.zeros(6, 2), torch.zeros(6, 2), out)
    assert seen["verify"] == ([2.0, 3.0, 4.0], [7])
    assert seen["original"] == ([0.0, 1.0, 5.0], None, 3)
    assert metadata["layer.0"] is md  # restored
    assert out[:, 0, 0].tolist() == [0.0, -1.0, 102.0, 103.0, 104.0, -5.0]

    # A step of decodes only: the tree rows are the leading rows, passed as views and written in place.
    decodes = dataclasses.replace(
        md, num_prefills=0, num_prefill_tokens=0, num_actual_tokens=3, spec_sequence_masks=torch.tensor([True])
    )
    metadata["layer.0"] = decodes
    only_trees = dataclasses.replace(step, token_index=torch.arange(3), other_index=None)
    seen.clear()
    out = torch.zeros(3, 2, 2)
    patches._gdn_forward_core_with_trees(
        layer, fake_original, only_trees, x[:3], torch.zeros(3, 2), torch.zeros(3, 2), out
    )
    assert seen["verify"] == ([0.0, 1.0, 2.0], [7]) and "original" not in seen
    assert seen["views"][0] == x.data_ptr() and seen["views"][1].data_ptr() == out.data_ptr()
    assert out[:, 0, 0].tolist() == [100.0, 101.0, 102.0]

    bad = dataclasses.replace(md, num_spec_decode_tokens=2)
    metadata["layer.0"] = bad
    with pytest.raises(RuntimeError, match="sees 2 spec-decode tokens in a step that verifies 3"):
        patches._gdn_forward_core_with_trees(layer, fake_original, step, x, torch.zeros(6, 2), torch.zeros(6, 2), out)


def test_the_non_tree_half_sees_no_spec_decode_field_of_vllms_metadata():
    """5d: every spec-decode field of this vLLM's ``GDNAttentionMetadata`` is cleared for the prefill half (0.33
    added ``spec_sequence_masks_cpu`` and ``uniform_spec_sequence_length``; a field added later fails here)."""
    import dataclasses

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    counts = {"num_spec_decodes", "num_spec_decode_tokens"}
    names = {f.name for f in dataclasses.fields(GDNAttentionMetadata)}
    # The spec half's fields (the non-spec half's own, ``non_spec_*``, stay; its token index is relative to the
    # whole step, and the half gets its tokens gathered already).
    spec_fields = {n for n in names if "spec" in n and not n.startswith("non_spec")} | {"num_accepted_tokens"}
    spec_fields |= {"non_spec_token_indx"}
    assert spec_fields - counts <= set(patches._SPEC_HALF_FIELDS), "a spec-decode field 5d does not clear"
    md = GDNAttentionMetadata(
        num_prefills=1,
        num_prefill_tokens=4,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=2,
        num_spec_decode_tokens=6,
        num_actual_tokens=10,
        **{name: torch.ones(2) for name in spec_fields - counts if name != "uniform_spec_sequence_length"},
        **({"uniform_spec_sequence_length": 3} if "uniform_spec_sequence_length" in names else {}),
        has_initial_state=torch.ones(1),
        non_spec_query_start_loc=torch.tensor([0, 4]),
    )
    rest = patches._without_spec_half(md, 4)
    assert (rest.num_spec_decodes, rest.num_spec_decode_tokens, rest.num_actual_tokens) == (0, 0, 4)
    assert all(getattr(rest, name) is None for name in spec_fields - counts)
    assert rest.has_initial_state is md.has_initial_state and rest.num_prefill_tokens == 4
    assert rest.non_spec_query_start_loc is md.non_spec_query_start_loc


def test_ddtree_gdn_layers_turn_off_vllms_fused_chain_kernel():
    """5e: a fused spec-decode op that never calls ``_forward_core`` would verify tree tokens as a chain; ddtree
    engines turn every such switch off (vLLM 0.33's ``enable_fused_gdn_spec_decode``), other engines keep it."""
    import inspect
    import re

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    patches.apply()
    assert getattr(qwen_gdn_linear_attn.QwenGatedDeltaNetAttention.__init__, "__ddtree_wrapped__", False)
    # This vLLM's layer selects its fused paths with no switch 5e does not know.
    source = inspect.getsource(qwen_gdn_linear_attn)
    switches = set(re.findall(r"self\.(enable_fused\w*spec\w*)\s*=", source))
    assert switches <= set(patches.FUSED_SPEC_DECODE_SWITCHES), switches

    class FakeLayer:
        def __init__(self, config, vllm_config, prefix=""):
            self.gdn_decode_kernel = "cuda"
            self.enable_fused_gdn_spec_decode = True

    patches._wrap_once(FakeLayer, "__init__", patches._no_fused_spec_decode)
    ddtree_cfg = SimpleNamespace(additional_config={"ddtree": {"budget": 64}})
    tree_layer = FakeLayer(None, vllm_config=ddtree_cfg, prefix="model.layers.0")
    assert (tree_layer.gdn_decode_kernel, tree_layer.enable_fused_gdn_spec_decode) == ("triton", False)
    chain_layer = FakeLayer(None, SimpleNamespace(additional_config={}))
    assert (chain_layer.gdn_decode_kernel, chain_layer.enable_fused_gdn_spec_decode) == ("cuda", True)


def test_drafting_reservation_follows_the_drafters_depth():
    """Patch 6: vLLM keeps (num_speculative_tokens - 1) * max_num_seqs tokens free for a parallel drafter's
    mask slots; a ddtree engine's drafter drafts L positions, not the budget's."""
    from vllm.config import SpeculativeConfig, VllmConfig

    patches.apply()
    assert getattr(VllmConfig._set_max_num_scheduled_tokens, "__ddtree_wrapped__", False)
    slots_property = SpeculativeConfig.max_num_new_slots_for_drafting

    class FakeSpec:  # what vLLM's property reads of a DFlash config
        parallel_drafting = True

        def __init__(self, budget, block_size=16):
            self.num_speculative_tokens = budget
            self.draft_model_config = SimpleNamespace(hf_config=SimpleNamespace(block_size=block_size))

        def uses_draft_model(self):
            return False

        def use_dflash(self):  # (0.33 asks)
            return True

        def use_dspark(self):
            return False

        max_num_new_slots_for_drafting = slots_property

    if not FakeSpec(256).max_num_new_slots_for_drafting:
        pytest.skip("this vLLM keeps no drafting reserve for a DFlash chain (0.33): no reserve for patch 6 to size")

    def engine(budget, max_num_seqs, batched, ddtree=None):
        return SimpleNamespace(
            speculative_config=FakeSpec(budget),
            scheduler_config=SimpleNamespace(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, max_num_scheduled_tokens=None
            ),
            additional_config={} if ddtree is None else {"ddtree": ddtree},
        )

    # vLLM's own chain of depth 256 keeps 255 slots per sequence: 8352 - 255 * 32 = 192 tokens a step.
    chain = engine(256, 32, 8352)
    VllmConfig._set_max_num_scheduled_tokens(chain)
    assert chain.scheduler_config.max_num_scheduled_tokens == 192
    # ddtree at budget 256 keeps what a depth-15 chain keeps (14 per sequence), whether the depth was given
    # or comes from the drafter's block_size; vLLM's view of the budget is restored.
    for settings in ({"budget": 256, "draft_len": 15}, {"budget": 256, "draft_len": None}):
        tree = engine(256, 32, 8352, settings)
        VllmConfig._set_max_num_scheduled_tokens(tree)
        assert tree.scheduler_config.max_num_scheduled_tokens == 8352 - 14 * 32
        assert tree.speculative_config.num_speculative_tokens == 256
    # With vLLM's default 256 sequences and 8192 batched tokens a budget-64 chain cannot start; ddtree can.
    with pytest.raises(ValueError, match="does not allow any tokens to be scheduled"):
        VllmConfig._set_max_num_scheduled_tokens(engine(64, 256, 8192))
    tree = engine(64, 256, 8192, {"budget": 64, "draft_len": None})
    VllmConfig._set_max_num_scheduled_tokens(tree)
    assert tree.scheduler_config.max_num_scheduled_tokens == 8192 - 14 * 256
    # No depth to go by: vLLM's rule stands (validate_vllm_config refuses such an engine with the reason).
    unknown = engine(64, 32, 8192, {"budget": 64, "draft_len": None})
    unknown.speculative_config.draft_model_config = SimpleNamespace(hf_config=SimpleNamespace())
    VllmConfig._set_max_num_scheduled_tokens(unknown)
    assert unknown.scheduler_config.max_num_scheduled_tokens == 8192 - 63 * 32


@pytest.mark.parametrize("max_num_seqs", [1, 7, 8, 40, 256])
def test_async_scheduler_places_each_steps_budget_in_drafts(max_num_seqs):
    """1b: vLLM's asynchronous scheduler, given a budget schedule as its dynamic speculative decoding schedule,
    gives a step of ``n`` requests the placeholders of ``budget_for(n)``, the trees the runner built for it."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from ddtree.vllm.config import DDTreeConfig

    cfg = DDTreeConfig(budget=64, draft_len=15, top_k=8, budget_schedule=((1, 64), (8, 32), (32, 16)))

    def engine(async_scheduling):
        return SimpleNamespace(
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling, max_num_seqs=max_num_seqs),
            speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=None),
        )

    on = engine(True)
    patches._schedule_for_async_scheduler(on, cfg)
    schedule = on.speculative_config.num_speculative_tokens_per_batch_size
    lookup = build_dynamic_sd_schedule_lookup(
        schedule, vllm_max_batch_size=max_num_seqs, vllm_num_speculative_tokens=64
    )
    assert lookup[1:] == [cfg.budget_for(n) for n in range(1, max_num_seqs + 1)]
    # Synchronous scheduling (the runner's drafts set the count) and a single budget leave vLLM's setting alone.
    off = engine(False)
    patches._schedule_for_async_scheduler(off, cfg)
    assert off.speculative_config.num_speculative_tokens_per_batch_size is None
    single = engine(True)
    patches._schedule_for_async_scheduler(single, DDTreeConfig(budget=64, draft_len=15, top_k=8))
    assert single.speculative_config.num_speculative_tokens_per_batch_size is None


def test_a_ddtree_engine_keeps_its_full_graphs_under_a_dynamic_speculation_schedule():
    """1b: vLLM switches V1 engines with a dynamic speculation schedule to PIECEWISE (also when the engine process
    re-runs ``VllmConfig.__post_init__``); a ddtree engine, whose runner dispatches each budget's trees to FULL
    graphs of their own, keeps its mode. Other engines keep vLLM's behaviour."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode

    patches.apply()
    override = VllmConfig._maybe_override_dynamic_sd_cudagraph_mode
    assert getattr(override, "__ddtree_wrapped__", False)

    def engine(additional_config):
        return SimpleNamespace(
            speculative_config=SimpleNamespace(uses_dynamic_speculative_decoding=lambda: True),
            compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
            use_v2_model_runner=False,
            additional_config=additional_config,
        )

    tree, chain = engine({"ddtree": {"budget": 64}}), engine({})
    override(tree)
    override(chain)
    assert tree.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert chain.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
