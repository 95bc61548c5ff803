"""DDTREE_SLIDING_DRAFTER: a drafter with sliding-window and full-attention layers (the released Qwen3.6-27B one),
built in one full-attention KV group, its sliding layers' causality and window carried by their attention metadata
(``ddtree.vllm.sliding_drafter``). The masks against the reference engine's; vLLM's resolver and FlashAttention
metadata as vLLM 0.25.1 defines them (CPU: no attention runs here)."""

from types import SimpleNamespace

import pytest
import torch
from test_vllm_admission_and_limits import _pair_args, sliding_pair_drafter

from ddtree.vllm import sliding_drafter
from ddtree.vllm.sliding_drafter import (
    SLIDING_DRAFTER_ENV,
    SlidingDrafterError,
    check_backends,
    flash_window,
    layer_mask,
    layer_masks,
    masked_metadata,
)

RELEASED_27B = ["sliding_attention"] * 4 + ["full_attention"]


def _config(layer_types=RELEASED_27B, sliding_window=2048, dflash_config=None):
    return SimpleNamespace(layer_types=list(layer_types), sliding_window=sliding_window, dflash_config=dflash_config)


def test_each_layers_mask_follows_vllms_rules():
    assert [layer_mask(_config(), i) for i in range(5)] == [(True, 2048)] * 4 + [(False, None)]
    # dflash_config's window wins over the top-level one; its causal flag overrides every layer's.
    config = _config(dflash_config={"swa_window_size": 512, "causal": False})
    assert [layer_mask(config, i) for i in range(5)] == [(False, 512)] * 4 + [(False, None)]
    with pytest.raises(SlidingDrafterError, match="layer 0 is 'sliding_attention' but its config gives no window"):
        layer_mask(_config(sliding_window=None), 0)


def test_the_masks_are_the_reference_engines():
    from transformers import Qwen3Config

    from ddtree.engine.drafter import layer_attention

    hf = Qwen3Config(num_hidden_layers=5, layer_types=RELEASED_27B, use_sliding_window=True, sliding_window=2048)
    assert [layer_mask(hf, i) for i in range(5)] == [layer_attention(hf, i) for i in range(5)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 16, 40, None])
def test_flash_attentions_window_sees_what_the_reference_mask_sees(causal, window):
    """FlashAttention's varlen rule (queries aligned to the end of the keys; key ``k`` visible to the query at
    ``q`` iff ``q - left <= k <= q + right``, ``-1`` unbounded, and ``k <= q`` when causal) with
    :func:`flash_window`'s ``(left, right)`` sees exactly the reference engine's keys, across context lengths
    that straddle the window."""
    from ddtree.engine.drafter import visible_keys

    left, right = flash_window(causal, window)
    block = 16
    for context in (0, 5, 23, 24, 25, 39, 40, 41, 100):
        keys = context + block
        q = torch.arange(context, keys)[:, None]
        k = torch.arange(keys)[None, :]
        seen = torch.ones((block, keys), dtype=torch.bool)
        if causal:
            seen &= k <= q
        if left >= 0:
            seen &= k >= q - left
        if right >= 0:
            seen &= k <= q + right
        assert torch.equal(seen, visible_keys(block, keys, causal, window, "cpu")), (context, causal, window)


