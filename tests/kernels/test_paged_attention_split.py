"""Split-KV (flash-decoding) path of the paged tree attention kernel, against the torch oracle.

The key range of every (sequence, query block, KV head) program is cut into ``num_kv_splits`` tile-aligned
chunks; each chunk's program writes unnormalised (max, sum, acc) partials and a second kernel merges them.
Batches here are built from explicit parent arrays, so a test can place a chunk that no row sees (sibling
nodes only) and trailing chunks with no key at all. The Triton kernels run under Triton's interpreter on
CPU in two subprocesses side by side (the flag is read when kernels are decorated); each test reports one
check. The split-count heuristic is plain Python and tested directly.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.kernels.paged_attention_reference import paged_tree_attention_reference  # noqa: E402
from ddtree.kernels.paged_attention_triton import _MIN_KEYS_PER_SPLIT, choose_num_kv_splits  # noqa: E402

from _paged_cache import random_paged_cache  # noqa: E402
from _triton_interpreter import child_env  # noqa: E402

HERE = Path(__file__).resolve().parent


def random_tree(n, rng):
    """Parents in pop order (parents first): node i's parent is a random earlier node; root is -1."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], dtype=np.int64)


def star_then_chain(star, chain):
    """Root, ``star`` children of the root, then a chain hanging off the last star node."""
    parents = [-1] + [0] * star
    for i in range(chain):
        parents.append(star + i)
    return np.array(parents, dtype=np.int64)


