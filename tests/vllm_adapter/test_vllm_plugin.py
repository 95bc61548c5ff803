"""The adapter against an installed vLLM 0.25.x, without a GPU (skipped without vLLM)."""


from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from ddtree.vllm import patches  # noqa: E402
from ddtree.vllm.config import DDTreeConfigError  # noqa: E402


def test_entry_point_is_registered():
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
    args = EngineArgs(model="/nonexistent", speculative_config={"method": "ddtree", "model": "/drafter",
                                                                 "num_speculative_tokens": 15, "ddtree_budget": 32})
    cfg = patches._translate_engine_args(args)
    assert cfg.budget == 32 and cfg.draft_len == 15
    assert args.speculative_config == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 32}
    assert args.additional_config["ddtree"]["budget"] == 32
    assert args.async_scheduling is False and args.enable_prefix_caching is False
    assert args.enforce_eager is False and args.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE"
    assert args.worker_cls == "ddtree.vllm.worker.DDTreeWorker"
    assert str(getattr(args.attention_backend, "name", args.attention_backend)) == "CUSTOM"
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    plain = EngineArgs(model="/nonexistent", speculative_config={"method": "dflash", "model": "/d",
                                                                  "num_speculative_tokens": 3})
    assert patches._translate_engine_args(plain) is None
    bad = EngineArgs(model="/nonexistent", async_scheduling=True,
                     speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32})
    with pytest.raises(DDTreeConfigError, match="async_scheduling"):
        patches._translate_engine_args(bad)
    full = EngineArgs(model="/nonexistent", compilation_config={"cudagraph_mode": "FULL"},
                      speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32})
    with pytest.raises(DDTreeConfigError, match="FULL_AND_PIECEWISE"):
        patches._translate_engine_args(full)
    piecewise = EngineArgs(model="/nonexistent", compilation_config={"cudagraph_mode": "PIECEWISE"},
                           speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32})
    patches._translate_engine_args(piecewise)
    assert piecewise.compilation_config.cudagraph_mode.name == "PIECEWISE"
    eager = EngineArgs(model="/nonexistent", enforce_eager=True,
                       speculative_config={"method": "ddtree", "model": "/d", "ddtree_budget": 32})
    patches._translate_engine_args(eager)
    assert eager.enforce_eager is True and eager.compilation_config.cudagraph_mode is None


def test_admission_refuses_unservable_requests():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    holder = type("Holder", (), {"_validate_params": lambda self, p, *a, **k: None})
    patches._wrap_validate_params(holder)  # the wrapper vLLM's InputProcessor gets, around a stub
    h = holder()
    h.vllm_config = SimpleNamespace(additional_config={"ddtree": {"budget": 8}})
    h._validate_params(SamplingParams(temperature=0.5, top_p=0.9, seed=1))
    json_only = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="structured outputs") as refused:  # a 400, no traceback
        h._validate_params(json_only)
    assert refused.value.parameter == "structured_outputs"
    h._validate_params(SamplingParams(logprobs=2, repetition_penalty=1.2, bad_words=["x"]))  # served
    h.vllm_config = SimpleNamespace(additional_config={})
    h._validate_params(json_only)  # not a ddtree engine: untouched