def test_the_worker_patch_builds_every_layer_without_a_window_only_under_the_switch(monkeypatch):
    """vLLM's own resolver refuses the released drafter's layer kinds; wrapped and switched on, every layer is
    built without a window of its own (a full-attention KV spec: one drafter KV group), with vLLM's causality."""
    from transformers import Qwen3Config
    from vllm.model_executor.models import qwen3_dflash

    original = getattr(qwen3_dflash._resolve_layer_attention, "__wrapped__", qwen3_dflash._resolve_layer_attention)
    hf = Qwen3Config(num_hidden_layers=5, layer_types=RELEASED_27B, use_sliding_window=True, sliding_window=2048)
    resolve = sliding_drafter.resolve_in_one_kv_group(original)
    # The worker's config, a V1 runner (vLLM 0.33's resolver reads it; 0.25's refuses mixed drafters on any).
    monkeypatch.setattr(qwen3_dflash, "get_current_vllm_config", lambda: SimpleNamespace(use_v2_model_runner=False))
    monkeypatch.delenv(SLIDING_DRAFTER_ENV, raising=False)
    with pytest.raises(NotImplementedError, match="mixed sliding/full attention"):
        resolve(hf, 0)
    monkeypatch.setenv(SLIDING_DRAFTER_ENV, "1")
    assert [resolve(hf, i) for i in range(5)] == [(None, True)] * 4 + [(None, False)]
    full = Qwen3Config(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    assert resolve(full, 1) == original(full, 1)  # any other drafter: vLLM's answer


def _layers(names):
    return [SimpleNamespace(self_attn=SimpleNamespace(attn=SimpleNamespace(layer_name=name))) for name in names]


NAMES = [f"model.layers.{64 + i}.self_attn.attn" for i in range(5)]


def test_only_the_layers_unlike_vllms_metadata_get_a_mask():
    assert layer_masks(_layers(NAMES), _config(), base_causal=False) == {name: (True, 2048) for name in NAMES[:4]}
    assert layer_masks(_layers(NAMES), _config(layer_types=["full_attention"] * 5), base_causal=False) == {}
    with pytest.raises(SlidingDrafterError, match="4 attention layers and 5 layer_types"):
        layer_masks(_layers(NAMES[:4]), _config(), base_causal=False)


def test_the_decoder_layers_are_found_in_order_inside_the_drafter():
    from torch import nn

    class Layer(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.self_attn = nn.Module()
            self.self_attn.attn = nn.Module()
            self.self_attn.attn.layer_name = name

    drafter = nn.Module()
    drafter.model = nn.Module()
    drafter.model.layers = nn.ModuleList([Layer(name) for name in NAMES])
    drafter.model.norm = nn.LayerNorm(4)
    found = sliding_drafter.draft_decoder_layers(drafter)
    assert [layer.self_attn.attn.layer_name for layer in found] == NAMES


def _metadata_has_window() -> bool:
    """Whether this vLLM's FlashAttention metadata carries a window (0.25; 0.33's reads the layer's)."""
    import dataclasses

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    return "sliding_window" in {f.name for f in dataclasses.fields(FlashAttentionMetadata)}


def _flash_metadata():
    import dataclasses

    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    empty = torch.zeros(0, dtype=torch.int32)
    fields = dict(
        num_actual_tokens=32,
        max_query_len=16,
        query_start_loc=torch.tensor([0, 16, 32], dtype=torch.int32),
        max_seq_len=3000,
        seq_lens=torch.tensor([3000, 40], dtype=torch.int32),
        block_table=torch.zeros((2, 200), dtype=torch.int32),
        slot_mapping=empty,
        use_cascade=False,  # (0.25's cascade fields, gone from 0.33)
        common_prefix_len=0,
        cu_prefix_query_lens=None,
        prefix_kv_lens=None,
        suffix_kv_lens=None,
        causal=False,
        sliding_window=(-1, -1),
    )
    known = {f.name for f in dataclasses.fields(FlashAttentionMetadata)}
    return FlashAttentionMetadata(**{name: value for name, value in fields.items() if name in known})


def _window(metadata):
    """The window a FlashAttention layer gets from its metadata (None where vLLM's metadata has none)."""
    return getattr(metadata, "sliding_window", None)


def test_the_sliding_layers_get_one_shared_copy_with_their_causality_and_window():
    base = _flash_metadata()
    per_layer = {name: base for name in NAMES}
    masks = {name: (True, 2048) for name in NAMES[:4]}
    out = masked_metadata(per_layer, masks)
    copies = {id(out[name]) for name in NAMES[:4]}
    assert len(copies) == 1 and out[NAMES[4]] is base
    sliding = out[NAMES[0]]
    assert sliding.causal is True and _window(sliding) == ((2047, 0) if _metadata_has_window() else None)
    assert sliding.block_table is base.block_table and sliding.seq_lens is base.seq_lens  # the same step's tensors
    assert base.causal is False and _window(base) == ((-1, -1) if _metadata_has_window() else None)  # untouched


def test_the_sliding_layers_carry_their_window_where_vllm_reads_it_from_the_layer():
    """vLLM 0.33's FlashAttention takes the window from ``impl.sliding_window`` (0.25's metadata window, the same,
    wins over it there): the masked layers get theirs, the others keep vLLM's."""
    layers = [
        SimpleNamespace(self_attn=SimpleNamespace(attn=SimpleNamespace(layer_name=name, impl=SimpleNamespace())))
        for name in NAMES
    ]
    for layer in layers:
        layer.self_attn.attn.impl.sliding_window = (-1, -1)  # as vLLM builds a layer without a window
    sliding_drafter.set_layer_windows(layers, {name: (True, 2048) for name in NAMES[:4]} | {"other": (False, 64)})
    windows = [layer.self_attn.attn.impl.sliding_window for layer in layers]
    assert windows == [(2047, 0)] * 4 + [(-1, -1)]


def test_the_proposer_hands_each_layer_its_metadata():
    """``DDTreeProposer.build_per_group_and_layer_attn_metadata`` over vLLM's (one drafter group, non-causal)."""
    from ddtree.vllm.proposer import DDTreeProposer

    base = _flash_metadata()
    builder = SimpleNamespace(build_for_drafting=lambda common_attn_metadata, draft_index: base)
    group = SimpleNamespace(
        get_metadata_builder=lambda: builder,
        build_metadata_for_drafting=builder.build_for_drafting,  # (vLLM 0.33 asks the group)
        layer_names=list(NAMES),
    )
    proposer = object.__new__(DDTreeProposer)
    proposer.draft_attn_groups, proposer.dflash_causal = [group], False
    proposer._ddtree_layer_masks = {name: (True, 2048) for name in NAMES[:4]}
    per_group, per_layer = proposer.build_per_group_and_layer_attn_metadata(SimpleNamespace())
    assert per_group == [base] and per_layer[NAMES[4]] is base
    window = (2047, 0) if _metadata_has_window() else None
    assert all(_window(per_layer[name]) == window and per_layer[name].causal for name in NAMES[:4])
    proposer._ddtree_layer_masks = {}  # an all-full drafter: vLLM's objects as they are
    assert all(m is base for m in proposer.build_per_group_and_layer_attn_metadata(SimpleNamespace())[1].values())


def test_a_backend_that_takes_no_window_from_the_metadata_is_refused():
    def group(backend, names):
        return SimpleNamespace(backend=SimpleNamespace(get_name=lambda: backend), layer_names=names)

    masks = {name: (True, 2048) for name in NAMES[:4]}
    check_backends([group("FLASH_ATTN", NAMES)], masks)
    check_backends([group("FLASH_ATTN", NAMES[:4]), group("TRITON_ATTN", NAMES[4:])], masks)  # unmasked layer
    with pytest.raises(SlidingDrafterError, match=r"would run on the TRITON_ATTN attention backend"):
        check_backends([group("TRITON_ATTN", NAMES)], masks)


@pytest.mark.parametrize("use_sliding_window", [True, False])
def test_admission_under_the_switch_needs_a_known_window(h200_platform, tmp_path, monkeypatch, use_sliding_window):
    """With the switch a mixed drafter is admitted when its window is known; transformers drops the window of a
    config without ``use_sliding_window: true``, and then it is refused before loading, saying why."""
    from vllm.usage.usage_lib import UsageContext

    from ddtree.vllm import patches
    from ddtree.vllm.config import DDTreeConfigError

    monkeypatch.setenv(SLIDING_DRAFTER_ENV, "1")
    patches.apply()
    args = _pair_args(64)
    args.speculative_config = dict(
        args.speculative_config, model=str(sliding_pair_drafter(tmp_path, True if use_sliding_window else None))
    )
    if use_sliding_window:
        config = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        assert config.speculative_config.draft_model_config.hf_config.sliding_window == 2048
    else:
        with pytest.raises(DDTreeConfigError, match="gives no window"):
            args.create_engine_config(UsageContext.OPENAI_API_SERVER)


def check_flash_attention_applies_the_window(device: str = "cuda") -> None:
    """vLLM's FlashAttention 3 call as its backend makes it for the drafter (paged K/V, queries aligned to the end
    of each request's keys, ``causal`` and ``window_size`` per call) with :func:`flash_window`'s window: the
    reference engine's attention (``visible_keys``) for a sliding layer and for a full one, over contexts that
    straddle the window; the unwindowed attention differs (the window is in force at these shapes)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ddtree.engine.drafter import visible_keys

    gen = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, dim, block, page, window = 4, 2, 128, 16, 16, 24
    contexts = [5, 30, 71]
    keys = [c + block for c in contexts]
    pages = [-(-n // page) for n in keys]
    k_cache = torch.randn((sum(pages) + 1, page, kv_heads, dim), generator=gen).to(device, torch.bfloat16)
    v_cache = torch.randn((sum(pages) + 1, page, kv_heads, dim), generator=gen).to(device, torch.bfloat16)
    table = torch.zeros((len(keys), max(pages)), dtype=torch.int32)
    first = 1  # (block 0 left unused, as vLLM's null block)
    for r, n in enumerate(pages):
        table[r, :n] = torch.arange(first, first + n)
        first += n
    q = torch.randn((block * len(keys), heads, dim), generator=gen).to(device, torch.bfloat16)
    cu_q = torch.arange(0, block * (len(keys) + 1), block, dtype=torch.int32)
    scale = dim**-0.5
    for causal, mask_window in ((True, window), (False, None)):
        out = flash_attn_varlen_func(
            q=q,
            k=k_cache,
            v=v_cache,
            max_seqlen_q=block,
            cu_seqlens_q=cu_q.to(device),
            max_seqlen_k=max(keys),
            seqused_k=torch.tensor(keys, dtype=torch.int32, device=device),
            softmax_scale=scale,
            causal=causal,
            window_size=list(flash_window(causal, mask_window)),
            block_table=table.to(device),
            fa_version=3,
        )
        for r, n in enumerate(keys):
            rows = table[r].long()
            k = k_cache[rows].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
            v = v_cache[rows].reshape(-1, kv_heads, dim)[:n].float().repeat_interleave(heads // kv_heads, dim=1)
            qr = q[r * block : (r + 1) * block].float()
            scores = torch.einsum("qhd,khd->hqk", qr, k) * scale

            def attend(visible):
                return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)

            expected = attend(visible_keys(block, n, causal, mask_window, device))
            got = out[r * block : (r + 1) * block].float()
            assert (got - expected).abs().max().item() < 3e-2, (causal, r)
            if mask_window is not None and contexts[r] + block > mask_window:
                unwindowed = attend(visible_keys(block, n, causal, None, device))
                assert (got - unwindowed).abs().max().item() > 0.1, (causal, r)  # the window mattered here
    print("flash attention applies the window as the reference does")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (FlashAttention 3)")
def test_flash_attention_applies_the_window_as_the_reference_engine_does():
    check_flash_attention_applies_the_window("cuda")


def test_vllms_v1_refusal_of_a_mixed_drafter_is_answered_for_ddtree_engines_only():
    """Patch 11's config half: vLLM 0.33's V1 check (``VllmConfig._dflash_needs_multi_kv_group``) would refuse the
    released drafter before ddtree's own check; a ddtree engine answers that one KV group serves it, any other
    engine keeps vLLM's answer. Installed where vLLM has the check."""
    from vllm.config import VllmConfig

    from ddtree.vllm import patches

    class FakeConfig:
        def __init__(self, additional_config):
            self.additional_config = additional_config

        def _dflash_needs_multi_kv_group(self):
            return True

    patches._wrap_once(FakeConfig, "_dflash_needs_multi_kv_group", patches._one_kv_group_for_trees)
    assert FakeConfig({"ddtree": {"budget": 64}})._dflash_needs_multi_kv_group() is False
    assert FakeConfig({})._dflash_needs_multi_kv_group() is True
    patches.apply()
    check = getattr(VllmConfig, "_dflash_needs_multi_kv_group", None)
    assert check is None or getattr(check, "__ddtree_wrapped__", False)
