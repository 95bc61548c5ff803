"""Exact tree verification of Gated DeltaNet layers inside vLLM's own state cache.

vLLM's chain speculation keeps one recurrent-state slot per draft position
(``num_speculative_tokens + 1`` slots per request per GDN layer) and reads
position t's state from slot t-1; a tree breaks both. DDTree keeps ONE slot per
request (the committed state, exactly as without speculation) and:

* *verify* (inside the layer's forward, :func:`verify_tree_tokens`): every tree
  node's conv window is gathered along its root path from the committed conv
  history and its ancestors' inputs; every node's output comes from the WY form
  of the delta rule over its root path (:func:`ddtree.kernels.gdn_triton.tree_gdn_verify`),
  which reads the committed state and writes nothing per node. The layer keeps
  what the commit needs (:class:`PendingCommit`): the nodes' conv inputs, raw
  keys, per-node deltas and root-path log decays -- activations of this step
  only, released after the commit;
* *commit* (after acceptance, :func:`commit_pending`): the conv history becomes
  the last ``W - 1`` inputs of ``history + accepted path`` and the state slot is
  overwritten in place with the state after the accepted path (WY commit, one
  ``[Dk, P] @ [P, Dv]`` product per head), so the next step reads slot 0 like
  any decode.

The state memory a request holds is therefore one slot whatever the budget
(vLLM's chain: 16 slots at 15 draft tokens). What grows with the tree is the
step's transient activations (about ``(C + 2 Hk Dk + 4 Hv Dv)`` bytes per tree
token and GDN layer).

No vLLM import: the runner and the patch (``ddtree.vllm.patches``) pass vLLM's
tensors in, which keeps this module testable on CPU (Triton interpreter).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class GdnTreeStep:
    """One verification step's tree layout, shared by every GDN layer (GPU tensors).

    ``token_index`` lists the tree tokens among the step's flat tokens in vLLM's
    batch order (which is also the order of the GDN metadata's spec requests).
    ``conv_index[t]`` indexes ``cat(history rows, tree inputs)`` where request
    ``r``'s committed history occupies rows ``r*(W-1) .. r*(W-1)+W-2`` (oldest
    first) and tree node ``t`` is row ``R*(W-1) + t``; its last column is node
    ``t`` itself.
    """

    token_index: torch.Tensor  # [T] int64
    other_index: Optional[torch.Tensor]  # [N - T] int64, None when every token is a tree token
    node_offsets: torch.Tensor  # [R + 1] int32
    ancestor_bits: torch.Tensor  # [T, words] int32
    conv_index: torch.Tensor  # [T, W] int64
    num_requests: int
    num_tree_tokens: int
    pending: Dict[str, "PendingCommit"] = dataclasses.field(default_factory=dict)
    # The layers' state slots as int32, converted once per step: every GDN layer of a step reads the same
    # slot tensor (one KV-cache group), as a new view each time.
    _slots: Optional[Tuple[Tuple[int, int, int], torch.Tensor]] = None

    def state_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` as contiguous int32, converted once per step and source tensor.

        The kernels index slots as a dense vector; vLLM's slot column is a strided view whenever its GDN
        builder copies the spec-decode indices into its ``[max_bs, num_spec + 1]`` graph buffer.
        """
        key = (slots.data_ptr(), slots.stride(0), slots.shape[0])
        if self._slots is None or self._slots[0] != key:
            self._slots = (key, slots.to(torch.int32).contiguous())
        return self._slots[1]


@dataclasses.dataclass
class PendingCommit:
    """What one GDN layer's commit needs from its verification."""

    conv_state: torch.Tensor  # [S, C, W - 1] view of the layer's conv cache
    ssm_state: torch.Tensor  # [S, Hv, Dk, Dv] view of the layer's state cache
    slots: torch.Tensor  # [R] state slot of each tree request
    x: torch.Tensor  # [T, C] conv inputs of the tree nodes
    k: torch.Tensor  # [T, Hk, Dk] raw keys (conv outputs)
    deltas: torch.Tensor  # [T, Hv, Dv] fp32
    cum_log_decay: torch.Tensor  # [T, Hv] fp32