def test_admission_through_vllms_own_checks_serves_min_p_and_logit_bias_only_for_ddtree():
    """vLLM's own ``SamplingParams.verify`` refuses min_p and logit_bias under any speculative config; a
    ddtree engine serves them (per-node sampling), a dflash engine still refuses them."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    patches.apply()
    model_config = SimpleNamespace(max_logprobs=20, get_vocab_size=lambda: 100, logits_processors=None,
                                   is_diffusion=False)

    def processor(additional_config):
        p = object.__new__(InputProcessor)  # vLLM's checks only read these attributes
        p.__dict__.update(model_config=model_config, speculative_config=SimpleNamespace(method="dflash"),
                          structured_outputs_config=None, renderer=SimpleNamespace(tokenizer=None),
                          vllm_config=SimpleNamespace(additional_config=additional_config, reasoning_config=None))
        return p

    ddtree_engine, dflash_engine = processor({"ddtree": {"budget": 8}}), processor({})
    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 5.0})):
        ddtree_engine._validate_params(params, ("generate",))
        with pytest.raises(ValueError, match="min_p and logit_bias"):
            dflash_engine._validate_params(params, ("generate",))
    with pytest.raises(ValueError, match="out of vocabulary|out-of-vocab|vocab"):
        ddtree_engine._validate_params(SamplingParams(logit_bias={1000: 5.0}), ("generate",))  # vLLM's check kept


def test_rejection_sampler_emits_vllm_chain_rows():
    """The sampler on CPU tensors with a fake runner: tree walk, chain format, plain rows."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(0)
    store = TreeStore(budget=6)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    drafts = [[], lists[0], lists[1][:4]]  # request "p" has no tree
    req_ids = ["p", "a", "b"]
    plan = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 7, 5]),
                       {"a": drafts[1], "b": drafts[2]})
    plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
    plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    md.bonus_logits_indices = torch.tensor([0, 7, 12])
    vocab = 20
    # Target logits: make every node's argmax the token of its first child when it has one (accept all
    # along first children), else token 19.
    logits = torch.full((13, vocab), -5.0)
    for j, (lo, hi) in enumerate(zip(plan.trees.node_offsets[:-1], plan.trees.node_offsets[1:])):
        parents = plan.trees.parents[lo:hi]
        toks = plan.trees.tokens[plan.trees.token_offsets[j]:plan.trees.token_offsets[j + 1]]
        for node in range(hi - lo):
            kids = [c for c in range(1, hi - lo) if parents[c] == node]
            tok = int(toks[kids[0] - 1]) if kids else 19
            logits[plan.logit_rows[lo + node], tok] = 5.0
    logits[0, 11] = 5.0
    from ddtree.vllm.runner import DDTreeGPUModelRunner, DDTreeStats
    from ddtree.vllm.staging import StepStaging

    # The runner's state the sampler touches, with the runner's own acceptance upload.
    runner = type("FakeRunner", (), {"ddtree_upload_acceptance": DDTreeGPUModelRunner.ddtree_upload_acceptance})()
    runner._ddtree_plan, runner._ddtree_accept = plan, None
    runner.ddtree_stats = DDTreeStats(15)
    runner._ddtree_flat_positions = torch.zeros(13, dtype=torch.int64)
    runner._ddtree_conv_window = 0
    runner._ddtree_accept_staging = StepStaging(torch.device("cpu"))
    sampler = DDTreeRejectionSampler(runner)
    sampling = SimpleNamespace(temperature=None, all_greedy=True, top_k=None, top_p=None, generators={},
                               no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None,
                               max_num_logprobs=None)
    out = sampler(md, None, logits, sampling).sampled_token_ids
    assert runner.ddtree_stats.host_seconds["accept"] > 0
    assert out.shape == (3, 7)
    assert out[0].tolist() == [11] + [-1] * 6
    for row, j in ((1, 0), (2, 1)):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        parents = plan.trees.parents[lo:hi]
        toks = plan.trees.tokens[plan.trees.token_offsets[j]:plan.trees.token_offsets[j + 1]]
        node, want = 0, []
        while True:
            kids = [c for c in range(1, hi - lo) if parents[c] == node]
            if not kids:
                break
            node = kids[0]
            want.append(int(toks[node - 1]))
        want.append(19)
        assert out[row, : len(want)].tolist() == want
        assert (out[row, len(want):] == -1).all()
    assert runner._ddtree_accept is not None
    # The acceptance's arrays reached the device side in one upload, in the runner's layout.
    staged = runner._ddtree_accept_gpu
    assert runner._ddtree_accept_staging.uploads == 1
    assert torch.equal(staged["output_tokens"], out[1:])
    assert staged["kv_src"].tolist() == runner._ddtree_accept.kv_src_token.tolist()
    assert staged["context_order"].shape == (13,)

    def replan():
        """The same trees again (plan_verify consumed the proposal), installed in the runner."""
        store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
        fresh = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 7, 5]),
                            {"a": drafts[1], "b": drafts[2]})
        fresh.logit_rows_gpu = torch.from_numpy(fresh.logit_rows)
        fresh.batch_index_gpu = torch.from_numpy(fresh.batch_index)
        runner._ddtree_plan = fresh
        return fresh

    # allowed_token_ids: a per-request mask (True = excluded), the same at every node, so exact for trees.
    unmasked = out.clone()
    plan = replan()
    mask = torch.zeros(4, vocab, dtype=torch.bool)  # vLLM's [max_num_reqs, V]
    mask[1] = True
    mask[1, 13] = False  # request "a" may only emit token 13
    masked = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "allowed_token_ids_mask": mask}))
    a_tokens = [t for t in masked.sampled_token_ids[1].tolist() if t >= 0]
    assert a_tokens and set(a_tokens) == {13}
    assert torch.equal(masked.sampled_token_ids[[0, 2]], unmasked[[0, 2]])

    # min_tokens: request "a" needs 3 more tokens before a stop token (19, what every leaf prefers) may end it.
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    plan = replan()
    min_tokens = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {1: (5, [101, 102], {19})}  # 2 generated of 5: positions 0-2 may not stop
    procs = SimpleNamespace(non_argmax_invariant=[min_tokens], argmax_invariant=[])
    held = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "logitsprocs": procs})).sampled_token_ids
    a_tokens = [t for t in held[1].tolist() if t >= 0]
    assert 19 not in a_tokens[:3] and 19 in unmasked[1].tolist()[:3]
    assert torch.equal(held[[0, 2]], unmasked[[0, 2]])

    # logit_bias: request "a" biased +100 towards token 13 at every node; the others unchanged.
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    plan = replan()
    bias = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    bias.biases = {1: {13: 100.0}}
    procs = SimpleNamespace(non_argmax_invariant=[bias], argmax_invariant=[])
    biased = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "logitsprocs": procs})).sampled_token_ids
    assert set(t for t in biased[1].tolist() if t >= 0) == {13}
    assert torch.equal(biased[[0, 2]], unmasked[[0, 2]])

    # Logprobs: each emitted token's, from the raw logits row of the node it was sampled at, in the layout
    # vLLM's own rejection sampler returns (vLLM's parse_output then keeps the emitted entries only).
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    runner.sampler = Sampler(logprobs_mode="raw_logprobs")
    logits += torch.linspace(0.0, 1.0, vocab)  # distinct values, so every rank is well defined
    plan = replan()
    result = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "max_num_logprobs": 2}))
    tokens, lists = RejectionSampler.parse_output(result.sampled_token_ids, vocab,
                                                  logprobs_tensors=result.logprobs_tensors)
    log_softmax = logits.log_softmax(dim=-1)
    paths = runner._ddtree_accept.accepted.paths
    expected_rows = [[0]]  # request "p": its only row
    for j in range(2):
        path = [int(p) for p in paths[j] if p >= 0]
        expected_rows.append([int(plan.logit_rows[plan.trees.node_offsets[j] + p]) for p in path])
    position = 0
    for r, (emitted, rows) in enumerate(zip(tokens, expected_rows)):
        assert len(emitted) == len(rows)
        for token, row in zip(emitted, rows):
            ids_row = lists.logprob_token_ids[position]
            values = lists.logprobs[position]
            assert ids_row[0] == token and values[0] == pytest.approx(float(log_softmax[row, token]), abs=1e-5)
            top2 = log_softmax[row].topk(2)
            assert list(ids_row[1:]) == top2.indices.tolist()
            assert lists.sampled_token_ranks[position] == int((log_softmax[row] > log_softmax[row, token]).sum()) + 1
            position += 1
    assert position == len(lists.logprobs)


