"""Patch 10: a whole-tree step's GDN metadata equals what vLLM's own builder writes, and nothing else takes the
fast path. vLLM's ``GDNAttentionMetadataBuilder.build`` runs here on CPU tensors as the oracle."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder  # noqa: E402

from ddtree.vllm import context, gdn_metadata, patches  # noqa: E402
from ddtree.vllm.context import PublishedStep, TreeAttentionInputs  # noqa: E402
from ddtree.vllm.gdn import GdnTreeStep  # noqa: E402

NUM_SPEC = 4  # budget: trees of 5 nodes
MAX_BS = 40  # the builder's graph buffers, in tokens (vLLM: max_num_seqs x (num_spec + 1), capped)


def vllms_build():
    """vLLM's own build, also when patch 10 is applied in this process."""
    build = GDNAttentionMetadataBuilder.build
    return getattr(build, "__wrapped__", build)


def fake_builder(max_bs: int = MAX_BS):
    """The attributes vLLM's build reads, with graph buffers filled with junk (a stale earlier step)."""

    def junk(*shape, dtype=torch.int32):
        return torch.full(shape, 77, dtype=dtype) if dtype != torch.bool else torch.zeros(shape, dtype=torch.bool)

    return SimpleNamespace(
        use_spec_decode=True,
        use_full_cuda_graph=True,
        num_spec=NUM_SPEC,
        decode_cudagraph_max_bs=max_bs,
        kv_cache_spec=None,
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none")),
        gdn_prefill_backend="triton",
        spec_state_indices_tensor=junk(max_bs, NUM_SPEC + 1),
        non_spec_state_indices_tensor=junk(max_bs),
        spec_sequence_masks=junk(max_bs, dtype=torch.bool),
        spec_token_indx=junk(max_bs),
        non_spec_token_indx=junk(max_bs),
        spec_query_start_loc=junk(max_bs + 1),
        non_spec_query_start_loc=junk(max_bs + 1),
        num_accepted_tokens=junk(max_bs),
    )


def common_metadata(query_lens, seq_lens, state_blocks):
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    num_reqs = len(query_lens)
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(),
        query_start_loc_cpu=starts.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=int(starts[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(state_blocks, dtype=torch.int32).view(num_reqs, 1),
        slot_mapping=torch.zeros(int(starts[-1]), dtype=torch.int64),
    )


def publish_trees(query_lens, mixed=False):
    tokens = sum(query_lens)
    step = GdnTreeStep(
        token_index=torch.arange(tokens),
        other_index=torch.tensor([tokens]) if mixed else None,
        node_offsets=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        ancestor_bits=torch.zeros(tokens, 1, dtype=torch.int32),
        conv_index=torch.zeros(tokens, 4, dtype=torch.int64),
        num_requests=len(query_lens),
        num_tree_tokens=tokens,
    )
    attention = TreeAttentionInputs(
        row_start=torch.zeros(len(query_lens), dtype=torch.int32),
        ancestor_bits=step.ancestor_bits,
        num_reqs=len(query_lens),
        num_tokens=tokens,
    )
    context.publish(PublishedStep(attention=attention, gdn=step))


@pytest.fixture(autouse=True)
def nothing_published(monkeypatch):
    import vllm.v1.attention.backends.gdn_attn as gdn_attn

    # vLLM pins host tensors before its copies when torch was built with CUDA; there is no GPU here.
    monkeypatch.setattr(gdn_attn, "async_tensor_h2d", lambda data, device, dtype=None: data.to(device, dtype))
    context.withdraw()
    yield
    context.withdraw()


@pytest.mark.parametrize(
    "query_lens",
    [
        [5, 5, 5],  # whole trees of budget 4
        [5, 3, 5],  # one tree cut to 3 nodes (max_model_len): still every request a spec decode
        [5],
    ],
)
@pytest.mark.skipif(
    not patches.whole_tree_gdn_metadata_matches(), reason="patch 10 is not installed on this vLLM: its own build runs"
)
def test_whole_tree_metadata_equals_vllms_build(query_lens):
    drafts = torch.tensor([n - 1 for n in query_lens], dtype=torch.int32)
    seq_lens = [100 + 7 * i + n for i, n in enumerate(query_lens)]
    blocks = [11 + 3 * i for i in range(len(query_lens))]
    accepted = torch.tensor([2, 1, 4][: len(query_lens)], dtype=torch.int32)
    publish_trees(query_lens)

    theirs_builder, ours_builder = fake_builder(), fake_builder()
    theirs = vllms_build()(theirs_builder, 0, common_metadata(query_lens, seq_lens, blocks), accepted, drafts)
    ours = gdn_metadata.whole_tree_metadata(
        ours_builder, common_metadata(query_lens, seq_lens, blocks), accepted, drafts
    )
    assert ours is not None
    # Field by field equal, each tensor a view of the same buffer in its own builder: compare values, then
    # that ours points into ours_builder where vLLM's points into theirs_builder.
    for field in dataclasses.fields(theirs):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b) and a.dtype == b.dtype, field.name
        else:
            assert a == b, field.name
    for name in vars(theirs_builder):
        buffer = getattr(theirs_builder, name)
        if isinstance(buffer, torch.Tensor):
            assert torch.equal(getattr(ours_builder, name), buffer), f"graph buffer {name} differs"
    assert ours.spec_state_indices_tensor.data_ptr() == ours_builder.spec_state_indices_tensor.data_ptr()