@dataclasses.dataclass
class GdnCommitPlan:
    """The accepted paths in the form the commit kernels take (GPU tensors, shared by every layer)."""

    node_offsets: torch.Tensor  # [R + 1] int32, the verified trees' CSR offsets
    paths: torch.Tensor  # [R, P] int32 request-local, padded with 0
    path_lengths: torch.Tensor  # [R] int32 (root included, >= 1)
    conv_index: torch.Tensor  # [R, W - 1] int64 into cat(history rows, tree inputs)


def tree_conv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    conv_index: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Optional[str],
) -> torch.Tensor:
    """Causal depthwise conv of every tree node along its own root path; fp32 math, ``x.dtype`` out.

    The torch form of :func:`ddtree.kernels.gdn_triton.tree_conv_qkv` (one launch instead of about
    ten), kept as its test reference.

    Args:
        x: ``[T, C]`` conv inputs of the tree nodes.
        conv_state: ``[S, C, W - 1]`` committed histories (oldest first).
        slots: ``[R]`` history slot of each request.
        conv_index: ``[T, W]`` (see :class:`GdnTreeStep`).
        weight: ``[C, W]``, ``weight[:, -1]`` multiplies the node's own input.
    """
    channels = x.shape[1]
    history = conv_state[slots.long()].transpose(1, 2).reshape(-1, channels)
    source = torch.cat([history.to(x.dtype), x])
    out = torch.einsum("twc,cw->tc", source[conv_index].float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported GDN conv activation {activation!r}")
    return out.to(x.dtype)


def verify_tree_tokens(
    step: GdnTreeStep,
    layer_name: str,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    activation: Optional[str],
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    head_k_dim: int,
    head_v_dim: int,
    out_dtype: torch.dtype,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Outputs ``[T, Hv, Dv]`` of one GDN layer for the step's tree tokens; records the layer's commit.

    ``x``, ``a``, ``b`` are the tree tokens' rows only (``[T, C]``, ``[T, Hv]``);
    ``conv_state`` is ``[S, C, W - 1]`` and ``ssm_state`` vLLM's ``[S, Hv, Dv, Dk]``.
    The caches are only read here. ``out`` (contiguous ``[T, Hv, Dv]``, e.g. the layer's output rows)
    receives the outputs instead of a new tensor. Three launches: conv (:func:`tree_conv_qkv`), the int32
    slots (once per step) and the tree kernel; the torch form of the conv is :func:`tree_conv`.
    """
    from ddtree.kernels.gdn_triton import tree_conv_qkv, tree_gdn_verify

    num_tokens = x.shape[0]
    if num_tokens != step.num_tree_tokens or slots.shape[0] != step.num_requests:
        raise RuntimeError(
            f"DDTree GDN layer {layer_name}: {num_tokens} tree tokens / {slots.shape[0]} requests in the layer, "
            f"{step.num_tree_tokens} / {step.num_requests} in the step's plan"
        )
    num_v_heads = a.shape[1]
    key_width = (x.shape[1] - num_v_heads * head_v_dim) // 2
    slots = step.state_slots(slots)
    q, k, v = tree_conv_qkv(x, conv_state, slots, step.conv_index, conv_weight, conv_bias, activation, key_width)
    q = q.view(num_tokens, -1, head_k_dim)
    k = k.view(num_tokens, -1, head_k_dim)
    v = v.view(num_tokens, num_v_heads, head_v_dim)
    pool = ssm_state.transpose(-1, -2)  # [S, Hv, Dk, Dv] view
    out, deltas, cum_log_decay = tree_gdn_verify(
        q,
        k,
        v,
        a,
        b,
        step.node_offsets,
        step.ancestor_bits,
        pool,
        slots,
        a_log=a_log,
        dt_bias=dt_bias,
        out_dtype=out_dtype,
        out=out,
    )
    # x is usually a view of the layer's input, which under CUDA graphs lives in the graph's memory pool and
    # is overwritten by later pieces before the commit runs: the commit keeps its own copy.
    step.pending[layer_name] = PendingCommit(conv_state, pool, slots, x.clone(), k, deltas, cum_log_decay)
    return out


def commit_layer(pending: PendingCommit, plan: GdnCommitPlan, dst_slots: Optional[torch.Tensor] = None) -> None:
    """Writes the accepted paths' conv history and recurrent state into the layer's slots (in place), or into
    ``dst_slots`` (int32 ``[R]``; a negative slot writes nothing), reading the layer's slots."""
    from ddtree.kernels.gdn_triton import tree_conv_commit, tree_gdn_commit

    tree_conv_commit(pending.x, pending.conv_state, pending.slots, plan.conv_index, dst_slots=dst_slots)
    tree_gdn_commit(
        pending.k,
        pending.deltas,
        pending.cum_log_decay,
        plan.node_offsets,
        plan.paths,
        plan.path_lengths,
        pending.ssm_state,
        pending.slots,
        dst_indices=dst_slots,
    )


def commit_conv_index(nodes: torch.Tensor, lengths: torch.Tensor, conv_window: int) -> torch.Tensor:
    """The commit's conv rows ``[R, conv_window]`` int64: the last ``conv_window`` rows of ``(history, path[:length])``,
    the history's row ``r * w + e`` and path entry ``p`` at ``R * w +`` its step node. ``nodes``: ``[R, P]`` int64, the
    step node of each path entry (any value past a path's length); ``lengths``: ``[R]`` entries taken, root included."""
    num_trees, path_width = nodes.shape
    entry = lengths.to(torch.int64)[:, None] + torch.arange(conv_window, device=nodes.device)[None, :]
    from_path = num_trees * conv_window + nodes.gather(1, (entry - conv_window).clamp(0, path_width - 1))
    history = torch.arange(num_trees, device=nodes.device)[:, None] * conv_window + entry
    return torch.where(entry >= conv_window, from_path, history)


def boundary_commit_plan(
    plan: GdnCommitPlan, prefix: torch.Tensor, conv_window: int
) -> Tuple[GdnCommitPlan, torch.Tensor]:
    """The commit of each accepted path's first ``prefix[r]`` entries (root included), and which rows write.

    Prefix caching with a hybrid target (``ddtree.vllm.mamba_align``): a row whose path reaches the end of its
    root's state block needs the state after exactly that block, which the main commit (the whole path) does not
    compute. Returns the plan of the prefixes and a bool ``[R]`` mask, true where ``0 < prefix[r] <=`` the row's
    accepted path length; the other rows must write nothing. Device tensors only, no host sync.
    """
    prefix = prefix.to(device=plan.path_lengths.device, dtype=torch.int32)
    writes = (prefix > 0) & (prefix <= plan.path_lengths)
    lengths = torch.where(writes, prefix, torch.ones_like(prefix))
    nodes = plan.node_offsets[:-1, None].to(torch.int64) + plan.paths.to(torch.int64)
    boundary = GdnCommitPlan(plan.node_offsets, plan.paths, lengths, commit_conv_index(nodes, lengths, conv_window))
    return boundary, writes


def commit_boundaries(
    pendings: Dict[str, PendingCommit],
    plan: GdnCommitPlan,
    prefix: torch.Tensor,
    boundary_slots: Dict[str, torch.Tensor],
    conv_window: int,
) -> None:
    """Every layer's boundary commit (:func:`boundary_commit_plan`) into ``boundary_slots[layer]`` (int32 ``[R]``,
    one tensor per KV-cache group, shared by its layers); rows whose path does not reach their prefix write nothing.
    Runs before the main commit, which overwrites the slots these commits read."""
    boundary, writes = boundary_commit_plan(plan, prefix, conv_window)
    masked: Dict[int, torch.Tensor] = {}
    for name, pending in pendings.items():
        slots = boundary_slots[name]
        dst = masked.get(id(slots))
        if dst is None:
            dst = masked[id(slots)] = torch.where(writes, slots, torch.full_like(slots, -1))
        commit_layer(pending, boundary, dst)


def commit_pending(step: GdnTreeStep, plan: GdnCommitPlan) -> int:
    """Commits every GDN layer verified in ``step``; returns the number of layers committed."""
    count = 0
    for pending in step.pending.values():
        commit_layer(pending, plan)
        count += 1
    step.pending.clear()
    return count