def test_vllm_layout_assumptions():
    """Signatures and layouts the adapter depends on (catches silent drift within 0.25.x)."""
    import inspect

    import dataclasses

    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionMetadata
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert TritonAttentionBackend.get_kv_cache_shape(4, 16, 2, 64) == (4, 2, 16, 2, 64)
    # The host-side int the split-KV heuristic takes (no device sync) once the backend enables it.
    max_seq_len = {f.name: f for f in dataclasses.fields(TritonAttentionMetadata)}["max_seq_len"]
    assert max_seq_len.type in (int, "int")
    params = list(inspect.signature(SpecDecodeBaseProposer.propose).parameters)
    assert params[:8] == ["self", "num_speculative_tokens", "target_token_ids", "target_positions",
                          "target_hidden_states", "next_token_ids", "token_indices_to_sample",
                          "common_attn_metadata"]
    assert "num_rejected_tokens_gpu" in params
    assert list(inspect.signature(SpecDecodeBaseProposer._sample_draft_tokens).parameters) == [
        "self", "hidden_states", "sampling_metadata"]
    for name in ("_prepare_inputs", "_sample", "_update_states", "take_draft_token_ids", "sample_tokens",
                 "propose_draft_token_ids", "execute_model"):
        assert hasattr(GPUModelRunner, name), name
    assert list(inspect.signature(GPUModelRunner._prepare_inputs).parameters) == [
        "self", "scheduler_output", "num_scheduled_tokens"]
    assert list(inspect.signature(GPUModelRunner._sample).parameters) == ["self", "logits", "spec_decode_metadata"]
    assert issubclass(DFlashProposer, SpecDecodeBaseProposer)
    src = inspect.getsource(GPUModelRunner._prepare_inputs)
    # Slot mapping is computed from the flat positions before we overwrite them with tree depths.
    assert src.index("compute_slot_mapping") < src.index("_prepare_input_ids")
    worker_src = inspect.getsource(__import__("vllm.v1.worker.gpu_worker", fromlist=["Worker"]).Worker.init_device)
    assert "from vllm.v1.worker.gpu_model_runner import" in worker_src


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
    for wrapped in (MambaBase.get_kv_cache_spec, GatedDeltaNetAttention.__init__,
                    Platform._align_hybrid_block_size, MambaStateShapeCalculator.gated_delta_net_state_shape):
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
            return MambaSpec(shapes=((4, 3), (2, 2)), dtypes=(torch.float32, torch.float32), block_size=16,
                             num_speculative_blocks=64)

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
    md = GDNAttentionMetadata(num_prefills=2, num_prefill_tokens=3, num_decodes=0, num_decode_tokens=0,
                              num_spec_decodes=1, num_spec_decode_tokens=3, num_actual_tokens=6,
                              spec_sequence_masks=torch.tensor([False, True, False]),
                              spec_state_indices_tensor=torch.tensor([[7]]), num_accepted_tokens=torch.tensor([1]))
    metadata = {"layer.0": md}
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: SimpleNamespace(attn_metadata=metadata))
    step = gdn.GdnTreeStep(token_index=tree_index, other_index=other_index, node_offsets=torch.tensor([0, 3]),
                           ancestor_bits=torch.zeros(3, 1, dtype=torch.int32), conv_index=torch.zeros(3, 4),
                           num_requests=1, num_tree_tokens=3)
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
    layer = SimpleNamespace(prefix="layer.0", kv_cache=(conv, torch.zeros(1)), conv1d=SimpleNamespace(
        weight=torch.zeros(1, 1, 4), bias=None), activation="silu", A_log=None, dt_bias=None, head_k_dim=2,
        head_v_dim=2)
    x = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 4)
    out = torch.zeros(6, 2, 2)
    patches._gdn_forward_core_with_trees(layer, fake_original, step, x, torch.zeros(6, 2), torch.zeros(6, 2), out)
    assert seen["verify"] == ([2.0, 3.0, 4.0], [7])
    assert seen["original"] == ([0.0, 1.0, 5.0], None, 3)
    assert metadata["layer.0"] is md  # restored
    assert out[:, 0, 0].tolist() == [0.0, -1.0, 102.0, 103.0, 104.0, -5.0]

    # A step of decodes only: the tree rows are the leading rows, passed as views and written in place.
    decodes = dataclasses.replace(md, num_prefills=0, num_prefill_tokens=0, num_actual_tokens=3,
                                  spec_sequence_masks=torch.tensor([True]))
    metadata["layer.0"] = decodes
    only_trees = dataclasses.replace(step, token_index=torch.arange(3), other_index=None)
    seen.clear()
    out = torch.zeros(3, 2, 2)
    patches._gdn_forward_core_with_trees(layer, fake_original, only_trees, x[:3], torch.zeros(3, 2),
                                         torch.zeros(3, 2), out)
    assert seen["verify"] == ([0.0, 1.0, 2.0], [7]) and "original" not in seen
    assert seen["views"][0] == x.data_ptr() and seen["views"][1].data_ptr() == out.data_ptr()
    assert out[:, 0, 0].tolist() == [100.0, 101.0, 102.0]

    bad = dataclasses.replace(md, num_spec_decode_tokens=2)
    metadata["layer.0"] = bad
    with pytest.raises(RuntimeError, match="sees 2 spec-decode tokens in a step that verifies 3"):
        patches._gdn_forward_core_with_trees(layer, fake_original, step, x, torch.zeros(6, 2), torch.zeros(6, 2),
                                             out)


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

        max_num_new_slots_for_drafting = slots_property

    def engine(budget, max_num_seqs, batched, ddtree=None):
        return SimpleNamespace(
            speculative_config=FakeSpec(budget),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
                                             max_num_scheduled_tokens=None),
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


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_bad_words_follow_each_nodes_own_history(monkeypatch, logits_dtype):
    """Bad words and presence/frequency/repetition penalties at a node see the committed output plus the tokens
    on the node's root path, exactly as vLLM's own code does for that history, row by row. bf16 target logits
    are constrained in fp32, like vLLM's sampler: its CUDA repetition-penalty op needs the logits in the
    penalties' dtype (fp32), which the check below stands in for on CPU."""
    import vllm._custom_ops as custom_ops
    import vllm.v1.sample.ops.penalties as penalties
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    monkeypatch.setattr(penalties, "PIN_MEMORY", False)  # a CUDA build of torch on a machine without a GPU
    cpu_op = custom_ops.apply_repetition_penalties

    def dtype_checked(logits, prompt_mask, output_mask, repetition_penalties):
        assert logits.dtype == repetition_penalties.dtype, "the CUDA op refuses mixed dtypes"
        return cpu_op(logits, prompt_mask, output_mask, repetition_penalties)

    monkeypatch.setattr(custom_ops, "apply_repetition_penalties", dtype_checked)

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(7)
    vocab = 12
    store = TreeStore(budget=8)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(vocab)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    req_ids = ["p", "a", "b"]
    plan = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 9, 6]), {"a": lists[0], "b": lists[1][:5]})
    counts = np.array([1, 9, 6])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    num_rows = int(counts.sum())
    logits = (torch.from_numpy(rng.normal(size=(num_rows, vocab)).astype(np.float32)) * 3).to(logits_dtype)
    outputs = [[1, 1, 4], [2, 3, 3, 5], [7]]
    prompts = torch.tensor([[0, 9, vocab], [6, 6, 2], [3, vocab, vocab]])  # padded with the vocabulary size
    sampling = SimpleNamespace(
        allowed_token_ids_mask=None, no_penalties=False, output_token_ids=outputs, prompt_token_ids=prompts,
        bad_words_token_ids={},
        presence_penalties=torch.tensor([0.5, 0.0, 1.5]), frequency_penalties=torch.tensor([0.2, 0.7, 0.0]),
        repetition_penalties=torch.tensor([1.0, 1.3, 2.0]),
    )
    rows_per_req = torch.from_numpy(counts)

    def per_row(t):
        return None if t is None else t[:3].repeat_interleave(rows_per_req, dim=0)

    # Bad words over each node's own history too: [4, x] bans x after a 4, [y] bans y everywhere.
    sampling.bad_words_token_ids = {0: [[4, 8]], 1: [[5, 2], [11]], 2: [[7, 3]]}
    got = DDTreeRejectionSampler._constrained(logits, plan, sampling, per_row, starts, counts, 3)
    assert got.dtype == torch.float32 and not torch.equal(got, logits.float())
    for r in range(3):
        j = {1: 0, 2: 1}.get(r)
        for k in range(counts[r]):
            history = list(outputs[r])
            if j is not None:  # walk node k up to the root, collecting its path's tokens
                first = plan.trees.node_offsets[j]
                tokens = plan.trees.tokens[plan.trees.token_offsets[j]:plan.trees.token_offsets[j + 1]]
                path, node = [], k
                while node > 0:
                    path.append(int(tokens[node - 1]))
                    node = int(plan.trees.parents[first + node])
                history += path[::-1]
            row = starts[r] + k
            want = logits[row:row + 1].float()
            for word in sampling.bad_words_token_ids[r]:
                if history[len(history) - len(word) + 1:] == word[:-1] or len(word) == 1:
                    want[0, word[-1]] = float("-inf")
            want = apply_all_penalties(want, prompts[r:r + 1], sampling.presence_penalties[r:r + 1],
                                       sampling.frequency_penalties[r:r + 1], sampling.repetition_penalties[r:r + 1],
                                       [history])
            assert torch.allclose(got[row], want[0], atol=1e-6), (r, k, history)


