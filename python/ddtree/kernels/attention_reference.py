"""Tree verification reference for the full-attention layers of a hybrid target.

The draft tree's nodes are appended after the request's committed prefix of
``P`` tokens. Node ``i`` sits at position ``P + depth(i)`` (siblings share a
position, so RoPE sees the same positions as a sequential decode of any root
path) and attends to the whole prefix plus its ancestors-or-self. After
verification, the K/V of the accepted path ``[0, a1, ..., am]`` must end up
at positions ``P .. P + m`` -- the slots the first ``m + 1`` tree nodes were
written to -- which :mod:`.kv_moves` does.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .topology import (
    IndexLike,
    ancestor_or_self_mask,
    tree_depths,
    validate_batched_parents,
    validate_node_offsets,
    validate_parents,
)


def tree_positions(parents: IndexLike, prefix_len: int) -> torch.Tensor:
    """Position ids ``[N]``: ``prefix_len + depth`` (the root is the next token after the prefix)."""
    parents = validate_parents(parents)
    return prefix_len + tree_depths(parents)


def tree_attention_mask(parents: IndexLike, prefix_len: int) -> torch.Tensor:
    """Boolean ``[N, P + N]``: True where node ``i`` may attend (whole prefix, ancestors-or-self)."""
    parents = validate_parents(parents)
    prefix_visible = torch.ones(parents.numel(), prefix_len, dtype=torch.bool, device=parents.device)
    return torch.cat([prefix_visible, ancestor_or_self_mask(parents)], dim=1)


def _check_attention_shapes(q, k, v, prefix_keys, prefix_values, num_nodes):
    if q.dim() != 3 or q.shape[0] != num_nodes:
        raise ValueError(f"q must have shape [N, Hq, D] with N = {num_nodes}, got {list(q.shape)}")
    if k.dim() != 3 or k.shape[0] != num_nodes or k.shape[2] != q.shape[2]:
        raise ValueError(f"k must have shape [N, Hkv, D] = [{num_nodes}, Hkv, {q.shape[2]}], got {list(k.shape)}")
    if list(v.shape[:2]) != list(k.shape[:2]) or v.dim() != 3:
        raise ValueError(f"v must have shape [N, Hkv, Dv] = [{k.shape[0]}, {k.shape[1]}, Dv], got {list(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q must have shape [N, Hq, D] with Hq a multiple of Hkv = {k.shape[1]}, got Hq = {q.shape[1]}"
        )
    if prefix_keys.dim() != 3 or list(prefix_keys.shape[1:]) != list(k.shape[1:]):
        raise ValueError(
            f"prefix_keys must have shape [P, Hkv, D] = [P, {k.shape[1]}, {k.shape[2]}], got {list(prefix_keys.shape)}"
        )
    if list(prefix_values.shape) != [prefix_keys.shape[0]] + list(v.shape[1:]):
        raise ValueError(
            f"prefix_values must have shape [P, Hkv, Dv] = {[prefix_keys.shape[0]] + list(v.shape[1:])}, "
            f"got {list(prefix_values.shape)}"
        )


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    parents: IndexLike,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Softmax attention of one tree's nodes over ``prefix + ancestors-or-self``.

    Args:
        q: ``[N, Hq, D]`` queries (RoPE already applied at :func:`tree_positions`).
        k, v: ``[N, Hkv, D]``, ``[N, Hkv, Dv]`` the nodes' own keys/values.
        prefix_keys, prefix_values: committed ``[P, Hkv, D]``, ``[P, Hkv, Dv]``.
        parents: ``[N]``.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``[N, Hq, Dv]`` in ``q.dtype``; node ``i`` equals causal attention of
        the last token of ``prefix + root path of i``. Query head ``h`` reads
        KV head ``h // (Hq / Hkv)``.
    """
    parents = validate_parents(parents, device=q.device)
    _check_attention_shapes(q, k, v, prefix_keys, prefix_values, parents.numel())
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)

    keys = torch.cat([prefix_keys, k]).to(dtype).repeat_interleave(group, dim=1)  # [P + N, Hq, D]
    values = torch.cat([prefix_values, v]).to(dtype).repeat_interleave(group, dim=1)
    visible = tree_attention_mask(parents, prefix_keys.shape[0]).to(q.device)  # [N, P + N]
    scores = torch.einsum("nhd,shd->hns", q.to(dtype), keys) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hns,she->nhe", weights, values).to(q.dtype)


def tree_attention_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_keys: Sequence[torch.Tensor],
    prefix_values: Sequence[torch.Tensor],
    parents: IndexLike,
    node_offsets: IndexLike,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """:func:`tree_attention` for R requests flattened to ``[T, ...]`` with CSR ``node_offsets [R + 1]``.

    ``prefix_keys[r]`` / ``prefix_values[r]`` are request ``r``'s committed
    ``[P_r, Hkv, D]`` / ``[P_r, Hkv, Dv]``; ``parents [T]`` are request-local.
    """
    offsets = validate_node_offsets(node_offsets, q.shape[0], device=q.device)
    local_parents = validate_batched_parents(parents, offsets, device=q.device)
    num_requests = offsets.numel() - 1
    if len(prefix_keys) != num_requests or len(prefix_values) != num_requests:
        raise ValueError(f"prefix_keys and prefix_values must hold R = {num_requests} tensors each")
    outputs = []
    for request in range(num_requests):
        rows = slice(int(offsets[request]), int(offsets[request + 1]))
        outputs.append(
            tree_attention(
                q[rows], k[rows], v[rows], prefix_keys[request], prefix_values[request], local_parents[rows], scale
            )
        )
    return torch.cat(outputs)
