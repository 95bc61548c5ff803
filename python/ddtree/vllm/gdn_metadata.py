"""vLLM's GDN attention metadata for a step in which every request verifies a tree, built without host syncs.

vLLM builds GDN metadata once per KV-cache group and step (10 builds per step at Qwen3.6-27B's shape, measured), and its
builder cannot reuse one group's build for the next (``supports_update_block_table`` is False). Each build
classifies the batch on the host (boolean masks, ``.item()``, ``nonzero``) before it writes the builder's
CUDA-graph buffers. vLLM's own chain hides that work behind the GPU with asynchronous scheduling; a ddtree step
cannot (the trees are built on the host between the drafter and the verification), so every host millisecond
there is a millisecond the GPU waits (``benches/results/gpu-h200-27b-shape-05fced2``: vLLM's GDN builds were the
largest host phase the GPU waited on; ``gpu-h200-gdn-metadata-ffa8839``: this path took a batch-1 step at the
27B shape from 35.46 to 33.44 ms, in one engine).

A step whose scheduled tokens are all tree tokens is one shape only: ``B`` spec-decode requests, no decodes,
no prefills. For it :func:`whole_tree_metadata` writes exactly what vLLM's ``GDNAttentionMetadataBuilder.build``
writes in its FULL-graph branch (the same buffers, the same values) and returns metadata equal field by field;
``tests/vllm_adapter/test_gdn_metadata.py`` checks that against vLLM's own ``build`` on the same inputs. Any
other step (prefills, chunks, padded requests, shapes beyond the builder's graph buffers) returns None and
vLLM's build runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from ddtree.vllm.context import published

#: Off: every build is vLLM's (the benches flip it between two timed runs of one engine, an A/B in one process;
#: ``DDTREE_WHOLE_TREE_GDN_METADATA=0`` does not install the patch at all).
active = True
#: GDN metadata builds this process served (one per GDN KV-cache group and whole-tree step): shows that a run
#: took this path (``DDTreeGPUModelRunner.ddtree_summary``).
builds = 0


def set_active(on: bool) -> bool:
    """Turns the whole-tree path on or off in this process; returns the previous setting."""
    global active
    previous, active = active, bool(on)
    return previous


#: The last verdict of :func:`is_whole_tree_step`, ``(step, num_reqs, verdict)``: vLLM builds every GDN group's
#: metadata of a step in turn from the same inputs, so the tensor checks run once per step, not once per group.
_last_verdict: tuple = (None, 0, False)


def is_whole_tree_step(num_decode_draft_tokens_cpu: Optional[torch.Tensor], num_reqs: int) -> bool:
    """Whether the published step verifies a tree in every one of the batch's ``num_reqs`` requests and every one
    of them is a spec decode to vLLM."""
    global _last_verdict
    current = published()
    step = current.gdn if current is not None else None
    if step is None or step.other_index is not None or step.num_requests != num_reqs:
        return False
    if _last_verdict[0] is step and _last_verdict[1] == num_reqs:
        return _last_verdict[2]
    verdict = num_decode_draft_tokens_cpu is not None and num_decode_draft_tokens_cpu.shape[0] >= num_reqs
    if verdict:
        drafts = num_decode_draft_tokens_cpu[:num_reqs]
        # vLLM's build treats a batch whose requests all have zero drafts as plain decodes.
        verdict = bool((drafts >= 0).all()) and int(drafts.sum()) > 0
    _last_verdict = (step, num_reqs, verdict)
    return verdict


def whole_tree_metadata(builder, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu):
    """vLLM's GDN metadata for a whole-tree step (see the module), or None to let vLLM build it."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    m = common_attn_metadata
    if not active or not (builder.use_spec_decode and builder.use_full_cuda_graph) or num_accepted_tokens is None:
        return None
    num_reqs = m.num_reqs
    if not is_whole_tree_step(num_decode_draft_tokens_cpu, num_reqs):
        return None
    num_tokens = int(m.query_start_loc_cpu[num_reqs])
    if num_reqs > builder.decode_cudagraph_max_bs or num_tokens > builder.decode_cudagraph_max_bs:
        return None
    block_table = mamba_get_block_table_tensor(
        m.block_table_tensor, m.seq_lens, builder.kv_cache_spec, builder.vllm_config.cache_config.mamba_cache_mode
    )
    # The FULL-graph branch of vLLM's build, for B spec decodes and nothing else.
    states = builder.spec_state_indices_tensor[:num_reqs]
    states.copy_(block_table[:num_reqs, : builder.num_spec + 1], non_blocking=True)
    masks = builder.spec_sequence_masks[:num_reqs]
    masks.fill_(True)
    spec_tokens = min(num_reqs * (builder.num_spec + 1), num_tokens)
    token_index = builder.spec_token_indx[:spec_tokens]
    torch.arange(spec_tokens, dtype=token_index.dtype, device=token_index.device, out=token_index)
    query_start = builder.spec_query_start_loc[: num_reqs + 1]
    query_start.copy_(m.query_start_loc[: num_reqs + 1], non_blocking=True)
    accepted = builder.num_accepted_tokens[:num_reqs]
    accepted.copy_(num_accepted_tokens[:num_reqs], non_blocking=True)
    global builds
    builds += 1
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=num_reqs,
        num_spec_decode_tokens=num_tokens,
        num_actual_tokens=m.num_actual_tokens,
        has_initial_state=None,
        spec_query_start_loc=query_start,
        non_spec_query_start_loc=None,
        spec_state_indices_tensor=states,
        non_spec_state_indices_tensor=None,
        spec_sequence_masks=masks,
        spec_token_indx=token_index,
        non_spec_token_indx=builder.non_spec_token_indx[:0],
        num_accepted_tokens=accepted,
    )
