"""The tree walk and the acceptance's layout on the device: :func:`ddtree.vllm.step.accept` without a host copy.

The Rust acceptance needs the target's per-node tokens on the host, so the host waits for the verification
before it can commit and prepare the drafter; that wait exposes the drafter's whole host preparation
(``docs/async-scheduling.md``, step 1). Here the same results are computed with a fixed number of torch
operations on the device from what the plan uploaded, so the host goes on queueing the commit and the drafter
while the GPU still verifies.

The walk: node ``i`` is accepted when every ancestor-or-self ``a`` but the root *matches*, i.e. ``a``'s draft
token equals the target's token sampled at ``a``'s parent. Siblings carry distinct tokens, so the accepted nodes
form one root path, and its ``k``-th node is the accepted node of depth ``k``. Everything returned equals the
Rust layout (``ddtree.acceptance_layout_into``) field by field, except the KV moves: Rust lists the ``M`` real
moves; here every tree has ``path width`` move slots, the unused ones moving the root's slot onto itself (no
real move writes a root's slot, so the gather-then-scatter of ``kernels.kv_moves`` stays exact).
``tests/vllm_adapter/test_device_accept.py`` checks all of it against the Rust acceptance.

No vLLM import (CPU-tested in CI).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np
import torch

from ddtree.vllm.gdn import commit_conv_index
from ddtree.vllm.step import index_within_groups

if TYPE_CHECKING:
    from ddtree.vllm.counts import PathRing

#: Host arrays the plan uploads for the device walk beside the verification layout and the nodes' ``depths``,
#: written by the Rust layout (``ddtree.verify_layout_into``; :func:`node_arrays` is their numpy reference).
NODE_ARRAYS = ("node_parents", "node_tree", "node_local", "node_tokens")


def node_arrays(trees) -> Dict[str, np.ndarray]:
    """The numpy reference of the device walk's per-node inputs (what the runner has the Rust layout write): int64
    ``[T]`` arrays in the plan's node order, each node's parent as a node index of the step (a root: itself), depth
    (``node_depths``), tree, index in its tree and draft token (a root: 0, never read)."""
    offsets = np.asarray(trees.node_offsets, dtype=np.int64)
    sizes = np.diff(offsets)
    tree = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)
    local = index_within_groups(sizes)
    parents = np.asarray(trees.parents, dtype=np.int64)
    tokens = np.zeros(tree.shape[0], dtype=np.int64)
    # Tree r's draft token k belongs to its node k + 1 (the root has none).
    token_offsets = np.asarray(trees.token_offsets, dtype=np.int64)
    non_root = local > 0
    tokens[non_root] = np.asarray(trees.tokens, dtype=np.int64)[token_offsets[tree[non_root]] + local[non_root] - 1]
    return {
        "node_parents": np.where(parents >= 0, offsets[tree] + parents, offsets[tree] + local),
        "node_depths": np.asarray(trees.depths, dtype=np.int64),
        "node_tree": tree,
        "node_local": local,
        "node_tokens": tokens,
    }


@dataclasses.dataclass
class DeviceTrees:
    """A step's trees on the device (views of the plan's upload), what :func:`accept_on_device` reads."""

    node_parents: torch.Tensor  # [T] int64
    node_depths: torch.Tensor  # [T] int64
    node_tree: torch.Tensor  # [T] int64
    node_local: torch.Tensor  # [T] int64
    node_tokens: torch.Tensor  # [T] int64
    node_offsets: torch.Tensor  # [R + 1] int64
    query_starts: torch.Tensor  # [R] int64: each tree's root among the step's scheduled tokens
    token_index: torch.Tensor  # [T] int64: each node among the step's scheduled tokens
    ancestor_bits: torch.Tensor  # [T, words] int32, tree-local ancestor-or-self bits
    # [1] int64: the step's serial, which places its path rows in the statistics' ring (None: no ring write)
    step_serial: Optional[torch.Tensor] = None


def accepted_nodes(trees: DeviceTrees, target: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: the nodes on each tree's accepted path, given the target's token at every node."""
    t = trees.node_tokens.shape[0]
    is_root = trees.node_local == 0
    matched = is_root | (trees.node_tokens == target.to(torch.int64)[trees.node_parents])
    num_trees = trees.node_offsets.shape[0] - 1
    words = trees.ancestor_bits.shape[1]
    # Each tree's unmatched nodes as bit words (distinct bits: the sum is the OR), then a node is accepted when
    # no ancestor-or-self of it is unmatched.
    bit = torch.ones(t, dtype=torch.int64, device=target.device) << (trees.node_local % 32)
    unmatched = torch.zeros(num_trees * words, dtype=torch.int64, device=target.device)
    unmatched.scatter_add_(0, trees.node_tree * words + trees.node_local // 32, torch.where(matched, 0, bit))
    ancestors = trees.ancestor_bits[:t].to(torch.int64) & 0xFFFFFFFF
    clash = ancestors & unmatched.view(num_trees, words)[trees.node_tree]
    return (clash == 0).all(dim=1)


def accept_on_device(
    trees: DeviceTrees,
    target: torch.Tensor,
    width: int,
    path_width: int,
    num_tokens: int,
    conv_window: int,
    ring: Optional["PathRing"] = None,
) -> Dict[str, torch.Tensor]:
    """What :func:`ddtree.vllm.step.accept` returns, on the device: ``output_tokens`` ``[R, width]`` int32 (vLLM's
    chain rows), ``kv_src``/``kv_dst`` ``[R * path_width]`` int64 (step tokens; unused slots move a root onto
    itself), ``context_order`` ``[num_tokens]`` int64, ``paths`` ``[R, path_width]`` int32 (0-padded),
    ``path_lengths`` ``[R]`` int32, both again as ``path_rows`` ``[R, 1 + path_width]`` int32 (the length, then the
    path) and, with a conv window, ``commit_conv_index`` ``[R, conv_window]`` int64. With a ``ring`` and the trees'
    ``step_serial``, the path rows also go into the statistics' ring (inside a walk graph's replay: no host launch).
    """
    device = target.device
    target = target.to(torch.int64)
    num_trees = trees.node_offsets.shape[0] - 1
    on_path = accepted_nodes(trees, target)
    depth = trees.node_depths
    # The accepted node of depth k is path entry k (paths never exceed path_width: a tree is at most L deep).
    full = torch.full((num_trees, path_width), -1, dtype=torch.int64, device=device)
    slot = torch.where(on_path, trees.node_tree * path_width + depth, num_trees * path_width)
    padded = torch.cat([full.view(-1), full.new_full((1,), -1)])
    padded.scatter_(0, slot, torch.where(on_path, trees.node_local, -1))
    full = padded[:-1].view(num_trees, path_width)
    lengths = (full >= 0).sum(dim=1)
    k = torch.arange(path_width, device=device)
    on = k[None, :] < lengths[:, None]
    first = trees.node_offsets[:-1, None]
    nodes = first + full.clamp(min=0)  # step node index of each path entry (clamped where unused)

    # vLLM's chain rows: the accepted drafts (path entries 1..), then the bonus token sampled at the last one.
    drafts = torch.where(on[:, 1:], trees.node_tokens[nodes[:, 1:]], -1)
    last = first[:, 0] + full.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    chain = torch.cat([drafts, drafts.new_full((num_trees, 1), -1)], dim=1)
    chain.scatter_(1, (lengths - 1)[:, None], target[last][:, None])
    output = torch.full((num_trees, width), -1, dtype=torch.int32, device=device)
    cols = min(width, path_width)
    output[:, :cols] = chain[:, :cols].to(torch.int32)

    # KV moves: path entry k's node to the tree's k-th slot; every other slot moves the root onto itself.
    moves = on & (full != k[None, :])
    root = trees.query_starts[:, None]
    kv_src = torch.where(moves, root + full, root).reshape(-1)
    kv_dst = torch.where(moves, root + k[None, :], root).reshape(-1)

    # The drafter's row order: each tree's path in path order, then its other nodes in node order.
    # (A tree's keys stay below path_width + num_tokens, so tree-major keys need no host sync.)
    key = torch.where(on_path, depth, path_width + trees.node_local) + trees.node_tree * (path_width + num_tokens)
    order = torch.arange(num_tokens, dtype=torch.int64, device=device)
    order[trees.token_index] = trees.token_index[torch.argsort(key, stable=True)]

    paths, path_lengths = torch.where(on, full, 0).to(torch.int32), lengths.to(torch.int32)
    out = {
        "output_tokens": output,
        "kv_src": kv_src,
        "kv_dst": kv_dst,
        "context_order": order,
        "paths": paths,  # (contiguous, as the commit kernels read them)
        "path_lengths": path_lengths,
        # One row per tree for the statistics (``PathRing``): the length, then the path.
        "path_rows": torch.cat((path_lengths[:, None], paths), dim=1),
    }
    if ring is not None and trees.step_serial is not None:
        ring.write(out["path_rows"], trees.step_serial)
    if conv_window > 0:
        out["commit_conv_index"] = commit_conv_index(nodes, lengths, conv_window)
    return out


def emitted_logit_rows(
    node_offsets: torch.Tensor,
    logit_rows: torch.Tensor,
    batch_index: torch.Tensor,
    accepted: Dict[str, torch.Tensor],
    last_rows: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """:func:`ddtree.vllm.step.emitted_logit_rows` on the device, from :func:`accept_on_device`'s ``paths`` and
    ``path_lengths``: the logits row of each emitted token in vLLM's ``[num_reqs, width]`` layout (token ``j`` of a
    tree request from its path's node ``j``; everything else from the request's last row, ``last_rows [R]``)."""
    rows = last_rows.to(torch.int64)[:, None].repeat(1, width)
    paths, lengths = accepted["paths"].to(torch.int64), accepted["path_lengths"].to(torch.int64)
    cols = min(width, paths.shape[1])
    k = torch.arange(cols, device=paths.device)
    nodes = node_offsets[:-1, None].to(torch.int64) + paths[:, :cols]
    fallback = rows[batch_index, :cols]
    rows[batch_index, :cols] = torch.where(k[None, :] < lengths[:, None], logit_rows[nodes], fallback)
    return rows