def test_runner_batch_holds_the_logit_bias_and_min_p_processors(monkeypatch):
    """Under a speculative config vLLM builds only the min_tokens logits processor (it refuses min_p and
    logit_bias there), so a ddtree engine, which admits both, would serve neither: its sampler finds no
    ``LogitBiasLogitsProcessor`` / ``MinPLogitsProcessor`` in the batch. The ddtree runner gives its persistent
    batch every built-in processor; through vLLM's own batch updates (add, finish, condense) the sampler then
    biases every row of each biased request."""
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.worker.gpu_input_batch as input_batch_module
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import ddtree.vllm.proposer as proposer_module
    from ddtree.vllm.config import ADDITIONAL_CONFIG_KEY, DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.sampler import DDTreeRejectionSampler

    for module in (torch_utils, input_batch_module):  # no CUDA driver here
        monkeypatch.setattr(module, "PIN_MEMORY", False)
    cpu, vocab = torch.device("cpu"), 32
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={ADDITIONAL_CONFIG_KEY: DDTreeConfig(budget=8, draft_len=4, top_k=None).to_dict()},
    )

    def vllm_init(self, vllm_config, device):  # what GPUModelRunner.__init__ sets up that the subclass uses
        self.vllm_config, self.device, self.speculative_config = vllm_config, device, vllm_config.speculative_config
        self.model_config = SimpleNamespace(is_hybrid=False)
        self.max_num_reqs, self.max_num_tokens = 4, 64
        self.drafter = object()
        self.input_batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=device,
                                      vocab_size=vocab, block_sizes=[16], kernel_block_sizes=[16],
                                      logitsprocs=build_logitsprocs(vllm_config, device, False, False))

    monkeypatch.setattr(GPUModelRunner, "__init__", vllm_init)
    monkeypatch.setattr(proposer_module, "DDTreeProposer", lambda *args: SimpleNamespace())
    assert [type(p) for p in build_logitsprocs(config, cpu, False, False).all] == [MinTokensLogitsProcessor]
    runner = DDTreeGPUModelRunner(config, cpu)
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor} <= {
        type(p) for p in runner.input_batch.logitsprocs.all}

    batch, bias = runner.input_batch, {5: 4.0, 9: -6.0}

    def request(req_id, temperature=0.0, **params):
        return CachedRequestState(req_id=req_id, prompt_token_ids=[1, 2, 3], mm_features=[],
                                  sampling_params=SamplingParams(temperature=temperature, **params), generator=None,
                                  block_ids=([],), num_computed_tokens=3, output_token_ids=[])

    for req_id, params in (("x", {}), ("a", {"logit_bias": bias}), ("b", {"logit_bias": bias, "min_p": 0.1, "temperature": 1.0}),
                           ("c", {"logit_bias": bias})):
        batch.add_request(request(req_id, **params))
    batch.condense()
    batch.refresh_metadata()
    batch.remove_request("x")  # finished: "c" moves into its slot
    batch.condense()
    batch.refresh_metadata()
    assert batch.req_ids == ["c", "a", "b"]
    metadata = batch.sampling_metadata
    min_p = next(p for p in metadata.logitsprocs.all if isinstance(p, MinPLogitsProcessor))
    assert min_p.min_p_count == 1 and min_p.min_p_cpu[2] == pytest.approx(0.1)

    # No trees this step (plan None): one row per request, its sampled token emitted.
    runner._ddtree_plan, runner._ddtree_accept = None, None
    md = SpecDecodeMetadata.make_dummy([[], [], []], cpu)
    md.bonus_logits_indices = torch.arange(3)
    logits = torch.zeros(3, vocab)
    logits[:, 9] = 3.0  # the raw argmax; the bias (+4 on 5, -6 on 9) makes token 5 the biased one
    # "b" samples at temperature 1: after the bias token 5 has p ~0.64, every other token ~0.012, below min_p's
    # 0.1 * 0.64, so min_p leaves token 5 alone.
    out = DDTreeRejectionSampler(runner)(md, None, logits, metadata).sampled_token_ids
    assert out[:, 0].tolist() == [5, 5, 5]