def ancestor_rows(parents):
    """Ancestor-or-self bit rows, ``[n, words]`` uint32 (the Rust core's ``ancestor_bits`` layout)."""
    n = len(parents)
    rows = np.zeros((n, (n + 31) // 32), dtype=np.uint32)
    for i in range(n):
        j = i
        while j >= 0:
            rows[i, j // 32] |= np.uint32(1 << (j % 32))
            j = int(parents[j])
    return rows


def build_batch(
    specs,
    *,
    num_heads=4,
    num_kv_heads=2,
    head_size=32,
    page=16,
    dtype=torch.float32,
    seed=0,
    q_scale=2.0,
    extra_tokens=0,
):
    """Kernel inputs for ``specs``: ``(context_len, queries)`` with ``queries`` an int (a plain causal
    sequence of that many queries) or a parents array (a tree). ``q_scale`` spreads the scores so chunk
    maxima differ (a merge that ignores them is visibly wrong); ``extra_tokens`` query rows past the last
    sequence belong to no sequence (no kernel may write them)."""
    gen = torch.Generator().manual_seed(seed)
    q_lens, row_start, trees = [], [], []
    rows = 0
    for ctx, queries in specs:
        if isinstance(queries, (int, np.integer)):
            q_lens.append(int(queries))
            row_start.append(-1)
        else:
            q_lens.append(len(queries))
            row_start.append(rows)
            trees.append(ancestor_rows(queries))
            rows += len(queries)
    words = max([1] + [t.shape[1] for t in trees])
    bits = np.zeros((max(1, rows), words), dtype=np.uint32)
    r = 0
    for t in trees:
        bits[r : r + len(t), : t.shape[1]] = t
        r += len(t)
    seq_lens = [ctx + q for (ctx, _), q in zip(specs, q_lens)]
    block_table, key_cache, value_cache = random_paged_cache(seq_lens, page, num_kv_heads, head_size, dtype, gen)
    total = sum(q_lens)
    query = (q_scale * torch.randn(total + extra_tokens, num_heads, head_size, generator=gen)).to(dtype)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        query_start_loc=torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        row_start=torch.tensor(row_start, dtype=torch.int32),
        ancestor_bits=torch.from_numpy(bits.view(np.int32)),
        scale=head_size**-0.5,
    ), max(q_lens)


# ------------------------------------------------------------------ heuristic (plain Python)


QWEN3 = dict(num_heads=32, num_kv_heads=8)  # GQA group 4: BLOCK_Q = 4 queries per program


def test_no_split_without_a_host_side_length_or_for_short_contexts():
    assert choose_num_kv_splits(1, 65, max_seq_len=None, **QWEN3) == 1
    assert choose_num_kv_splits(1, 65, max_seq_len=2 * _MIN_KEYS_PER_SPLIT - 1, **QWEN3) == 1
    assert choose_num_kv_splits(1, 1, max_seq_len=128, **QWEN3) == 1


def test_no_split_when_the_grid_already_fills_the_gpu():
    # batch 32 x 65-node trees: 32 x 17 x 8 = 4352 programs >= 4 x 132.
    assert choose_num_kv_splits(32, 65, max_seq_len=16384, **QWEN3) == 1
    # A long prefill chunk: its query blocks alone fill the machine.
    assert choose_num_kv_splits(1, 2048, max_seq_len=16384, **QWEN3) == 1


def test_split_grows_with_context_and_fills_the_gpu_at_small_batch():
    # batch 1, one 65-node tree: 17 x 8 = 136 programs; 4 x 132 / 136 -> 4 splits once keys allow.
    assert choose_num_kv_splits(1, 65, max_seq_len=1024, **QWEN3) == 4
    assert choose_num_kv_splits(1, 65, max_seq_len=16384, **QWEN3) == 4
    # batch 1 plain decode: 8 programs; capped by chunk length, then by the split limit.
    assert choose_num_kv_splits(1, 1, max_seq_len=1024, **QWEN3) == 1024 // _MIN_KEYS_PER_SPLIT
    assert choose_num_kv_splits(1, 1, max_seq_len=1 << 20, **QWEN3) == 64
    # The tiny Qwen3 of the vLLM runs (4 heads, 2 KV heads), 17-node tree at a 1004-token prompt.
    assert choose_num_kv_splits(1, 17, 4, 2, max_seq_len=1021) == 3
    for batch in (1, 2, 8, 32):
        for ctx in (512, 1024, 4096, 16384):
            n = choose_num_kv_splits(batch, 65, max_seq_len=ctx, **QWEN3)
            assert 1 <= n <= max(1, ctx // _MIN_KEYS_PER_SPLIT)
            programs = batch * 17 * 8
            assert n == 1 or programs * (n - 1) < 4 * 132  # never more splits than needed to fill the GPU


def test_split_count_follows_the_device_size():
    assert choose_num_kv_splits(1, 65, max_seq_len=16384, num_sms=264, **QWEN3) == 8
    assert choose_num_kv_splits(8, 65, max_seq_len=16384, num_sms=16, **QWEN3) == 1


def test_rows_per_program_override():
    from ddtree.kernels.paged_attention_triton import _block_shape

    assert _block_shape(24, 4) == (16, 2)  # Qwen3.6-27B: six query heads per KV head, two queries per program
    assert _block_shape(24, 4, 32) == (32, 5) and _block_shape(24, 4, 64) == (64, 10)
    for bad in (8, 48):
        with pytest.raises(ValueError, match=f"block_m={bad} must be a power of two"):
            _block_shape(24, 4, bad)
    # The split count sees the override: fewer, fuller programs get more splits.
    assert choose_num_kv_splits(1, 65, 24, 4, 4096, 132, block_m=64) > choose_num_kv_splits(1, 65, 24, 4, 4096, 132)


def test_rejects_a_split_count_below_one():
    pytest.importorskip("triton")
    from ddtree.kernels.paged_attention_triton import paged_tree_attention

    inputs, max_q = build_batch([(40, 1)])
    with pytest.raises(ValueError, match="num_kv_splits=0"):
        paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=0)


# ------------------------------------------------------------------ kernels (Triton interpreter, subprocesses)


SPLIT_CHECKS = r"""
import json, sys, traceback
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
import _triton_interpreter
_triton_interpreter.patch_triton_interpreter_for_numpy2()
from test_paged_attention_split import build_batch, random_tree, star_then_chain
from ddtree.kernels import paged_attention_triton as pta
from ddtree.kernels.paged_attention_reference import paged_tree_attention_reference
from ddtree.kernels.paged_attention_triton import paged_tree_attention
from test_paged_attention_split import CHECKS

selected = set(sys.argv[2].split(","))
results = {}

def close(got, want, tol):
    assert not torch.isnan(got).any(), "NaN in the output"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

def against_oracle(specs, splits, tol=1e-4, **kw):
    inputs, max_q = build_batch(specs, **kw)
    want = paged_tree_attention_reference(**inputs)
    for n in splits:
        got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=n)
        assert got.dtype == inputs["query"].dtype
        close(got, want, tol)

def check(name):
    def wrap(fn):
        if name not in selected:
            return fn
        global rng
        rng = np.random.default_rng(sorted(CHECKS).index(name))  # each check's trees, whichever process runs it
        try:
            fn()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()[-3000:]
        return fn
    return wrap

@check("plain_only")
def _():
    against_oracle([(0, 9), (150, 1), (260, 1), (40, 12)], [3, 8])

@check("tree_only")
def _():
    against_oracle([(200, random_tree(20, rng)), (33, random_tree(45, rng)), (130, random_tree(1, rng))], [2, 5])

@check("mixed")
def _():
    against_oracle([(0, 12), (150, random_tree(30, rng)), (5, 1), (200, random_tree(40, rng)), (100, 3),
                    (77, random_tree(9, rng))], [5], seed=1)

@check("gqa")
def _():
    specs = [(100, random_tree(13, rng)), (130, 1), (60, random_tree(20, rng))]
    # group 4 (BLOCK_Q 4), group 3 with a padded head (24 -> 32), group 1, group 32 (BLOCK_M 32, BLOCK_Q 1)
    for heads in [(8, 2, 32), (6, 2, 24), (4, 4, 16), (32, 1, 16)]:
        against_oracle(specs, [3], num_heads=heads[0], num_kv_heads=heads[1], head_size=heads[2], seed=2)

@check("block_sizes")
def _():
    specs = [(100, random_tree(25, rng)), (200, 1), (21, 5)]
    for page in (16, 32, 64):
        against_oracle(specs, [4], page=page, seed=3)

@check("long_context_heuristic")
def _():
    # Batch 1, a tree at a context long enough for the heuristic to split (no forcing).
    specs = [(520, random_tree(9, rng))]
    inputs, max_q = build_batch(specs, seed=4)
    max_seq_len = int(inputs["seq_lens"].max())
    n = pta.choose_num_kv_splits(1, max_q, 4, 2, max_seq_len)
    assert n == 2, n
    want = paged_tree_attention_reference(**inputs)
    got = paged_tree_attention(**inputs, max_query_len=max_q, max_seq_len=max_seq_len)
    close(got, want, 1e-4)
    single = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=1)
    close(got, single, 1e-5)

@check("masked_and_empty_chunks")
def _():
    # ctx 31: key 31 is the root, keys 32..63 are star nodes 1..32 (siblings), then nodes 33..40 and the
    # chain 41..50 under node 40. With 3 splits, the chunk [32, 64) of the last query block holds no
    # ancestor of its chain rows: fully masked by the bits, not by causality. With 8 splits, chunks 3..7
    # of that block hold no key at all. Rows whose chunk is masked must still get their exact output.
    parents = star_then_chain(40, 10)
    ctx, n = 31, len(parents)
    inputs, max_q = build_batch([(ctx, parents), (0, 1)], seed=5)
    bits = inputs["ancestor_bits"].numpy().view(np.uint32)
    block_q = pta._block_shape(4, 2)[1]
    q_block = (n - 1) // block_q
    kv_end = min(ctx + n, ctx + (q_block + 1) * block_q)
    rows = range(q_block * block_q, n)
    chunk = pta._cdiv(pta._cdiv(kv_end, 3), 32) * 32  # the kernel's chunk (TILE 32 at head 32)
    assert (chunk, kv_end) == (32, 82)
    lo, hi = chunk, 2 * chunk
    for i in rows:  # every row of the block is blind to chunk 1, yet causality would allow all of it
        assert i >= 41 and ctx + i >= hi - 1
        seen = [k for k in range(lo, hi) if ((bits[i, (k - ctx) // 32] >> ((k - ctx) % 32)) & 1)]
        assert seen == [], seen
    want = paged_tree_attention_reference(**inputs)
    for splits in (3, 8):
        got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=splits)
        close(got, want, 1e-4)

@check("split_equals_single_pass")
def _():
    specs = [(160, random_tree(33, rng)), (0, 11), (129, 1)]
    inputs, max_q = build_batch(specs, seed=6)
    single = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=1)
    for n in (2, 7):
        got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=n)
        close(got, single, 1e-5)

@check("low_precision")
def _():
    specs = [(150, random_tree(30, rng)), (120, 1), (0, 6)]
    for dtype in (torch.bfloat16, torch.float16):
        inputs, max_q = build_batch(specs, dtype=dtype, seed=8, q_scale=1.0)
        want = paged_tree_attention_reference(**inputs)
        single = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=1)
        got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=4)
        assert got.dtype == dtype
        close(got, want, 2e-2)
        close(got, single, 2e-2)

@check("rows_outside_every_sequence_untouched")
def _():
    specs = [(100, random_tree(12, rng)), (90, 1)]
    inputs, max_q = build_batch(specs, seed=9, extra_tokens=5)
    n = int(inputs["query_start_loc"][-1])
    want = paged_tree_attention_reference(**{**inputs, "query": inputs["query"][:n]})
    for splits in (1, 3):
        out = torch.full_like(inputs["query"], 7.0)
        got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=splits, out=out)
        assert got is out
        close(got[:n], want, 1e-4)
        assert (got[n:] == 7.0).all()

@check("block_m_override")
def _():
    # Six query heads per KV head (Qwen3.6-27B's grouping): 2 queries per program by default, 5 or 10 with more rows.
    specs = [(100, random_tree(23, rng)), (70, 1), (40, random_tree(9, rng))]
    inputs, max_q = build_batch(specs, num_heads=12, num_kv_heads=2, head_size=32, seed=11)
    want = paged_tree_attention_reference(**inputs)
    for block_m in (16, 32, 64):
        for splits in (1, 3):
            got = paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=splits, block_m=block_m)
            close(got, want, 1e-4)

@check("workspace_reused")
def _():
    specs = [(100, random_tree(10, rng))]
    inputs, max_q = build_batch(specs, seed=10)
    paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=4)
    buf = pta._WORKSPACE[inputs["query"].device]
    paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=4)
    paged_tree_attention(**inputs, max_query_len=max_q, num_kv_splits=2)
    assert pta._WORKSPACE[inputs["query"].device] is buf

print("SPLIT-RESULTS " + json.dumps(results))
"""


CHECKS = [
    "plain_only",
    "tree_only",
    "mixed",
    "gqa",
    "block_sizes",
    "long_context_heuristic",
    "masked_and_empty_chunks",
    "split_equals_single_pass",
    "low_precision",
    "rows_outside_every_sequence_untouched",
    "workspace_reused",
    "block_m_override",
]


@pytest.fixture(scope="module")
def split_results():
    """Runs every check once, in two interpreter processes side by side (about a minute of CPU each)."""
    pytest.importorskip("triton")
    env = child_env(HERE, interpret=True)
    groups = [CHECKS[0::2], CHECKS[1::2]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SPLIT_CHECKS, str(HERE), ",".join(g)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in groups
    ]
    results = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        lines = [line for line in stdout.splitlines() if line.startswith("SPLIT-RESULTS ")]
        assert lines, stdout[-3000:] + stderr[-3000:]
        results.update(json.loads(lines[-1][len("SPLIT-RESULTS ") :]))
    return results


@pytest.mark.parametrize("name", CHECKS)
def test_split_kv_kernel_under_interpreter(split_results, name):
    assert split_results.get(name) == "ok", split_results.get(name, "check did not run")


def test_batch_builder_matches_its_own_oracle():
    """The builder's hand-made trees are what the oracle sees: a chain node attends to its root path only."""
    parents = star_then_chain(5, 3)  # 0 <- 1..5, 5 <- 6 <- 7 <- 8
    inputs, _ = build_batch([(4, parents)], seed=11)
    out = paged_tree_attention_reference(**inputs)
    kc, vc, bt = inputs["key_cache"], inputs["value_cache"], inputs["block_table"]
    page = kc.shape[1]
    path = [0, 5, 6, 7, 8]
    pos = torch.tensor(list(range(4)) + [4 + p for p in path])
    k = kc[bt[0, pos // page].long(), pos % page].repeat_interleave(2, 1)
    v = vc[bt[0, pos // page].long(), pos % page].repeat_interleave(2, 1)
    q = inputs["query"][8]
    w = (torch.einsum("hd,khd->hk", q, k) * inputs["scale"]).softmax(-1)
    torch.testing.assert_close(out[8], torch.einsum("hk,khd->hd", w, v), atol=1e-5, rtol=1e-5)