def test_the_patched_build_serves_whole_tree_steps_and_delegates_the_rest():
    calls = []

    def original(self, *args):
        calls.append(args)
        return "vllm"

    build = patches._whole_tree_gdn_build(original)
    served = gdn_metadata.builds
    query_lens, drafts = [5, 5], torch.tensor([4, 4], dtype=torch.int32)
    accepted = torch.ones(2, dtype=torch.int32)
    m = common_metadata(query_lens, [50, 60], [3, 4])
    assert build(fake_builder(), 0, m, accepted, drafts) == "vllm" and len(calls) == 1  # nothing published
    publish_trees(query_lens)
    assert build(fake_builder(), 0, m, accepted, drafts).num_spec_decodes == 2 and len(calls) == 1
    assert gdn_metadata.builds == served + 1  # counted: a GPU run's summary shows the path was taken


@pytest.mark.parametrize(
    "case",
    ["nothing published", "mixed step", "a request without a tree", "no drafts at all", "beyond the graph buffers"],
)
def test_other_steps_are_left_to_vllm(case):
    query_lens = [5, 5]
    drafts = torch.tensor([4, 4], dtype=torch.int32)
    builder = fake_builder()
    if case != "nothing published":
        publish_trees(query_lens, mixed=case == "mixed step")
    if case == "a request without a tree":
        drafts[1] = -1
    if case == "no drafts at all":
        query_lens, drafts = [1, 1], torch.zeros(2, dtype=torch.int32)
        publish_trees(query_lens)
    if case == "beyond the graph buffers":
        builder = fake_builder(max_bs=8)
    m = common_metadata(query_lens, [50, 60], [3, 4])
    assert gdn_metadata.whole_tree_metadata(builder, m, torch.ones(2, dtype=torch.int32), drafts) is None


def test_turned_off_in_process_every_build_is_vllms():
    query_lens, drafts = [5, 5], torch.tensor([4, 4], dtype=torch.int32)
    m = common_metadata(query_lens, [50, 60], [3, 4])
    publish_trees(query_lens)
    previous = gdn_metadata.set_active(False)
    try:
        assert previous is True
        assert gdn_metadata.whole_tree_metadata(fake_builder(), m, torch.ones(2, dtype=torch.int32), drafts) is None
    finally:
        gdn_metadata.set_active(True)
    assert gdn_metadata.whole_tree_metadata(fake_builder(), m, torch.ones(2, dtype=torch.int32), drafts) is not None


def test_patch_10_is_for_vllm_0_25_only():
    """Its metadata equals vLLM 0.25's build (above); 0.33's builder stages other buffers, so there vLLM builds."""
    assert patches.whole_tree_gdn_metadata_matches("0.25.1") and patches.whole_tree_gdn_metadata_matches("0.25.3")
    assert not patches.whole_tree_gdn_metadata_matches("0.33.0")
