"""ddtree's tree-attention backend against vLLM's Triton one: the target's K/V cache in vLLM's two layouts (0.25's
``[blocks, 2, block_size, H, D]`` and 0.33's ``[blocks, H, block_size, 2 * D]``, K then V on the last dimension, in
any physical stride order), which the tree attention reads through :func:`ddtree.vllm.attention.key_value_caches`
and the commit's K/V moves index alike; and what the implementation tells vLLM it supports."""

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from ddtree.kernels.kv_moves import apply_kv_moves_paged  # noqa: E402
from ddtree.vllm.attention import key_value_caches  # noqa: E402

BLOCKS, PAGE, HEADS, DIM = 6, 16, 2, 8


def _caches(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, PAGE, HEADS, DIM, generator=gen), torch.randn(BLOCKS, PAGE, HEADS, DIM, generator=gen)


def _layouts(key, value):
    """The same K/V in each layout: 0.25's; 0.33's logical [B, H, N, 2D] stored NHD (as its default layout views
    it) and stored HND."""
    v025 = torch.stack([key, value], dim=1)
    v033_nhd = torch.cat([key, value], dim=-1).transpose(1, 2)
    v033_hnd = v033_nhd.contiguous()
    return {"0.25": v025, "0.33 NHD": v033_nhd, "0.33 HND": v033_hnd}


@pytest.mark.parametrize("layout", ["0.25", "0.33 NHD", "0.33 HND"])
def test_each_layout_gives_the_same_key_and_value_views(layout):
    key, value = _caches()
    cache = _layouts(key, value)[layout]
    got_key, got_value = key_value_caches(cache, DIM)
    assert got_key.shape == got_value.shape == (BLOCKS, PAGE, HEADS, DIM)
    assert got_key.stride(-1) == got_value.stride(-1) == 1  # (the kernel's contiguous head dimension)
    assert torch.equal(got_key, key) and torch.equal(got_value, value)
    # Views, not copies: what vLLM writes into the cache is what the tree attention reads.
    assert got_key.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", ["0.33 NHD", "0.33 HND"])
def test_kv_moves_in_0_33s_layout_equal_0_25s(layout):
    key, value = _caches(1)
    caches = _layouts(key, value)
    rng = np.random.default_rng(0)
    src = torch.from_numpy(rng.permutation(BLOCKS * PAGE)[:20])
    dst = torch.from_numpy(rng.permutation(BLOCKS * PAGE)[:20])
    reference, cache = caches["0.25"].clone(), caches[layout].clone()
    apply_kv_moves_paged(reference, src, dst)
    apply_kv_moves_paged(cache, src, dst)
    moved_key, moved_value = key_value_caches(cache, DIM)
    assert not torch.equal(reference[:, 0], key)  # the moves changed something
    assert torch.equal(moved_key, reference[:, 0]) and torch.equal(moved_value, reference[:, 1])


def test_a_cache_in_no_known_layout_is_refused_by_shape():
    with pytest.raises(ValueError, match=r"shape \(6, 2, 16, 8\) is in no layout .* head_size=8"):
        key_value_caches(torch.zeros(BLOCKS, HEADS, PAGE, DIM), DIM)
    with pytest.raises(ValueError, match="head_size=4"):
        key_value_caches(torch.zeros(BLOCKS, HEADS, PAGE, 2 * DIM), 4)


def vllms_attention_cache_shape(blocks=4, block_size=16, kv_heads=2, head_size=64):
    """One layer's K/V cache shape as the installed vLLM lays out the Triton backend's (0.25: the backend's
    ``get_kv_cache_shape``; 0.33: the per-layer view ``[blocks, H, block_size, C]``, C in bytes, of its spec)."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    if hasattr(TritonAttentionBackend, "get_kv_cache_shape"):
        return tuple(TritonAttentionBackend.get_kv_cache_shape(blocks, block_size, kv_heads, head_size))
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.bfloat16)
    *shape, channel_bytes = compute_layer_kv_cache_shape_bytes(spec, blocks)
    return (*shape, channel_bytes // torch.bfloat16.itemsize)


def test_the_installed_vllms_cache_layout_is_one_the_tree_attention_reads():
    shape = vllms_attention_cache_shape()
    assert shape in ((4, 2, 16, 2, 64), (4, 2, 16, 128)), shape  # (0.25's; 0.33's [blocks, H, block_size, 2D])
    key, value = key_value_caches(torch.zeros(shape), 64)
    assert key.shape == value.shape == (4, 16, 2, 64)


def test_the_tree_attention_takes_no_fused_output_quantization():
    """vLLM's fusion pass fuses an attention's FP8 output quantization where the implementation says it can; vLLM's
    Triton implementation can, the tree kernel cannot (a tree step would raise), so ddtree's says no."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from ddtree.vllm.attention import DDTreeAttentionImpl

    try:
        from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym
    except ImportError:  # (moved in another vLLM)
        pytest.skip("vLLM's FP8 static quantization key is not where 0.25 keeps it")
    impl = object.__new__(DDTreeAttentionImpl)
    assert TritonAttentionImpl.fused_output_quant_supported(impl, kFp8StaticTensorSym)  # the premise: vLLM's can
    assert impl.fused_output_quant_supported(kFp8StaticTensorSym) is False
