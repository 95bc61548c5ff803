"""First Triton version of the tree WY solve (correctness baseline, not tuned).

One program per (request, value head) holds the whole tree in registers
(``N <= 128`` nodes after padding to a power of two) and computes exactly what
:func:`ddtree.kernels.gdn_tree.tree_gated_delta_rule_batched` computes:

* ``decay[i, j] = exp(G_i - G_j)`` on ancestors-or-self, 0 elsewhere;
* ``(I + L) U = beta (V - exp(G) K S_0)`` solved by forward substitution
  (row ``i`` only reads rows ``j < i``, because parents precede children);
* ``O = exp(G) Q S_0 + (decay * Q K^T) U``.

The host wrapper prepares what is cheap and shared: l2-normalised keys and
queries, ``G`` and the packed ancestor masks (from the torch reference
helpers). All matmuls run with ``input_precision="ieee"`` so fp32 results are
not degraded by TF32. The forward substitution extracts one row per step with
masked reductions -- O(N^3) but simple; a tuned kernel would solve 16 x 16
diagonal blocks and merge them with tensor-core products instead.

Import this module only where Triton is available; it is not imported by
``ddtree.kernels``. Set ``TRITON_INTERPRET=1`` before import to run it on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gdn_tree import _check_gdn_inputs, _compute_dtype, _prepare_qk, _require_shape
from .tree_topology import IndexLike, ancestor_or_self_mask, validate_batched_parents, validate_node_offsets

MAX_TREE_NODES = 128


@triton.jit
def _tree_gdn_wy_kernel(
    q_ptr, k_ptr, v_ptr, cum_log_decay_ptr, beta_ptr, mask_ptr, state_ptr,  # inputs
    out_ptr, delta_ptr,  # outputs
    node_offsets_ptr, mask_offsets_ptr,
    NUM_K_HEADS: tl.constexpr, NUM_V_HEADS: tl.constexpr, HEAD_K_DIM: tl.constexpr, HEAD_V_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    request = tl.program_id(0)
    v_head = tl.program_id(1)
    k_head = v_head // (NUM_V_HEADS // NUM_K_HEADS)
    first_node = tl.load(node_offsets_ptr + request)
    num_nodes = tl.load(node_offsets_ptr + request + 1) - first_node
    mask_base = tl.load(mask_offsets_ptr + request)

    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < num_nodes
    node = first_node + rows

    # Per-node tiles of this head (rows past the tree are zero).
    qk_offsets = (node[:, None] * NUM_K_HEADS + k_head) * HEAD_K_DIM + dk[None, :]
    qk_mask = row_ok[:, None] & (dk[None, :] < HEAD_K_DIM)
    q = tl.load(q_ptr + qk_offsets, mask=qk_mask, other=0.0)
    k = tl.load(k_ptr + qk_offsets, mask=qk_mask, other=0.0)
    v_offsets = (node[:, None] * NUM_V_HEADS + v_head) * HEAD_V_DIM + dv[None, :]
    v_mask = row_ok[:, None] & (dv[None, :] < HEAD_V_DIM)
    v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
    cum = tl.load(cum_log_decay_ptr + node * NUM_V_HEADS + v_head, mask=row_ok, other=0.0)
    beta = tl.load(beta_ptr + node * NUM_V_HEADS + v_head, mask=row_ok, other=0.0)
    cum_cols = tl.load(cum_log_decay_ptr + (first_node + cols) * NUM_V_HEADS + v_head, mask=cols < num_nodes, other=0.0)

    in_tree = row_ok[:, None] & (cols[None, :] < num_nodes)
    visible = tl.load(mask_ptr + mask_base + rows[:, None] * num_nodes + cols[None, :], mask=in_tree, other=0) != 0
    # Mask before exp: G_i - G_j is only <= 0 on root paths.
    decay = tl.exp(tl.where(visible, cum[:, None] - cum_cols[None, :], float("-inf")))

    state_offsets = ((request * NUM_V_HEADS + v_head) * HEAD_K_DIM + dk[:, None]) * HEAD_V_DIM + dv[None, :]
    state_mask = (dk[:, None] < HEAD_K_DIM) & (dv[None, :] < HEAD_V_DIM)
    state = tl.load(state_ptr + state_offsets, mask=state_mask, other=0.0)

    key_gram = tl.dot(k, tl.trans(k), input_precision="ieee")
    strictly_ancestor = visible & (rows[:, None] != cols[None, :])
    interaction = tl.where(strictly_ancestor, beta[:, None] * decay * key_gram, 0.0)
    initial_decay = tl.exp(cum)[:, None]
    rhs = beta[:, None] * (v - initial_decay * tl.dot(k, state, input_precision="ieee"))

    # Forward substitution: u_i = rhs_i - sum_{j < i} L[i, j] u_j. Padding rows have
    # zero rhs and interaction, so running over the whole block leaves them zero.
    deltas = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    for i in range(0, BLOCK_N):
        is_row = rows[:, None] == i
        interaction_row = tl.sum(tl.where(is_row, interaction, 0.0), axis=0)  # [BLOCK_N] over j
        rhs_row = tl.sum(tl.where(is_row, rhs, 0.0), axis=0)  # [BLOCK_DV]
        delta_row = rhs_row - tl.sum(interaction_row[:, None] * deltas, axis=0)
        deltas = tl.where(is_row, delta_row[None, :], deltas)

    attention = decay * tl.dot(q, tl.trans(k), input_precision="ieee")
    out = initial_decay * tl.dot(q, state, input_precision="ieee") + tl.dot(attention, deltas, input_precision="ieee")
    tl.store(out_ptr + v_offsets, out, mask=v_mask)
    tl.store(delta_ptr + v_offsets, deltas, mask=v_mask)


def _next_power_of_two(value: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (int(value) - 1).bit_length())


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
):
    """Triton counterpart of ``tree_gated_delta_rule_batched`` (same shapes, fp32 compute).

    Returns ``(o [T, Hv, Dv] in q.dtype, deltas u [T, Hv, Dv] fp32, G [T, Hv] fp32)``.
    """
    num_nodes = q.shape[0]
    num_k_heads, head_k_dim, num_v_heads, head_v_dim = _check_gdn_inputs(q, k, v, g, beta, num_nodes)
    offsets = validate_node_offsets(node_offsets, num_nodes, device=q.device)
    local_parents = validate_batched_parents(parents, offsets, device=q.device)
    num_requests = offsets.numel() - 1
    _require_shape(
        "initial_states", initial_states, [num_requests, num_v_heads, head_k_dim, head_v_dim], "[R, Hv, Dk, Dv]"
    )
    sizes = (offsets[1:] - offsets[:-1]).tolist()
    if max(sizes) > MAX_TREE_NODES:
        raise ValueError(f"node_offsets: trees of at most {MAX_TREE_NODES} nodes fit one program, got {max(sizes)}")
    dtype = _compute_dtype(q.dtype)
    if dtype != torch.float32:
        raise ValueError(f"q must be fp32, fp16 or bf16 for the Triton kernel (computes in fp32), got {q.dtype}")

    q_prepared, k_prepared = _prepare_qk(q, k, use_qk_l2norm, torch.float32)
    masks, cum_log_decays = [], []
    for request, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        visible = ancestor_or_self_mask(local_parents[start:end])
        masks.append(visible.reshape(-1).to(torch.uint8))
        cum_log_decays.append(visible.float() @ g[start:end].float())  # G_i = sum over root path
    mask_offsets = torch.tensor([0] + [n * n for n in sizes], device=q.device).cumsum(0)

    out = torch.empty(num_nodes, num_v_heads, head_v_dim, dtype=torch.float32, device=q.device)
    deltas = torch.empty_like(out)
    cum_log_decay = torch.cat(cum_log_decays).contiguous()
    _tree_gdn_wy_kernel[(num_requests, num_v_heads)](
        q_prepared.contiguous(), k_prepared.contiguous(), v.float().contiguous(), cum_log_decay,
        beta.float().contiguous(), torch.cat(masks).contiguous(), initial_states.float().contiguous(),
        out, deltas, offsets.contiguous(), mask_offsets.contiguous(),
        NUM_K_HEADS=num_k_heads, NUM_V_HEADS=num_v_heads, HEAD_K_DIM=head_k_dim, HEAD_V_DIM=head_v_dim,
        BLOCK_N=_next_power_of_two(max(sizes)), BLOCK_DK=_next_power_of_two(head_k_dim),
        BLOCK_DV=_next_power_of_two(head_v_dim),
    )
    return out.to(q.dtype), deltas, cum_log_decay