PAIR = "tests/fixtures/models"


@pytest.fixture
def h200_platform(monkeypatch):
    """vLLM's platform as an H200 host reports it, for config creation on this GPU-less machine (nothing runs)."""
    import vllm.platforms

    platform = vllm.platforms.current_platform
    monkeypatch.setattr(platform, "device_type", "cuda", raising=False)
    monkeypatch.setattr(platform, "get_device_total_memory", lambda device_id=0: 141 << 30, raising=False)
    monkeypatch.setattr(platform, "get_device_name", lambda device_id=0: "NVIDIA H200", raising=False)
    monkeypatch.setattr(platform, "support_static_graph_mode", lambda: True, raising=False)
    return platform


def _pair_args(budget, **kw):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(model=f"{PAIR}/target", language_model_only=True,
                           additional_config={"gdn_prefill_backend": "triton"},
                           speculative_config={"method": "ddtree", "model": f"{PAIR}/drafter", "ddtree_budget": budget},
                           **kw)


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
    assert scheduler.max_num_batched_tokens >= scheduler.max_num_seqs * (budget + depth)
    assert compilation.cudagraph_mode.name == "FULL_AND_PIECEWISE" and not config.model_config.enforce_eager
    sizes = compilation.cudagraph_capture_sizes
    trees = min(scheduler.max_num_seqs, 32)
    assert all(k * (budget + 1) in sizes for k in range(1, trees + 1)
               if k * (budget + 1) <= scheduler.max_num_batched_tokens)
    assert compilation.max_cudagraph_capture_size == sizes[-1] <= scheduler.max_num_batched_tokens


