"""Paged tree attention (vLLM cache layout) against the project's dense reference.

A fake paged cache with shuffled block tables holds a mixed batch: a prefill,
a plain decode and tree requests of different shapes, as vLLM lays them out
in one step. The Triton kernel runs under Triton's interpreter on CPU (in a
subprocess: the flag is read when kernels are decorated) and natively when
CUDA is available.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ddtree  # noqa: E402
from ddtree.kernels.attention_reference import tree_attention  # noqa: E402
from ddtree.kernels.kv_moves import apply_kv_moves_paged  # noqa: E402
from ddtree.kernels.paged_attention_reference import paged_tree_attention_reference  # noqa: E402

from _paged_cache import random_paged_cache  # noqa: E402
from _triton_interpreter import child_env  # noqa: E402


def make_batch(seed=0, dtype=torch.float32, device="cpu", num_heads=4, num_kv_heads=2, head_size=32, page=16):
    """Returns the kernel inputs plus the dense per-sequence tensors for the oracle."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    # (context_len, kind, budget): kinds "prefill" (q = 9), "decode" (q = 1), "tree"
    seqs = [(0, "prefill", 0), (37, "tree", 12), (5, "decode", 0), (70, "tree", 30), (16, "tree", 1), (3, "prefill", 0)]
    q_lens, trees = [], []
    for ctx, kind, budget in seqs:
        if kind == "tree":
            lp = np.sort(rng.normal(size=(5, 4)).astype(np.float32), axis=-1)[:, ::-1] - 10.0
            ids = np.stack([rng.permutation(40)[:4] for _ in range(5)]).astype(np.int64)
            tree = ddtree.build_tree(np.ascontiguousarray(lp), ids, budget)
            trees.append(tree)
            q_lens.append(len(tree))
        else:
            trees.append(None)
            q_lens.append(9 if kind == "prefill" else 1)
    seq_lens = [ctx + q for (ctx, _, _), q in zip(seqs, q_lens)]
    block_table, key_cache, value_cache = random_paged_cache(seq_lens, page, num_kv_heads, head_size, dtype, gen)
    total = sum(q_lens)
    query = torch.randn(total, num_heads, head_size, generator=gen).to(dtype)
    query_start = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    row_start, rows = [], []
    bits_rows = 0
    words = max(1, max((len(t) + 31) // 32 for t in trees if t is not None))
    for t in trees:
        if t is None:
            row_start.append(-1)
        else:
            row_start.append(bits_rows)
            c = ddtree.compile_tree(t, 0).ancestor_bits
            padded = np.zeros((len(t), words), dtype=np.uint32)
            padded[:, : c.shape[1]] = c
            rows.append(padded)
            bits_rows += len(t)
    bits = torch.from_numpy(np.concatenate(rows).view(np.int32))
    inputs = dict(
        query=query.to(device),
        key_cache=key_cache.to(device),
        value_cache=value_cache.to(device),
        block_table=block_table.to(device),
        query_start_loc=query_start.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        row_start=torch.tensor(row_start, dtype=torch.int32, device=device),
        ancestor_bits=bits.to(device),
        scale=head_size**-0.5,
    )
    return inputs, seqs, q_lens, trees


def dense_oracle(inputs, seqs, q_lens, trees):
    """Per sequence: the project's dense tree attention, or plain causal attention."""
    kc, vc, bt = inputs["key_cache"].cpu().float(), inputs["value_cache"].cpu().float(), inputs["block_table"].cpu()
    page = kc.shape[1]
    q = inputs["query"].cpu().float()
    outs, start = [], 0
    for (ctx, kind, _), q_len, tree in zip(seqs, q_lens, trees):
        s_len = ctx + q_len
        pos = torch.arange(s_len)
        keys = kc[bt[len(outs), pos // page].long(), pos % page]
        values = vc[bt[len(outs), pos // page].long(), pos % page]
        qq = q[start : start + q_len]
        if tree is not None:
            outs.append(
                tree_attention(
                    qq,
                    keys[ctx:],
                    values[ctx:],
                    keys[:ctx],
                    values[:ctx],
                    torch.from_numpy(tree.parents.astype(np.int64)),
                    inputs["scale"],
                )
            )
        else:
            group = qq.shape[1] // keys.shape[1]
            k = keys.repeat_interleave(group, 1)
            v = values.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", qq, k) * inputs["scale"]
            mask = pos[None, :] <= (ctx + torch.arange(q_len))[:, None]
            scores = scores.masked_fill(~mask[None], float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def test_paged_reference_matches_dense_tree_attention():
    inputs, seqs, q_lens, trees = make_batch()
    got = paged_tree_attention_reference(**inputs)
    want = dense_oracle(inputs, seqs, q_lens, trees)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tree_node_equals_causal_attention_of_its_root_path():
    """The property verification relies on: node i sees exactly prefix + its root path."""
    inputs, seqs, q_lens, trees = make_batch(seed=3)
    out = paged_tree_attention_reference(**inputs)
    s = 3  # the 30-node tree
    ctx, tree = seqs[s][0], trees[s]
    q0 = int(inputs["query_start_loc"][s])
    kc, vc, bt = inputs["key_cache"], inputs["value_cache"], inputs["block_table"]
    page = kc.shape[1]
    for node in [0, 5, len(tree) - 1]:
        path = [node]
        while path[-1] != 0:
            path.append(int(tree.parents[path[-1]]))
        path = path[::-1]
        pos = torch.tensor(list(range(ctx)) + [ctx + p for p in path])
        k = kc[bt[s, pos // page].long(), pos % page].repeat_interleave(2, 1)
        v = vc[bt[s, pos // page].long(), pos % page].repeat_interleave(2, 1)
        qq = inputs["query"][q0 + node]
        w = (torch.einsum("hd,khd->hk", qq, k) * inputs["scale"]).softmax(-1)
        torch.testing.assert_close(out[q0 + node], torch.einsum("hk,khd->hd", w, v), atol=1e-5, rtol=1e-5)


KERNEL_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "cpu":
    import _triton_interpreter
    _triton_interpreter.patch_triton_interpreter_for_numpy2()
from test_paged_attention import make_batch
from ddtree.kernels.paged_attention_reference import paged_tree_attention_reference
from ddtree.kernels.paged_attention_triton import paged_tree_attention
device = sys.argv[2]
for seed, dtype, heads in [(0, torch.float32, (4, 2, 32)), (5, torch.float32, (6, 2, 24)), (9, torch.float32, (2, 2, 64))]:
    if device == "cuda":
        dtype = torch.bfloat16
    inputs, seqs, q_lens, trees = make_batch(seed=seed, dtype=dtype, device=device, num_heads=heads[0],
                                             num_kv_heads=heads[1], head_size=heads[2])
    want = paged_tree_attention_reference(**inputs)
    got = paged_tree_attention(**inputs, max_query_len=max(q_lens))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    if seed == 0:
        # vLLM 0.33's layout: the K and V halves of [blocks, H, page, 2D], stored NHD (page-major) or HND
        # (head-major), read as strided [blocks, page, H, D] views.
        k, v = inputs["key_cache"], inputs["value_cache"]
        nhd = torch.cat([k, v], dim=-1)  # [blocks, page, H, 2D] in memory
        hnd = nhd.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, [blocks, H, page, 2D] in memory
        for stored in (nhd, hnd):
            relaid = stored.split(k.shape[-1], dim=-1)
            assert relaid[0].stride(-1) == 1 and relaid[0].stride(2) != k.stride(2)  # not the plain layout's
            strided = dict(inputs, key_cache=relaid[0], value_cache=relaid[1])
            got = paged_tree_attention(**strided, max_query_len=max(q_lens))
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
print("KERNEL-OK")
"""


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    env = child_env(Path(__file__).parent, interpret=True)
    res = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK, str(Path(__file__).parent), "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "KERNEL-OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_on_gpu():
    env = child_env(Path(__file__).parent, interpret=False)
    res = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECK, str(Path(__file__).parent), "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "KERNEL-OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_kv_moves_on_a_fake_paged_cache():
    """After the moves, positions start..start+m hold the accepted nodes' K/V (vLLM layout [blocks, 2, page, H, D])."""
    rng = np.random.default_rng(0)
    page, num_blocks = 16, 12
    cache = torch.randn(num_blocks, 2, page, 2, 8)
    block_table = torch.from_numpy(rng.permutation(num_blocks)[:5]).long()
    start = 27  # root at position 27, tree of 30 nodes at 27..56 (crosses pages)
    slot = lambda p: int(block_table[p // page]) * page + p % page  # noqa: E731
    lp = np.sort(rng.normal(size=(6, 3)).astype(np.float32), axis=-1)[:, ::-1] - 10.0
    ids = np.stack([rng.permutation(20)[:3] for _ in range(6)]).astype(np.int64)
    tree = ddtree.build_tree(np.ascontiguousarray(lp), ids, 29)
    before = cache.clone()
    node_kv = [before[slot(start + j) // page, :, slot(start + j) % page].clone() for j in range(len(tree))]
    # Accept the deepest path.
    node = int(np.argmax(tree.depths))
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    path = np.array(path[::-1], dtype=np.int32)
    src, dst = ddtree.kv_move_plan(path)
    src_slots = torch.tensor([slot(start + int(s)) for s in src])
    dst_slots = torch.tensor([slot(start + int(d)) for d in dst])
    apply_kv_moves_paged(cache, src_slots, dst_slots)
    for i, n in enumerate(path):
        p = slot(start + i)
        torch.testing.assert_close(cache[p // page, :, p % page], node_kv[n])
    # Slots before the tree are untouched.
    for p in range(start):
        s = slot(p)
        torch.testing.assert_close(cache[s // page, :, s % page], before[s // page, :, s % page])
