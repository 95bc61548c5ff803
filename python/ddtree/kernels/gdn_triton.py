r"""Triton kernels for exact tree verification of Gated DeltaNet (GDN) layers.

Math (see :mod:`ddtree.kernels.gdn_reference` for the derivation): per request and
value head, with ``M`` the ancestor-or-self mask of the request's tree,
``G = M g`` (log decay summed along root paths), ``D = M * exp(G_i - G_j)``,
``L = strictly_lower(D * beta_i * K K^T)``::

    (I + L) U = beta * (V - exp(G) * K S0)           # U: per-node deltas
    O = exp(G) * Q S0 + (D * Q K^T) U

Kernels
-------
``_tree_gdn_fwd_kernel`` -- grid ``(R, Hv, Dv / BV)``; one program owns one
request, one value head and ``BV`` value columns (the solve is column-wise in
``U``, so value-column blocks are independent and only the ``N x N`` key
products are recomputed per block). Inside a program:

1. ``G`` for every node: row block ``i`` reads its ancestor bits and sums
   ``g`` over them (no sequential parent walk). Stored to ``cum_log_decay``.
2. Blocked forward substitution over row blocks of ``BT`` (16 or 32) nodes,
   in index order (parents precede children, so every ancestor of a row
   block lies in it or in an earlier one):

   * ``rhs = beta (V_b - exp(G_b) K_b S0)``, ``o = exp(G_b) Q_b S0``
     (tensor-core products with the state tile);
   * for every earlier column tile of ``BC`` nodes: ``K_b K_c^T`` and
     ``Q_b K_c^T`` (tensor cores), masked by the ancestor bits and decays,
     then ``rhs -= L_bc U_c`` and ``o += A_bc U_c`` (tensor cores). ``U_c``
     was written to ``u`` by this program in earlier iterations;
   * diagonal block: ``(I + L_bb)^{-1}`` by ``BT - 1`` register-level row
     substitutions on a ``BT x BT`` tile (it does not depend on ``U`` and is
     the only non-tensor-core part), ``U_b = (I + L_bb)^{-1} rhs`` and
     ``o += A_bb U_b`` (tensor cores); ``U_b`` and ``o_b`` are stored and a
     CTA barrier makes ``U_b`` visible to the next row blocks.

   Work per program is ``O(N^2 (Dk + BV) + N Dk BV)`` flops, all but the
   ``BT x BT`` inverses on tensor cores; memory is the inputs, ``u`` and
   ``o`` -- nothing of size ``Dk x Dv`` per node, no ``N x N`` buffer.

``_tree_gdn_commit_kernel`` -- grid ``(R, Hv, Dv / BV)``: the WY commit
``S_new = exp(G_last) S0 + K_path^T (exp(G_last - G_path) * U_path)``, one
``[Dk, P] @ [P, BV]`` product per program, written into a state-pool slot
(may be the source slot: each program reads its whole tile before writing
it).

Precision
---------
States, ``G``, ``U``, ``O`` accumulate in fp32. ``precision`` picks how fp32
``tl.dot`` operands are fed to tensor cores: ``"tf32x3"`` (default; three
TF32 products, about fp32 accuracy), ``"ieee"`` (fp32 FMA, no tensor cores,
slowest) or ``"tf32"`` (one TF32 product, ~1e-3 relative error: not exact,
for timing comparisons only). The l2 normalisation is applied as row and
column scales after the products (``q^ . k^ = (q . k) r_q r_k``), so when
q/k are bf16/fp16 the two ``N x N`` key products run on the raw 16-bit
values with fp32 accumulation: products of 16-bit numbers are exact in
fp32, so this is as accurate as the fp32 path at one 16-bit MMA instead of
three TF32 ones. Every product over the head dimension walks it in chunks
of ``BKC`` loaded from memory: a ``BT x Dk`` MMA operand would sit whole in
every warp's registers and spill (checked with ptxas for sm_90).

Ancestor mask
-------------
Packed bits, the layout of ``ddtree.compile_trees(...).ancestor_bits``:
int32 (uint32 reinterpreted) ``[T, W]``, bit ``j % 32`` of word ``j // 32``
of (request-local) row ``i`` set iff node ``j`` is ``i`` or an ancestor of
``i``. A 64-column tile of one row costs two 4-byte words instead of 64
bytes of a dense uint8 mask (``T x N`` bytes, 16x the bits); unpacking is a
shift and an AND per element, free next to the Gram products. The bits are
built once per verification step and shared by every GDN layer;
:func:`ancestor_bits_from_parents` builds them on any device.

Limits
------
* The row blocks of one program are sequential (``ceil(N / BT)`` steps, 17 at
  N = 257 with BT = 16) and every step re-reads the earlier column tiles, so
  one program does ``O(N^2)`` work; with few requests the grid is only
  ``R * Hv * Dv / BV`` programs (48 x 2 at batch 1). Splitting Dv repeats
  the ``N x N`` key products per split, and the 3 value heads of a GQA group
  repeat them too (they differ only in decays and betas).
* ``G`` is written by every value-column program of a head (identical
  values, benign) and read back after ``tl.debug_barrier()``; ``U`` rows are
  read back the same way (each program owns its value columns).
* Register pressure: ptxas for sm_90 reports ~255 registers per thread at
  BT = 16 / 4 warps with a few bytes of spill; tiles are small because
  ``BT = 16`` row blocks make every MMA an ``m16`` (mma.sync, not wgmma).
* The tree conv (:func:`tree_conv_qkv`) is one kernel per layer: gather of each node's ``W``-row window
  along its root path from the committed history and the step's inputs, the depthwise conv, bias and
  SiLU, written straight into contiguous q, k and v (the torch form,
  :func:`ddtree.kernels.gdn_reference.tree_causal_conv1d_batched` or ``ddtree.vllm.gdn.tree_conv``, takes
  about ten launches).

Import this module only where Triton is available; it is not imported by
``ddtree.kernels``. Set ``TRITON_INTERPRET=1`` before importing triton to run
the kernels on CPU.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .gdn_reference import _check_gdn_inputs, _require_shape
from .topology import IndexLike, validate_batched_parents, validate_node_offsets

PRECISIONS = ("tf32x3", "ieee", "tf32")


# --------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------


@triton.jit
def _ancestor_tile(bits_ptr, num_words, first, rows, cols, row_ok, col_ok):
    """Bool ``[len(rows), len(cols)]``: column node is an ancestor-or-self of the row node."""
    words = tl.load(
        bits_ptr + (first + rows)[:, None] * num_words + (cols >> 5)[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0,
    )
    return ((words >> (cols & 31)[None, :]) & 1) != 0


@triton.jit
def _load_gates(
    g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, nodes, ok, head, NUM_V_HEADS: tl.constexpr, RAW_GATING: tl.constexpr
):
    """fp32 ``(g, beta)`` of ``nodes`` for one value head (0 outside ``ok``).

    With ``RAW_GATING`` the pointers hold the projections ``a`` and ``b`` and
    the gates are computed as vLLM's fused kernel does:
    ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus linear above 20),
    ``beta = sigmoid(b)``.
    """
    offsets = nodes * NUM_V_HEADS + head
    if RAW_GATING:
        x = tl.load(g_ptr + offsets, mask=ok, other=0).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
        beta = tl.sigmoid(tl.load(beta_ptr + offsets, mask=ok, other=0).to(tl.float32))
    else:
        g = tl.load(g_ptr + offsets, mask=ok, other=0).to(tl.float32)
        beta = tl.load(beta_ptr + offsets, mask=ok, other=0).to(tl.float32)
    return tl.where(ok, g, 0.0), tl.where(ok, beta, 0.0)


@triton.jit
def _load_chunk(ptr, nodes, ok, head, d0, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BKC: tl.constexpr):
    """Raw ``[len(nodes), BKC]`` tile of one q/k head, columns ``d0 : d0 + BKC`` (0 outside)."""
    d = d0 + tl.arange(0, BKC)
    return tl.load(
        ptr + (nodes[:, None] * NUM_HEADS + head) * HEAD_DIM + d[None, :],
        mask=ok[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """fp32-accumulated product; 16-bit operands go to the MMA as they are (their products are exact
    in fp32), fp32 operands use ``PRECISION``."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision=PRECISION)
    else:
        return tl.dot(a, b)