def test_user_limits_that_hold_no_tree_are_refused_before_loading(h200_platform):
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    with pytest.raises(DDTreeConfigError, match="--max-num-batched-tokens >= 80896 or --max-num-seqs <= 103"):
        _pair_args(64, max_num_seqs=1024, max_num_batched_tokens=8192).create_engine_config(
            UsageContext.OPENAI_API_SERVER)
    # The user's sequences are kept, the default tokens grow to hold their trees.
    config = _pair_args(64, max_num_seqs=300).create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert config.scheduler_config.max_num_seqs == 300
    assert config.scheduler_config.max_num_batched_tokens == 300 * (64 + 15)
    # User-chosen capture sizes are left alone; eager mode captures nothing.
    config = _pair_args(64, compilation_config={"cudagraph_capture_sizes": [1, 2, 65]}).create_engine_config(
        UsageContext.LLM_CLASS)
    assert config.compilation_config.cudagraph_capture_sizes == [1, 2, 65]
    config = _pair_args(64, enforce_eager=True).create_engine_config(UsageContext.LLM_CLASS)
    assert config.compilation_config.cudagraph_mode.name == "NONE"


def test_drafting_continues_near_max_model_len_while_the_drafters_depth_fits():
    """vLLM skips the drafter for the whole batch when a request's ``seq_len + num_speculative_tokens + 1``
    passes max_model_len; for ddtree that count is the budget, so requests within budget + 1 tokens of the end
    verified no tree. The drafter queries depth + 1 positions: it drafts while those fit."""
    from ddtree.vllm.config import DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    runner = object.__new__(DDTreeGPUModelRunner)
    runner.ddtree_cfg = DDTreeConfig(budget=64, draft_len=15, top_k=None)
    runner.effective_drafter_max_model_len = 1024
    fits = runner._input_fits_in_drafter
    assert fits(SimpleNamespace(max_seq_len=1024 - 16)) is True  # 16 queries end exactly at max_model_len
    assert fits(SimpleNamespace(max_seq_len=1024 - 15)) is False
    assert fits(SimpleNamespace(max_seq_len=1024 - 40)) is True  # vLLM's own rule (budget 64) said no here
    assert fits(None) is False


