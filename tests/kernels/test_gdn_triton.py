"""The Triton tree GDN kernels (verify + commit) equal the torch reference.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1, in one subprocess because the flag is read
when triton is imported); on a CUDA machine the compiled kernels are checked too. Small head dims keep the
interpreter fast; the tree sizes (1, 17, 64, 130 nodes) cross the 16/32/64-node block boundaries.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _triton_interpreter import child_env  # noqa: E402
from _gdn_testing import chain_parents, random_gdn_inputs, random_parents, root_path_outputs_by_state_walk, star_parents  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
GDN_ARGS = ("q", "k", "v", "g", "beta")


def _batch(trees, num_k_heads, num_v_heads, head_k_dim, head_v_dim, seed=0):
    requests = [
        random_gdn_inputs(len(p), num_k_heads, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float64, seed=seed + i)
        for i, p in enumerate(trees)
    ]
    stacked = {name: torch.cat([r[name] for r in requests]) for name in GDN_ARGS}
    states = torch.stack([r["initial_state"] for r in requests])
    sizes = torch.tensor([len(p) for p in trees])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    return requests, stacked, states, offsets, torch.tensor(sum(trees, []))


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1e-30))


def check_fp32_trees_against_reference(
    device: str,
    shapes=(("random", 130), ("chain", 1), ("chain", 17), ("star", 64), ("random", 33)),
    head_k_dim=16,
    **kernel_options,
) -> None:
    """Random, single-node, chain, star and random trees (sizes cross the block boundaries) in one
    batch, GQA ratio 3."""
    from ddtree.kernels.gdn_reference import tree_gated_delta_rule_batched
    from ddtree.kernels.gdn_triton import tree_gated_delta_rule_triton

    gen = torch.Generator().manual_seed(0)
    makers = {"random": lambda n: random_parents(n, gen), "chain": chain_parents, "star": star_parents}
    trees = [makers[kind](n) for kind, n in shapes]
    # Dv = 24 is not a power of two: exercises the padded value-column blocks.
    requests, stacked, states, offsets, parents = _batch(trees, 1, 3, head_k_dim, 24)
    fp32 = {name: value.float().to(device) for name, value in stacked.items()}
    out, deltas, cum_log_decay = tree_gated_delta_rule_triton(
        *(fp32[name] for name in GDN_ARGS),
        parents.to(device),
        offsets.to(device),
        states.float().to(device),
        **kernel_options,
    )
    reference, cache = tree_gated_delta_rule_batched(
        *(fp32[name] for name in GDN_ARGS), parents, offsets, states.float().to(device), return_cache=True
    )
    assert _relative_error(out, reference) <= 1e-4, _relative_error(out, reference)
    assert _relative_error(deltas, cache.deltas) <= 1e-4
    assert _relative_error(cum_log_decay, cache.cumulative_log_decay) <= 1e-5
    for request in range(1, min(3, len(trees))):  # and against the fp64 sequential oracle
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        expected = root_path_outputs_by_state_walk(requests[request], trees[request])
        assert _relative_error(out[rows].cpu(), expected) <= 1e-4


def check_bf16_raw_gating_pool_and_commit(device: str) -> None:
    """bf16 q/k/v with raw gate projections, a vLLM-layout state pool read by index, and the WY commit."""
    from ddtree.kernels.gdn_reference import commit_recurrent_state, tree_gated_delta_rule_batched
    from ddtree.kernels.gdn_triton import (
        ancestor_bits_from_parents,
        pad_accepted_paths,
        tree_gdn_commit,
        tree_gdn_verify,
    )
    from ddtree.kernels.topology import root_path

    gen = torch.Generator().manual_seed(1)
    trees = [random_parents(40, gen), chain_parents(5), [-1, 0, 0, 1, 2, 2]]
    _, stacked, states, offsets, parents = _batch(trees, 2, 6, 32, 16, seed=10)
    num_nodes, num_v_heads = stacked["g"].shape
    a_log = torch.empty(num_v_heads).uniform_(-3.0, 1.0, generator=gen)
    dt_bias = torch.randn(num_v_heads, generator=gen)
    a = torch.randn(num_nodes, num_v_heads, generator=gen).bfloat16()
    b = torch.randn(num_nodes, num_v_heads, generator=gen).bfloat16()
    q, k, v = (stacked[name].bfloat16() for name in ("q", "k", "v"))

    # vLLM keeps [slots, Hv, Dv, Dk]; the kernel reads it through a transposed view. Slot 0 unused.
    slots = torch.tensor([3, 1, 4])
    pool_vllm = torch.randn(6, num_v_heads, 16, 32, generator=gen)
    pool_vllm[slots] = states.float().transpose(-1, -2)
    pool_before = pool_vllm.clone()
    dev = lambda x: x.to(device)  # noqa: E731
    bits = ancestor_bits_from_parents(dev(parents), dev(offsets))
    out, deltas, cum = tree_gdn_verify(
        dev(q),
        dev(k),
        dev(v),
        dev(a),
        dev(b),
        dev(offsets.int()),
        bits,
        dev(pool_vllm).transpose(-1, -2),
        dev(slots.int()),
        a_log=dev(a_log),
        dt_bias=dev(dt_bias),
        out_dtype=torch.float32,
        block_v=8,
    )
    assert torch.equal(pool_vllm, pool_before), "verification must not write the state pool"

    # Reference on the same bf16-rounded inputs, gates as vLLM computes them, fp32 math.
    g = -a_log.exp() * F.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    reference, cache = tree_gated_delta_rule_batched(
        q.float(), k.float(), v.float(), g, beta, parents, offsets, states.float(), return_cache=True
    )
    assert _relative_error(out.cpu(), reference) <= 1e-4, _relative_error(out.cpu(), reference)
    assert _relative_error(deltas.cpu(), cache.deltas) <= 1e-4
    assert _relative_error(cum.cpu(), cache.cumulative_log_decay) <= 1e-5

    # Commit: accept the path to the last node of each tree, write into fresh slots of the same pool.
    paths = [root_path(torch.tensor(tree), len(tree) - 1) for tree in trees]
    padded, lengths = pad_accepted_paths(paths, device=device)
    destination = torch.tensor([5, 2, 0]).int()
    pool = dev(pool_vllm).transpose(-1, -2)
    tree_gdn_commit(dev(k), deltas, cum, dev(offsets.int()), padded, lengths, pool, dev(slots.int()), dev(destination))
    for request, path in enumerate(paths):
        expected = commit_recurrent_state(cache.request(request), path, states[request].float())
        committed = pool[int(destination[request])].cpu()
        assert _relative_error(committed, expected) <= 1e-4
        assert torch.equal(pool[int(slots[request])].cpu(), pool_before[int(slots[request])].transpose(-1, -2))


def check_tree_conv_qkv_against_torch_form(device: str) -> None:
    """The fused conv (gather along root paths + conv + bias + SiLU, split into q, k, v) equals the torch form,
    for both conv-state layouts, strided rows, no bias or activation, bf16 and fp32."""
    from ddtree.kernels.gdn_triton import tree_conv_qkv
    from ddtree.vllm.gdn import tree_conv

    gen = torch.Generator().manual_seed(3)
    width, key_width, value_width, slots_count = 4, 24, 40, 5
    channels = 2 * key_width + value_width
    sizes = [7, 1, 12]  # node counts per request (a root-only tree too)
    num_nodes, num_requests = sum(sizes), len(sizes)
    # conv_index rows: history rows r * (W - 1) + j, then node rows R * (W - 1) + t; last column is the node.
    index = []
    for r, size in enumerate(sizes):
        first = sum(sizes[:r])
        for node in range(size):
            earlier = [r * (width - 1) + j for j in range(width - 1)] + [
                num_requests * (width - 1) + first + i for i in range(node)
            ]
            picks = sorted(torch.randperm(len(earlier), generator=gen)[: width - 1].tolist())
            index.append([earlier[i] for i in picks] + [num_requests * (width - 1) + first + node])
    conv_index = torch.tensor(index, dtype=torch.int64, device=device)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device=device)
    for dtype, sd_layout, with_bias, activation in [
        (torch.float32, False, True, "silu"),
        (torch.bfloat16, True, True, "silu"),
        (torch.float32, True, False, None),
    ]:
        wide = torch.randn(num_nodes, channels + 8, generator=gen).to(device=device, dtype=dtype)
        x = wide[:, 3 : 3 + channels]  # rows with a stride larger than C
        if sd_layout:
            conv_state = torch.randn(slots_count, width - 1, channels, generator=gen).to(device, dtype).transpose(1, 2)
        else:
            conv_state = torch.randn(slots_count, channels, width - 1, generator=gen).to(device, dtype)
        weight = (torch.randn(channels, width, generator=gen) * 0.5).to(device, dtype)
        bias = (torch.randn(channels, generator=gen) * 0.1).to(device, dtype) if with_bias else None
        q, k, v = tree_conv_qkv(x, conv_state, slots, conv_index, weight, bias, activation, key_width)
        expected = tree_conv(x, conv_state, slots, conv_index, weight, bias, activation)
        got = torch.cat([q, k, v], dim=1)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous() and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _relative_error(got, expected) <= tol, (dtype, sd_layout, _relative_error(got, expected))
    with pytest.raises(ValueError, match="conv_index must have shape"):
        tree_conv_qkv(x, conv_state, slots, conv_index[:, :2], weight, bias, activation, key_width)


def run_all_checks(device: str) -> None:
    import time

    for name, check in [
        # defaults: 16-node row blocks, 32-node column tiles, tf32x3 (fp32 in the interpreter)
        ("fp32 defaults", lambda: check_fp32_trees_against_reference(device)),
        # 32-node row blocks, 16-node column tiles, 3 value-column programs, 2 head-dim chunks (the
        # smallest chunk: tl.dot needs K >= 16 when compiled)
        (
            "fp32 small tiles",
            lambda: check_fp32_trees_against_reference(
                device,
                shapes=(("random", 70), ("chain", 40), ("star", 5)),
                head_k_dim=32,
                block_t=32,
                block_c=16,
                block_v=8,
                block_kc=16,
                precision="ieee",
            ),
        ),
        ("bf16 raw gates, pool, commit", lambda: check_bf16_raw_gating_pool_and_commit(device)),
        ("tree conv into q, k, v", lambda: check_tree_conv_qkv_against_torch_form(device)),
    ]:
        start = time.perf_counter()
        check()
        print(f"{name}: ok in {time.perf_counter() - start:.1f} s")


def test_triton_kernels_in_interpreter_mode_match_reference():
    env = child_env(TESTS_DIR, interpret=True)
    script = (
        "import _triton_interpreter; _triton_interpreter.patch_triton_interpreter_for_numpy2(); import test_gdn_triton as t; "
        "import torch; torch.set_num_threads(1); t.run_all_checks('cpu')"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    print(result.stdout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_gpu_match_reference():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode is covered by the CPU test")
    run_all_checks("cuda")


def test_ancestor_bits_match_the_dense_mask():
    from ddtree.kernels.gdn_triton import ancestor_bits_from_parents
    from ddtree.kernels.topology import ancestor_or_self_mask

    gen = torch.Generator().manual_seed(2)
    trees = [random_parents(70, gen), chain_parents(40), star_parents(33), [-1]]
    parents = torch.tensor(sum(trees, []))
    offsets = torch.tensor([0] + [len(t) for t in trees]).cumsum(0)
    bits = ancestor_bits_from_parents(parents, offsets)
    assert bits.dtype == torch.int32 and list(bits.shape) == [len(parents), 3]
    words = bits.long() & 0xFFFFFFFF
    for request, tree in enumerate(trees):
        rows = words[int(offsets[request]) : int(offsets[request + 1])]
        columns = torch.arange(96)
        decoded = ((rows[:, columns // 32] >> (columns % 32)) & 1).bool()
        expected = torch.zeros(len(tree), 96, dtype=torch.bool)
        expected[:, : len(tree)] = ancestor_or_self_mask(torch.tensor(tree))
        assert torch.equal(decoded, expected)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(block_kc=8), "block_kc must be a power of two >= 16"),
        (dict(block_kc=24), "block_kc must be a power of two >= 16"),
        (dict(block_t=64), "block_t must be 16 or 32"),
        (dict(precision="fp16"), "precision must be one of"),
    ],
)
def test_verify_refuses_block_settings_a_compiled_kernel_cannot_take(options, message):
    """The interpreter runs a tl.dot with K < 16 that the GPU compiler rejects: the wrapper must refuse it
    first, on any device, with the setting's name."""
    from ddtree.kernels.gdn_triton import ancestor_bits_from_parents, tree_gdn_verify

    _, stacked, states, offsets, parents = _batch([chain_parents(3)], 1, 1, 16, 16)
    bits = ancestor_bits_from_parents(parents, offsets)
    with pytest.raises(ValueError, match=message):
        tree_gdn_verify(
            *(stacked[name].float() for name in GDN_ARGS),
            offsets.int(),
            bits,
            states.float(),
            torch.zeros(1, dtype=torch.int32),
            **options,
        )


@pytest.mark.parametrize(
    "requests, heads, head_v_dim, block_v",
    [
        (1, 48, 128, 64),  # Qwen3.6-27B, batch 1: 64 beat 128 (gpu-h200-device-plan-c4ff208, block_c 32)
        (8, 48, 128, 128),  # batch 8: 128 beat 64; the switch: 384 request-heads
        (32, 48, 128, 128),  # batch 32: 128 beat 64
        (7, 48, 128, 64),
        (1, 4, 8, 16),  # tiny heads: one block covers the head (the smallest tl.dot width)
    ],
)
def test_default_value_block_follows_the_h200_sweep(requests, heads, head_v_dim, block_v):
    from ddtree.kernels.gdn_triton import _default_block_v

    assert _default_block_v(requests * heads, head_v_dim) == block_v