@triton.jit
def _row_scale(sum_sq, L2NORM: tl.constexpr):
    """l2-normalisation factor ``rsqrt(|x|^2 + 1e-6)`` (1 without ``L2NORM``)."""
    if L2NORM:
        return tl.rsqrt(sum_sq + 1e-6)
    else:
        return sum_sq * 0.0 + 1.0


@triton.jit
def _key_products(
    q_ptr,
    k_ptr,
    nodes,
    row_ok,
    col_nodes,
    col_ok,
    k_head,
    NUM_K_HEADS: tl.constexpr,
    HEAD_K_DIM: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Raw ``K_rows K_cols^T``, ``Q_rows K_cols^T`` (fp32 ``[BT, BC]``) and ``|k_col|^2`` (``[BC]``).

    The head dimension is walked in ``BKC`` chunks loaded from memory (L1/L2
    hits): an MMA operand spanning all of Dk would need ``BT * Dk / 32``
    registers per thread in every warp and spills. Normalisation is applied
    by the caller as row/column scales, so 16-bit q/k enter the MMA unrounded.
    """
    kk = tl.zeros([BT, BC], dtype=tl.float32)
    qk = tl.zeros([BT, BC], dtype=tl.float32)
    col_sum_sq = tl.zeros([BC], dtype=tl.float32)
    for d0 in range(0, BK, BKC):
        k_cols = _load_chunk(k_ptr, col_nodes, col_ok, k_head, d0, NUM_K_HEADS, HEAD_K_DIM, BKC)
        k_rows = _load_chunk(k_ptr, nodes, row_ok, k_head, d0, NUM_K_HEADS, HEAD_K_DIM, BKC)
        q_rows = _load_chunk(q_ptr, nodes, row_ok, k_head, d0, NUM_K_HEADS, HEAD_K_DIM, BKC)
        k_cols_t = tl.trans(k_cols)
        kk += _dot(k_rows, k_cols_t, PRECISION)
        qk += _dot(q_rows, k_cols_t, PRECISION)
        k_cols_f = k_cols.to(tl.float32)
        col_sum_sq += tl.sum(k_cols_f * k_cols_f, 1)
    return kk, qk, col_sum_sq


@triton.jit
def _unit_lower_inverse(strict_lower, BT: tl.constexpr):
    """``(I + L)^{-1}`` of a strictly lower triangular ``[BT, BT]`` fp32 tile, by row substitution.

    Row ``i`` of the inverse is ``e_i - sum_{j < i} L[i, j] inv[j]``; rows not yet
    reached are still ``e_j`` and ``L[i, j] = 0`` for ``j >= i``, so each step may
    reduce over the whole tile. ``BT - 1`` steps of ``O(BT^2)`` register work.
    """
    idx = tl.arange(0, BT)
    inverse = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BT):
        is_row = idx[:, None] == i
        l_row = tl.sum(tl.where(is_row, strict_lower, 0.0), 0)  # L[i, :], indexed by j
        update = tl.sum(l_row[:, None] * inverse, 0)  # sum_j L[i, j] inv[j, :]
        inverse = tl.where(is_row, inverse - update[None, :], inverse)
    return inverse


# --------------------------------------------------------------------------
# Forward (verification) kernel
# --------------------------------------------------------------------------


@triton.jit
def _tree_gdn_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,  # [T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]
    g_ptr,
    beta_ptr,  # [T, Hv]: g and beta, or raw a and b with RAW_GATING
    a_log_ptr,
    dt_bias_ptr,  # [Hv] (RAW_GATING only)
    bits_ptr,
    num_words,  # int32 [T, num_words] ancestor-or-self bits
    node_offsets_ptr,  # [R + 1]
    state_ptr,
    state_indices_ptr,  # state pool (any strides), slot per request [R]
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    stride_state_v,
    o_ptr,
    u_ptr,
    cum_ptr,  # [T, Hv, Dv] (o dtype), fp32 [T, Hv, Dv], fp32 [T, Hv]
    scale,
    NUM_K_HEADS: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    HEAD_K_DIM: tl.constexpr,
    HEAD_V_DIM: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BKC: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
    RAW_GATING: tl.constexpr,
    L2NORM: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    k_head = head // (NUM_V_HEADS // NUM_K_HEADS)
    first = tl.load(node_offsets_ptr + request).to(tl.int64)
    num_nodes = (tl.load(node_offsets_ptr + request + 1) - first).to(tl.int32)
    num_row_blocks = tl.cdiv(num_nodes, BT)

    # ---- 1. G_i = sum of g over the ancestors-or-self of i (bits rows). Every
    # value-column program of this head writes the same values (benign: identical
    # 4-byte words), then reads them back after the CTA barrier.
    for rb in range(0, num_row_blocks):
        rows = rb * BT + tl.arange(0, BT)
        row_ok = rows < num_nodes
        cum = tl.zeros([BT], dtype=tl.float32)
        for c0 in range(0, (rb + 1) * BT, BC):
            cols = c0 + tl.arange(0, BC)
            col_ok = cols < num_nodes
            visible = _ancestor_tile(bits_ptr, num_words, first, rows, cols, row_ok, col_ok)
            g_cols, _ = _load_gates(
                g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, first + cols, col_ok, head, NUM_V_HEADS, RAW_GATING
            )
            cum += tl.sum(tl.where(visible, g_cols[None, :], 0.0), 1)
        tl.store(cum_ptr + (first + rows) * NUM_V_HEADS + head, cum, mask=row_ok)
    tl.debug_barrier()

    # ---- 2. Blocked forward substitution over row blocks.
    dv = v_block * BV + tl.arange(0, BV)
    dv_ok = dv < HEAD_V_DIM
    slot = tl.load(state_indices_ptr + request).to(tl.int64)
    state_base = state_ptr + slot * stride_state_slot + head * stride_state_head

    for rb in range(0, num_row_blocks):
        row0 = rb * BT
        rows = row0 + tl.arange(0, BT)
        row_ok = rows < num_nodes
        nodes = first + rows
        _, beta = _load_gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, nodes, row_ok, head, NUM_V_HEADS, RAW_GATING)
        cum_rows = tl.load(cum_ptr + nodes * NUM_V_HEADS + head, mask=row_ok, other=0.0)
        uv_offsets = (nodes[:, None] * NUM_V_HEADS + head) * HEAD_V_DIM + dv[None, :]
        uv_mask = row_ok[:, None] & dv_ok[None, :]
        v_rows = tl.load(v_ptr + uv_offsets, mask=uv_mask, other=0.0).to(tl.float32)

        # Terms from the committed state S0 and the rows' l2 norms, walking Dk in chunks.
        k_state = tl.zeros([BT, BV], dtype=tl.float32)
        q_state = tl.zeros([BT, BV], dtype=tl.float32)
        k_sum_sq = tl.zeros([BT], dtype=tl.float32)
        q_sum_sq = tl.zeros([BT], dtype=tl.float32)
        for d0 in range(0, BK, BKC):
            dk = d0 + tl.arange(0, BKC)
            state = tl.load(
                state_base + dk[:, None] * stride_state_k + dv[None, :] * stride_state_v,
                mask=(dk < HEAD_K_DIM)[:, None] & dv_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            k_rows = _load_chunk(k_ptr, nodes, row_ok, k_head, d0, NUM_K_HEADS, HEAD_K_DIM, BKC).to(tl.float32)
            q_rows = _load_chunk(q_ptr, nodes, row_ok, k_head, d0, NUM_K_HEADS, HEAD_K_DIM, BKC).to(tl.float32)
            k_state += tl.dot(k_rows, state, input_precision=PRECISION)
            q_state += tl.dot(q_rows, state, input_precision=PRECISION)
            k_sum_sq += tl.sum(k_rows * k_rows, 1)
            q_sum_sq += tl.sum(q_rows * q_rows, 1)
        k_scale = _row_scale(k_sum_sq, L2NORM)
        q_scale = _row_scale(q_sum_sq, L2NORM) * scale
        initial_decay = tl.exp(cum_rows)
        rhs = beta[:, None] * (v_rows - (initial_decay * k_scale)[:, None] * k_state)
        out = (initial_decay * q_scale)[:, None] * q_state

        # Earlier nodes: rhs -= L[b, c] U_c, out += A[b, c] U_c.
        for c0 in range(0, row0, BC):
            cols = c0 + tl.arange(0, BC)
            col_ok = cols < row0  # only rows already solved (all < num_nodes)
            col_nodes = first + cols
            kk, qk, col_sum_sq = _key_products(
                q_ptr,
                k_ptr,
                nodes,
                row_ok,
                col_nodes,
                col_ok,
                k_head,
                NUM_K_HEADS,
                HEAD_K_DIM,
                BT,
                BC,
                BK,
                BKC,
                PRECISION,
            )
            col_scale = _row_scale(col_sum_sq, L2NORM)
            cum_cols = tl.load(cum_ptr + col_nodes * NUM_V_HEADS + head, mask=col_ok, other=0.0)
            u_cols = tl.load(
                u_ptr + (col_nodes[:, None] * NUM_V_HEADS + head) * HEAD_V_DIM + dv[None, :],
                mask=col_ok[:, None] & dv_ok[None, :],
                other=0.0,
            )
            visible = _ancestor_tile(bits_ptr, num_words, first, rows, cols, row_ok, col_ok)
            # Mask the exponent, not the result: off-path G_i - G_j can be large and positive.
            decay = tl.exp(tl.where(visible, cum_rows[:, None] - cum_cols[None, :], float("-inf")))
            decay = decay * col_scale[None, :]
            interaction = (beta * k_scale)[:, None] * decay * kk
            attention = q_scale[:, None] * decay * qk
            rhs -= tl.dot(interaction, u_cols, input_precision=PRECISION)
            out += tl.dot(attention, u_cols, input_precision=PRECISION)

        # Diagonal block: U_b = (I + L_bb)^{-1} rhs; out += A_bb U_b (A_bb includes i == j).
        kk, qk, _ = _key_products(
            q_ptr, k_ptr, nodes, row_ok, nodes, row_ok, k_head, NUM_K_HEADS, HEAD_K_DIM, BT, BT, BK, BKC, PRECISION
        )
        visible = _ancestor_tile(bits_ptr, num_words, first, rows, rows, row_ok, row_ok)
        decay = tl.exp(tl.where(visible, cum_rows[:, None] - cum_rows[None, :], float("-inf")))
        decay = decay * k_scale[None, :]
        kk = (beta * k_scale)[:, None] * decay * kk
        qk = q_scale[:, None] * decay * qk
        strictly_before = rows[:, None] > rows[None, :]
        inverse = _unit_lower_inverse(tl.where(strictly_before, kk, 0.0), BT)
        deltas = tl.dot(inverse, rhs, input_precision=PRECISION)
        out += tl.dot(qk, deltas, input_precision=PRECISION)
        tl.store(u_ptr + uv_offsets, deltas, mask=uv_mask)
        tl.store(o_ptr + uv_offsets, out.to(o_ptr.dtype.element_ty), mask=uv_mask)
        # U_b must be visible to every thread of this program before later row blocks read it.
        tl.debug_barrier()


# --------------------------------------------------------------------------
# Commit kernel
# --------------------------------------------------------------------------


@triton.jit
def _tree_gdn_commit_kernel(
    k_ptr,
    u_ptr,
    cum_ptr,  # [T, Hk, Dk] raw keys, fp32 [T, Hv, Dv], fp32 [T, Hv]
    node_offsets_ptr,
    paths_ptr,
    path_lengths_ptr,
    max_path,  # [R + 1], int32 [R, max_path], [R]
    src_ptr,
    src_indices_ptr,
    dst_ptr,
    dst_indices_ptr,
    stride_src_slot,
    stride_src_head,
    stride_src_k,
    stride_src_v,
    stride_dst_slot,
    stride_dst_head,
    stride_dst_k,
    stride_dst_v,
    NUM_K_HEADS: tl.constexpr,
    NUM_V_HEADS: tl.constexpr,
    HEAD_K_DIM: tl.constexpr,
    HEAD_V_DIM: tl.constexpr,
    BP: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
    L2NORM: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    k_head = head // (NUM_V_HEADS // NUM_K_HEADS)
    first = tl.load(node_offsets_ptr + request).to(tl.int64)
    path_length = tl.load(path_lengths_ptr + request)
    steps = tl.arange(0, BP)
    on_path = steps < path_length
    nodes = first + tl.load(paths_ptr + request * max_path + steps, mask=on_path, other=0).to(tl.int64)
    last = first + tl.load(paths_ptr + request * max_path + path_length - 1).to(tl.int64)

    keys = _load_chunk(k_ptr, nodes, on_path, k_head, 0, NUM_K_HEADS, HEAD_K_DIM, BK).to(tl.float32)
    keys = keys * _row_scale(tl.sum(keys * keys, 1), L2NORM)[:, None]
    dk = tl.arange(0, BK)
    dv = v_block * BV + tl.arange(0, BV)
    dv_ok = dv < HEAD_V_DIM
    deltas = tl.load(
        u_ptr + (nodes[:, None] * NUM_V_HEADS + head) * HEAD_V_DIM + dv[None, :],
        mask=on_path[:, None] & dv_ok[None, :],
        other=0.0,
    )
    cum = tl.load(cum_ptr + nodes * NUM_V_HEADS + head, mask=on_path, other=0.0)
    cum_last = tl.load(cum_ptr + last * NUM_V_HEADS + head)
    weights = tl.where(on_path, tl.exp(cum_last - cum), 0.0)

    state_mask = (dk < HEAD_K_DIM)[:, None] & dv_ok[None, :]
    src_slot = tl.load(src_indices_ptr + request).to(tl.int64)
    state = tl.load(
        src_ptr
        + src_slot * stride_src_slot
        + head * stride_src_head
        + dk[:, None] * stride_src_k
        + dv[None, :] * stride_src_v,
        mask=state_mask,
        other=0.0,
    ).to(tl.float32)
    state = tl.exp(cum_last) * state + tl.dot(tl.trans(keys), weights[:, None] * deltas, input_precision=PRECISION)
    dst_slot = tl.load(dst_indices_ptr + request).to(tl.int64)
    if dst_slot < 0:  # a request with nothing to write (a boundary commit's rows that did not reach the boundary)
        return
    tl.store(
        dst_ptr
        + dst_slot * stride_dst_slot
        + head * stride_dst_head
        + dk[:, None] * stride_dst_k
        + dv[None, :] * stride_dst_v,
        state.to(dst_ptr.dtype.element_ty),
        mask=state_mask,
    )


# --------------------------------------------------------------------------
# Host wrappers
# --------------------------------------------------------------------------


def _next_power_of_two(value: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (int(value) - 1).bit_length())


def ancestor_bits_from_parents(
    parents: torch.Tensor, node_offsets: torch.Tensor, max_nodes: Optional[int] = None
) -> torch.Tensor:
    """Packed ancestor-or-self bits ``int32 [T, ceil(max_nodes / 32)]`` from request-local parents.

    Same layout as ``ddtree.compile_trees(...).ancestor_bits`` (uint32 viewed
    as int32). Pointer jumping: after step ``s`` row ``i`` covers the first
    ``2^s`` nodes of its root path, so ``ceil(log2(max depth + 1))`` steps of
    whole-batch gathers suffice; runs on the tensors' device. ``max_nodes``
    (the largest tree) avoids a device-to-host sync when given.

    Args:
        parents: ``[T]`` request-local parents (-1 for roots), any int dtype.
        node_offsets: ``[R + 1]`` CSR offsets, on the same device.
    """
    device = parents.device
    parents = parents.to(torch.int64)
    offsets = node_offsets.to(device=device, dtype=torch.int64)
    num_nodes = parents.numel()
    sizes = offsets[1:] - offsets[:-1]
    if max_nodes is None:
        max_nodes = int(sizes.max())
    num_words = max(1, (max_nodes + 31) // 32)
    request = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes, output_size=num_nodes)
    node = torch.arange(num_nodes, device=device)
    local = node - offsets[request]
    bits = torch.zeros(num_nodes, num_words, dtype=torch.int64, device=device)
    bits[node, local // 32] = torch.ones_like(local) << (local % 32)
    pointer = torch.where(parents >= 0, offsets[request] + parents, -1)
    for _ in range(max(1, math.ceil(math.log2(max_nodes + 1)))):
        valid = pointer >= 0
        safe = pointer.clamp(min=0)
        bits = bits | torch.where(valid[:, None], bits[safe], 0)
        pointer = torch.where(valid, pointer[safe], -1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # uint32 -> int32 bit pattern
    return bits.to(torch.int32)


def _default_block_v(num_programs_without_split: int, head_v_dim: int) -> int:
    """Value columns per program, chosen from the block sweeps at Qwen3.6-27B's GDN shape on an H200 (CUDA-graph
    times per layer call, 65 nodes a tree). With 64-node column tiles (``gpu-gdn-tree-b78fcae``) 64 beat 32 and
    128 at batches 1 and 8, and 128 beat 64 at 32; with 32-node column tiles (the default since
    ``gpu-h200-device-plan-c4ff208``) 64 beat 128 at batch 1 (51.9 vs 65.5 us) and 128 beat 64 at batch 8 (168.9
    vs 188.6 us) and 32 (520 vs 753 us): the switch sits at the measured 8 requests of 48 value heads."""
    block_v = 128 if num_programs_without_split >= WIDE_BLOCK_V_FROM else 64
    return min(block_v, _next_power_of_two(head_v_dim))


#: Request-heads (requests x value heads) from which one program takes 128 value columns instead of 64.
WIDE_BLOCK_V_FROM = 384

#: Earlier nodes a column tile of the verify covers. 32 against 64 on the H200 sweep of
#: ``gpu-h200-device-plan-c4ff208`` (65-node trees, each batch size's default value block): 51.9 vs 54.4 us at
#: batch 1, 168.9 vs 199.7 at 8 (block_v 128 vs 64), 520 vs 718 at 32; 2-3.5% in ``gpu-gdn-tree-b78fcae``.
DEFAULT_BLOCK_C = 32


def tree_gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    node_offsets: torch.Tensor,
    ancestor_bits: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    a_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    precision: str = "tf32x3",
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
    block_t: int = 16,
    block_c: int = DEFAULT_BLOCK_C,
    block_v: Optional[int] = None,
    block_kc: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree verification of one GDN layer for a batch of requests (no host sync; graph-capturable).

    Args:
        q, k: ``[T, Hk, Dk]`` (raw conv outputs; l2-normalised in the kernel
            when ``use_qk_l2norm``; q scaled by ``scale``, default ``Dk**-0.5``).
        v: ``[T, Hv, Dv]``, ``Hv % Hk == 0`` (value head h reads key head
            ``h // (Hv // Hk)``). fp32, bf16 or fp16; math is fp32.
        g, beta: ``[T, Hv]`` log decays and betas -- or, when ``a_log`` and
            ``dt_bias`` (``[Hv]``) are given, the raw projections ``a`` and
            ``b`` (gates computed in the kernel like vLLM's fused kernel).
        node_offsets: int ``[R + 1]`` CSR offsets of the requests' trees.
        ancestor_bits: int32 ``[T, W]`` (see :func:`ancestor_bits_from_parents`),
            ``W >= ceil(largest tree / 32)``.
        state_pool: ``[S, Hv, Dk, Dv]`` committed states, any strides (pass
            vLLM's ``[S, Hv, Dv, Dk]`` pool as ``pool.transpose(-1, -2)``); read only.
        state_indices: int ``[R]`` slot of each request in ``state_pool``.
        precision: fp32 ``tl.dot`` mode, see the module docstring.
        out: optional contiguous ``[T, Hv, Dv]`` tensor the outputs are written into (e.g. rows of the
            layer's own output buffer), in place of a new one; its dtype wins over ``out_dtype``.
        block_t: row-block size of the substitution (16 or 32); block_c: column
            tile of earlier nodes (16..128); block_v: value columns per program;
            block_kc: head-dim chunk of the q/k products.

    Returns:
        ``o [T, Hv, Dv]`` (``out_dtype``, default q's dtype), ``u [T, Hv, Dv]`` fp32
        (per-node deltas) and ``G [T, Hv]`` fp32 (root-path log decays); ``u``
        and ``G`` are what :func:`tree_gdn_commit` needs.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if block_t not in (16, 32) or block_c not in (16, 32, 64, 128):
        raise ValueError(f"block_t must be 16 or 32 and block_c 16..128, got {block_t}, {block_c}")
    if block_kc < 16 or block_kc & (block_kc - 1):
        # Compiled tl.dot needs K >= 16; the interpreter would accept less and hide it.
        raise ValueError(f"block_kc must be a power of two >= 16 (tl.dot's smallest K), got {block_kc}")
    num_nodes = q.shape[0]
    num_k_heads, head_k_dim, num_v_heads, head_v_dim = _check_gdn_inputs(q, k, v, g, beta, num_nodes)
    if ancestor_bits.dtype != torch.int32 or ancestor_bits.dim() != 2 or ancestor_bits.shape[0] != num_nodes:
        raise ValueError(
            f"ancestor_bits must be int32 [T = {num_nodes}, W], got {ancestor_bits.dtype} {list(ancestor_bits.shape)}"
        )
    num_requests = node_offsets.numel() - 1
    if state_pool.dim() != 4 or list(state_pool.shape[1:]) != [num_v_heads, head_k_dim, head_v_dim]:
        raise ValueError(
            f"state_pool must have shape [S, Hv, Dk, Dv] = [S, {num_v_heads}, {head_k_dim}, "
            f"{head_v_dim}], got {list(state_pool.shape)}"
        )
    _require_shape("state_indices", state_indices, [num_requests], "[R]")
    raw_gating = a_log is not None
    if raw_gating != (dt_bias is not None):
        raise ValueError("a_log and dt_bias must be given together (raw gating) or both omitted")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta, ancestor_bits = g.contiguous(), beta.contiguous(), ancestor_bits.contiguous()
    if block_v is None:
        block_v = _default_block_v(num_requests * num_v_heads, head_v_dim)
    block_k = _next_power_of_two(head_k_dim)
    if out is None:
        out = torch.empty(num_nodes, num_v_heads, head_v_dim, dtype=out_dtype or q.dtype, device=q.device)
    elif list(out.shape) != [num_nodes, num_v_heads, head_v_dim] or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous [T, Hv, Dv] = [{num_nodes}, {num_v_heads}, {head_v_dim}] "
            f"tensor, got shape {list(out.shape)} strides {out.stride()}"
        )
    deltas = torch.empty(num_nodes, num_v_heads, head_v_dim, dtype=torch.float32, device=q.device)
    cum_log_decay = torch.empty(num_nodes, num_v_heads, dtype=torch.float32, device=q.device)
    dummy = cum_log_decay  # unused pointer arguments when gates are precomputed
    grid = (num_requests, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _tree_gdn_fwd_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        a_log if raw_gating else dummy,
        dt_bias if raw_gating else dummy,
        ancestor_bits,
        ancestor_bits.shape[1],
        node_offsets,
        state_pool,
        state_indices,
        *state_pool.stride(),
        out,
        deltas,
        cum_log_decay,
        float(scale if scale is not None else head_k_dim**-0.5),
        NUM_K_HEADS=num_k_heads,
        NUM_V_HEADS=num_v_heads,
        HEAD_K_DIM=head_k_dim,
        HEAD_V_DIM=head_v_dim,
        BT=block_t,
        BC=block_c,
        BK=block_k,
        BKC=min(block_kc, block_k),
        BV=block_v,
        PRECISION=precision,
        RAW_GATING=raw_gating,
        L2NORM=use_qk_l2norm,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, deltas, cum_log_decay


@triton.jit
def _tree_conv_qkv_kernel(
    x_ptr,
    stride_x,
    history_ptr,
    stride_hs,
    stride_hc,
    stride_hw,
    slots_ptr,
    index_ptr,
    weight_ptr,
    bias_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    num_history_rows,
    num_channels,
    key_width,
    value_width,
    WIDTH: tl.constexpr,
    HISTORY: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    """One node, ``BLOCK_C`` channels: ``sum_w source[index[t, w], c] * weight[c, w]`` (+ bias, SiLU).

    ``source`` is ``cat(history rows, x)`` without materialising it: row ``i < num_history_rows`` is
    column ``i % HISTORY`` of request ``i // HISTORY``'s history slot, later rows are rows of ``x``.
    """
    node = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = channels < num_channels
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for w in tl.static_range(WIDTH):
        row = tl.load(index_ptr + node * WIDTH + w)
        from_history = row < num_history_rows
        if HISTORY > 0:
            slot = tl.load(slots_ptr + row // HISTORY, mask=from_history, other=0).to(tl.int64)
            past = tl.load(
                history_ptr + slot * stride_hs + channels * stride_hc + (row % HISTORY) * stride_hw,
                mask=ok & from_history,
                other=0.0,
            )
            # The torch form casts the history to x's dtype before the fp32 conv: same rounding here.
            past = past.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            past = tl.zeros([BLOCK_C], dtype=tl.float32)
        current = tl.load(
            x_ptr + (row - num_history_rows) * stride_x + channels, mask=ok & (row >= num_history_rows), other=0.0
        ).to(tl.float32)
        weight = tl.load(weight_ptr + channels * WIDTH + w, mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(from_history, past, current) * weight
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = acc.to(q_ptr.dtype.element_ty)
    # Channels are [q | k | v]: each lands in its own contiguous tensor.
    in_q = channels < key_width
    in_k = (channels >= key_width) & (channels < 2 * key_width)
    in_v = ok & (channels >= 2 * key_width)
    tl.store(q_ptr + node * key_width + channels, out, mask=in_q)
    tl.store(k_ptr + node * key_width + (channels - key_width), out, mask=in_k)
    tl.store(v_ptr + node * value_width + (channels - 2 * key_width), out, mask=in_v)


def tree_conv_qkv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    conv_index: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
    key_width: int,
    *,
    block_c: int = 256,
    num_warps: int = 4,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of every tree node along its own root path, split into contiguous q, k, v.

    Args:
        x: ``[T, C]`` conv inputs of the tree nodes (rows contiguous), ``C = 2 * key_width + value_width``.
        conv_state: ``[S, C, W - 1]`` committed histories, oldest first, any strides (vLLM's "SD" layout
            is a transposed view).
        slots: int ``[R]`` history slot of each request.
        conv_index: int64 ``[T, W]`` rows of ``cat(history rows, x)`` (request ``r``'s history is rows
            ``r * (W - 1) .. r * (W - 1) + W - 2``); the last column is the node itself.
        weight: ``[C, W]``; bias: ``[C]`` or None; activation: ``"silu"``/``"swish"`` or None.

    Returns ``q [T, key_width]``, ``k [T, key_width]``, ``v [T, C - 2 key_width]`` in ``x.dtype``; fp32 math.
    """
    num_nodes, channels = x.shape
    width = weight.shape[-1]
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported GDN conv activation {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with contiguous rows, got shape {list(x.shape)} strides {x.stride()}")
    _require_shape("weight", weight, [channels, width], "[C, W]")
    _require_shape("conv_index", conv_index, [num_nodes, width], "[T, W]")
    if conv_state.dim() != 3 or conv_state.shape[1] != channels or conv_state.shape[2] != width - 1:
        raise ValueError(
            f"conv_state must have shape [S, C = {channels}, W - 1 = {width - 1}], got {list(conv_state.shape)}"
        )
    if bias is not None:
        _require_shape("bias", bias, [channels], "[C]")
    value_width = channels - 2 * key_width
    if key_width <= 0 or value_width <= 0:
        raise ValueError(f"key_width={key_width} leaves no value channels of C={channels}")
    q = torch.empty(num_nodes, key_width, dtype=x.dtype, device=x.device)
    k = torch.empty(num_nodes, key_width, dtype=x.dtype, device=x.device)
    v = torch.empty(num_nodes, value_width, dtype=x.dtype, device=x.device)
    if num_nodes == 0:
        return q, k, v
    weight = weight.contiguous()
    grid = (num_nodes, triton.cdiv(channels, block_c))
    _tree_conv_qkv_kernel[grid](
        x,
        x.stride(0),
        conv_state,
        *conv_state.stride(),
        slots,
        conv_index.contiguous(),
        weight,
        bias if bias is not None else weight,
        q,
        k,
        v,
        slots.shape[0] * (width - 1),
        channels,
        key_width,
        value_width,
        WIDTH=width,
        HISTORY=width - 1,
        BLOCK_C=block_c,
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        num_warps=num_warps,
    )
    return q, k, v


@triton.jit
def _tree_conv_commit_kernel(
    x_ptr,
    stride_x,
    history_ptr,
    stride_hs,
    stride_hc,
    stride_hw,
    slots_ptr,
    dst_slots_ptr,
    index_ptr,
    num_history_rows,
    num_channels,
    HISTORY: tl.constexpr,
    HISTORY_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One request, ``BLOCK_C`` channels: rows ``index[r, :]`` of ``cat(history, x)`` (history read from the
    requests' ``slots``) become the history in slot ``dst_slots[r]`` (``slots[r]`` in place; a negative slot:
    nothing written)."""
    request = tl.program_id(0)
    slot = tl.load(dst_slots_ptr + request).to(tl.int64)
    if slot < 0:
        return
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    column = tl.arange(0, HISTORY_PAD)
    ok = (column < HISTORY)[:, None] & (channels < num_channels)[None, :]
    rows = tl.load(index_ptr + request * HISTORY + column, mask=column < HISTORY, other=0)
    from_history = (rows < num_history_rows)[:, None]
    source_slot = tl.load(slots_ptr + rows // HISTORY, mask=(column < HISTORY) & (rows < num_history_rows), other=0).to(
        tl.int64
    )
    past = tl.load(
        history_ptr
        + source_slot[:, None] * stride_hs
        + channels[None, :] * stride_hc
        + (rows % HISTORY)[:, None] * stride_hw,
        mask=ok & from_history,
        other=0.0,
    )
    current = tl.load(
        x_ptr + (rows - num_history_rows)[:, None] * stride_x + channels[None, :],
        mask=ok & (rows >= num_history_rows)[:, None],
        other=0.0,
    )
    value = tl.where(from_history, past, current.to(history_ptr.dtype.element_ty))
    # The new history may be the old one shifted: every thread has read before any writes.
    tl.debug_barrier()
    tl.store(
        history_ptr + slot * stride_hs + channels[None, :] * stride_hc + column[:, None] * stride_hw, value, mask=ok
    )


def tree_conv_commit(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    conv_index: torch.Tensor,
    dst_slots: Optional[torch.Tensor] = None,
    *,
    block_c: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """Writes each request's new conv history into its slot, in place (or into ``dst_slots``); one launch.

    Args:
        x: ``[T, C]`` conv inputs of the verified tree nodes (channels contiguous).
        conv_state: ``[S, C, W - 1]`` histories, oldest first, any strides; slot ``slots[r]`` of request ``r``
            is read and overwritten.
        slots: int ``[R]``.
        conv_index: int64 ``[R, W - 1]`` rows of ``cat(history rows, x)`` (``ddtree.vllm.step.conv_commit_index``:
            the last ``W - 1`` entries of the old history followed by the accepted path).
        dst_slots: int ``[R]``, where each new history goes (default ``slots``: in place); a negative slot writes
            nothing. A destination must not be a slot another request reads in the same launch.

    Returns ``conv_state``.
    """
    num_requests = slots.shape[0]
    if dst_slots is None:
        dst_slots = slots
    _require_shape("dst_slots", dst_slots, [num_requests], "[R]")
    history = conv_state.shape[-1]
    if conv_state.dim() != 3 or conv_state.shape[1] != x.shape[1]:
        raise ValueError(f"conv_state must have shape [S, C = {x.shape[1]}, W - 1], got {list(conv_state.shape)}")
    _require_shape("conv_index", conv_index, [num_requests, history], "[R, W - 1]")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, C] with contiguous channels, got shape {list(x.shape)} strides {x.stride()}")
    if history == 0 or num_requests == 0:
        return conv_state
    channels = x.shape[1]
    grid = (num_requests, triton.cdiv(channels, block_c))
    _tree_conv_commit_kernel[grid](
        x,
        x.stride(0),
        conv_state,
        *conv_state.stride(),
        slots,
        dst_slots,
        conv_index.contiguous(),
        num_requests * history,
        channels,
        HISTORY=history,
        HISTORY_PAD=_next_power_of_two(history, minimum=1),
        BLOCK_C=block_c,
        num_warps=num_warps,
    )
    return conv_state


def pad_accepted_paths(paths: Sequence[IndexLike], device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(int32 [R, P] request-local paths padded with 0, int32 [R] lengths)`` for :func:`tree_gdn_commit`."""
    lists = [torch.as_tensor(p).reshape(-1).tolist() for p in paths]
    width = max(len(p) for p in lists)
    padded = torch.zeros(len(lists), width, dtype=torch.int32)
    for row, path in enumerate(lists):
        padded[row, : len(path)] = torch.tensor(path, dtype=torch.int32)
    lengths = torch.tensor([len(p) for p in lists], dtype=torch.int32)
    return padded.to(device), lengths.to(device)


def tree_gdn_commit(
    k: torch.Tensor,
    deltas: torch.Tensor,
    cum_log_decay: torch.Tensor,
    node_offsets: torch.Tensor,
    paths: torch.Tensor,
    path_lengths: torch.Tensor,
    state_pool: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: Optional[torch.Tensor] = None,
    dst_pool: Optional[torch.Tensor] = None,
    *,
    use_qk_l2norm: bool = True,
    precision: str = "tf32x3",
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """Write each request's state after its accepted path into a pool slot (WY commit, no solve).

    ``S_new = exp(G_last) S0 + sum_{j in path} exp(G_last - G_j) k^_j u_j^T``.

    Args:
        k: ``[T, Hk, Dk]`` raw keys of the verification pass (normalised here).
        deltas, cum_log_decay: ``u [T, Hv, Dv]`` and ``G [T, Hv]`` from :func:`tree_gdn_verify`.
        node_offsets: ``[R + 1]``; paths: int32 ``[R, P]`` request-local
            ``[0, a1, ..., am]`` padded; path_lengths: int32 ``[R]`` (>= 1).
        state_pool: ``[S, Hv, Dk, Dv]`` (any strides) holding ``S0`` at
            ``src_indices [R]``; the result goes to ``dst_pool`` (default
            ``state_pool``) at ``dst_indices`` (default ``src_indices``, in place); a negative
            destination writes nothing for its request.

    Returns ``dst_pool``. Cost per request and head: read ``S0`` and write
    ``S_new`` (2 Dk Dv fp32) plus ``m + 1`` rows of k and u -- the memory
    traffic of one recurrent step, independent of the tree size.
    """
    if dst_pool is None:
        dst_pool = state_pool
    if dst_indices is None:
        dst_indices = src_indices
    num_k_heads, head_k_dim = k.shape[1:]
    num_v_heads, head_v_dim = deltas.shape[1:]
    num_requests = node_offsets.numel() - 1
    grid = (num_requests, num_v_heads, triton.cdiv(head_v_dim, block_v))
    _tree_gdn_commit_kernel[grid](
        k.contiguous(),
        deltas,
        cum_log_decay,
        node_offsets,
        paths.contiguous(),
        path_lengths,
        paths.shape[1],
        state_pool,
        src_indices,
        dst_pool,
        dst_indices,
        *state_pool.stride(),
        *dst_pool.stride(),
        NUM_K_HEADS=num_k_heads,
        NUM_V_HEADS=num_v_heads,
        HEAD_K_DIM=head_k_dim,
        HEAD_V_DIM=head_v_dim,
        BP=_next_power_of_two(paths.shape[1]),
        BK=_next_power_of_two(head_k_dim),
        BV=block_v,
        PRECISION=precision,
        L2NORM=use_qk_l2norm,
        num_warps=num_warps,
    )
    return dst_pool


def tree_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: IndexLike,
    node_offsets: IndexLike,
    initial_states: torch.Tensor,
    use_qk_l2norm: bool = True,
    **kernel_options,
):
    """Drop-in counterpart of ``tree_gated_delta_rule_batched`` (same arguments; states ``[R, Hv, Dk, Dv]``).

    Validates the trees on the host, builds the ancestor bits and calls
    :func:`tree_gdn_verify` with ``state_indices = arange(R)``.

    Returns ``(o [T, Hv, Dv] in q.dtype, deltas u [T, Hv, Dv] fp32, G [T, Hv] fp32)``.
    """
    num_nodes = q.shape[0]
    _check_gdn_inputs(q, k, v, g, beta, num_nodes)
    offsets = validate_node_offsets(node_offsets, num_nodes, device=q.device)
    local_parents = validate_batched_parents(parents, offsets, device=q.device)
    num_requests = offsets.numel() - 1
    if initial_states.dim() != 4 or initial_states.shape[0] != num_requests:
        raise ValueError(
            f"initial_states must have shape [R = {num_requests}, Hv, Dk, Dv], got {list(initial_states.shape)}"
        )
    bits = ancestor_bits_from_parents(local_parents, offsets)
    indices = torch.arange(num_requests, device=q.device, dtype=torch.int32)
    return tree_gdn_verify(
        q,
        k,
        v,
        g,
        beta,
        offsets.to(torch.int32),
        bits,
        initial_states,
        indices,
        use_qk_l2norm=use_qk_l2norm,
        **kernel_options,
    )