def test_kv_moves_share_one_index_across_the_layers_of_a_group():
    """The runner moves the accepted nodes' K/V in every target attention layer with one block/offset index
    per KV-cache group; each layer ends as a move of its own would leave it."""
    from ddtree.kernels.paged_tree_attention import apply_kv_moves_paged
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(6, 2, 4, 2, 8, generator=gen) for _ in range(3)]  # [blocks, K/V, page, heads, dim]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([17, 18, 19, 20, 21, 22, 23, 4, 5])  # flat scheduled token -> slot
    src, dst = torch.tensor([3, 6]), torch.tensor([1, 2])  # accepted nodes 3 and 6 to positions 1 and 2
    for c in expected:
        apply_kv_moves_paged(c, mapping[src], mapping[dst])
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_kv_layers = [(0, caches[0]), (0, caches[1]), (1, caches[2])]
    table = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=mapping))
    runner.input_batch = SimpleNamespace(block_table=[table, table])
    runner._ddtree_move_kv(src, dst)
    for got, want in zip(caches, expected):
        assert torch.equal(got, want)
    assert not torch.equal(caches[0], caches[1])  # the layers really differ


def test_a_refused_request_is_a_400_without_a_server_traceback(caplog):
    """vLLM's API server registers its handlers as below (``api_server.build_app``): a VLLMValidationError is
    answered with a 400 by Starlette's exception middleware; a plain ValueError falls through to the
    catch-all, which answers but re-raises, and the ASGI server logs 'Exception in ASGI application'."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.utils.server_utils import exception_handler
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    holder = type("Holder", (), {"_validate_params": lambda self, p, *a, **k: None})
    patches._wrap_validate_params(holder)
    admission = holder()
    admission.vllm_config = SimpleNamespace(additional_config={"ddtree": {"budget": 8}})
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
