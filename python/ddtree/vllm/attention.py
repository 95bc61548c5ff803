"""DDTree's attention backend for the target (registered as vLLM's CUSTOM backend).

vLLM 0.25.1 has no tree attention (TREE_ATTN was removed in 0.22, and the
surviving ``unified_attention(qq_bias=...)`` shares one bias across the
batch). This backend is vLLM's Triton backend with one change: when the step
verifies trees, ``forward`` runs :func:`ddtree.kernels.paged_attention_triton.paged_tree_attention`,
which masks each tree request with its own ancestor bitmasks and keeps every
other sequence (prefills, chunks, plain decodes) causal, all in one launch.
Steps without trees take the stock Triton path unchanged. Under CUDA graphs, steps in
which every request verifies a whole tree replay FULL graphs (the builder declares
UNIFORM_BATCH support); the runner keeps the tree inputs at fixed addresses.

The per-step tree inputs reach the builder through :mod:`ddtree.vllm.context`
(published by the model runner after it builds the verification plan and
before vLLM builds the attention metadata, withdrawn once the forward is done);
the builder attaches them to this backend's metadata.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from ddtree.kernels.paged_attention_triton import paged_tree_attention
from ddtree.vllm.context import TreeAttentionInputs, published


@dataclasses.dataclass
class DDTreeAttentionMetadata(TritonAttentionMetadata):
    tree: Optional[TreeAttentionInputs] = None


class DDTreeAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    # FULL graphs of uniform batches: every request verifies a whole tree, whose layout the runner writes
    # into persistent buffers (ddtree.vllm.graphs) before a replay; the launch grid depends only on the
    # graph's request count and tree size. Mixed batches take PIECEWISE graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        step = published()
        tree = step.attention if step is not None else None
        if tree is not None:
            if (
                tree.num_reqs != common_attn_metadata.num_reqs
                or tree.num_tokens != common_attn_metadata.num_actual_tokens
            ):
                raise RuntimeError(
                    "DDTree tree-attention inputs do not match the batch being built "
                    f"({tree.num_reqs} requests / {tree.num_tokens} tokens vs "
                    f"{common_attn_metadata.num_reqs} / {common_attn_metadata.num_actual_tokens})"
                )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(TritonAttentionMetadata)}
        return DDTreeAttentionMetadata(**fields, tree=tree)


def key_value_caches(kv_cache: torch.Tensor, head_size: int):
    """``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_size]`` (views, the head
    dimension contiguous), of one layer's cache as vLLM's Triton backend lays it out: 0.25's
    ``[num_blocks, 2, block_size, H, D]``, or 0.33's ``[num_blocks, H, block_size, 2 * D]`` (K then V on the last
    dimension, ``triton_attn.py:653-657``; physical stride order set by the KV-cache layout)."""
    if kv_cache.dim() == 5 and kv_cache.shape[1] == 2:
        return kv_cache.unbind(1)
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * head_size:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
        return key_cache, value_cache
    raise ValueError(
        f"DDTree: a KV cache of shape {tuple(kv_cache.shape)} is in no layout the tree attention knows for "
        f"head_size={head_size} ([blocks, 2, block_size, heads, head_size] or [blocks, heads, block_size, "
        "2 * head_size])"
    )


class DDTreeAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = []
        if self.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if tuple(self.sliding_window) != (-1, -1):
            unsupported.append("sliding window")
        if self.logits_soft_cap:
            unsupported.append("logit soft-capping")
        if self.sinks is not None:
            unsupported.append("attention sinks")
        if self.attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {self.attn_type}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            unsupported.append(f"kv_cache_dtype={self.kv_cache_dtype}")
        if getattr(self, "chunk_lookback", -1) not in (-1, None):
            unsupported.append("chunked local attention")
        if unsupported:
            raise NotImplementedError(
                "DDTree's tree-attention backend does not support "
                + ", ".join(unsupported)
                + " (method 'ddtree' supports plain causal decoder attention targets for now)"
            )

    def fused_output_quant_supported(self, quant_key) -> bool:
        """No: the tree kernel writes unquantized outputs (vLLM's Triton path fuses an FP8 output quantization, which
        vLLM's fusion pass would then ask of every step, tree steps included)."""
        return False

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        tree = getattr(attn_metadata, "tree", None) if attn_metadata is not None else None
        if tree is None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("DDTree tree attention does not support fused output quantization")
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = key_value_caches(kv_cache, self.head_size)
        out = output[:n]
        if out.dim() == 2:
            out = out.view(n, self.num_heads, self.head_size)
        paged_tree_attention(
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            tree.row_start,
            tree.ancestor_bits,
            self.scale,
            attn_metadata.max_query_len,
            out=out,
            # Steers the split-KV count (a host-side int; correctness does not depend on it): few sequences
            # over long contexts split their keys across programs, 1.2-1.7x faster at batch 1 and 512-16k
            # keys on an H200, single pass otherwise (benches/results/gpu-x2-5a1fbe7/c8/tree_attention.md).
            max_seq_len=attn_metadata.max_seq_len,
            # A captured graph replays one split count for every context length, and its workspace would have
            # to outlive the capture: graphs run the single pass.
            num_kv_splits=1 if torch.cuda.is_current_stream_capturing() else None,
        )
        return output


class DDTreeAttentionBackend(TritonAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return DDTreeAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeAttentionMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
