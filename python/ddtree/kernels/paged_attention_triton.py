"""Paged tree attention, the Triton kernel: one launch for a mixed batch in vLLM's KV-cache layout.

The visibility rule and the cache layout are those of :mod:`.paged_attention_reference` (its torch oracle).
:func:`paged_tree_attention` runs on CPU under ``TRITON_INTERPRET=1`` (set before import). No vLLM import: the
vLLM adapter (``ddtree.vllm.attention``) calls it.

Grid: one program per (sequence, block of ``BLOCK_Q`` queries, KV head), its rows the block's queries times the KV
head's ``QUERIES_PER_KV`` query heads (GQA). When that grid is too small to fill the GPU and the keys are long (few
sequences, long contexts), the key range of each program is split (flash-decoding): ``num_kv_splits`` programs per
(sequence, query block, KV head) each take a tile-aligned chunk and write fp32 partials (running max, sum of
exponentials, unnormalised output), and a merge kernel over the unsplit grid combines them with a log-sum-exp
merge. The split count is chosen on the host (:func:`choose_num_kv_splits`) from host-known sizes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


try:  # Triton is optional for the CPU parts of the adapter.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _paged_tree_attention_kernel(
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr,
        query_start_ptr,
        seq_lens_ptr,
        row_start_ptr,
        bits_ptr,
        scale,
        stride_q_tok,
        stride_q_head,
        stride_o_tok,
        stride_o_head,
        stride_k_blk,
        stride_k_slot,
        stride_k_head,
        stride_v_blk,
        stride_v_slot,
        stride_v_head,
        stride_bt,
        stride_bits,
        num_tokens,
        num_splits,
        NUM_HEADS: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits

        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        if q_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        row0 = tl.load(row_start_ptr + seq)
        is_tree = row0 >= 0

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        offs_t = tl.arange(0, TILE)
        q_local = offs_m // QUERIES_PER_KV
        q_pos = q_block * BLOCK_Q + q_local
        head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
        row_ok = (q_local < BLOCK_Q) & (q_pos < q_len) & (head < NUM_HEADS)
        d_ok = offs_d < HEAD_SIZE

        q_off = (q_begin + q_pos).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

        # Keys past the block's last query are masked for every row.
        kv_end = tl.minimum(seq_len, ctx + (q_block + 1) * BLOCK_Q)
        if SPLIT:
            # This program's share of [0, kv_end): whole tiles, possibly none.
            chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE) * TILE
            kv_lo = tl.minimum(split * chunk, kv_end)
            kv_hi = tl.minimum(kv_lo + chunk, kv_end)
        else:
            kv_lo = 0
            kv_hi = kv_end
        bits_row = (row0 + q_pos).to(tl.int64) * stride_bits
        for start in range(kv_lo, kv_hi, TILE):
            k_pos = start + offs_t
            k_ok = k_pos < kv_hi
            blk = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + k_pos // PAGE, mask=k_ok, other=0).to(
                tl.int64
            )
            slot = k_pos % PAGE
            k_off = (
                blk[None, :] * stride_k_blk + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None]
            )
            k = tl.load(k_cache_ptr + k_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE]
            s = tl.dot(q, k.to(q.dtype)) * scale  # [BLOCK_M, TILE]

            visible = k_pos[None, :] <= (ctx + q_pos)[:, None]
            tree_j = k_pos - ctx
            in_tree = tree_j >= 0
            bit_mask = row_ok[:, None] & (in_tree & k_ok)[None, :] & is_tree
            word = tl.load(
                bits_ptr + bits_row[:, None] + (tl.maximum(tree_j, 0) // 32)[None, :],
                mask=bit_mask,
                other=0,
            )
            bit = (word >> (tl.maximum(tree_j, 0) % 32)[None, :]) & 1
            visible = visible & ((~is_tree) | (~in_tree)[None, :] | (bit != 0))
            visible = visible & row_ok[:, None] & k_ok[None, :]
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]

            v_off = (
                blk[:, None] * stride_v_blk + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :]
            )
            v = tl.load(v_cache_ptr + v_off, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, HEAD_PAD]
            acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if SPLIT:
            # Unnormalised partials, [splits, tokens, heads(, head_size)] fp32; a chunk with no visible key
            # for a row leaves (-inf, 0, 0), which the merge weights zero.
            part = (split * num_tokens).to(tl.int64) * NUM_HEADS + (q_begin + q_pos).to(tl.int64) * NUM_HEADS + head
            tl.store(part_m_ptr + part, m_i, mask=row_ok)
            tl.store(part_l_ptr + part, l_i, mask=row_ok)
            a_off = part[:, None] * HEAD_SIZE + offs_d[None, :]
            tl.store(part_acc_ptr + a_off, acc, mask=row_ok[:, None] & d_ok[None, :])
        else:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            acc = acc / l_safe[:, None]
            tok = (q_begin + q_pos).to(tl.int64)
            o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
            tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        query_start_ptr,
        num_tokens,
        num_splits,
        stride_o_tok,
        stride_o_head,
        NUM_HEADS: tl.constexpr,
        QUERIES_PER_KV: tl.constexpr,
        HEAD_SIZE: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        # The split kernel's grid without the split axis, so exactly the rows the single pass writes are
        # written: log-sum-exp merge of the splits' (max, sum, acc), one split after another.
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        if q_block * BLOCK_Q >= q_len:
            return
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_PAD)
        q_local = offs_m // QUERIES_PER_KV
        q_pos = q_block * BLOCK_Q + q_local
        head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
        row_ok = (q_local < BLOCK_Q) & (q_pos < q_len) & (head < NUM_HEADS)
        d_ok = offs_d < HEAD_SIZE
        row = (q_begin + q_pos).to(tl.int64) * NUM_HEADS + head

        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
        for sp in range(0, num_splits):
            part = (sp * num_tokens).to(tl.int64) * NUM_HEADS + row
            m_s = tl.load(part_m_ptr + part, mask=row_ok, other=float("-inf"))
            l_s = tl.load(part_l_ptr + part, mask=row_ok, other=0.0)
            acc_s = tl.load(
                part_acc_ptr + part[:, None] * HEAD_SIZE + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            m_new = tl.maximum(m_run, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_safe)  # 0 while nothing was visible
            beta = tl.exp(m_s - m_safe)  # 0 for a chunk with no visible key
            l_run = l_run * alpha + l_s * beta
            acc_run = acc_run * alpha[:, None] + tl.where(beta[:, None] > 0.0, acc_s * beta[:, None], 0.0)
            m_run = m_new

        l_safe = tl.where(l_run == 0.0, 1.0, l_run)
        acc_run = acc_run / l_safe[:, None]
        o_off = (q_begin + q_pos).to(tl.int64)[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, acc_run.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Split-KV (flash-decoding) heuristic: split each program's key range only while the grid is smaller than
# ``_SPLIT_PROGRAMS_PER_SM`` programs per SM, and never into chunks shorter than ``_MIN_KEYS_PER_SPLIT`` keys
# (8 tiles: enough work per program to pay for its launch, its fp32 partials and the merge). Starting values,
# not tuned on a GPU yet: ``benches/bench_tree_attention.py`` prints a sweep of forced split counts.
_SPLIT_PROGRAMS_PER_SM = 4
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
_DEFAULT_NUM_SMS = 132  # an H200; used off CUDA so the heuristic is the same under the interpreter

_NUM_SMS: dict = {}
_WORKSPACE: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def _block_shape(num_heads: int, num_kv_heads: int, block_m: Optional[int] = None) -> tuple:
    """(BLOCK_M, BLOCK_Q): a program's rows are BLOCK_Q queries x the QUERIES_PER_KV heads of one KV head.
    ``block_m`` overrides the rows per program (a power of two holding at least one query's heads)."""
    group = num_heads // num_kv_heads
    if block_m is None:
        block_m = 16 if group <= 16 else _next_pow2(group)
    elif block_m < max(16, group) or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= max(16, {group} query heads per KV head)")
    return block_m, max(1, block_m // group)


def choose_num_kv_splits(
    num_seqs: int,
    max_query_len: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: Optional[int],
    num_sms: int = _DEFAULT_NUM_SMS,
    block_m: Optional[int] = None,
) -> int:
    """How many programs share each (sequence, query block, KV head)'s key range; 1 means no split.

    Decided on the host from host-known sizes only (no device sync): the unsplit grid is
    ``num_seqs x cdiv(max_query_len, BLOCK_Q) x num_kv_heads``; ``max_seq_len`` (an upper bound of the
    longest key range) caps the split so every chunk keeps ``_MIN_KEYS_PER_SPLIT`` keys. Without
    ``max_seq_len`` nothing is split.
    """
    if max_seq_len is None or max_seq_len < 2 * _MIN_KEYS_PER_SPLIT:
        return 1
    _, block_q = _block_shape(num_heads, num_kv_heads, block_m)
    programs = max(1, num_seqs) * _cdiv(max(1, max_query_len), block_q) * num_kv_heads
    target = _SPLIT_PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    splits = min(_cdiv(target, programs), max_seq_len // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS)
    return max(1, splits)


def _split_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A flat fp32 buffer of at least ``numel`` elements, kept per device and grown geometrically, so
    steady-state calls allocate nothing. Kernels on one stream use it one launch after another."""
    buf = _WORKSPACE.get(device)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(_next_pow2(numel), dtype=torch.float32, device=device)
        _WORKSPACE[device] = buf
    return buf


def paged_tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    row_start: torch.Tensor,
    ancestor_bits: Optional[torch.Tensor],
    scale: float,
    max_query_len: int,
    out: Optional[torch.Tensor] = None,
    *,
    max_seq_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    block_m: Optional[int] = None,
) -> torch.Tensor:
    """Triton paged tree attention. Arguments as the reference, plus ``max_query_len``.

    ``ancestor_bits`` is ``[T, words]`` int32 (uint32 bit patterns); ``row_start``
    ``[num_seqs]`` int32 with -1 for plain causal sequences.

    Split-KV: with ``num_kv_splits`` > 1 every (sequence, query block, KV head) program's key range is cut
    into that many tile-aligned chunks, one program each, writing unnormalised (max, sum, acc) partials that
    a second kernel merges (log-sum-exp). ``num_kv_splits=None`` picks the count with
    :func:`choose_num_kv_splits` from ``max_seq_len`` (host-known, e.g. vLLM's ``attn_metadata.max_seq_len``;
    it only steers the split count, correctness does not depend on it); without ``max_seq_len`` the single
    pass runs. ``block_m`` overrides the rows per program (default: 16, or the next power of two of the query heads
    per KV head), so a program takes ``block_m // group`` queries of one KV head (``benches/bench_tree_attention.py``
    times the choices).
    """
    if triton is None:
        raise RuntimeError("paged_tree_attention needs triton")
    num_tokens, num_heads, head_size = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("the head dimension of query, key_cache and value_cache must be contiguous")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits={num_kv_splits} must be >= 1")
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q = _block_shape(num_heads, num_kv_heads, block_m)
    head_pad = max(16, _next_pow2(head_size))
    tile = 32 if head_pad <= 128 else 16
    if ancestor_bits is None or ancestor_bits.numel() == 0:
        ancestor_bits = torch.zeros((1, 1), dtype=torch.int32, device=query.device)
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(
            num_seqs, max_query_len, num_heads, num_kv_heads, max_seq_len, _num_sms(query.device), block_m
        )
    split = num_kv_splits > 1
    if split:
        rows = num_tokens * num_heads * num_kv_splits
        pad = _cdiv(rows, 16) * 16  # 64-byte aligned regions: one pointer specialisation whatever the size
        work = _split_workspace(query.device, pad * 2 + rows * head_size)
        part_m, part_l, part_acc = work[:rows], work[pad : pad + rows], work[2 * pad : 2 * pad + rows * head_size]
    else:
        part_m = part_l = part_acc = out  # unused: SPLIT=False writes ``out`` directly
    grid = (num_seqs, triton.cdiv(max(1, max_query_len), block_q), num_kv_heads * num_kv_splits)
    _paged_tree_attention_kernel[grid](
        out,
        part_m,
        part_l,
        part_acc,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        row_start,
        ancestor_bits,
        float(scale),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        ancestor_bits.stride(0),
        num_tokens,
        num_kv_splits,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PAGE=page,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE=tile,
        SPLIT=split,
    )
    if split:
        _merge_splits_kernel[(num_seqs, grid[1], num_kv_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            query_start_loc,
            num_tokens,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            QUERIES_PER_KV=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
        )
    return out


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
